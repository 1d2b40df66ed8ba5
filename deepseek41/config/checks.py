"""Pure validators: each takes resolved sections and raises ConfigError naming the key at fault.

One concern per check (docs/architecture.md names the mechanisms); resolve.py runs them all
before anything compiles. Kernel shape contracts come from ops/contracts.py, the same functions
the `auto` policy and the kernels use.
"""

from __future__ import annotations

import math

from deepseek41.batch import max_span_positions
from deepseek41.config.keys import require
from deepseek41.config.roles import latest_at_or_below
from deepseek41.config.schema import (CheckpointConfig, DataConfig, DSparkConfig, LogConfig,
                                      MeshConfig, ModelConfig, TasksConfig, TrainConfig,
                                      engram_compresses, max_positions)
from deepseek41.config.tasks import TASK_NAMES, parse_task_specs
from deepseek41.ops.contracts import (attention_kernel_supported, index_scores_supported,
                                      mhc_kernel_supported, mosaic_index_supported,
                                      mosaic_window_supported)



def check_model_sizes(m: ModelConfig):
  L = m.num_layers
  require(L >= 1, 'model.num_layers', f'must be >= 1, got {L}')
  require(0 <= m.num_encoder_layers <= L, 'model.num_encoder_layers',
          f'must be in [0, num_layers={L}], got {m.num_encoder_layers}')
  for k in ('vocab_size', 'd_model', 'num_heads', 'head_dim', 'q_lora_rank', 'o_groups',
            'o_lora_rank', 'sliding_window', 'n_routed_experts', 'num_experts_per_tok',
            'moe_intermediate_size'):
    require(getattr(m, k) >= 1, f'model.{k}', f'must be >= 1, got {getattr(m, k)}')
  require(m.n_shared_experts >= 0, 'model.n_shared_experts', 'must be >= 0')
  require(m.rope_head_dim % 2 == 0 and 0 < m.rope_head_dim <= m.head_dim, 'model.rope_head_dim',
          f'must be even and in (0, head_dim={m.head_dim}], got {m.rope_head_dim}')
  require(m.num_heads % m.o_groups == 0, 'model.o_groups',
          f'must divide num_heads={m.num_heads}, got {m.o_groups}')


def check_layer_wiring(m: ModelConfig):
  """The role table must be one the model can run (docs/design.md "Layer roles")."""
  L, ratios = m.num_layers, m.compress_ratios
  kv, idx = m.kv_source_layer_ids, m.index_source_layer_ids
  require(len(ratios) == L, 'model.compress_ratios',
          f'needs one entry per layer (num_layers={L}), got {len(ratios)}')
  require(all(r in (0, 1, 2) for r in ratios), 'model.compress_ratios',
          f'entries must be 0, 1 or 2, got {ratios}')
  for k in ('kv_source_layer_ids', 'index_source_layer_ids', 'engram_layer_ids'):
    ids = getattr(m, k)
    require(list(ids) == sorted(set(ids)), f'model.{k}', f'must be sorted and unique, got {ids}')
    for i in ids:
      require(0 <= i < L, f'model.{k}', f'layer id {i} out of range [0, {L})')
  for i in kv + idx:
    require(ratios[i] > 0, 'model.kv_source_layer_ids / index_source_layer_ids',
            f'layer {i} has compress ratio 0 (SWA only) and cannot be a KV or index source')
  for l, r in enumerate(ratios):
    if r == 0:
      continue
    s = latest_at_or_below(kv, l)
    require(s >= 0, 'model.kv_source_layer_ids',
            f'layer {l} (ratio {r}) has no KV source at or below it')
    require(ratios[s] == r, 'model.compress_ratios',
            f'layer {l} has ratio {r} but its KV source layer {s} has ratio {ratios[s]}')
    i = latest_at_or_below(idx, l)
    require(i >= 0, 'model.index_source_layer_ids',
            f'layer {l} (ratio {r}) has no index source at or below it')
    require(i >= s, 'model.index_source_layer_ids',
            f'layer {l}: its index source {i} precedes its KV source {s}')
  cand = m.candidate_source_layer_id
  require(cand < 0 or (cand in idx and cand in kv), 'model.candidate_source_layer_id',
          f'layer {cand} must be both a KV source and an index source')
  enc = m.num_encoder_layers
  require(enc == 0 or enc == L or all(latest_at_or_below(kv, l) >= enc or ratios[l] == 0
                                   for l in range(enc, L)), 'model.num_encoder_layers',
          'decoder layers must read KV produced inside the decoder (CED wiring)')


