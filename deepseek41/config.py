"""Configuration: declared keys -> validated ConfigDict -> frozen dataclasses -> layer-role table.

Each section (model, data, train, mesh, checkpoint, log) is a frozen dataclass, and its fields
are the schema: `name: type = _key(default)` declares the config key `section.name`, its default
and, for a string choice, the values allowed; the comment beside it documents it.
`base_config()` is generated from these declarations, and config files under `configs/` start
from it and override what they need. Anything a config file or a `--config.a.b=c` override names
that is not declared is rejected with the key's full name.

`resolve()` validates the whole config before anything compiles: it converts each value to its
declared type, resolves the `auto` choices for the backend at hand, runs the per-section checks
(each error a `ConfigError` starting with the key) and returns the frozen `RunConfig` the rest of
the package reads. With `with_data=True` it also checks the model against the data's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from typing import Any, Callable

import ml_collections

from deepseek41.batch import max_span_positions

LAYOUT_VERSION = 1  # bump when the train-state pytree layout changes incompatibly


class ConfigError(ValueError):
  """A config value is unknown, out of range or inconsistent; the message names the key."""


def _key(default: Any, *, choices: tuple[str, ...] = (),
        auto: Callable[[dict[str, Any], str], str] | None = None) -> Any:
  """Declare a config key: its default and, for a string key, the values it may take.

  `auto`, when given, also allows the value 'auto' and resolves it from the section's other
  values and the backend ('cpu', 'gpu', 'tpu'); the dataclass then holds the resolved choice.
  """
  return dataclasses.field(metadata={'default': default, 'choices': tuple(choices), 'auto': auto})


def _keys(cls) -> list[dataclasses.Field]:
  """The fields of a section that are config keys (the others are derived by resolve())."""
  return [f for f in dataclasses.fields(cls) if 'default' in f.metadata]


# ---------------------------------------------------------------------------------------------
# `auto` choices of the model: how, not what, is computed (docs/architecture.md section 2).


# The fastest dropless expert path of each platform (ops/expert_gemm.py): `auto` never drops.
# GPU: the grouped Pallas GEMM, dropless at about the capacity einsum's speed (measured on the
# H200, docs/performance.md 9.7). CPU: `reference`, every expert on every token (E/K times the
# useful FLOPs; the README's tiny quick start took 7m24s against 4m36s with the dropping
# capacity einsum, setup included), since ragged_dot computes every group densely there (E
# times). TPU: ragged_dot's real grouped GEMM.
_DROPLESS_MOE_BACKENDS = {'tpu': 'ragged_dot', 'gpu': 'grouped', 'cpu': 'reference'}


def _auto_moe_backend(m: dict[str, Any], backend: str) -> str:
  return _DROPLESS_MOE_BACKENDS.get(backend, 'reference')


def _auto_grouped_wgrad(m: dict[str, Any], backend: str) -> str:
  return 'mosaic' if backend == 'gpu' and m['d_model'] >= 4096 else 'triton'


def _auto_eval_moe_backend(m: dict[str, Any], backend: str) -> str:
  # Evaluation is dropless whatever the training backend (a capacity drop moves a toy model's
  # logits by up to 5.7): a dropless training backend is kept, the capacity einsum replaced by
  # the fastest dropless path here. On the CPU ragged_dot, at the tiny config's expert shapes,
  # compiles in 0.8 s against reference's 0.4 s and runs slower (E=64, K=6: 630 ms against 235
  # ms per call).
  if m['moe_backend'] != 'capacity_einsum':
    return m['moe_backend']
  return _DROPLESS_MOE_BACKENDS.get(backend, 'reference')


def default_expert_exchange(backend: str) -> str:
  """model.expert_exchange=auto (the comment at the key says why)."""
  return 'ragged' if backend == 'tpu' else 'allgather'


def _auto_index_impl(m: dict[str, Any], backend: str) -> str:
  if backend == 'tpu' and mosaic_index_supported(m['index_head_dim']):
    return 'mosaic'
  return _auto_selected_scores_impl(m, backend)


def _auto_selected_scores_impl(m: dict[str, Any], backend: str) -> str:
  fused_ok = index_scores_supported(m['index_n_heads'], m['index_head_dim'])
  return 'fused' if backend == 'gpu' and fused_ok else 'reference'


def _auto_attention_impl(m: dict[str, Any], backend: str) -> str:
  fused_ok = attention_kernel_supported(m['num_heads'], m['head_dim'])
  return 'fused' if backend == 'gpu' and fused_ok else 'chunked'


def _auto_sparse_impl(m: dict[str, Any], backend: str) -> str:
  return 'fused' if backend == 'gpu' else 'gathered'


def mhc_kernel_supported(hc_mult: int, d_model: int) -> bool:
  return hc_mult & (hc_mult - 1) == 0 and d_model % 16 == 0


def _auto_mhc_impl(m: dict[str, Any], backend: str) -> str:
  fused_ok = m['residual'] != 'plain' and mhc_kernel_supported(m['hc_mult'], m['d_model'])
  return 'fused' if backend == 'gpu' and fused_ok else 'reference'


def _auto_compute_dtype(m: dict[str, Any], backend: str) -> str:
  return 'float32' if backend == 'cpu' else 'bfloat16'


def _auto_vision_attention_impl(m: dict[str, Any], backend: str) -> str:
  return 'reference' if backend == 'cpu' else 'fused'


QUANT_FORMATS = ('none', 'fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32')


# ---------------------------------------------------------------------------------------------
# The sections. Model: bracketed names are the released config.json names
# (docs/architecture.md section 2).


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model, as every module sees it (`auto` choices resolved)."""
  vocab_size: int = _key(512)            # [vocab_size] must cover the tokenizer's vocabulary
  d_model: int = _key(128)               # [hidden_size]
  num_layers: int = _key(4)              # [num_hidden_layers] backbone layers (no DSpark blocks)
  num_encoder_layers: int = _key(2)      # CED split: layers [0, n) are the causal encoder
  num_heads: int = _key(4)               # [num_attention_heads]
  head_dim: int = _key(64)               # [head_dim] width of the shared K=V latent
  rope_head_dim: int = _key(16)          # [qk_rope_head_dim] RoPE on the last channels
  q_lora_rank: int = _key(64)            # [q_lora_rank]
  o_groups: int = _key(2)                # [o_groups]
  o_lora_rank: int = _key(64)            # [o_lora_rank] per group
  sliding_window: int = _key(16)         # [sliding_window] keys t-W < s <= t
  # Residual (section 3.2): mHC over hc_mult streams, V4.1 single-pass or V4 multi-pass order,
  # or a plain pre-norm residual (ablation).
  residual: str = _key('mhc_single_pass', choices=('mhc_single_pass', 'mhc_multi_pass', 'plain'))
  hc_mult: int = _key(4)                 # [hc_mult] residual streams
  # How the mHC sites run: `reference` (jnp, model/mhc.py) or `fused` (ops/mhc_kernel.py, GPU
  # Pallas kernels that read and write the streams once per site). auto = fused on the GPU where
  # it tiles (docs/performance.md section 10.2: one layer's mHC 8.3 -> 5.2 ms, 18 GB less).
  mhc_impl: str = _key('auto', choices=('reference', 'fused'), auto=_auto_mhc_impl)
  hc_sinkhorn_iters: int = _key(20)      # [hc_sinkhorn_iters]
  hc_eps: float = _key(1e-6)             # [hc_eps]
  hc_init_std: float = _key(0.02)        # std of the coefficient projections [S: HF's init]
  q_head_norm: bool = _key(True)         # per-head q re-normalisation (3.3); off = HF parity
  # Layer roles (section 1). One ratio per backbone layer: 0 = SWA only, 1 or 2 = CSA2 ratio.
  compress_ratios: tuple[int, ...] = _key((0, 2, 1, 1))
  kv_source_layer_ids: tuple[int, ...] = _key((1, 2))
  index_source_layer_ids: tuple[int, ...] = _key((1, 2, 3))
  candidate_source_layer_id: int = _key(2)  # -1: no candidate pool
  engram_layer_ids: tuple[int, ...] = _key((1,))
  # Engram (section 3.12): hashed n-gram memory injected into the residual before these layers.
  engram: bool = _key(True)              # off = the layer ids are ignored (ablation)
  engram_max_ngram: int = _key(3)        # [engram_max_ngram_size]: 2..max-grams (released 4)
  engram_n_heads: int = _key(2)          # [engram_n_heads] (released 8)
  engram_head_dim: int = _key(16)        # [engram_head_dim] (released 256)
  engram_vocab_start: int = _key(1000)   # [engram_vocab_size]: prime search start (released 16M)
  engram_pad_token_id: int = _key(2)     # [engram_pad_token_id], in the hashed id space
  # [engram_compressed_vocab_size]: ids the tokenizer compresses to (resolve(with_data=True)
  # checks it against the data's tokenizer); 0 = hash raw token ids.
  engram_compressed_vocab_size: int = _key(0)
  # Pad table rows to a multiple of this so they can shard (a sum of primes divides by few mesh
  # sizes); 1 = exact.
  engram_table_row_multiple: int = _key(1)
  # [I] Tables split over several devices: each device sends its distinct row ids to the rows'
  # owners in chunks of engram_exchange_capacity x (its lookups / owners) ids (at least 256);
  # ids past a chunk read zero rows and are counted in engram_dropped_frac. 0 = chunks of every
  # lookup (exact under any skew, owners x the bytes). ops/engram_lookup.py says why 2 is ample.
  engram_exchange_capacity: float = _key(2.0)
  # CSA2 (sections 3.6-3.8): on in every shipped config; off = window attention only (ablation).
  csa2: bool = _key(False)
  index_n_heads: int = _key(4)           # [index_n_heads]
  index_head_dim: int = _key(32)         # [index_head_dim]
  index_topk: int = _key(8)              # [index_topk]
  indexer_loss_weight: float = _key(1.0)  # weight of the indexer distillation loss [I] (csa2.py)
  candidate_topk_blocks: int = _key(4)   # [candidate_topk_blocks]
  candidate_block_size: int = _key(4)    # [candidate_block_size]
  index_topk_block: int = _key(8)        # exact two-stage top-k over blocks of this; 0 = one pass
  # RoPE (section 3.4): "main" for ratio-0 layers, "compress" (YaRN) for ratio > 0 layers.
  rope_theta: float = _key(10000.0)
  compress_rope_theta: float = _key(160000.0)
  yarn_factor: float = _key(4.0)         # [rope_scaling.factor]; 1 disables YaRN
  yarn_original_max_position: int = _key(128)
  yarn_beta_fast: float = _key(32.0)
  yarn_beta_slow: float = _key(1.0)
  rms_norm_eps: float = _key(1e-6)       # released: 1e-20 (parity tests only)
  # DeepSeekMoE (section 3.11).
  n_routed_experts: int = _key(8)
  num_experts_per_tok: int = _key(2)
  n_shared_experts: int = _key(1)
  moe_intermediate_size: int = _key(128)
  route_scale: float = _key(1.5)         # [routed_scaling_factor]
  swiglu_limit: float = _key(10.0)
  router_bias_rate: float = _key(0.001)  # gamma of the sign rule, per step, per modality
  balance_loss_weight: float = _key(1e-4)  # alpha of the sequence-wise balance loss [S]; 0 = off
  moe_backend: str = _key('auto', auto=_auto_moe_backend,
                         choices=('reference', 'capacity_einsum', 'ragged_dot', 'grouped'))
  capacity_factor: float = _key(1.25)    # capacity_einsum: slots per expert = ceil(cf * N * K / E)
  # Expert parallelism (mesh.expert > 1; ops/expert_parallel.py), how the dropless backends'
  # tokens reach their experts' shards (model.expert_exchange):
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
  expert_buffer_factor: float = _key(0.0)
  # The grouped experts' weight-gradient kernel (ops/grouped_gemm.py): our Triton tgmm, or jax's
  # Mosaic GPU transposed ragged dot (Hopper only; elsewhere it falls back to tgmm). On the H200
  # mosaic makes the expert block's forward+backward 21% faster at the released shapes (d 5120)
  # but only 9% at the 1B ones, where the training step does not move and its compile takes 36 s
  # longer (docs/performance.md 11.1). auto: mosaic on the GPU from d_model 4096 up.
  grouped_wgrad: str = _key('auto', choices=('triton', 'mosaic'), auto=_auto_grouped_wgrad)
  expert_exchange: str = _key('auto', choices=('allgather', 'ragged', 'padded'),
                              auto=lambda m, backend: default_expert_exchange(backend))
  # The allgather exchange's partial outputs (each expert shard's weighted sum of its experts'
  # outputs for every gathered token), as they are reduce-scattered back: float32 (the sum over
  # shards unrounded, as one device's combine) or the compute dtype (bf16: a third fewer bytes
  # each way, 2 + 2 instead of 2 + 4 per token row and D, and half the partials' memory; each
  # shard's partial is rounded once and the shards' sum is taken in bf16). The ragged and padded
  # exchanges return each assignment's row in the compute dtype already.
  expert_partials: str = _key('float32', choices=('float32', 'compute'))
  # The routed experts of held-out evaluation, dropless: auto keeps a dropless moe_backend and
  # replaces capacity_einsum (grouped on the GPU, ragged_dot on the TPU, reference on the CPU).
  eval_moe_backend: str = _key('auto', auto=_auto_eval_moe_backend,
                              choices=('reference', 'capacity_einsum', 'ragged_dot', 'grouped'))
  # fused: the GPU kernels (ops/window_kernel.py, ops/sparse_kernel.py); the other choices are
  # the plain jnp paths, which every backend runs. auto picks the kernels on the GPU (the window
  # kernel where attention_kernel_supported() takes the shapes; docs/performance.md section 9).
  attention_impl: str = _key('auto', choices=('reference', 'chunked', 'fused'),
                            auto=_auto_attention_impl)
  sparse_impl: str = _key('auto', choices=('reference', 'gathered', 'fused'),
                         auto=_auto_sparse_impl)
  # How the indexer picks its top-k: XLA's top_k (sorts whole rows on the GPU) or the exact
  # threshold select (ops/topk_select.py); the same entries either way.
  select_impl: str = _key('auto', choices=('top_k', 'threshold'),
                         auto=lambda m, backend: 'threshold' if backend == 'gpu' else 'top_k')
  sparse_chunk: int = _key(1024)         # queries per chunk in the gathered path and the indexer
  # [I] The indexer's query chunks run in up to this many runs, each scoring and selecting over
  # only the entries its last row can see (model/csa2.py `causal_groups`): a causal slab is half
  # empty, and 4 runs score 5/8 of it. Each run is one more compiled loop body; 1 = one run over
  # every entry. The same selection for any value.
  index_causal_groups: int = _key(4)
  # With the fused kernel, the layers that read one index source's selection (and so the same
  # KV rows) add their key/value gradient once, in the index source's backward, instead of once
  # each (ops/sparse_kernel.py; docs/performance.md section 25). Same gradients.
  sparse_group_dkv: bool = _key(True)
  # With the fused kernels, their backward runs against the layer's merged softmax
  # (log-sum-exp, output cotangent, D = sum dO * O) instead of through autodiff of the merge,
  # which writes and reads a [T, H, d] cotangent per branch (ops/softmax_merge.py). Same
  # gradients.
  merged_backward: bool = _key(True)
  # Image-span queries per chunk of the span branch; each chunk's scores are recomputed in the
  # backward instead of kept (ops/span_attention.py). 0: whole spans, probabilities kept.
  span_chunk: int = _key(256)
  # fused: the GPU kernel (ops/index_scores.py), for the shapes index_scores_supported() takes;
  # auto picks it wherever it can run.
  index_impl: str = _key('auto', choices=('reference', 'fused', 'mosaic'), auto=_auto_index_impl)
  # The selected entries' indexer scores, which train the indexer (ops/selected_scores.py):
  # fused is the GPU kernel, for the same shapes as index_impl's.
  selected_scores_impl: str = _key('auto', choices=('reference', 'fused'),
                                   auto=_auto_selected_scores_impl)
  # Fake quantization (section 3.16), each 'none' or a deepseek41.quant format name; the
  # released formats are fp4_e4m3_16 / fp4_ue8m0_32 / fp8_ue8m0_32 (configs/v41_flash.py).
  kv_quant: str = _key('none', choices=QUANT_FORMATS)  # compressed main KV, after RoPE
  index_quant: str = _key('none', choices=QUANT_FORMATS)  # indexer q and k
  swa_quant: str = _key('none', choices=QUANT_FORMATS)  # sliding-window KV, after RoPE
  init_std: float = _key(0.02)
  # auto: bf16 on GPU/TPU, f32 on CPU.
  compute_dtype: str = _key('auto', choices=('float32', 'bfloat16'), auto=_auto_compute_dtype)
  param_dtype: str = _key('float32', choices=('float32', 'bfloat16'))  # master weights
  # [I] FP8 training GEMMs (ops/fp8_matmul.py): 'rowwise' runs the attention projections, the
  # shared and the routed experts in e4m3 with per-row power-of-two scales and float32
  # accumulation, forward and backward (not V3's 128-tiles: cuBLAS FP8 takes row scales only).
  # Master weights and optimizer stay in param_dtype; embedding, LM head, router, norms, mHC,
  # attention core, indexer and compressor stay in compute_dtype.
  fp8: str = _key('off', choices=('off', 'rowwise'))
  # Vision (section 3.15): DeepSeek-ViT + 3x3 merge aligner, image spans in the token stream.
  # Defaults are the tiny test dims; configs/v41_flash.py holds the released ones.
  vision: bool = _key(False)
  vision_layers: int = _key(2)           # released 32
  vision_dim: int = _key(64)             # 1024
  vision_heads: int = _key(4)            # 16 (head dim 64; 2D RoPE needs head dim % 4 == 0)
  vision_mlp: int = _key(128)            # SwiGLU hidden, 2816
  vision_patch: int = _key(4)            # patch side in pixels, 14
  vision_merge: int = _key(3)            # merge x merge patches -> one LM token
  vision_rope_theta: float = _key(10000.0)
  vision_norm_eps: float = _key(1e-6)
  vision_max_image_tokens: int = _key(16)  # merged tokens per image at most, 1024 (~1344x1344 px)
  vision_min_pixels: int = _key(0)       # images are scaled up to at least this area, 544^2
  # auto: fused off the CPU.
  vision_attention_impl: str = _key('auto', choices=('reference', 'fused'),
                                   auto=_auto_vision_attention_impl)
  # Id placed at image-span positions (released 129264); its table row is never read: spans
  # take aligner outputs and learned delimiters.
  image_token_id: int = _key(0)

  @property
  def image_span_max_len(self) -> int:
    """Longest image span (alignment pad included): how far span attention reaches; 0 = none."""
    return max_span_positions(self.vision_max_image_tokens) if self.vision else 0


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
class DataConfig:
  seq_len: int = _key(128)
  # Comma-separated prepared dataset directories (or `default`, the embedded corpus) with
  # optional mixture weights ("/data/a:0.7,/data/b:0.3"); resolved to ((dir, weight), ...).
  # Empty: the embedded default corpus (Python stdlib sources).
  sources: Sources = _key('')
  synthetic: bool = _key(False)          # random tokens, no I/O: for benchmarks
  cache_dir: str = _key('')              # where the default corpus is prepared ('' = ~/.cache/...)
  default_corpus_vocab_size: int = _key(512)  # BPE vocabulary trained on the default corpus
  default_corpus_max_files: int = _key(0)  # 0 = every stdlib source file
  shuffle_seed: int = _key(0)
  num_workers: int = _key(0)             # grain worker processes (0 = in the training process)
  prefetch: int = _key(2)                # batches prefetched per worker / by the prefetch thread
  packing_bins: int = _key(16)           # first-fit packing bins
  document_align: int = _key(2)          # documents start at multiples of this (largest ratio)
  # Interleaved image-text sources (model.vision on), mixed with `sources` by weight:
  # "shapes:0.7,/data/pairs:0.2,/data/web.jsonl:0.1". `shapes` is the embedded task
  # (deepseek41/data/shapes.py); a directory holds image + caption pairs (a.png + a.txt); a
  # .jsonl file holds records {"content": [{"text": ...}, {"image": "relative/or/abs.png"}]}.
  image_sources: Sources = _key('')
  max_images_per_row: int = _key(4)      # image slots per packed row (static shape)
  image_heldout_fraction: float = _key(0.02)  # records of each image source held out for eval
  shapes_image_size: int = _key(48)      # side in pixels of the embedded task's images
  # Input streams the global batch is split into; each process reads streams / processes of them
  # and the checkpoint holds each stream's position. 0: the process count. Fixed at a run's
  # first start: a resumed run keeps its checkpoint's count (README, "Several GPUs and hosts").
  streams: int = _key(0)
  images: ImageGeometry | None           # derived from the model; None when model.vision is off


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = _key(200)
  batch_size: int = _key(8)              # global batch (sequences per optimizer step)
  grad_accum_steps: int = _key(1)        # microbatches per step; batch_size must divide evenly
  seed: int = _key(0)
  lr: float = _key(3e-3)
  min_lr_ratio: float = _key(0.1)        # final lr = lr * min_lr_ratio
  warmup_steps: int = _key(20)
  schedule: str = _key('cosine', choices=('cosine', 'wsd', 'constant'))
  wsd_decay_fraction: float = _key(0.2)  # wsd: the last fraction of steps decays linearly
  b1: float = _key(0.9)
  b2: float = _key(0.95)
  eps: float = _key(1e-8)
  weight_decay: float = _key(0.1)        # never on norms, biases, sinks or scales (1-D params)
  grad_clip_norm: float = _key(1.0)      # global-norm clipping; 0 disables
  engram_table_lr_multiplier: float = _key(5.0)  # Engram tables learn at this multiple of lr
  # [I] The ViT and its aligner learn at this multiple of lr. Adam moves every aligner weight by
  # about lr per step, so its output (the LM input at image positions) grows like fan-in x lr
  # while a table embedding row barely moves; at a text-tuned lr the spans become large,
  # near-constant vectors the LM cannot read (docs/performance.md section 7.2).
  vision_lr_multiplier: float = _key(1.0)
  # block_keep_attention: block remat that also keeps the GPU attention kernels' outputs
  remat: str = _key('none', choices=('none', 'block', 'block_keep_attention'))
  # With remat (ignored under 'none'): how many layers, from the first, are rematerialized
  # (0 = all). The others keep their residuals for the backward: less recompute, more memory.
  remat_layers: int = _key(0)
  eval_every_steps: int = _key(50)       # 0 disables evaluation
  eval_batches: int = _key(4)
  peak_tflops: float = _key(0.0)         # per-device peak for MFU; 0 = look up by device kind
  # JAX's persistent compilation cache: compiled programs are written here and loaded by any
  # later run of the same program (a restart, a rerun); '' = off. Under the user's cache dir, not
  # the work directory: all of a user's runs share it (JAX keys entries by program, devices and
  # versions, and several processes may use one directory), and JAX runs what it finds there,
  # so it belongs in a directory only its user can write. The trainer expands '~'.
  compilation_cache_dir: str = _key('~/.cache/deepseek41/jax-compilation-cache')


