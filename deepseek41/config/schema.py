"""The config schema: one frozen dataclass per section, whose fields declare the keys.

`name: type = key(default)` declares the config key `section.name`, its default and, for a
string choice, the values allowed; the comment beside it documents it. `base_config()` is
generated from these declarations, and config files under `configs/` start from it. Keys marked
`execution_only=True` change how the model is computed, not what it computes or stores; the
checkpoint check derives its list from these marks (`execution_only_keys`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections

from deepseek41.batch import max_span_positions
from deepseek41.config import auto
from deepseek41.config.keys import key, keys_of

LAYOUT_VERSION = 1  # bump when the train-state pytree layout changes incompatibly

QUANT_FORMATS = ('none', 'fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32')
# The routed experts' backends (ops/expert_gemm.py BACKENDS).
MOE_BACKENDS = ('reference', 'capacity_einsum', 'ragged_dot', 'grouped', 'grouped_fused')

ATTENTION_VARIANTS = ('csa2', 'dense', 'window')  # model.attention_variant

# Model keys that were replaced: {old key: (the key now, old value -> its value now)}. A saved
# config (a checkpoint's config.json) holding the old key is read as the same model; a config
# file setting it is refused with this replacement named (resolve.py).
RENAMED_MODEL_KEYS = {
    'csa2': ('attention_variant', lambda on: 'csa2' if on else 'window'),
}



@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model, as every module sees it (`auto` choices resolved)."""
  vocab_size: int = key(512)            # [vocab_size] must cover the tokenizer's vocabulary
  d_model: int = key(128)               # [hidden_size]
  num_layers: int = key(4)              # [num_hidden_layers] backbone layers (no DSpark blocks)
  num_encoder_layers: int = key(2)      # CED split: layers [0, n) are the causal encoder
  num_heads: int = key(4)               # [num_attention_heads]
  head_dim: int = key(64)               # [head_dim] width of the shared K=V latent
  rope_head_dim: int = key(16)          # [qk_rope_head_dim] RoPE on the last channels
  q_lora_rank: int = key(64)            # [q_lora_rank]
  o_groups: int = key(2)                # [o_groups]
  o_lora_rank: int = key(64)            # [o_lora_rank] per group
  sliding_window: int = key(16)         # [sliding_window] keys t-W < s <= t
  # Residual (section 3.2): mHC over hc_mult streams, V4.1 single-pass or V4 multi-pass order,
  # or a plain pre-norm residual (ablation).
  residual: str = key('mhc_single_pass', choices=('mhc_single_pass', 'mhc_multi_pass', 'plain'))
  hc_mult: int = key(4)                 # [hc_mult] residual streams
  # How the mHC sites run: `reference` (jnp, model/mhc.py) or `fused` (ops/gpu/mhc_kernel.py, GPU
  # Pallas kernels that read and write the streams once per site). auto = fused on the GPU where
  # it tiles (docs/performance.md section 10.2: one layer's mHC 8.3 -> 5.2 ms, 18 GB less).
  mhc_impl: str = key('auto', choices=('reference', 'fused'), auto=auto.mhc_impl,
                      execution_only=True)
  # The fused sites of a call of less than one token block (fewer than 128 tokens: a decode
  # step) walk d_model in chunks this wide (0: the training chunks, 32). One token is one
  # program, so its serial walk is the kernel's time: 32 chunks of 32 columns took 18-60 us a
  # site on an H100, 1.47 ms of a 1B decode token's 4.4 (docs/performance.md section 54); 4-8
  # chunks should have taken a fraction of that, but 256-wide chunks decoded slower on an H100
  # (section 56); splitting the walk over programs (below) is what paid. [I] ours.
  mhc_decode_block_d: int = key(0, execution_only=True)
  # Such a call walks d_model in this many programs at once (the site's coefficients from their
  # partial sums in a second small kernel), so one token's walk runs on that many SMs; the
  # single-pass and expand-only sites (the multi-pass own collapse keeps one program). 0: one
  # program. [I] ours; 16 measured fastest on an H100: the 1B model decodes 1.45x faster at
  # batch 1 and 32 than with one program (docs/performance.md section 59).
  mhc_decode_splits: int = key(16, execution_only=True)
  hc_sinkhorn_iters: int = key(20)      # [hc_sinkhorn_iters]
  hc_eps: float = key(1e-6)             # [hc_eps]
  hc_init_std: float = key(0.02)        # std of the coefficient projections [S: HF's init]
  q_head_norm: bool = key(True)         # per-head q re-normalisation (3.3); off = HF parity
  # Layer roles (section 1). One ratio per backbone layer: 0 = SWA only, 1 or 2 = CSA2 ratio.
  compress_ratios: tuple[int, ...] = key((0, 2, 1, 1))
  kv_source_layer_ids: tuple[int, ...] = key((1, 2))
  index_source_layer_ids: tuple[int, ...] = key((1, 2, 3))
  candidate_source_layer_id: int = key(2)  # -1: no candidate pool
  engram_layer_ids: tuple[int, ...] = key((1,))
  # Engram (section 3.12): hashed n-gram memory injected into the residual before these layers.
  engram: bool = key(True)              # off = the layer ids are ignored (ablation)
  engram_max_ngram: int = key(3)        # [engram_max_ngram_size]: 2..max-grams (released 4)
  engram_n_heads: int = key(2)          # [engram_n_heads] (released 8)
  engram_head_dim: int = key(16)        # [engram_head_dim] (released 256)
  engram_vocab_start: int = key(1000)   # [engram_vocab_size]: prime search start (released 16M)
  engram_pad_token_id: int = key(2)     # [engram_pad_token_id], in the hashed id space
  # [engram_compressed_vocab_size]: ids the tokenizer compresses to (`model_fits_data` in
  # data/engram_vocab.py checks it against the data's tokenizer); 0 = hash raw token ids.
  engram_compressed_vocab_size: int = key(0)
  # Pad table rows to a multiple of this so they can shard (a sum of primes divides by few mesh
  # sizes); 1 = exact.
  engram_table_row_multiple: int = key(1)
  # [I] Tables split over several devices: each device sends its distinct row ids to the rows'
  # owners in chunks of engram_exchange_capacity x (its lookups / owners) ids (at least 256);
  # ids past a chunk read zero rows and are counted in engram_dropped_frac. 0 = chunks of every
  # lookup (exact under any skew, owners x the bytes). ops/parallel/engram_lookup.py says why 2
  # is ample.
  engram_exchange_capacity: float = key(2.0, execution_only=True)
  # The attention of every ratio > 0 layer (docs/architecture.md section 3.8.1; ratio-0 layers
  # are window-only in every variant):
  #   csa2:   its window plus the compressed entries its index source selects (sections 3.6-3.8;
  #           every shipped config);
  #   dense:  every earlier token of its document, exactly (ablation baseline; no compressor or
  #           indexer);
  #   window: its sliding window only (ablation).
  # Replaces `model.csa2` (True = 'csa2', False = 'window'); saved configs that have it are read
  # as the same model (`upgrade_saved_model`).
  attention_variant: str = key('window', choices=ATTENTION_VARIANTS)
  index_n_heads: int = key(4)           # [index_n_heads]
  index_head_dim: int = key(32)         # [index_head_dim]
  index_topk: int = key(8)              # [index_topk]
  indexer_loss_weight: float = key(1.0)  # weight of the indexer distillation loss [I] (csa2.py)
  candidate_topk_blocks: int = key(4)   # [candidate_topk_blocks]
  candidate_block_size: int = key(4)    # [candidate_block_size]
  # Exact two-stage top-k over blocks of this many entries; 0 = one pass. The same entries.
  index_topk_block: int = key(8, execution_only=True)
  # RoPE (section 3.4): "main" for ratio-0 layers, "compress" (YaRN) for ratio > 0 layers.
  rope_theta: float = key(10000.0)
  compress_rope_theta: float = key(160000.0)
  yarn_factor: float = key(4.0)         # [rope_scaling.factor]; 1 disables YaRN
  yarn_original_max_position: int = key(128)
  yarn_beta_fast: float = key(32.0)
  yarn_beta_slow: float = key(1.0)
  rms_norm_eps: float = key(1e-6)       # released: 1e-20 (parity tests only)
  # DeepSeekMoE (section 3.11).
  n_routed_experts: int = key(8)
  num_experts_per_tok: int = key(2)
  n_shared_experts: int = key(1)
  moe_intermediate_size: int = key(128)
  route_scale: float = key(1.5)         # [routed_scaling_factor]
  swiglu_limit: float = key(10.0)
  router_bias_rate: float = key(0.001)  # gamma of the sign rule, per step, per modality
  balance_loss_weight: float = key(1e-4)  # alpha of the sequence-wise balance loss [S]; 0 = off
  # grouped_fused (ops/gpu/fused_experts.py): grouped's kernels gathering their own token rows,
  # gate+up+SwiGLU in one kernel, the router weights and the combine in the down projection's
  # epilogue (docs/performance.md C). Opt-in until measured on the GPU: auto never picks it; no
  # FP8 (model.fp8 must be off with it).
  moe_backend: str = key('auto', auto=auto.moe_backend, choices=MOE_BACKENDS,
                         execution_only=True)
  # capacity_einsum: slots per expert = ceil(cf * N * K / E)
  capacity_factor: float = key(1.25, execution_only=True)
  # Expert parallelism (mesh.expert > 1; ops/parallel/expert_parallel.py), how the dropless
  # backends' tokens reach their experts' shards (model.expert_exchange):
  #   allgather: every shard's tokens gathered on each expert shard, the partial outputs summed
  #     back (psum_scatter); a token crosses once whatever its K, never drops; sends (S-1) x N
  #     rows each way, S = mesh.expert: the smallest exchange while S < K.
  #   ragged: each assignment to its expert's shard by ragged_all_to_all (about N K (S-1)/S rows).
  #   padded: the same through a dense all_to_all of chunks padded to the largest (S x the bytes,
  #     but the collective every backend runs well).
  # Each expert shard computes at most expert_buffer_factor x N K assignments (N K: a shard's
  # own tokens' assignments, the average load): the ragged and padded exchanges' receive buffer,
  # the allgather exchange's expert-sorted rows (of the S N K its gathered tokens could bring).
  # 0 = mesh.expert x N K, which never overflows; past a smaller bound the shard's assignments
  # to its highest-numbered experts are dropped and counted in dropped_frac. auto: ragged on the
  # TPU (its expert axis is large); elsewhere allgather (the CPU has no ragged collective; on
  # the H200 XLA's ragged_all_to_all took 644 ms where the padded exchange took 12.8 ms, one
  # device, 32K tokens: docs/performance.md 11.1).
  expert_buffer_factor: float = key(0.0, execution_only=True)
  # The grouped experts' weight-gradient kernel (ops/gpu/grouped_gemm.py): our Triton tgmm, or jax's
  # Mosaic GPU transposed ragged dot (Hopper only; elsewhere it falls back to tgmm). On the H200
  # mosaic makes the expert block's forward+backward 21% faster at the released shapes (d 5120)
  # but only 9% at the 1B ones, where the training step does not move and its compile takes 36 s
  # longer (docs/performance.md 11.1). auto: mosaic on the GPU from d_model 4096 up.
  grouped_wgrad: str = key('auto', choices=('triton', 'mosaic'), auto=auto.grouped_wgrad,
                           execution_only=True)
  expert_exchange: str = key('auto', choices=('allgather', 'ragged', 'padded'),
                              auto=auto.expert_exchange, execution_only=True)
  # The allgather exchange's partial outputs (each expert shard's weighted sum of its experts'
  # outputs for every gathered token), as they are reduce-scattered back: float32 (the sum over
  # shards unrounded, as one device's combine) or the compute dtype (bf16: a third fewer bytes
  # each way, 2 + 2 instead of 2 + 4 per token row and D, and half the partials' memory; each
  # shard's partial is rounded once and the shards' sum is taken in bf16). The ragged and padded
  # exchanges return each assignment's row in the compute dtype already.
  expert_partials: str = key('float32', choices=('float32', 'compute'), execution_only=True)
  # A dropless backend's call of at most E (token, expert) assignments on a device holding every
  # expert (a decode step of a few rows) gathers each assignment's expert weights instead of
  # building the expert-sorted layout, which pads every expert's group to a whole tile: 8,192
  # rows and three grouped GEMM launches for one token of 64 experts
  # (docs/performance.md section 54). On an H100 the 1B model decodes 1.2x faster at batch 1
  # with it (section 56); batch 32 (192 assignments) keeps the grouped kernels either way.
  moe_gather_small_calls: bool = key(True, execution_only=True)
  # A grouped-backend call of fewer than 128 tokens (a decode step, batch 32 say: 192 assignments
  # over 64 experts) lays each expert's rows out in tiles of this many rows instead of the
  # training's 128 (0: those at every size): 8,320 layout rows -> 1,152 in each GEMM, the
  # swiglu and the combine at batch 32 of the 1B model (docs/performance.md section 67). A power
  # of two, 16 to 128. [I] ours.
  moe_small_call_block_m: int = key(16, execution_only=True)
  # A generation chunk of at most this many tokens (a decode step: 1; a speculative verification:
  # the drafts + 1) attends over all its keys at a window layer (its own, the cached ring's, the
  # selected compressed entries) in one softmax with the sink (ops/union_attention.py) instead
  # of a partial per key set and their merge: fewer, larger kernels a step (docs/performance.md
  # section 67). 0: the partials at every size. Larger chunks keep the partials, whose memory
  # does not grow with T x (ring + T + K) keys. [I] ours.
  decode_union_rows: int = key(16, execution_only=True)
  # How generation's programs compile a product of one row with a weight (a batch-1 decode
  # step's projections): `reduce`, XLA's GPU default for a vector, a multiply and a reduction
  # (two kernels a projection in the 1B decode step, the product written to memory between
  # them); `gemm`, that pass (dot-strength-reduction) off in generation's programs, one GEMM
  # kernel each: 781 -> 718 kernels a 1B token, compiled for an H100 without one
  # (docs/performance.md section 62); 1.06x `reduce`'s tokens/s at batch 1 on an H100 (section
  # 64). The gathered experts keep one fused reduction either way. [I] ours.
  decode_vector_dots: str = key('gemm', choices=('reduce', 'gemm'), execution_only=True)
  # The routed experts of held-out evaluation, dropless: auto keeps a dropless moe_backend and
  # replaces capacity_einsum (grouped on the GPU, ragged_dot on the TPU, reference on the CPU).
  eval_moe_backend: str = key('auto', auto=auto.eval_moe_backend,
                              choices=MOE_BACKENDS,
                              execution_only=True)
  # fused: the GPU kernels (ops/gpu/window_kernel.py, ops/gpu/sparse_kernel.py); the other choices
  # are the plain jnp paths, which every backend runs. auto picks the kernels on the GPU (the window
  # kernel where attention_kernel_supported() takes the shapes; docs/performance.md section 9).
  attention_impl: str = key('auto', choices=('reference', 'chunked', 'fused'),
                            auto=auto.attention_impl, execution_only=True)
  # The window kernel's forward where the backward comes from the merged softmax (training and
  # evaluation with model.merged_backward): the Mosaic GPU kernel (TMA, wgmma; Hopper, sm_90 and
  # up) or the Triton one. auto: mosaic wherever attention_impl is fused and the shapes fit
  # (ops/contracts.py). Image spans, fp32 latents and the unmerged path always use Triton's.
  window_forward: str = key('auto', choices=('triton', 'mosaic'), auto=auto.window_forward,
                            execution_only=True)
  sparse_impl: str = key('auto', choices=('reference', 'gathered', 'fused'),
                         auto=auto.sparse_impl, execution_only=True)
  # How the indexer picks its top-k: XLA's top_k (sorts whole rows on the GPU) or the exact
  # threshold select (ops/topk_select.py); the same entries either way.
  select_impl: str = key('auto', choices=('top_k', 'threshold'),
                         auto=auto.select_impl, execution_only=True)
  # Queries per chunk in the gathered path, the indexer and the dense variant's chunked path.
  sparse_chunk: int = key(1024, execution_only=True)
  # [I] The indexer's query chunks run in up to this many runs, each scoring and selecting over
  # only the entries its last row can see (model/csa2.py `causal_groups`): a causal slab is half
  # empty, and 4 runs score 5/8 of it. Each run is one more compiled loop body; 1 = one run over
  # every entry. The same selection for any value.
  index_causal_groups: int = key(4, execution_only=True)
  # With the fused kernel, the layers that read one index source's selection (and so the same
  # KV rows) add their key/value gradient once, in the index source's backward, instead of once
  # each (ops/gpu/sparse_kernel.py; docs/performance.md section 25). Same gradients.
  sparse_group_dkv: bool = key(True, execution_only=True)
  # With the fused kernel, the sparse branch's key/value gradient sums each tile of this many
  # consecutive queries on chip before adding it to the entries' rows, which neighbouring
  # queries' overlapping picks make fewer adds (ops/gpu/merged_dkv.py); 0 adds each query's
  # own with atomics. A power of two. Same gradients up to the order of fp32 adds; the faster
  # depends on how much neighbouring selections overlap (docs/performance.md part K).
  sparse_dkv_tile: int = key(0, execution_only=True)
  # With the fused kernels, their backward runs against the layer's merged softmax
  # (log-sum-exp, output cotangent, D = sum dO * O) instead of through autodiff of the merge,
  # which writes and reads a [T, H, d] cotangent per branch (ops/softmax_merge.py). Same
  # gradients.
  merged_backward: bool = key(True, execution_only=True)
  # Image-span queries per chunk of the span branch; each chunk's scores are recomputed in the
  # backward instead of kept (ops/span_attention.py). 0: whole spans, probabilities kept.
  span_chunk: int = key(256, execution_only=True)
  # The LM head and its cross-entropy as one op (ops/cross_entropy.py) that walks the sequence
  # this many positions of every row at a time: the forward keeps each token's log-sum-exp, the
  # backward recomputes a chunk's logits, so the vocabulary costs one chunk's [B, head_chunk, V]
  # fp32 logits instead of the whole batch's [B, T, V] (2 GB at 8 x 4,096 with the 1B model's
  # vocabulary, 34 GB at 65,536 tokens with V4.1's), for one more [tokens, D] x [D, V] product.
  # 0 = the whole logits, kept for the backward. The same loss and gradients to rounding. 2048:
  # faster than 512 and 1024 at the 1B and V4.1 heads on the H100 (docs/performance.md 39).
  head_chunk: int = key(2048, execution_only=True)
  # fused: the GPU kernel (ops/gpu/index_scores.py), for the shapes index_scores_supported() takes;
  # auto picks it wherever it can run.
  index_impl: str = key('auto', choices=('reference', 'fused', 'mosaic'), auto=auto.index_impl,
                        execution_only=True)
  # The selected entries' indexer scores, which train the indexer (ops/selected_scores.py):
  # fused is the GPU kernel, for the same shapes as index_impl's.
  selected_scores_impl: str = key('auto', choices=('reference', 'fused'),
                                   auto=auto.selected_scores_impl, execution_only=True)
  # Fake quantization (section 3.16), each 'none' or a deepseek41.quant format name; the
  # released formats are fp4_e4m3_16 / fp4_ue8m0_32 / fp8_ue8m0_32 (configs/v41_flash.py).
  kv_quant: str = key('none', choices=QUANT_FORMATS)  # compressed main KV, after RoPE
  index_quant: str = key('none', choices=QUANT_FORMATS)  # indexer q and k
  swa_quant: str = key('none', choices=QUANT_FORMATS)  # sliding-window KV, after RoPE
  init_std: float = key(0.02)
  # auto: bf16 on GPU/TPU, f32 on CPU.
  compute_dtype: str = key('auto', choices=('float32', 'bfloat16'), auto=auto.compute_dtype,
                           execution_only=True)
  param_dtype: str = key('float32', choices=('float32', 'bfloat16'))  # master weights
  # [I] FP8 training GEMMs (ops/fp8_matmul.py): 'rowwise' runs the attention projections, the
  # shared and the routed experts in e4m3 with per-row power-of-two scales and float32
  # accumulation, forward and backward (not V3's 128-tiles: cuBLAS FP8 takes row scales only).
  # Master weights and optimizer stay in param_dtype; embedding, LM head, router, norms, mHC,
  # attention core, indexer and compressor stay in compute_dtype.
  fp8: str = key('off', choices=('off', 'rowwise'), execution_only=True)
  # Vision (section 3.15): DeepSeek-ViT + 3x3 merge aligner, image spans in the token stream.
  # Defaults are the tiny test dims; configs/v41_flash.py holds the released ones.
  vision: bool = key(False)
  vision_layers: int = key(2)           # released 32
  vision_dim: int = key(64)             # 1024
  vision_heads: int = key(4)            # 16 (head dim 64; 2D RoPE needs head dim % 4 == 0)
  vision_mlp: int = key(128)            # SwiGLU hidden, 2816
  vision_patch: int = key(4)            # patch side in pixels, 14
  vision_merge: int = key(3)            # merge x merge patches -> one LM token
  vision_rope_theta: float = key(10000.0)
  vision_norm_eps: float = key(1e-6)
  vision_max_image_tokens: int = key(16)  # merged tokens per image at most, 1024 (~1344x1344 px)
  vision_min_pixels: int = key(0)       # images are scaled up to at least this area, 544^2
  # auto: fused off the CPU.
  vision_attention_impl: str = key('auto', choices=('reference', 'fused'),
                                   auto=auto.vision_attention_impl, execution_only=True)
  # Id placed at image-span positions (released 129264); its table row is never read: spans
  # take aligner outputs and learned delimiters.
  image_token_id: int = key(0)

  @property
  def csa2(self) -> bool:
    """Whether ratio > 0 layers run the compressed sparse branch (attention_variant 'csa2')."""
    return self.attention_variant == 'csa2'

  @property
  def dense(self) -> bool:
    """Whether ratio > 0 layers attend to their whole document (attention_variant 'dense')."""
    return self.attention_variant == 'dense'

  @property
  def image_span_max_len(self) -> int:
    """Longest image span (alignment pad included): how far span attention reaches; 0 = none."""
    return max_span_positions(self.vision_max_image_tokens) if self.vision else 0