def check_residual(m: ModelConfig):
  require(m.hc_mult >= 1, 'model.hc_mult', f'must be >= 1, got {m.hc_mult}')
  require(m.mhc_impl != 'fused' or m.residual == 'plain' or
          mhc_kernel_supported(m.hc_mult, m.d_model),
          'model.mhc_impl', f"'fused' needs a power-of-two hc_mult and d_model a multiple of 16 "
          f'(got {m.hc_mult} and {m.d_model})')
  bd = m.mhc_decode_block_d
  require(bd == 0 or (bd >= 16 and not bd & (bd - 1)), 'model.mhc_decode_block_d',
          f'must be 0 (the training chunks) or a power of two >= 16, got {bd}')
  sp = m.mhc_decode_splits
  require(sp >= 0 and not sp & (sp - 1), 'model.mhc_decode_splits',
          f'must be 0 (one program) or a power of two, got {sp}')
  bm = m.moe_small_call_block_m
  require(bm == 0 or (16 <= bm <= 128 and not bm & (bm - 1)), 'model.moe_small_call_block_m',
          f'must be 0 (the training tiles) or a power of two from 16 to 128, got {bm}')
  require(m.decode_union_rows >= 0, 'model.decode_union_rows',
          f'must be >= 0 (0: the partials at every size), got {m.decode_union_rows}')
  require(m.hc_sinkhorn_iters >= 1, 'model.hc_sinkhorn_iters', 'must be >= 1')
  require(m.hc_eps >= 0, 'model.hc_eps', 'must be >= 0')


def check_engram(m: ModelConfig):
  require(m.engram_max_ngram >= 2, 'model.engram_max_ngram', 'must be >= 2 (2-grams and up)')
  require(m.engram_n_heads >= 1 and m.engram_head_dim >= 1, 'model.engram_n_heads',
          'engram_n_heads and engram_head_dim must be >= 1')
  require(2 <= m.engram_vocab_start < 2**24 - 2**16, 'model.engram_vocab_start',
          f'must be in [2, 2^24 - 2^16) (exact 32-bit hashing), got {m.engram_vocab_start}')
  require(m.engram_compressed_vocab_size >= 0, 'model.engram_compressed_vocab_size', 'must be >= 0')
  require(m.engram_table_row_multiple >= 1, 'model.engram_table_row_multiple', 'must be >= 1')
  require(m.engram_exchange_capacity >= 0, 'model.engram_exchange_capacity',
          f'must be >= 0 (0 = exact chunks), got {m.engram_exchange_capacity}')
  require(0 <= m.engram_pad_token_id < (m.engram_compressed_vocab_size or m.vocab_size),
          'model.engram_pad_token_id', 'must be an id of the hashed vocabulary')


def check_indexer(m: ModelConfig):
  require(m.index_topk >= 1, 'model.index_topk', 'must be >= 1')
  if m.candidate_source_layer_id >= 0:
    require(m.index_topk <= m.candidate_topk_blocks * m.candidate_block_size,
            'model.index_topk', f'top-{m.index_topk} is larger than the candidate pool '
            f'({m.candidate_topk_blocks} blocks x {m.candidate_block_size})')
  require(m.index_n_heads >= 1, 'model.index_n_heads', 'must be >= 1')
  require(m.indexer_loss_weight >= 0, 'model.indexer_loss_weight', 'must be >= 0')
  require(m.index_head_dim >= 2 and m.index_head_dim % 2 == 0 and
          m.index_head_dim >= m.rope_head_dim, 'model.index_head_dim',
          f'must be even and >= rope_head_dim ({m.rope_head_dim}), got {m.index_head_dim}')
  require(m.sparse_chunk >= 1, 'model.sparse_chunk', 'must be >= 1')
  require(m.sparse_dkv_tile >= 0 and not m.sparse_dkv_tile & (m.sparse_dkv_tile - 1),
          'model.sparse_dkv_tile', f'must be 0 or a power of two, got {m.sparse_dkv_tile}')
  require(m.index_causal_groups >= 1, 'model.index_causal_groups', 'must be >= 1')
  require(m.span_chunk >= 0, 'model.span_chunk', 'must be >= 0 (0 = whole spans, kept)')
  require(m.index_topk_block >= 0, 'model.index_topk_block', 'must be >= 0 (0 = one top-k pass)')