# logical axis -> mesh axis or axes ('' = replicated); see sharding.py. Activations are split
# over `batch` and, with context parallelism, over `context` along the sequence (ops/per_device.py:
# the mesh axis names there are these rules' defaults).
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
  data: int = _key(-1)
  fsdp: int = _key(1)
  expert: int = _key(1)
  tensor: int = _key(1)
  context: int = _key(1)                 # sequence shards (context parallelism)
  # Sequence parallelism: with tensor > 1, the residual between layers (what block remat keeps)
  # is split along the sequence over `tensor` too, not replicated (ops/per_device.py).
  sequence_parallel: bool = _key(True)
  # Resolved to ((logical_axis, (mesh_axis, ...)), ...).
  rules: tuple[tuple[str, tuple[str, ...]], ...] = _key(DEFAULT_RULES)

  AXES = ('data', 'fsdp', 'expert', 'tensor', 'context')

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, a) for a in self.AXES)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = _key(100)           # 0 disables periodic saves (SIGTERM/SIGINT still save)
  max_to_keep: int = _key(3)             # keep the newest N ...
  keep_period: int = _key(0)             # ... plus every K-th step (0: none)
  async_save: bool = _key(True)
  # A checkpoint step directory (WORKDIR/checkpoints/<step>, e.g. written by
  # `deepseek41.tools.convert import`): a run with no checkpoint of its own starts from its
  # parameters and router biases, with a fresh optimizer and step 0 (interop/init_from.py).
  init_from: str = _key('')