def upgrade_saved_model(saved_model: dict) -> dict:
  """A saved model section (a checkpoint's config.json) in today's keys: each replaced key
  (`RENAMED_MODEL_KEYS`) becomes its successor, unless the successor is saved too."""
  out = dict(saved_model)
  for old, (new, convert) in RENAMED_MODEL_KEYS.items():
    if old in out:
      value = out.pop(old)
      out.setdefault(new, convert(value))
  return out


def engram_compresses(m: ModelConfig) -> bool:
  """Whether Engram hashes tokenizer-compressed ids (model.engram_compressed_vocab_size > 0)."""
  return bool(m.engram and m.engram_layer_ids and m.engram_compressed_vocab_size)


def max_positions(m: ModelConfig, seq_len: int) -> int:
  """The longest sequence the model is configured for: YaRN's extended range, or the trained
  sequence length (data.seq_len) without YaRN."""
  if m.yarn_factor > 1.0:
    return int(m.yarn_original_max_position * m.yarn_factor)
  return seq_len


@dataclasses.dataclass(frozen=True)
class ImageGeometry:
  """What the data pipeline needs of the vision model to lay out image spans and patches."""
  patch_size: int
  merge: int
  max_image_tokens: int
  min_pixels: int
  image_token_id: int
  max_images_per_row: int

  @property
  def max_patches(self) -> int:
    return self.merge * self.merge * self.max_image_tokens