def check_head(m: ModelConfig):
  require(m.head_chunk >= 0, 'model.head_chunk',
          f'must be >= 0 (0 = the whole logits), got {m.head_chunk}')


def check_rope_and_norms(m: ModelConfig):
  require(m.yarn_factor >= 1.0, 'model.yarn_factor', f'must be >= 1, got {m.yarn_factor}')
  require(m.rms_norm_eps > 0, 'model.rms_norm_eps', 'must be > 0')


def check_moe(m: ModelConfig):
  require(m.num_experts_per_tok <= m.n_routed_experts, 'model.num_experts_per_tok',
          f'top-{m.num_experts_per_tok} of {m.n_routed_experts} experts is impossible')
  require(m.capacity_factor > 0, 'model.capacity_factor', 'must be > 0')
  require(m.expert_buffer_factor >= 0, 'model.expert_buffer_factor',
          f'must be >= 0 (0: never overflow), got {m.expert_buffer_factor}')
  require(m.eval_moe_backend != 'capacity_einsum', 'model.eval_moe_backend',
          "'capacity_einsum' drops assignments past capacity and evaluation must not: use auto, "
          'reference, ragged_dot, grouped or grouped_fused')
  for name in ('moe_backend', 'eval_moe_backend'):
    require(m.fp8 == 'off' or getattr(m, name) != 'grouped_fused', f'model.{name}',
            f"'grouped_fused' has no FP8 path and model.fp8 is {m.fp8!r}: use 'grouped' for "
            "FP8 expert GEMMs, or model.fp8=off")
  require(m.router_bias_rate >= 0, 'model.router_bias_rate', 'must be >= 0')
  require(m.balance_loss_weight >= 0, 'model.balance_loss_weight', 'must be >= 0')