@dataclasses.dataclass(frozen=True)
class LogConfig:
  every_steps: int = _key(10)
  tensorboard: bool = _key(True)
  progress_bar: bool = _key(True)
  profile_start_step: int = _key(0)      # > 0: trace steps [N, N + profile_steps) (0: off)
  profile_steps: int = _key(5)
  # Weights & Biases beside TensorBoard ('' = off; needs `pip install -e '.[wandb]'`). Offline by
  # default: the run is written under WORKDIR/wandb and `wandb sync` uploads it later.
  wandb_project: str = _key('')
  wandb_mode: str = _key('offline', choices=('offline', 'online'))


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
  """DSpark, the drafting module (docs/architecture.md section 3.14): its shape and its stage.

  `stage`: 'off' (pretraining, no DSpark), 'frozen' (the DSpark stage: the backbone restored from
  `backbone_checkpoint` and never updated) or 'post_training' (DSpark trained beside the backbone,
  a stop-gradient between them, so its loss never reaches the backbone).
  """
  stage: str = _key('off', choices=('off', 'frozen', 'post_training'))
  # A pretraining checkpoint step directory (WORKDIR/checkpoints/<step>) whose backbone the
  # DSpark stage starts from; read at the stage's first start only (a resume reads its own).
  # Empty with post_training: backbone and drafter both start from initialization [I].
  backbone_checkpoint: str = _key('')
  num_blocks: int = _key(3)              # draft blocks, stacked (released 3)
  block_size: int = _key(5)              # draft slots per anchor (released 5)
  # Layers whose incoming residual feeds the drafter (released 37-39 of 40); () = the last
  # `num_blocks` layers.
  target_layer_ids: tuple[int, ...] = _key(())
  markov_rank: int = _key(256)
  n_routed_experts: int = _key(128)      # the draft blocks' own MoE (released 128, top-3)
  num_experts_per_tok: int = _key(3)
  noise_token_id: int = _key(-1)         # the placeholder of slots 2..K; -1 = the last vocab id [I]
  anchors_per_sequence: int = _key(16)   # anchor positions drawn per training row [I]
  ce_weight: float = _key(0.1)
  l1_weight: float = _key(0.9)
  bce_weight: float = _key(1.0)
  slot_decay: float = _key(5.0)          # L1 weight of slot k: exp(-(k-1)/slot_decay)

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

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = {'model': ModelConfig, 'data': DataConfig, 'train': TrainConfig, 'mesh': MeshConfig,
            'checkpoint': CheckpointConfig, 'log': LogConfig, 'dspark': DSparkConfig}