Sources = tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class TasksConfig:
  """The synthetic long-context tasks (README, "Long-context evaluation"): retrieval documents
  generated from a seed inside the data pipeline when data.sources names them (`mqar:0.5,
  default:0.5`), and by evaluation (train.eval_tasks, `python -m deepseek41.eval`). Every task
  encodes its text with the run's tokenizer and supervises only its answers (unless
  `supervise='all'`); a document is one whole piece of the packed stream."""
  # Tokens per training document (its positions: inputs and targets); 0 = data.seq_len, one
  # document per row. Shorter documents pack several to a row.
  length: int = key(0)
  # Training loss on the answer tokens only, or on every token of the document.
  supervise: str = key('answers', choices=('answers', 'all'))
  # mqar, multi-query associative recall: `mqar_pairs` "key:value" pairs, then random filler
  # tokens with `mqar_queries` of the keys asked again ("key:" -> value) at random places.
  mqar_pairs: int = key(8)
  mqar_queries: int = key(4)            # distinct keys asked; at most mqar_pairs
  mqar_key_letters: int = key(3)        # lowercase letters per key
  mqar_value_digits: int = key(3)       # digits per value
  # passkey: a number of passkey_digits digits hidden in repeated filler sentences at a depth,
  # asked for at the end.
  passkey_digits: int = key(5)
  # needle: needle_count sentences "the code for <word> is <number>" hidden in real text (the
  # first text source of data.sources, else the default corpus; or needle_filler, a prepared
  # dataset directory or `default`); needle_queries of them are asked for at the end, the
  # others are distractors. Depth places the first asked needle; the others lie anywhere.
  needle_count: int = key(1)
  needle_queries: int = key(1)
  needle_value_digits: int = key(7)
  needle_filler: str = key('')
  # Evaluation: documents per task, length and depth; depths (0 = at the start of the filler,
  # 1 = right before the question) of the tasks that have one (passkey, needle).
  eval_examples: int = key(16)
  eval_depths: tuple[float, ...] = key((0.0, 0.25, 0.5, 0.75, 1.0))