def check_vision(m: ModelConfig):
  require(0 <= m.image_token_id < m.vocab_size, 'model.image_token_id',
          f'must be in [0, vocab_size={m.vocab_size}), got {m.image_token_id}')
  if not m.vision:
    return
  for k in ('vision_layers', 'vision_dim', 'vision_heads', 'vision_mlp', 'vision_patch',
            'vision_merge', 'vision_max_image_tokens'):
    require(getattr(m, k) >= 1, f'model.{k}', f'must be >= 1, got {getattr(m, k)}')
  require(m.vision_dim % m.vision_heads == 0 and (m.vision_dim // m.vision_heads) % 4 == 0,
          'model.vision_heads', f'vision_dim={m.vision_dim} / vision_heads={m.vision_heads} must '
          'be a whole head dim divisible by 4 (2D RoPE rotates row and column halves in pairs)')
  require(m.vision_min_pixels >= 0, 'model.vision_min_pixels', 'must be >= 0')


def check_index_impl(m: ModelConfig, backend: str):
  """A requested 'fused' indexer must be able to run here ('auto' only picks it where it can)."""
  fused_ok = index_scores_supported(m.index_n_heads, m.index_head_dim)
  for key in ('index_impl', 'selected_scores_impl'):
    require(getattr(m, key) != 'fused' or (fused_ok and backend == 'gpu'), f'model.{key}',
            f"'fused' is a GPU kernel for power-of-two index_n_heads and index_head_dim >= 16 "
            f'(got {m.index_n_heads} x {m.index_head_dim} on {backend})')
  mosaic_ok = backend == 'tpu' and mosaic_index_supported(m.index_head_dim)
  require(m.index_impl != 'mosaic' or mosaic_ok,
          'model.index_impl', f"'mosaic' is a TPU kernel for index_head_dim a multiple of 128 "
          f'(got {m.index_head_dim} on {backend})')
  for key in ('attention_impl', 'sparse_impl', 'mhc_impl'):
    require(getattr(m, key) != 'fused' or backend == 'gpu', f'model.{key}',
            f"'fused' is a GPU kernel (Pallas on the Triton backend); this backend is {backend}")
  require(m.attention_impl != 'fused' or attention_kernel_supported(m.num_heads, m.head_dim),
          'model.attention_impl', f"'fused' needs power-of-two num_heads and head_dim, both >= 16 "
          f'(got {m.num_heads} x {m.head_dim})')
  require(m.window_forward != 'mosaic' or m.attention_impl == 'fused', 'model.window_forward',
          f"'mosaic' replaces the fused window kernel's forward: it needs "
          f"model.attention_impl='fused' (got {m.attention_impl!r})")
  require(m.window_forward != 'mosaic' or mosaic_window_supported(m.num_heads, m.head_dim),
          'model.window_forward', f"'mosaic' needs num_heads a power of two dividing 64 and "
          f'head_dim a multiple of 128 (got {m.num_heads} x {m.head_dim})')
  require(m.select_impl != 'threshold' or backend == 'gpu', 'model.select_impl',
          f"'threshold' is a GPU kernel (Pallas on the Triton backend); this backend is {backend}")


MODEL_CHECKS = (check_model_sizes, check_layer_wiring, check_residual, check_engram,
                check_indexer, check_head, check_rope_and_norms, check_moe, check_vision)


# ---------------------------------------------------------------------------------------------
# Data.


def check_data(d: DataConfig, m: ModelConfig):
  require(d.seq_len >= 2, 'data.seq_len', f'must be >= 2, got {d.seq_len}')
  require(d.num_workers >= 0, 'data.num_workers', 'must be >= 0')
  require(d.prefetch >= 0, 'data.prefetch', 'must be >= 0')
  require(d.packing_bins >= 1, 'data.packing_bins', 'must be >= 1')
  require(d.streams >= 0, 'data.streams', f'must be >= 0 (0: the process count), got {d.streams}')
  require(d.document_align >= 1 and d.seq_len % d.document_align == 0, 'data.document_align',
          f'must be >= 1 and divide data.seq_len={d.seq_len}, got {d.document_align}')
  if m.csa2 and 2 in m.compress_ratios:
    require(d.document_align % 2 == 0, 'data.document_align',
            'must be even with ratio-2 layers, or compressed groups would straddle documents')
  require(d.default_corpus_vocab_size >= 259, 'data.default_corpus_vocab_size',
          'must be >= 259 (256 bytes + special tokens)')
  if not d.synthetic and all(path in TASK_NAMES for path, _ in d.sources):
    # no text source: the default corpus's tokenizer (the tasks encode through it)
    require(m.vocab_size >= d.default_corpus_vocab_size, 'model.vocab_size',
            f'{m.vocab_size} is smaller than data.default_corpus_vocab_size '
            f'({d.default_corpus_vocab_size})')
  require(not (d.synthetic and engram_compresses(m)), 'model.engram_compressed_vocab_size',
          'synthetic data has no tokenizer to compress; set it to 0')


def check_images(d: DataConfig, m: ModelConfig):
  require(not d.image_sources or m.vision, 'data.image_sources',
          'needs model.vision=True (image sources feed the vision encoder)')
  require(d.max_images_per_row >= 1, 'data.max_images_per_row', 'must be >= 1')
  require(0 <= d.image_heldout_fraction < 1, 'data.image_heldout_fraction', 'must be in [0, 1)')
  require(d.shapes_image_size >= 1, 'data.shapes_image_size', 'must be >= 1')
  if m.vision:
    span = max_span_positions(m.vision_max_image_tokens)
    require(span <= d.seq_len, 'model.vision_max_image_tokens',
            f'the longest image span ({span} positions) must fit in data.seq_len={d.seq_len}, or '
            'packing could not keep it whole')


def check_tasks(tk: TasksConfig, d: DataConfig, t: TrainConfig, m: ModelConfig,
                mesh: MeshConfig):
  """The task section, the task sources of data.sources and train.eval_tasks."""
  require(0 <= tk.length <= d.seq_len, 'tasks.length',
          f'must be in [0, data.seq_len={d.seq_len}] (0: data.seq_len), got {tk.length}')
  require(tk.mqar_pairs >= 1, 'tasks.mqar_pairs', f'must be >= 1, got {tk.mqar_pairs}')
  require(1 <= tk.mqar_queries <= tk.mqar_pairs, 'tasks.mqar_queries',
          f'must be in [1, tasks.mqar_pairs={tk.mqar_pairs}] (distinct keys are asked), got '
          f'{tk.mqar_queries}')
  require(1 <= tk.mqar_key_letters <= 16 and 26 ** tk.mqar_key_letters >= tk.mqar_pairs,
          'tasks.mqar_key_letters', f'{tk.mqar_key_letters} letters cannot make '
          f'{tk.mqar_pairs} distinct keys (1..16 letters, 26^letters >= tasks.mqar_pairs)')
  for k in ('mqar_value_digits', 'passkey_digits', 'needle_value_digits'):
    require(1 <= getattr(tk, k) <= 18, f'tasks.{k}', f'must be in [1, 18], got {getattr(tk, k)}')
  require(tk.needle_count >= 1, 'tasks.needle_count', f'must be >= 1, got {tk.needle_count}')
  require(1 <= tk.needle_queries <= tk.needle_count, 'tasks.needle_queries',
          f'must be in [1, tasks.needle_count={tk.needle_count}], got {tk.needle_queries}')
  require(tk.eval_examples >= 1, 'tasks.eval_examples', f'must be >= 1, got {tk.eval_examples}')
  require(len(tk.eval_depths) >= 1 and all(0 <= x <= 1 for x in tk.eval_depths),
          'tasks.eval_depths', f'must be one or more depths in [0, 1], got {tk.eval_depths}')
  # (With data.synthetic the sources are not read; train.eval_tasks then fails at the start of
  # training, for want of a tokenizer: generation resolves saved configs as synthetic.)
  for spec in parse_task_specs(t.eval_tasks, 'train.eval_tasks'):
    check_task_length(spec.label, spec.length, m, d.seq_len, mesh.context, 'train.eval_tasks')


def check_task_length(label: str, length: int, m: ModelConfig, seq_len: int, context: int,
                      key: str):
  """A task's context length must be within the model's positions and split over the context
  shards as the training sequence is."""
  limit = max_positions(m, seq_len)
  require(length <= limit, key,
          f'{label}: {length} tokens exceed the model\'s {limit} positions ' +
          ('(model.yarn_original_max_position x model.yarn_factor)' if m.yarn_factor > 1 else
           '(data.seq_len; without YaRN, model.yarn_factor = 1, the model is not extended)'))
  require(length % context == 0 and length // context >= m.sliding_window, key,
          f'{label}: {length} tokens do not split over mesh.context={context} shards of at '
          f'least model.sliding_window={m.sliding_window} tokens')


# ---------------------------------------------------------------------------------------------
# Mesh, train, checkpoint, log.


def check_train(t: TrainConfig):
  require(t.steps >= 1, 'train.steps', f'must be >= 1, got {t.steps}')
  require(t.batch_size >= 1, 'train.batch_size', f'must be >= 1, got {t.batch_size}')
  require(t.grad_accum_steps >= 1, 'train.grad_accum_steps', 'must be >= 1')
  require(t.batch_size % t.grad_accum_steps == 0, 'train.grad_accum_steps',
          f'must divide train.batch_size={t.batch_size}, got {t.grad_accum_steps}')
  require(t.lr > 0, 'train.lr', 'must be > 0')
  require(0 <= t.min_lr_ratio <= 1, 'train.min_lr_ratio', 'must be in [0, 1]')
  require(t.warmup_steps >= 0, 'train.warmup_steps', 'must be >= 0')
  require(0 < t.wsd_decay_fraction <= 1, 'train.wsd_decay_fraction', 'must be in (0, 1]')
  require(t.eval_every_steps >= 0, 'train.eval_every_steps', 'must be >= 0')
  require(t.eval_batches >= 1, 'train.eval_batches', 'must be >= 1')
  require(t.grad_clip_norm >= 0, 'train.grad_clip_norm', 'must be >= 0')
  require(t.engram_table_lr_multiplier > 0, 'train.engram_table_lr_multiplier', 'must be > 0')
  require(t.vision_lr_multiplier > 0, 'train.vision_lr_multiplier', 'must be > 0')
  require(t.remat_layers >= 0, 'train.remat_layers', f'must be >= 0, got {t.remat_layers}')
  check_muon_hybrid(t)


def check_muon_hybrid(t: TrainConfig):
  """The muon_hybrid keys (checked whatever train.optimizer is: a config switched to it later
  must not fail then)."""
  require(0 <= t.muon_momentum < 1, 'train.muon_momentum',
          f'must be in [0, 1), got {t.muon_momentum}')
  require(len(t.muon_ns_coeffs) >= 1 and all(len(abc) == 3 for abc in t.muon_ns_coeffs),
          'train.muon_ns_coeffs', f'must be one or more (a, b, c) triples, got {t.muon_ns_coeffs}')
  require(len(t.muon_ns_steps) == len(t.muon_ns_coeffs), 'train.muon_ns_steps',
          f'needs one iteration count per train.muon_ns_coeffs triple ({len(t.muon_ns_coeffs)}), '
          f'got {t.muon_ns_steps}')
  require(all(n >= 0 for n in t.muon_ns_steps) and sum(t.muon_ns_steps) >= 1,
          'train.muon_ns_steps', f'must be >= 0 each and >= 1 in all, got {t.muon_ns_steps}')
  require(t.muon_rms_match > 0, 'train.muon_rms_match', f'must be > 0, got {t.muon_rms_match}')
  require(t.muon_batch_mib >= 0, 'train.muon_batch_mib', f'must be >= 0, got {t.muon_batch_mib}')
  require(0 <= t.sinkhorn_momentum < 1, 'train.sinkhorn_momentum',
          f'must be in [0, 1), got {t.sinkhorn_momentum}')
  require(t.sinkhorn_gamma > 0, 'train.sinkhorn_gamma', f'must be > 0, got {t.sinkhorn_gamma}')
  require(t.sinkhorn_normalizations >= 1 and t.sinkhorn_normalizations % 2 == 1,
          'train.sinkhorn_normalizations', 'must be odd (rows first and last, so every row of '
          f'the update has RMS 1), got {t.sinkhorn_normalizations}')
  require(0 <= t.sinkhorn_tau < 1, 'train.sinkhorn_tau', f'must be in [0, 1), got {t.sinkhorn_tau}')
  require(t.sinkhorn_eps > 0, 'train.sinkhorn_eps', f'must be > 0, got {t.sinkhorn_eps}')
  for name in ('muon_lr_multiplier', 'sinkhorn_lr_multiplier'):
    require(getattr(t, name) > 0, f'train.{name}', f'must be > 0, got {getattr(t, name)}')
  require(t.sinkhorn_weight_decay >= 0, 'train.sinkhorn_weight_decay', 'must be >= 0')


def check_batch_split(t: TrainConfig, mesh: MeshConfig):
  micro = t.batch_size // t.grad_accum_steps
  shards = math.prod(getattr(mesh, a) for name, axes in mesh.rules if name == 'batch'
                     for a in axes)
  require(micro % shards == 0, 'train.batch_size',
          f'the microbatch ({micro} = batch_size / grad_accum_steps) must be divisible by the '
          f'{shards} devices the batch is sharded over (mesh rules for "batch")')


def check_context_split(d: DataConfig, m: ModelConfig, mesh: MeshConfig):
  if mesh.context == 1:
    return
  require(d.seq_len % mesh.context == 0, 'mesh.context',
          f'{mesh.context} sequence shards cannot split data.seq_len={d.seq_len} evenly')
  require(not m.dense, 'model.attention_variant',
          "'dense' attends every query to its whole document, which context parallelism splits "
          f'over mesh.context={mesh.context} shards; set mesh.context=1 (or the variant csa2 or '
          'window)')
  require(d.seq_len // mesh.context >= m.sliding_window, 'mesh.context',
          f'{d.seq_len // mesh.context} tokens per sequence shard cannot hold the window halo of '
          f'model.sliding_window={m.sliding_window} tokens')


def check_expert_split(m: ModelConfig, mesh: MeshConfig):
  require(m.n_routed_experts % mesh.expert == 0, 'mesh.expert',
          f'{mesh.expert} expert shards cannot split model.n_routed_experts={m.n_routed_experts} '
          'evenly (each shard holds a contiguous block of experts)')


def check_checkpoint(ck: CheckpointConfig):
  require(ck.every_steps >= 0, 'checkpoint.every_steps', 'must be >= 0')
  require(ck.max_to_keep >= 1, 'checkpoint.max_to_keep', 'must be >= 1')
  require(ck.keep_period >= 0, 'checkpoint.keep_period', 'must be >= 0')
  require(ck.save_timeout_s > 0, 'checkpoint.save_timeout_s',
          f'must be > 0 seconds, got {ck.save_timeout_s}')


def check_log(lg: LogConfig):
  require(lg.every_steps >= 1, 'log.every_steps', 'must be >= 1')
  require(lg.profile_start_step >= 0, 'log.profile_start_step', 'must be >= 0 (0 = no profile)')
  require(lg.profile_steps >= 1, 'log.profile_steps', 'must be >= 1')




def check_remat_layers(t: TrainConfig, m: ModelConfig):
  require(t.remat_layers <= m.num_layers, 'train.remat_layers',
          f'must be <= model.num_layers={m.num_layers}, got {t.remat_layers}')


def check_dspark(ds: DSparkConfig, m: ModelConfig, mesh: MeshConfig, t: TrainConfig):
  """The DSpark section, when a DSpark stage is on (docs/architecture.md section 3.14)."""
  if ds.stage == 'off':
    return
  require(t.grad_accum_steps == 1, 'train.grad_accum_steps',
          f'the DSpark stage ({ds.stage}) takes whole batches: set it to 1')
  require(ds.num_blocks >= 1, 'dspark.num_blocks', 'must be >= 1')
  require(ds.block_size >= 1, 'dspark.block_size', 'must be >= 1')
  require(ds.markov_rank >= 1, 'dspark.markov_rank', 'must be >= 1')
  require(ds.anchors_per_sequence >= 1, 'dspark.anchors_per_sequence', 'must be >= 1')
  require(ds.slot_decay > 0, 'dspark.slot_decay', 'must be > 0')
  require(min(ds.ce_weight, ds.l1_weight, ds.bce_weight) >= 0, 'dspark.*_weight', 'must be >= 0')
  require(0 <= ds.noise_token_id < m.vocab_size, 'dspark.noise_token_id',
          f'must be a token id below model.vocab_size={m.vocab_size} (-1: the last one)')
  targets = ds.targets(m.num_layers)
  require(len(set(targets)) == len(targets) and all(0 <= l < m.num_layers for l in targets),
          'dspark.target_layer_ids', f'must be distinct layers of 0..{m.num_layers - 1}, got '
          f'{targets}')
  require(1 <= ds.num_experts_per_tok <= ds.n_routed_experts, 'dspark.num_experts_per_tok',
          f'must be in 1..dspark.n_routed_experts={ds.n_routed_experts}')
  require(ds.n_routed_experts % mesh.expert == 0, 'dspark.n_routed_experts',
          f'{mesh.expert} expert shards cannot split {ds.n_routed_experts} experts evenly')