def base_config() -> ml_collections.ConfigDict:
  """Every key with its default, from the section declarations above."""
  c = ml_collections.ConfigDict()
  for name, cls in SECTIONS.items():
    section = c[name] = ml_collections.ConfigDict()
    for f in _keys(cls):
      section[f.name] = f.metadata['default']
  return c


# ---------------------------------------------------------------------------------------------
# Layer roles (docs/design.md "Layer roles"): the model never tests layer numbers, it reads
# this table.

SWA, FULL, REINDEX, REUSE = 'SWA', 'Full', 'Reindex', 'Reuse'


@dataclasses.dataclass(frozen=True)
class LayerRole:
  layer: int
  block: str                # encoder | decoder
  ratio: int                # 0 = SWA only
  mode: str                 # SWA | Full | Reindex | Reuse
  kv_source: int            # -1 for SWA-only layers
  index_source: int         # -1 for SWA-only layers
  publishes_candidates: bool
  uses_candidates: bool     # Reindex layers after the candidate source select inside its pool
  engram: bool
  rope: str                 # main | compress


def _latest_at_or_below(sources: tuple[int, ...], layer: int) -> int:
  below = [s for s in sources if s <= layer]
  return max(below) if below else -1


def layer_roles(m: ModelConfig) -> tuple[LayerRole, ...]:
  roles = []
  for l in range(m.num_layers):
    r = m.compress_ratios[l]
    engram = l in m.engram_layer_ids
    block = 'encoder' if l < m.num_encoder_layers else 'decoder'
    if r == 0:
      roles.append(LayerRole(l, block, 0, SWA, -1, -1, False, False, engram, 'main'))
      continue
    kv_src = _latest_at_or_below(m.kv_source_layer_ids, l)
    idx_src = _latest_at_or_below(m.index_source_layer_ids, l)
    if idx_src != l:
      mode = REUSE
    elif kv_src == l:
      mode = FULL
    else:
      mode = REINDEX
    cand = m.candidate_source_layer_id
    roles.append(LayerRole(
        layer=l, block=block, ratio=r, mode=mode, kv_source=kv_src, index_source=idx_src,
        publishes_candidates=(l == cand),
        uses_candidates=(mode == REINDEX and cand >= 0 and kv_src == cand and l > cand),
        engram=engram, rope='compress'))
  return tuple(roles)


def format_role_table(m: ModelConfig) -> str:
  head = f"{'layer':>5} {'block':<8} {'ratio':>5} {'mode':<8} {'kv_src':>6} {'idx_src':>7} " \
         f"{'cand':<9} {'engram':<6} {'rope':<8}"
  lines = [head]
  for r in layer_roles(m):
    cand = 'publish' if r.publishes_candidates else ('restrict' if r.uses_candidates else '-')
    lines.append(
        f'{r.layer:>5} {r.block:<8} {r.ratio:>5} {r.mode:<8} {r.kv_source:>6} {r.index_source:>7} '
        f"{cand:<9} {'yes' if r.engram else '-':<6} {r.rope:<8}")
  return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------
# Reading a section: keys, types, choices.


def _check_keys(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict, prefix=''):
  for name in cfg.keys():
    full = f'{prefix}{name}'
    if name not in schema:
      close = [k for k in schema.keys() if k.lower() == name.lower() or k.startswith(name[:3])]
      hint = f' (did you mean {", ".join(prefix + k for k in close)}?)' if close else ''
      raise ConfigError(f'unknown config key {full!r}{hint}')
    if isinstance(schema[name], ml_collections.ConfigDict):
      if not isinstance(cfg[name], ml_collections.ConfigDict):
        raise ConfigError(f'config key {full!r} must be a section, got {cfg[name]!r}')
      _check_keys(cfg[name], schema[name], full + '.')
  for name in schema.keys():
    if name not in cfg:
      raise ConfigError(f'config is missing key {prefix}{name}; start config files from '
                        'deepseek41.config.base_config()')