@dataclasses.dataclass(frozen=True)
class DataConfig:
  seq_len: int = key(128)
  # Comma-separated prepared dataset directories (or `default`, the embedded corpus) with
  # optional mixture weights ("/data/a:0.7,/data/b:0.3"); resolved to ((dir, weight), ...).
  # Empty: the embedded default corpus (Python stdlib sources).
  sources: Sources = key('')
  synthetic: bool = key(False)          # random tokens, no I/O: for benchmarks
  cache_dir: str = key('')              # where the default corpus is prepared ('' = ~/.cache/...)
  default_corpus_vocab_size: int = key(512)  # BPE vocabulary trained on the default corpus
  default_corpus_max_files: int = key(0)  # 0 = every stdlib source file
  shuffle_seed: int = key(0)
  num_workers: int = key(0)             # grain worker processes (0 = in the training process)
  prefetch: int = key(2)                # batches prefetched per worker / by the prefetch thread
  packing_bins: int = key(16)           # first-fit packing bins
  document_align: int = key(2)          # documents start at multiples of this (largest ratio)
  # Interleaved image-text sources (model.vision on), mixed with `sources` by weight:
  # "shapes:0.7,/data/pairs:0.2,/data/web.jsonl:0.1". `shapes` is the embedded task
  # (deepseek41/data/shapes.py); a directory holds image + caption pairs (a.png + a.txt); a
  # .jsonl file holds records {"content": [{"text": ...}, {"image": "relative/or/abs.png"}]}.
  image_sources: Sources = key('')
  max_images_per_row: int = key(4)      # image slots per packed row (static shape)
  image_heldout_fraction: float = key(0.02)  # records of each image source held out for eval
  shapes_image_size: int = key(48)      # side in pixels of the embedded task's images
  # Input streams the global batch is split into; each process reads streams / processes of them
  # and the checkpoint holds each stream's position. 0: the process count. Fixed at a run's
  # first start: a resumed run keeps its checkpoint's count (README, "Several GPUs and hosts").
  streams: int = key(0)
  images: ImageGeometry | None           # derived from the model; None when model.vision is off
  # Derived: the tasks section, for the task sources of data.sources (None: its defaults).
  tasks: TasksConfig | None = None

  def task_params(self) -> TasksConfig:
    """The tasks section's values (set by resolve; a DataConfig built by hand gets defaults)."""
    return self.tasks or TasksConfig(**{f.name: f.metadata['default']
                                        for f in keys_of(TasksConfig)})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = key(200)
  batch_size: int = key(8)              # global batch (sequences per optimizer step)
  grad_accum_steps: int = key(1)        # microbatches per step; batch_size must divide evenly
  seed: int = key(0)
  lr: float = key(3e-3)
  min_lr_ratio: float = key(0.1)        # final lr = lr * min_lr_ratio
  warmup_steps: int = key(20)
  schedule: str = key('cosine', choices=('cosine', 'wsd', 'constant'))
  wsd_decay_fraction: float = key(0.2)  # wsd: the last fraction of steps decays linearly
  b1: float = key(0.9)
  b2: float = key(0.95)
  eps: float = key(1e-8)
  # Decoupled (x lr), never on norms, biases, sinks or scales (1-D params); under muon_hybrid on
  # the Muon matrices only (the token tables: sinkhorn_weight_decay).
  weight_decay: float = key(0.1)
  grad_clip_norm: float = key(1.0)      # global-norm clipping; 0 disables
  engram_table_lr_multiplier: float = key(5.0)  # Engram tables learn at this multiple of lr
  # [I] The ViT and its aligner learn at this multiple of lr. Adam moves every aligner weight by
  # about lr per step, so its output (the LM input at image positions) grows like fan-in x lr
  # while a table embedding row barely moves; at a text-tuned lr the spans become large,
  # near-constant vectors the LM cannot read (docs/performance.md section 7.2).
  vision_lr_multiplier: float = key(1.0)
  # The optimizer (docs/architecture.md section 4.2): `adamw` for every parameter, or
  # `muon_hybrid`, the V4 report's [S]: Muon for the matrices (each routed expert, each head of
  # a Q projection, each output group on its own), a Sinkhorn-balanced Nesterov update for the
  # token tables (embedding, LM head, Engram and DSpark Markov tables), AdamW (b1, b2, eps) for
  # the rest (norms, biases, sinks, scales, mHC's static parameters), one schedule for all
  # (train/optimizer.py). A checkpoint resumes only under the optimizer that wrote it.
  # muon_hybrid is the default since it trained better at every size measured: held-out 2.37
  # against the tuned AdamW's 2.96 after 600 steps of the 1B model, 1.84-1.93 against 2.39-2.94
  # on configs/tiny.py (docs/performance.md sections 33, 36, 41, 51). Its best rate is not
  # AdamW's (1B: 2.4e-3 against 3e-4), so each shipped config sets train.lr for its optimizer.
  optimizer: str = key('muon_hybrid', choices=('adamw', 'muon_hybrid'))
  # Muon: heavy-ball momentum with the Nesterov look-ahead [S: 0.95, NANO], then Newton-Schulz.
  muon_momentum: float = key(0.95)
  # The Newton-Schulz phases [S: NANO]: (a, b, c) of X -> aX + b(XX^T)X + c(XX^T)^2 X: fast ones
  # (Keller Jordan's coefficients, singular values pushed into ~[0.7, 1.2]), then ones that
  # settle them at 1. [I] 4 + 1 iterations, not the source's 8 + 2: the update is then 9.4% of
  # the 1B step on an H200 against 13.7% (issue 45's bound is 10%), the step 5-6% faster, and
  # the held-out loss 0.05 behind at step 100 and 0.025 at 200, about what two runs of one
  # schedule differ by (docs/performance.md sections 47 and 51): no slower to a given loss. It
  # leaves directions far below the largest partly lifted (docs/architecture.md section 4.2).
  muon_ns_coeffs: tuple[tuple[float, ...], ...] = key(
      ((3.4445, -4.775, 2.0315), (2.0, -1.5, 0.5)))
  muon_ns_steps: tuple[int, ...] = key((4, 1))
  # Each matrix's update scaled to this RMS x the rate (x sqrt(max(fan_in, fan_out)), the
  # orthogonal factor's RMS being 1/sqrt of it): AdamW's update RMS (Moonlight's match; [S: 0.18,
  # NANO; optax suggests 0.2]). It does not make AdamW's rate right here: on the 1B model
  # muon_hybrid's best rate was 8x AdamW's (docs/performance.md section 42).
  muon_rms_match: float = key(0.18)
  # [I] The Newton-Schulz iterations' dtype; the momentum, the Frobenius scaling and the result
  # stay fp32. auto = bfloat16 on the GPU and TPU (the matmuls at bf16 rate; the stable phase
  # leaves singular values within ~1e-2 of 1: tests/unit/test_optimizer.py), float32 on the CPU
  # (where bf16 matmuls are slower than fp32 ones).
  muon_ns_dtype: str = key('auto', choices=('float32', 'bfloat16'), auto=auto.muon_ns_dtype)
  # [I] Newton-Schulz runs the weights of one shape and layout (the layers' copies of a weight) as
  # one batch of up to this many MiB in muon_ns_dtype (a transient copy; 0: each weight on its
  # own): three batched matmuls an iteration for all of them, not three per weight.
  muon_batch_mib: int = key(2048)
  # [I] The Muon and Sinkhorn groups learn at these multiples of the schedule's rate (1: the RMS
  # matches make train.lr right for all groups).
  muon_lr_multiplier: float = key(1.0)
  sinkhorn_lr_multiplier: float = key(1.0)
  # The token tables' update [S: NANO's reading of the report; TileKernels' Engram kernels]:
  # Nesterov momentum (as an EMA or a sum: the same direction) [I: 0.95, NANO and TileKernels'
  # tests], rows and columns normalised in turn `sinkhorn_normalizations` times (odd: rows first
  # and last), scaled to RMS 1 per row, times sinkhorn_gamma. Rows whose momentum norm is at most
  # sinkhorn_tau x the mean row norm (tokens not seen for a while) get no update [S value; I
  # meaning, NANO's]; sinkhorn_eps is added to every norm.
  sinkhorn_momentum: float = key(0.95)
  sinkhorn_gamma: float = key(0.18)
  sinkhorn_normalizations: int = key(11)
  sinkhorn_tau: float = key(1e-3)
  sinkhorn_eps: float = key(1e-20)
  sinkhorn_weight_decay: float = key(0.0)  # [I: NANO's] decoupled decay of the token tables
  # block_keep_attention: block remat that also keeps the GPU attention kernels' outputs
  remat: str = key('none', choices=('none', 'block', 'block_keep_attention'))
  # With remat (ignored under 'none'): how many layers, from the first, are rematerialized
  # (0 = all). The others keep their residuals for the backward: less recompute, more memory.
  remat_layers: int = key(0)
  eval_every_steps: int = key(50)       # 0 disables evaluation
  # The step-0 evaluation, the start of the held-out curve; off where its compilation is the
  # time a short run cannot spare (a stage of benchmarks/gpu_longctx.sh).
  eval_at_start: bool = key(True)
  eval_batches: int = key(4)
  # Long-context tasks evaluated with the held-out loss: "task@length,..." (e.g.
  # 'passkey@256,mqar@4k'; the tasks section says how many documents, at which depths), logged
  # as eval_acc/<task>@<length>; '' = none.
  eval_tasks: str = key('')
  # With eval_tasks on a CSA2 model, also each CSA2 layer's selection against dense attention at
  # the rows that predict an answer (model/diagnostics.py), logged as
  # eval_sel/<measure>/<task>@<length>: dense scores of those rows (a few hundred a document)
  # over every visible entry in each CSA2 layer of the evaluation forward. The dense and window
  # variants select nothing: no eval_sel there.
  eval_selection: bool = key(True)
  peak_tflops: float = key(0.0)         # per-device peak for MFU; 0 = look up by device kind
  # JAX's persistent compilation cache: compiled programs are written here and loaded by any
  # later run of the same program (a restart, a rerun); '' = off. Under the user's cache dir, not
  # the work directory: all of a user's runs share it (JAX keys entries by program, devices and
  # versions, and several processes may use one directory), and JAX runs what it finds there,
  # so it belongs in a directory only its user can write. The trainer expands '~'.
  compilation_cache_dir: str = key('~/.cache/deepseek41/jax-compilation-cache')
  # Also keep the update step's executable there keyed by the source, config, devices and
  # versions that decide it, so a restart loads it without tracing or lowering the model
  # (train/executable_store.py). Off with the cache, or here.
  store_executables: bool = key(True)