def _req(cond: bool, key: str, msg: str):
  if not cond:
    raise ConfigError(f'{key}: {msg}')


def _tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (list, tuple)) else (v,)


_CONVERT = {int: int, float: float, bool: bool, str: str,
            tuple[int, ...]: lambda v: tuple(int(x) for x in _tuple(v))}


def _read_section(cls, section: ml_collections.ConfigDict, name: str,
                  backend: str | None = None) -> dict[str, Any]:
  """The section's keys converted to their declared types, choices checked, `auto` resolved.

  Keys whose declared type is not a plain value (data sources, mesh rules) are returned as
  written; their section's resolver parses them.
  """
  types = typing.get_type_hints(cls)
  out = {}
  for f in _keys(cls):
    value, convert = section[f.name], _CONVERT.get(types[f.name])
    if convert is not None:
      try:
        value = convert(value)
      except (TypeError, ValueError):
        t = types[f.name]
        type_name = t.__name__ if isinstance(t, type) else str(t)
        raise ConfigError(f'{name}.{f.name}: must be {type_name}, got {value!r}') from None
    out[f.name] = value
  for f in _keys(cls):
    choices, auto = f.metadata['choices'], f.metadata['auto']
    allowed = (('auto',) if auto else ()) + choices
    _req(not allowed or out[f.name] in allowed, f'{name}.{f.name}',
         f'must be one of {allowed}, got {out[f.name]!r}')
    if out[f.name] == 'auto' and auto:
      out[f.name] = auto(out, backend)
  return out


# ---------------------------------------------------------------------------------------------
# Model checks, one concern each (docs/architecture.md names the mechanisms).


def _check_model_sizes(m: ModelConfig):
  L = m.num_layers
  _req(L >= 1, 'model.num_layers', f'must be >= 1, got {L}')
  _req(0 <= m.num_encoder_layers <= L, 'model.num_encoder_layers',
       f'must be in [0, num_layers={L}], got {m.num_encoder_layers}')
  for k in ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'q_lora_rank', 'o_groups',
            'o_lora_rank', 'sliding_window', 'n_routed_experts', 'num_experts_per_tok',
            'moe_intermediate_size'):
    _req(getattr(m, k) >= 1, f'model.{k}', f'must be >= 1, got {getattr(m, k)}')
  _req(m.n_shared_experts >= 0, 'model.n_shared_experts', 'must be >= 0')
  _req(m.rope_head_dim % 2 == 0 and 0 < m.rope_head_dim <= m.head_dim, 'model.rope_head_dim',
       f'must be even and in (0, head_dim={m.head_dim}], got {m.rope_head_dim}')
  _req(m.num_heads % m.o_groups == 0, 'model.o_groups',
       f'must divide num_heads={m.num_heads}, got {m.o_groups}')


def _check_layer_wiring(m: ModelConfig):
  """The role table must be one the model can run (docs/design.md "Layer roles")."""
  L, ratios = m.num_layers, m.compress_ratios
  kv, idx = m.kv_source_layer_ids, m.index_source_layer_ids
  _req(len(ratios) == L, 'model.compress_ratios',
       f'needs one entry per layer (num_layers={L}), got {len(ratios)}')
  _req(all(r in (0, 1, 2) for r in ratios), 'model.compress_ratios',
       f'entries must be 0, 1 or 2, got {ratios}')
  for k in ('kv_source_layer_ids', 'index_source_layer_ids', 'engram_layer_ids'):
    ids = getattr(m, k)
    _req(list(ids) == sorted(set(ids)), f'model.{k}', f'must be sorted and unique, got {ids}')
    for i in ids:
      _req(0 <= i < L, f'model.{k}', f'layer id {i} out of range [0, {L})')
  for i in kv + idx:
    _req(ratios[i] > 0, 'model.kv_source_layer_ids / index_source_layer_ids',
         f'layer {i} has compress ratio 0 (SWA only) and cannot be a KV or index source')
  for l, r in enumerate(ratios):
    if r == 0:
      continue
    s = _latest_at_or_below(kv, l)
    _req(s >= 0, 'model.kv_source_layer_ids',
         f'layer {l} (ratio {r}) has no KV source at or below it')
    _req(ratios[s] == r, 'model.compress_ratios',
         f'layer {l} has ratio {r} but its KV source layer {s} has ratio {ratios[s]}')
    i = _latest_at_or_below(idx, l)
    _req(i >= 0, 'model.index_source_layer_ids',
         f'layer {l} (ratio {r}) has no index source at or below it')
    _req(i >= s, 'model.index_source_layer_ids',
         f'layer {l}: its index source {i} precedes its KV source {s}')
  cand = m.candidate_source_layer_id
  _req(cand < 0 or (cand in idx and cand in kv), 'model.candidate_source_layer_id',
       f'layer {cand} must be both a KV source and an index source')
  enc = m.num_encoder_layers
  _req(enc == 0 or enc == L or all(_latest_at_or_below(kv, l) >= enc or ratios[l] == 0
                                   for l in range(enc, L)), 'model.num_encoder_layers',
       'decoder layers must read KV produced inside the decoder (CED wiring)')


def _check_residual(m: ModelConfig):
  _req(m.hc_mult >= 1, 'model.hc_mult', f'must be >= 1, got {m.hc_mult}')
  _req(m.mhc_impl != 'fused' or m.residual == 'plain' or
       mhc_kernel_supported(m.hc_mult, m.d_model),
       'model.mhc_impl', f"'fused' needs a power-of-two hc_mult and d_model a multiple of 16 "
       f'(got {m.hc_mult} and {m.d_model})')
  _req(m.hc_sinkhorn_iters >= 1, 'model.hc_sinkhorn_iters', 'must be >= 1')
  _req(m.hc_eps >= 0, 'model.hc_eps', 'must be >= 0')


def _check_engram(m: ModelConfig):
  _req(m.engram_max_ngram >= 2, 'model.engram_max_ngram', 'must be >= 2 (2-grams and up)')
  _req(m.engram_n_heads >= 1 and m.engram_head_dim >= 1, 'model.engram_n_heads',
       'engram_n_heads and engram_head_dim must be >= 1')
  _req(2 <= m.engram_vocab_start < 2**24 - 2**16, 'model.engram_vocab_start',
       f'must be in [2, 2^24 - 2^16) (exact 32-bit hashing), got {m.engram_vocab_start}')
  _req(m.engram_compressed_vocab_size >= 0, 'model.engram_compressed_vocab_size', 'must be >= 0')
  _req(m.engram_table_row_multiple >= 1, 'model.engram_table_row_multiple', 'must be >= 1')
  _req(m.engram_exchange_capacity >= 0, 'model.engram_exchange_capacity',
       f'must be >= 0 (0 = exact chunks), got {m.engram_exchange_capacity}')
  _req(0 <= m.engram_pad_token_id < (m.engram_compressed_vocab_size or m.vocab_size),
       'model.engram_pad_token_id', 'must be an id of the hashed vocabulary')


def _check_indexer(m: ModelConfig):
  _req(m.index_topk >= 1, 'model.index_topk', 'must be >= 1')
  if m.candidate_source_layer_id >= 0:
    _req(m.index_topk <= m.candidate_topk_blocks * m.candidate_block_size,
         'model.index_topk', f'top-{m.index_topk} is larger than the candidate pool '
         f'({m.candidate_topk_blocks} blocks x {m.candidate_block_size})')
  _req(m.index_n_heads >= 1, 'model.index_n_heads', 'must be >= 1')
  _req(m.indexer_loss_weight >= 0, 'model.indexer_loss_weight', 'must be >= 0')
  _req(m.index_head_dim >= 2 and m.index_head_dim % 2 == 0 and
       m.index_head_dim >= m.rope_head_dim, 'model.index_head_dim',
       f'must be even and >= rope_head_dim ({m.rope_head_dim}), got {m.index_head_dim}')
  _req(m.sparse_chunk >= 1, 'model.sparse_chunk', 'must be >= 1')
  _req(m.index_causal_groups >= 1, 'model.index_causal_groups', 'must be >= 1')
  _req(m.span_chunk >= 0, 'model.span_chunk', 'must be >= 0 (0 = whole spans, kept)')
  _req(m.index_topk_block >= 0, 'model.index_topk_block', 'must be >= 0 (0 = one top-k pass)')