# logical axis -> mesh axis or axes ('' = replicated); see sharding.py. Activations are split
# over `batch` and, with context parallelism, over `context` along the sequence
# (ops/parallel/per_device.py: the mesh axis names there are these rules' defaults).
DEFAULT_RULES = (
    ('batch', 'data,fsdp,expert'),
    ('length', 'context'),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('head_dim', ''),
    ('q_lora', ''),
    ('kv_latent', ''),
    ('o_groups', 'tensor'),
    ('o_lora', ''),
    ('mlp', 'tensor'),
    ('experts', 'expert'),
    ('expert_mlp', 'tensor'),
    ('index_heads', 'tensor'),
    ('index_dim', ''),
    ('norm', ''),
    ('hc_coef', ''),
    ('hc_embed', ''),
    ('engram_rows', 'fsdp,expert'),  # the tables are the largest tensors: shard their rows
    ('engram_dim', ''),
    ('engram_in', ''),
    ('vision_embed', ''),            # the ViT is small next to the LM: replicate its width
    ('vision_heads', 'tensor'),
    ('vision_mlp', 'tensor'),
    ('patch_in', ''),
    ('merge_in', ''),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes (-1 in the config: all devices left over by the other axes) and rules."""
  data: int = key(-1)
  fsdp: int = key(1)
  expert: int = key(1)
  tensor: int = key(1)
  context: int = key(1)                 # sequence shards (context parallelism)
  # Sequence parallelism: with tensor > 1, the residual between layers (what block remat keeps)
  # is split along the sequence over `tensor` too, not replicated (ops/parallel/per_device.py).
  sequence_parallel: bool = key(True)
  # Resolved to ((logical_axis, (mesh_axis, ...)), ...).
  rules: tuple[tuple[str, tuple[str, ...]], ...] = key(DEFAULT_RULES)

  AXES = ('data', 'fsdp', 'expert', 'tensor', 'context')

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, a) for a in self.AXES)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = key(100)           # 0 disables periodic saves (SIGTERM/SIGINT still save)
  # False: no save when the run reaches its last step (benchmarks, whose states nobody resumes:
  # a 3B state is ~40 GB a save). A stop signal still saves.
  save_at_end: bool = key(True)
  max_to_keep: int = key(3)             # keep the newest N ...
  keep_period: int = key(0)             # ... plus every K-th step (0: none)
  async_save: bool = key(True)
  # The longest the trainer waits for one save to finish (its background writes, the commit and
  # the checksums): Orbax's own default bound. Past it the save is taken to be stuck (a hung
  # file system) and the run stops with exit 74, the complete checkpoints kept.
  save_timeout_s: float = key(1200.0)
  # zstd on the state's arrays (Orbax's default). Trained fp32 weights and moments barely
  # compress (random fp32: 7.5% smaller), while decompressing slows every restart's restore
  # 1.6-1.9x and compressing slows the saves (docs/performance.md section 62). A checkpoint
  # records its own codec, so either restores under either setting. [I] ours: off.
  compress: bool = key(False)
  # A checkpoint step directory (WORKDIR/checkpoints/<step>, e.g. written by
  # `deepseek41.tools.convert import`): a run with no checkpoint of its own starts from its
  # parameters and router biases, with a fresh optimizer and step 0 (train/warm_start.py).
  init_from: str = key('')


@dataclasses.dataclass(frozen=True)
class LogConfig:
  every_steps: int = key(10)
  tensorboard: bool = key(True)
  progress_bar: bool = key(True)
  profile_start_step: int = key(0)      # > 0: trace steps [N, N + profile_steps) (0: off)
  profile_steps: int = key(5)
  # Weights & Biases beside TensorBoard ('' = off; needs `pip install -e '.[wandb]'`). Offline by
  # default: the run is written under WORKDIR/wandb and `wandb sync` uploads it later.
  wandb_project: str = key('')
  wandb_mode: str = key('offline', choices=('offline', 'online'))


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
  """DSpark, the drafting module (docs/architecture.md section 3.14): its shape and its stage.

  `stage`: 'off' (pretraining, no DSpark), 'frozen' (the DSpark stage: the backbone restored from
  `backbone_checkpoint` and never updated) or 'post_training' (DSpark trained beside the backbone,
  a stop-gradient between them, so its loss never reaches the backbone).
  """
  stage: str = key('off', choices=('off', 'frozen', 'post_training'))
  # A pretraining checkpoint step directory (WORKDIR/checkpoints/<step>) whose backbone the
  # DSpark stage starts from; read at the stage's first start only (a resume reads its own).
  # Empty with post_training: backbone and drafter both start from initialization [I].
  backbone_checkpoint: str = key('')
  num_blocks: int = key(3)              # draft blocks, stacked (released 3)
  block_size: int = key(5)              # draft slots per anchor (released 5)
  # Layers whose incoming residual feeds the drafter (released 37-39 of 40); () = the last
  # `num_blocks` layers.
  target_layer_ids: tuple[int, ...] = key(())
  markov_rank: int = key(256)
  n_routed_experts: int = key(128)      # the draft blocks' own MoE (released 128, top-3)
  num_experts_per_tok: int = key(3)
  noise_token_id: int = key(-1)         # the placeholder of slots 2..K; -1 = the last vocab id [I]
  anchors_per_sequence: int = key(16)   # anchor positions drawn per training row [I]
  ce_weight: float = key(0.1)
  l1_weight: float = key(0.9)
  bce_weight: float = key(1.0)
  slot_decay: float = key(5.0)          # L1 weight of slot k: exp(-(k-1)/slot_decay)

  def targets(self, num_layers: int) -> tuple[int, ...]:
    return self.target_layer_ids or tuple(range(num_layers - self.num_blocks, num_layers))


@dataclasses.dataclass(frozen=True)
class RunConfig:
  model: ModelConfig
  data: DataConfig
  train: TrainConfig
  mesh: MeshConfig
  checkpoint: CheckpointConfig
  log: LogConfig
  dspark: DSparkConfig
  tasks: TasksConfig

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = {'model': ModelConfig, 'data': DataConfig, 'train': TrainConfig, 'mesh': MeshConfig,
            'checkpoint': CheckpointConfig, 'log': LogConfig, 'dspark': DSparkConfig,
            'tasks': TasksConfig}


def base_config() -> ml_collections.ConfigDict:
  """Every key with its default, from the section declarations above."""
  c = ml_collections.ConfigDict()
  for name, cls in SECTIONS.items():
    section = c[name] = ml_collections.ConfigDict()
    for f in keys_of(cls):
      section[f.name] = f.metadata['default']
  return c


def execution_only_keys(section: str = 'model') -> frozenset[str]:
  """The keys of `section` declared execution-only: a checkpoint resumes across a change of
  any of them (train/checkpoint.py), and generation re-resolves those with an `auto` rule for
  its own devices."""
  return frozenset(f.name for f in keys_of(SECTIONS[section]) if f.metadata['execution_only'])