def _check_rope_and_norms(m: ModelConfig):
  _req(m.yarn_factor >= 1.0, 'model.yarn_factor', f'must be >= 1, got {m.yarn_factor}')
  _req(m.rms_norm_eps > 0, 'model.rms_norm_eps', 'must be > 0')


def _check_moe(m: ModelConfig):
  _req(m.num_experts_per_tok <= m.n_routed_experts, 'model.num_experts_per_tok',
       f'top-{m.num_experts_per_tok} of {m.n_routed_experts} experts is impossible')
  _req(m.capacity_factor > 0, 'model.capacity_factor', 'must be > 0')
  _req(m.expert_buffer_factor >= 0, 'model.expert_buffer_factor',
       f'must be >= 0 (0: never overflow), got {m.expert_buffer_factor}')
  _req(m.eval_moe_backend != 'capacity_einsum', 'model.eval_moe_backend',
       "'capacity_einsum' drops assignments past capacity and evaluation must not: use auto, "
       'reference, ragged_dot or grouped')
  _req(m.router_bias_rate >= 0, 'model.router_bias_rate', 'must be >= 0')
  _req(m.balance_loss_weight >= 0, 'model.balance_loss_weight', 'must be >= 0')


def _check_vision(m: ModelConfig):
  _req(0 <= m.image_token_id < m.vocab_size, 'model.image_token_id',
       f'must be in [0, vocab_size={m.vocab_size}), got {m.image_token_id}')
  if not m.vision:
    return
  for k in ('vision_layers', 'vision_dim', 'vision_heads', 'vision_mlp', 'vision_patch',
            'vision_merge', 'vision_max_image_tokens'):
    _req(getattr(m, k) >= 1, f'model.{k}', f'must be >= 1, got {getattr(m, k)}')
  _req(m.vision_dim % m.vision_heads == 0 and (m.vision_dim // m.vision_heads) % 4 == 0,
       'model.vision_heads', f'vision_dim={m.vision_dim} / vision_heads={m.vision_heads} must '
       'be a whole head dim divisible by 4 (2D RoPE rotates row and column halves in pairs)')
  _req(m.vision_min_pixels >= 0, 'model.vision_min_pixels', 'must be >= 0')


def attention_kernel_supported(heads: int, dim: int) -> bool:
  """Shapes the fused window kernel takes: heads and head width powers of two, >= 16."""
  return index_scores_supported(heads, dim) and heads >= 16


def mosaic_index_supported(dim: int) -> bool:
  """The TPU indexer kernel (ops/tpu_index_scores.py) takes head widths of whole lanes."""
  return dim % 128 == 0


def index_scores_supported(heads: int, dim: int) -> bool:
  """Shapes the fused indexer kernel takes (ops/index_scores.py): powers of two, width >= 16."""
  pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
  return pow2(heads) and pow2(dim) and dim >= 16


def _check_index_impl(m: ModelConfig, backend: str):
  """A requested 'fused' indexer must be able to run here ('auto' only picks it where it can)."""
  fused_ok = index_scores_supported(m.index_n_heads, m.index_head_dim)
  for key in ('index_impl', 'selected_scores_impl'):
    _req(getattr(m, key) != 'fused' or (fused_ok and backend == 'gpu'), f'model.{key}',
         f"'fused' is a GPU kernel for power-of-two index_n_heads and index_head_dim >= 16 "
         f'(got {m.index_n_heads} x {m.index_head_dim} on {backend})')
  _req(m.index_impl != 'mosaic' or (backend == 'tpu' and mosaic_index_supported(m.index_head_dim)),
       'model.index_impl', f"'mosaic' is a TPU kernel for index_head_dim a multiple of 128 "
       f'(got {m.index_head_dim} on {backend})')
  for key in ('attention_impl', 'sparse_impl', 'mhc_impl'):
    _req(getattr(m, key) != 'fused' or backend == 'gpu', f'model.{key}',
         f"'fused' is a GPU kernel (Pallas on the Triton backend); this backend is {backend}")
  _req(m.attention_impl != 'fused' or attention_kernel_supported(m.num_heads, m.head_dim),
       'model.attention_impl', f"'fused' needs power-of-two num_heads and head_dim, both >= 16 "
       f'(got {m.num_heads} x {m.head_dim})')
  _req(m.select_impl != 'threshold' or backend == 'gpu', 'model.select_impl',
       f"'threshold' is a GPU kernel (Pallas on the Triton backend); this backend is {backend}")


MODEL_CHECKS = (_check_model_sizes, _check_layer_wiring, _check_residual, _check_engram,
                _check_indexer, _check_rope_and_norms, _check_moe, _check_vision)


def _resolve_model(section: ml_collections.ConfigDict, backend: str) -> ModelConfig:
  m = ModelConfig(**_read_section(ModelConfig, section, 'model', backend))
  for check in MODEL_CHECKS:
    check(m)
  _check_index_impl(m, backend)
  return m


# ---------------------------------------------------------------------------------------------
# Data.


def _split_weight(entry: str, key: str) -> tuple[str, float]:
  """'path[:weight]' -> (path, weight); a colon inside a path (one that exists, or followed by
  a '/') is part of the path."""
  path, sep, tail = entry.rpartition(':')
  if not sep or '/' in tail or os.path.exists(entry):
    return entry, 1.0
  try:
    weight = float(tail)
  except ValueError:
    raise ConfigError(f'{key}: the weight of entry {entry!r} is {tail!r}, not a number '
                      '(entries are path[:weight], weights > 0)') from None
  _req(bool(path), key, f'entry {entry!r} has a weight but no path')
  _req(math.isfinite(weight) and weight > 0, key,
       f'the weight of entry {entry!r} must be a number > 0, got {tail}')
  return path, weight


def parse_sources(spec: str, key: str = 'data.sources') -> Sources:
  """'a:0.7,b:0.3' -> (('a', 0.7), ('b', 0.3)); an entry without a weight weighs 1."""
  return tuple(_split_weight(entry, key)
               for entry in (p.strip() for p in spec.split(',')) if entry)


def _check_source_paths(d: DataConfig):
  """Entries that exist but cannot be what their key reads (missing ones are prepared or
  reported by the data pipeline, which knows how to make them)."""
  for path, _ in d.sources:
    _req(path == 'default' or not os.path.isfile(path), 'data.sources',
         f'entry {path!r} is a file; a text source is a directory written by '
         '`python -m deepseek41.data.prepare` (or `default`, the embedded corpus)')
  for path, _ in d.image_sources:
    _req(path == 'shapes' or not os.path.isfile(path) or path.endswith('.jsonl'),
         'data.image_sources', f'entry {path!r} is a file but not .jsonl; an image source is '
         '`shapes`, a directory of image + caption pairs or a .jsonl file')


def _check_data(d: DataConfig, m: ModelConfig):
  _req(d.seq_len >= 2, 'data.seq_len', f'must be >= 2, got {d.seq_len}')
  _req(d.num_workers >= 0, 'data.num_workers', 'must be >= 0')
  _req(d.prefetch >= 0, 'data.prefetch', 'must be >= 0')
  _req(d.packing_bins >= 1, 'data.packing_bins', 'must be >= 1')
  _req(d.streams >= 0, 'data.streams', f'must be >= 0 (0: the process count), got {d.streams}')
  _req(d.document_align >= 1 and d.seq_len % d.document_align == 0, 'data.document_align',
       f'must be >= 1 and divide data.seq_len={d.seq_len}, got {d.document_align}')
  if m.csa2 and 2 in m.compress_ratios:
    _req(d.document_align % 2 == 0, 'data.document_align',
         'must be even with ratio-2 layers, or compressed groups would straddle documents')
  _req(d.default_corpus_vocab_size >= 259, 'data.default_corpus_vocab_size',
       'must be >= 259 (256 bytes + special tokens)')
  if not d.sources and not d.synthetic:
    _req(m.vocab_size >= d.default_corpus_vocab_size, 'model.vocab_size',
         f'{m.vocab_size} is smaller than data.default_corpus_vocab_size '
         f'({d.default_corpus_vocab_size})')
  _req(not (d.synthetic and engram_compresses(m)), 'model.engram_compressed_vocab_size',
       'synthetic data has no tokenizer to compress; set it to 0')


def _check_images(d: DataConfig, m: ModelConfig):
  _req(not d.image_sources or m.vision, 'data.image_sources',
       'needs model.vision=True (image sources feed the vision encoder)')
  _req(d.max_images_per_row >= 1, 'data.max_images_per_row', 'must be >= 1')
  _req(0 <= d.image_heldout_fraction < 1, 'data.image_heldout_fraction', 'must be in [0, 1)')
  _req(d.shapes_image_size >= 1, 'data.shapes_image_size', 'must be >= 1')
  if m.vision:
    span = max_span_positions(m.vision_max_image_tokens)
    _req(span <= d.seq_len, 'model.vision_max_image_tokens',
         f'the longest image span ({span} positions) must fit in data.seq_len={d.seq_len}, or '
         'packing could not keep it whole')


def _resolve_data(section: ml_collections.ConfigDict, m: ModelConfig) -> DataConfig:
  values = _read_section(DataConfig, section, 'data')
  images = ImageGeometry(
      patch_size=m.vision_patch, merge=m.vision_merge, max_image_tokens=m.vision_max_image_tokens,
      min_pixels=m.vision_min_pixels, image_token_id=m.image_token_id,
      max_images_per_row=values['max_images_per_row']) if m.vision else None
  d = DataConfig(**{**values, 'sources': parse_sources(values['sources'], 'data.sources'),
                    'image_sources': parse_sources(values['image_sources'], 'data.image_sources'),
                    'images': images})
  _check_data(d, m)
  _check_images(d, m)
  _check_source_paths(d)
  return d


def engram_compresses(m: ModelConfig) -> bool:
  """Whether Engram hashes tokenizer-compressed ids (model.engram_compressed_vocab_size > 0)."""
  return bool(m.engram and m.engram_layer_ids and m.engram_compressed_vocab_size)


def _check_against_data(m: ModelConfig, d: DataConfig):
  """What needs the data's tokenizer (the default corpus is prepared here on first use)."""
  if d.synthetic:
    return  # synthetic tokens are drawn below model.vocab_size
  from deepseek41.data.pipeline import tokenizer_path_of, vocab_size_of  # data imports config
  vocab = vocab_size_of(d)
  _req(vocab <= m.vocab_size, 'model.vocab_size',
       f'{m.vocab_size} is smaller than the tokenizer vocabulary of the data ({vocab})')
  if engram_compresses(m):
    import tokenizers

    from deepseek41.model.engram_hash import compress_vocab, vocab_strings
    path = tokenizer_path_of(d)
    _, count = compress_vocab(*vocab_strings(tokenizers.Tokenizer.from_file(path)))
    _req(count == m.engram_compressed_vocab_size, 'model.engram_compressed_vocab_size',
         f'{m.engram_compressed_vocab_size}, but the tokenizer {path} compresses to {count} ids')


# ---------------------------------------------------------------------------------------------
# Mesh, train, checkpoint, log.


def _mesh_sizes(sizes: dict[str, int], num_devices: int | None) -> dict[str, int]:
  """Fill the one -1 axis from the device count (1 without one); check the product."""
  fill = [a for a, s in sizes.items() if s == -1]
  _req(len(fill) <= 1, 'mesh', f'at most one axis may be -1, got {fill}')
  for a, s in sizes.items():
    _req(s == -1 or s >= 1, f'mesh.{a}', f'must be >= 1 or -1, got {s}')
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if num_devices is None:
    return {a: 1 if s == -1 else s for a, s in sizes.items()}
  if fill:
    _req(num_devices % fixed == 0, f'mesh.{fill[0]}',
         f'cannot fill: {num_devices} devices are not divisible by the other axes ({fixed})')
    return {**sizes, fill[0]: num_devices // fixed}
  _req(fixed == num_devices, 'mesh',
       f'axes multiply to {fixed} but {num_devices} devices are present; set one axis to -1')
  return sizes


def _mesh_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """(('batch', 'data,fsdp'), ...) -> (('batch', ('data', 'fsdp')), ...), axes checked."""
  out = []
  for i, rule in enumerate(rules):
    _req(isinstance(rule, (tuple, list)) and len(rule) == 2, f'mesh.rules[{i}]',
         f'must be a (logical_axis, "mesh_axis[,mesh_axis]") pair, got {rule!r}')
    name, axes = rule
    listed = axes if isinstance(axes, (tuple, list)) else str(axes).split(',')  # or resolved
    axes_t = tuple(a.strip() for a in listed if a.strip())
    for a in axes_t:
      _req(a in MeshConfig.AXES, f'mesh.rules[{i}]', f'unknown mesh axis {a!r} for {name!r}')
    out.append((str(name), axes_t))
  return tuple(out)


def _resolve_mesh(section: ml_collections.ConfigDict, num_devices: int | None) -> MeshConfig:
  values = _read_section(MeshConfig, section, 'mesh')
  sizes = _mesh_sizes({a: values[a] for a in MeshConfig.AXES}, num_devices)

  return MeshConfig(**sizes, sequence_parallel=values['sequence_parallel'],
                    rules=_mesh_rules(values['rules']))


def _check_train(t: TrainConfig):
  _req(t.steps >= 1, 'train.steps', f'must be >= 1, got {t.steps}')
  _req(t.batch_size >= 1, 'train.batch_size', f'must be >= 1, got {t.batch_size}')
  _req(t.grad_accum_steps >= 1, 'train.grad_accum_steps', 'must be >= 1')
  _req(t.batch_size % t.grad_accum_steps == 0, 'train.grad_accum_steps',
       f'must divide train.batch_size={t.batch_size}, got {t.grad_accum_steps}')
  _req(t.lr > 0, 'train.lr', 'must be > 0')
  _req(0 <= t.min_lr_ratio <= 1, 'train.min_lr_ratio', 'must be in [0, 1]')
  _req(t.warmup_steps >= 0, 'train.warmup_steps', 'must be >= 0')
  _req(0 < t.wsd_decay_fraction <= 1, 'train.wsd_decay_fraction', 'must be in (0, 1]')
  _req(t.eval_every_steps >= 0, 'train.eval_every_steps', 'must be >= 0')
  _req(t.eval_batches >= 1, 'train.eval_batches', 'must be >= 1')
  _req(t.grad_clip_norm >= 0, 'train.grad_clip_norm', 'must be >= 0')
  _req(t.engram_table_lr_multiplier > 0, 'train.engram_table_lr_multiplier', 'must be > 0')
  _req(t.vision_lr_multiplier > 0, 'train.vision_lr_multiplier', 'must be > 0')
  _req(t.remat_layers >= 0, 'train.remat_layers', f'must be >= 0, got {t.remat_layers}')


def remats_layer(remat: str, remat_layers: int, layer: int) -> bool:
  """Whether backbone layer `layer` runs under remat (`train.remat`, `train.remat_layers`)."""
  return remat != 'none' and (remat_layers == 0 or layer < remat_layers)


def remat_label(t: TrainConfig) -> str:
  """train.remat as the plans print it: 'block', or 'block (layers 0-5)' with remat_layers."""
  if t.remat == 'none' or t.remat_layers == 0:
    return t.remat
  return f'{t.remat} (layers 0-{t.remat_layers - 1})'


def _check_batch_split(t: TrainConfig, mesh: MeshConfig):
  micro = t.batch_size // t.grad_accum_steps
  shards = math.prod(getattr(mesh, a) for name, axes in mesh.rules if name == 'batch'
                     for a in axes)
  _req(micro % shards == 0, 'train.batch_size',
       f'the microbatch ({micro} = batch_size / grad_accum_steps) must be divisible by the '
       f'{shards} devices the batch is sharded over (mesh rules for "batch")')


def _check_context_split(d: DataConfig, m: ModelConfig, mesh: MeshConfig):
  if mesh.context == 1:
    return
  _req(d.seq_len % mesh.context == 0, 'mesh.context',
       f'{mesh.context} sequence shards cannot split data.seq_len={d.seq_len} evenly')
  _req(d.seq_len // mesh.context >= m.sliding_window, 'mesh.context',
       f'{d.seq_len // mesh.context} tokens per sequence shard cannot hold the window halo of '
       f'model.sliding_window={m.sliding_window} tokens')


def _check_expert_split(m: ModelConfig, mesh: MeshConfig):
  _req(m.n_routed_experts % mesh.expert == 0, 'mesh.expert',
       f'{mesh.expert} expert shards cannot split model.n_routed_experts={m.n_routed_experts} '
       'evenly (each shard holds a contiguous block of experts)')


def _check_checkpoint(ck: CheckpointConfig):
  _req(ck.every_steps >= 0, 'checkpoint.every_steps', 'must be >= 0')
  _req(ck.max_to_keep >= 1, 'checkpoint.max_to_keep', 'must be >= 1')
  _req(ck.keep_period >= 0, 'checkpoint.keep_period', 'must be >= 0')


def _check_log(lg: LogConfig):
  _req(lg.every_steps >= 1, 'log.every_steps', 'must be >= 1')
  _req(lg.profile_start_step >= 0, 'log.profile_start_step', 'must be >= 0 (0 = no profile)')
  _req(lg.profile_steps >= 1, 'log.profile_steps', 'must be >= 1')


def _resolve_dspark(section, m: ModelConfig, mesh: MeshConfig) -> DSparkConfig:
  values = _read_section(DSparkConfig, section, 'dspark')
  if values['noise_token_id'] == -1:
    values['noise_token_id'] = m.vocab_size - 1
  ds = DSparkConfig(**values)
  if ds.stage == 'off':
    return ds
  _req(ds.num_blocks >= 1, 'dspark.num_blocks', 'must be >= 1')
  _req(ds.block_size >= 1, 'dspark.block_size', 'must be >= 1')
  _req(ds.markov_rank >= 1, 'dspark.markov_rank', 'must be >= 1')
  _req(ds.anchors_per_sequence >= 1, 'dspark.anchors_per_sequence', 'must be >= 1')
  _req(ds.slot_decay > 0, 'dspark.slot_decay', 'must be > 0')
  _req(min(ds.ce_weight, ds.l1_weight, ds.bce_weight) >= 0, 'dspark.*_weight', 'must be >= 0')
  _req(0 <= ds.noise_token_id < m.vocab_size, 'dspark.noise_token_id',
       f'must be a token id below model.vocab_size={m.vocab_size} (-1: the last one)')
  targets = ds.targets(m.num_layers)
  _req(len(set(targets)) == len(targets) and all(0 <= l < m.num_layers for l in targets),
       'dspark.target_layer_ids', f'must be distinct layers of 0..{m.num_layers - 1}, got '
       f'{targets}')
  _req(1 <= ds.num_experts_per_tok <= ds.n_routed_experts, 'dspark.num_experts_per_tok',
       f'must be in 1..dspark.n_routed_experts={ds.n_routed_experts}')
  _req(ds.n_routed_experts % mesh.expert == 0, 'dspark.n_routed_experts',
       f'{mesh.expert} expert shards cannot split {ds.n_routed_experts} experts evenly')
  return ds


# ---------------------------------------------------------------------------------------------
# resolve()


def _default_backend() -> str:
  import jax  # imported lazily: validating a config must not need a device
  return jax.default_backend()


def resolve(cfg: ml_collections.ConfigDict, *, num_devices: int | None = None,
            backend: str | None = None, with_data: bool = False) -> RunConfig:
  """Validate `cfg` against the schema and the devices; return the frozen RunConfig.

  `backend` ('cpu', 'gpu', 'tpu') resolves the `auto` choices; it and `num_devices` default to
  JAX's. `with_data=True` also checks model.vocab_size and
  model.engram_compressed_vocab_size against the data's tokenizer, preparing the default corpus
  if it is the data and not prepared yet (the trainer passes it).
  """
  _check_keys(cfg, base_config())
  backend = backend or _default_backend()
  if num_devices is None and backend is not None:
    import jax
    num_devices = jax.device_count()
  model = _resolve_model(cfg.model, backend)
  mesh = _resolve_mesh(cfg.mesh, num_devices)
  data = _resolve_data(cfg.data, model)
  train = TrainConfig(**_read_section(TrainConfig, cfg.train, 'train'))
  _check_train(train)
  _req(train.remat_layers <= model.num_layers, 'train.remat_layers',
       f'must be <= model.num_layers={model.num_layers}, got {train.remat_layers}')
  _check_batch_split(train, mesh)
  _check_expert_split(model, mesh)
  _check_context_split(data, model, mesh)
  checkpoint = CheckpointConfig(**_read_section(CheckpointConfig, cfg.checkpoint, 'checkpoint'))
  _check_checkpoint(checkpoint)
  log = LogConfig(**_read_section(LogConfig, cfg.log, 'log'))
  _check_log(log)
  dspark = _resolve_dspark(cfg.dspark, model, mesh)
  _req(dspark.stage == 'off' or train.grad_accum_steps == 1, 'train.grad_accum_steps',
       f'the DSpark stage ({dspark.stage}) takes whole batches: set it to 1')
  if with_data:
    _check_against_data(model, data)
  return RunConfig(model=model, data=data, train=train, mesh=mesh, checkpoint=checkpoint, log=log,
                   dspark=dspark)


def config_from_saved(saved: dict, sections: tuple[str, ...] | None = None
                      ) -> ml_collections.ConfigDict:
  """The ConfigDict of a resolved config saved as JSON (a checkpoint's `config` item): the
  declared keys only (derived fields are rebuilt by `resolve`), lists back to tuples, source
  lists back to their 'dir:weight,...' form. `sections`: only these are read, the others keep
  their defaults."""
  def tuples(v):
    return tuple(tuples(x) for x in v) if isinstance(v, list) else v
  c = base_config()
  for section in (sections or c.keys()):
    for name in c[section].keys():
      if name not in saved.get(section, {}):
        continue
      value = tuples(saved[section][name])
      if isinstance(c[section][name], str) and isinstance(value, tuple):  # data sources
        value = ','.join(f'{path}:{weight:g}' for path, weight in value)
      c[section][name] = value
  return c


def load_config_file(path: str,
                     overrides: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Load a `get_config()` file (for tests and tools; the CLI uses absl config_flags)."""
  import importlib.util
  if not os.path.isfile(path):
    raise ConfigError(f'config file {path!r} does not exist')
  spec = importlib.util.spec_from_file_location('_ds41_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  for name, value in (overrides or {}).items():
    node = cfg
    *parents, leaf = name.split('.')
    for p in parents:
      if p not in node:
        raise ConfigError(f'unknown config key {name!r}')
      node = node[p]
    if leaf not in node:
      raise ConfigError(f'unknown config key {name!r}')
    node[leaf] = value
  return cfg
