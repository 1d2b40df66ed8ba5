"""CSA2 of one layer across the role table (docs/architecture.md sections 3.6-3.8).

    KV source (Full):  compress this layer's attention input -> entries (kv, latent, layout);
                       index keys from the pre-RoPE latent; publish both for the layers it serves
    index source:      score the visible entries of its KV source with its own query -> top-k
      Full + candidates: also publish the best `candidate_topk_blocks` blocks per query
      Reindex:           score only inside the candidate source's pool
    Reuse:             take the latest index source's selection; compute nothing

Everything a later layer needs travels in `shared` (model/shared.py `Shared`), threaded through
the layers. In generation a KV source keeps its entries in its own cache (`EntryCache`): a chunk
appends the groups it completes, and every entry is published.
Selection is query-chunked (`sparse_chunk` queries at a time): the [Tq, N] score slab of one chunk
exists, never [T, N] for the whole sequence.

Indexer training [I] (docs/architecture.md section 4; our choice, V3.2's sparse-stage recipe adapted
to CSA2, no dense warm-up): at each index source the teacher is this layer's own attention
probability over the selected entries (averaged over heads, renormalised over the selection,
stop-gradient); the student is the indexer score of the same entries; the loss is KL(teacher ||
softmax(student)). The indexer's inputs (q_r, x, the compressor latent) are detached, so only
W_qb^I, W_w, W_k and k_norm learn from it, and top-k has no gradient, so the LM loss never
reaches the indexer. Early in training (or with <= top-k visible entries) the selection is every
visible entry and the teacher is the full compressed distribution. Recall: the share of the
teacher's top quarter of the selection that the student also ranks in its top quarter.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from deepseek41.config import SWA, LayerRole, ModelConfig, layer_roles
from deepseek41.model import diagnostics
from deepseek41.model import indexer as idx_lib
from deepseek41.model.compressor import (CompressedKV, Compressor, RowRing,
                                         document_first_entry_bt, visible_btn,
                                         visible_entries_btp)
from deepseek41.model.indexer import IndexKeys, IndexQuery
from deepseek41.model.layer_cache import CacheSpec, scatter_rows
from deepseek41.model.params import dtype_of
from deepseek41.model.rope import apply_rope, rope_for_role
from deepseek41.model.shared import Decoding, Selection, Shared, SourceEntries
from deepseek41.ops.chunking import map_query_chunks
from deepseek41.ops.index_scores import (SCORERS, index_scores_gathered, index_scores_reference,
                                        index_scores_stored)
from deepseek41.ops.selected_scores import selected_scores
from deepseek41.ops.sparse_attention import compressed_branch, compressed_partial, selected_rows
from deepseek41.packing import empty_stored, load, store
from deepseek41.quant import get_fake_quant


# The checkpoint name of an index source's selection (and published candidate blocks): block
# remat saves them (model/transformer.py), so the backward does not rescore and reselect.
SELECTION = 'csa2_selection'

# Generation scores a KV source's stored index keys a block of entries at a time, so that the
# history is never dequantized whole (at 1M tokens that copy would be 256 MB a layer at c = 128,
# bf16): blocks of at least STORED_KEYS_BLOCK entries, and as many more as STORED_KEYS_BYTES of
# dequantized keys and BLOCK_PRODUCTS_BYTES of a block's fp32 products allow. Each block is an
# iteration of a device loop of about five kernels: at 8,192 entries a block, a batch-1 decode
# step at 1M tokens of context ran 1,000 more kernels than at 4K (docs/performance.md section 64).
STORED_KEYS_BLOCK = 8192
STORED_KEYS_BYTES = 32 << 20
BLOCK_PRODUCTS_BYTES = 256 << 20
# A generation chunk of more query rows than this (a prefill chunk) unpacks the keys once and
# scores them with model.index_impl's scorer: the copy is then small beside the chunk's own
# activations, and the kernel is the fast path for many rows.
STORED_KEYS_ROWS = 64
# The jnp scorer writes a chunk's [rows, H, N] fp32 products whole: past this many bytes it
# scores `stored_keys_block` entries at a time instead (a 1,024-row prefill chunk over 1M
# entries of 16 heads would ask for 64 GiB; docs/performance.md section 64). The kernels never
# write them.
REFERENCE_PRODUCTS_BYTES = 1 << 31


@struct.dataclass
class EntryCache:
  """Generation: a KV source's entries of the whole sequence, entry j = tokens j*r .. j*r + r-1
  (N = `CacheSpec.entries(r)`), in their stored formats (packing.py)."""
  kv_bnd: Any          # compressed K=V in model.kv_quant
  keys_bnc: Any        # indexer keys in model.index_quant
  written_bn: jax.Array  # bool: the entry's group is complete
  rows: RowRing | None   # ratio > 1: the compressor's newest projected rows


def causal_groups(t: int, chunk: int, groups: int, row_offset, ratio: int, n: int,
                  align: int = 16) -> list[tuple[int, int, int]]:
  """[(first row, end row, entries scored)]: the query chunks split into up to `groups` runs of
  whole chunks; each run scores only the entries its last row can see, rounded up to `align`.

  One run per call scores every entry for every chunk: under causality half of that is past
  every row's limit. `groups` runs cut the slab to (groups + 1) / (2 groups) of it (each run is
  one compiled loop body). A traced or per-row `row_offset` (decoding) keeps one run.
  """
  chunk = max(1, min(chunk or t, t))  # as map_query_chunks takes it
  n_chunks = -(-t // chunk)
  if not isinstance(row_offset, int) or groups <= 1 or n_chunks <= 1:
    return [(0, t, n)]
  groups = min(groups, n_chunks)
  runs = []
  for g in range(groups):
    c0, c1 = g * n_chunks // groups, (g + 1) * n_chunks // groups
    r0, r1 = c0 * chunk, min(c1 * chunk, t)
    seen = (row_offset + r1) // ratio  # entries complete by the run's last row
    runs.append((r0, r1, min(n, max(align, -(-seen // align) * align))))
  return runs


def stored_keys_block(q_bthc) -> int:
  """Entries a block when scoring the keys a block at a time for these queries (above)."""
  b, rows, heads, c = q_bthc.shape
  fit = min(STORED_KEYS_BYTES // (q_bthc.dtype.itemsize * b * c),
            BLOCK_PRODUCTS_BYTES // (4 * b * rows * heads))
  return max(STORED_KEYS_BLOCK, fit)


def _rows_at(x_bn, entry_btp):
  """Rows of a [B, N, ...] array (or a pytree of them, stored keys) at [B, T, P] entries."""
  return jax.tree.map(lambda a: jax.vmap(lambda a_n, e_tp: a_n[e_tp])(a, entry_btp), x_bn)


def select_chunked(q_bthc, w_bth, k_bnc, segment_ids_bt, comp, *, topk: int, chunk: int,
                   block_size: int, pool=None, publish_blocks: int = 0, topk_block: int = 0,
                   scores_fn: Callable = index_scores_reference, row_offset=0,
                   select_impl: str = 'top_k', groups: int = 1, load_keys=None):
  """Top-k entries per query, processed `chunk` queries at a time.

  topk_block > 1: exact two-stage top-k over blocks of that many entries (`select_topk_blocked`).
  scores_fn: the indexer scorer, one of ops/index_scores.py's `SCORERS`.
  row_offset: row index of the first query (the entries cover the whole row from 0).
  select_impl: 'top_k' or 'threshold' (model.select_impl; the same entries, see model/indexer.py).
  groups: the chunks run in up to this many runs, each over the entries it can see
  (`causal_groups`, model.index_causal_groups); the same selection for any value.

  pool: (blk_idx_btk, blk_valid_btk) of the candidate source, restricting the choice (Reindex);
  its blocks are numbered within each query's document (indexer.block_scores), whose first
  entry this layer finds the same way, in the same KV source's entries. Where a chunk's pools
  hold fewer entries than the row (generation), only the pool's keys are gathered and scored
  (the formula's cost, train/flops.py); otherwise every entry is scored and masked to the pool.
  The same selection either way.
  load_keys: `k_bnc` holds a cache's stored keys (generation) and this unpacks rows of them;
  the whole row is then scored a block of entries at a time (`stored_keys_block`).
  publish_blocks > 0: also return this layer's best `publish_blocks` candidate blocks.
  Returns (idx_btk, valid_btk, (blk_idx_btk, blk_valid_btk) or None).
  """
  xs = {'q': q_bthc, 'w': w_bth, 'seg': segment_ids_bt}
  if pool is not None or publish_blocks:
    xs['first'] = document_first_entry_bt(segment_ids_bt, comp, row_offset)
  if pool is not None:
    xs['pool_idx'], xs['pool_valid'] = pool

  def run(xs_run, first_row, n):
    """The chunks of rows [first_row, ...) over entries [0, n), which hold all they can see."""
    k_run, comp_run = k_bnc, comp
    if n < comp.seg_bn.shape[1]:  # visibility reads only the entries' segment ids and last rows
      k_run = jax.tree.map(lambda a: a[:, :n], k_bnc)
      comp_run = comp.replace(seg_bn=comp.seg_bn[:, :n], last_bn=comp.last_bn[:, :n])

    def in_pool(c, offset):
      """A Reindex chunk scoring only its queries' pools (generation)."""
      entry_bcp, in_pool_bcp = idx_lib.pool_entries(c['pool_idx'], c['pool_valid'], c['first'],
                                                    block_size, n)
      keys = _rows_at(k_run, entry_bcp)
      k_bcpc = keys if load_keys is None else load_keys(keys)
      scores_bcp = index_scores_gathered(c['q'], c['w'], k_bcpc.astype(c['q'].dtype))
      eligible = in_pool_bcp & visible_entries_btp(c['seg'], comp_run, entry_bcp, offset)
      pos_bck, valid_bck = idx_lib.select_topk(scores_bcp, eligible, topk,
                                               select_impl=select_impl)
      idx_bck = jnp.take_along_axis(entry_bcp, pos_bck, axis=-1)
      return {'idx': jnp.where(valid_bck, idx_bck, 0), 'valid': valid_bck}

    def per_chunk(c, offset):
      offset = offset + row_offset + first_row
      if pool is not None and c['q'].shape[1] * c['pool_idx'].shape[-1] * block_size < n:
        return in_pool(c, offset)
      rows_c = offset + jnp.arange(c['q'].shape[1], dtype=jnp.int32)
      limit_bc = jnp.broadcast_to((rows_c + 1) // comp.ratio, c['seg'].shape)
      b, rows, heads = c['q'].shape[:3]
      if load_keys is not None:
        scores_bcn = index_scores_stored(c['q'], c['w'], k_run, load_keys,
                                         stored_keys_block(c['q']))
      elif (scores_fn is index_scores_reference and
            4 * b * rows * heads * n > REFERENCE_PRODUCTS_BYTES):
        scores_bcn = index_scores_stored(c['q'], c['w'], k_run, idx_lib.identity,
                                         stored_keys_block(c['q']))
      else:
        scores_bcn = scores_fn(c['q'], c['w'], k_run, limit_bc)
      vis_bcn = visible_btn(c['seg'], comp_run, offset)
      allowed = None
      if pool is not None:
        allowed = idx_lib.pool_entry_mask(c['pool_idx'], c['pool_valid'], c['first'],
                                          block_size, n)
      sel_idx, sel_valid = idx_lib.select_topk_blocked(scores_bcn, vis_bcn, topk, topk_block,
                                                       allowed, select_impl=select_impl)
      out = {'idx': sel_idx, 'valid': sel_valid}
      if publish_blocks:
        blocks = idx_lib.block_scores(scores_bcn, vis_bcn, c['first'], block_size)
        newest = idx_lib.newest_visible_bt(vis_bcn)
        out['blk_idx'], out['blk_valid'] = idx_lib.candidate_blocks(
            blocks, newest, c['first'], block_size, publish_blocks, select_impl=select_impl)
      return out

    return map_query_chunks(per_chunk, xs_run, chunk)

  runs = causal_groups(q_bthc.shape[1], chunk, groups, row_offset, comp.ratio,
                       comp.seg_bn.shape[1])
  outs = [run({k: v[:, r0:r1] for k, v in xs.items()}, r0, n) for r0, r1, n in runs]
  out = jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=1), *outs) if len(outs) > 1 else outs[0]
  blocks = (out['blk_idx'], out['blk_valid']) if publish_blocks else None
  return out['idx'], out['valid'], blocks


class CSA2(nnx.Module):
  """The compressed sparse branch of one layer; `None` modules where the role needs none."""

  def __init__(self, cfg: ModelConfig, role: LayerRole, rngs: nnx.Rngs):
    if role.mode == SWA:
      raise ValueError(f'layer {role.layer} is SWA-only and has no CSA2 branch')
    self.cfg, self.role = cfg, role
    self.owns_kv = role.kv_source == role.layer
    self.owns_index = role.index_source == role.layer
    if self.owns_kv:
      self.compressor = Compressor(cfg, role.ratio, rngs)
      self.index_keys = IndexKeys(cfg, cfg.index_head_dim, rngs)
    if self.owns_index:
      self.index_query = IndexQuery(cfg, cfg.index_n_heads, cfg.index_head_dim, rngs)
    # The later layers reading this layer's selection (hence its KV source's entries): with the
    # fused kernel they hand their key/value gradient's coefficients to this layer's backward,
    # which adds it once for all (cfg.sparse_group_dkv; ops/gpu/sparse_kernel.py).
    self.selection_readers = tuple(r.layer for r in layer_roles(cfg)
                                   if r.index_source == role.index_source and r.mode != SWA
                                   and r.layer != role.index_source)

  def publish_kv(self, x_btd, batch, shared: Shared) -> Shared:
    """Compress this KV-source layer's attention input and publish entries and index keys."""
    cfg = self.cfg
    comp = self.compressor(x_btd, batch['segment_ids'], batch['positions'],
                           quantize=get_fake_quant(cfg.kv_quant))
    k_bnc = self.index_keys(jax.lax.stop_gradient(comp.latent_bnd), comp.pos_bn,
                            quantize=get_fake_quant(cfg.index_quant))
    return shared.with_kv(self.role.layer, SourceEntries(comp, k_bnc))

  def init_cache(self, spec: CacheSpec) -> EntryCache:
    """A KV source's empty entries."""
    cfg = self.cfg
    b, n, dt = spec.batch, spec.entries(self.role.ratio), dtype_of(cfg.compute_dtype)
    return EntryCache(kv_bnd=empty_stored(cfg.kv_quant, (b, n), cfg.head_dim, dt),
                      keys_bnc=empty_stored(cfg.index_quant, (b, n), cfg.index_head_dim, dt),
                      written_bn=jnp.zeros((b, n), bool),
                      rows=self.compressor.init_cache(spec))

  def decode_kv(self, x_btd, batch, cache: EntryCache,
                decoding: Decoding) -> tuple[EntryCache, SourceEntries]:
    """Generation: the chunk's completed groups appended to this KV source's entries; returns
    (the cache, every entry as published). The entries and index keys stay in their stored
    formats: attention gathers its selected rows and unpacks only those
    (`CompressedKV.load_rows`); the indexer unpacks a block of keys at a time, or only its
    candidate pool's (`select_chunked`)."""
    cfg, comp = self.cfg, self.compressor
    r = comp.ratio
    if decoding.write_entries:
      pos_bq, valid_bq = batch['positions'], batch['segment_ids'] > 0
      latent_bgd, first_bg, complete_bg, rows = comp.decode(
          x_btd, pos_bq, valid_bq, decoding.start_b, decoding.end_b, cache.rows)
      entry_raw = apply_rope(latent_bgd, first_bg, rope_for_role(cfg, 'compress'))
      keys_raw = self.index_keys(latent_bgd, first_bg)
      n = cache.written_bn.shape[1]
      slot_bg = jnp.where(complete_bg, first_bg // r, n)
      cache = EntryCache(
          kv_bnd=scatter_rows(cache.kv_bnd, slot_bg, store(cfg.kv_quant, entry_raw)),
          keys_bnc=scatter_rows(cache.keys_bnc, slot_bg, store(cfg.index_quant, keys_raw)),
          written_bn=scatter_rows(cache.written_bn, slot_bg, complete_bg), rows=rows)
    b, n = cache.written_bn.shape
    j_n = jnp.arange(n, dtype=jnp.int32)
    dt = x_btd.dtype
    view = CompressedKV(latent_bnd=None, kv_bnd=cache.kv_bnd,
                        pos_bn=jnp.broadcast_to(j_n * r, (b, n)),
                        seg_bn=cache.written_bn.astype(jnp.int32),
                        last_bn=jnp.broadcast_to(j_n * r + r - 1, (b, n)), ratio=r,
                        load_rows=functools.partial(load, cfg.kv_quant, dtype=dt))
    return cache, SourceEntries(view, cache.keys_bnc)

  def __call__(self, x_btd, q_r_btr, q_bthd, batch, shared: Shared, as_keys: bool = False):
    """Returns (the compressed branch's partial (o, lse) or `softmax_merge.Branch`, the updated
    `shared`); a Branch's handoffs (the deferred key/value gradient's sinks, {index source:
    sinks}) are published by the layer after the merge. as_keys (generation): the selected
    entries themselves instead of a partial, (kv_btkd, valid_btk), for the layer's one softmax
    over all its keys (ops/union_attention.py)."""
    cfg, role = self.cfg, self.role
    seg, pos = batch['segment_ids'], batch['positions']
    row_offset = batch.get('row_offset', 0)  # CED prefill: the query rows are a tail
    decoding = shared.decode is not None
    # (CED prefill publishes beforehand, `Block.publish_global_kv`; generation always does,
    # `Attention.decode`)
    if self.owns_kv and role.layer not in shared.kv:
      shared = self.publish_kv(x_btd, batch, shared)
    comp, k_bnc = shared.kv[role.kv_source]
    # Generation publishes the stored keys (`decode_kv`); training, their values.
    load_keys = None if isinstance(k_bnc, jax.Array) else functools.partial(
        load, cfg.index_quant, dtype=x_btd.dtype)
    if load_keys is not None and x_btd.shape[1] > STORED_KEYS_ROWS:
      k_bnc, load_keys = load_keys(k_bnc), None
    if self.owns_index:
      q_idx, w_bth = self.index_query(jax.lax.stop_gradient(q_r_btr),
                                      jax.lax.stop_gradient(x_btd), pos,
                                      quantize=get_fake_quant(cfg.index_quant))
      pool = shared.pools.get(cfg.candidate_source_layer_id) if role.uses_candidates else None
      sel_idx, sel_valid, blocks = select_chunked(
          jax.lax.stop_gradient(q_idx), jax.lax.stop_gradient(w_bth),
          jax.lax.stop_gradient(k_bnc), seg, comp, topk=cfg.index_topk,
          chunk=cfg.sparse_chunk, block_size=cfg.candidate_block_size, pool=pool,
          publish_blocks=cfg.candidate_topk_blocks if role.publishes_candidates else 0,
          topk_block=cfg.index_topk_block, scores_fn=SCORERS[cfg.index_impl],
          row_offset=row_offset, select_impl=cfg.select_impl, groups=cfg.index_causal_groups,
          load_keys=load_keys)
      sel_idx, sel_valid, blocks = checkpoint_name((sel_idx, sel_valid, blocks), SELECTION)
      shared = shared.with_selection(role.layer, Selection(sel_idx, sel_valid))
      if blocks is not None:
        shared = shared.with_pool(role.layer, blocks)
    sel_idx, sel_valid = shared.selections[role.index_source]
    if shared.probe is not None:  # diagnostics: the selection against dense attention
      shared = shared.with_probe_stats(role.layer, diagnostics.selection_stats(
          q_bthd, comp, sel_idx, sel_valid, seg, shared.probe.answer_rows_bt,
          topk=cfg.index_topk, window=cfg.sliding_window, chunk=shared.probe.chunk,
          rows_bm=shared.probe.rows_bm))
    # Only an index source in training needs the per-slot mass (its indexer's distillation
    # target); generation computes no indexer loss.
    distill = self.owns_index and not decoding
    kv = comp.kv_bnd if comp.load_rows else comp.kv_bnd.astype(q_bthd.dtype)
    if as_keys:
      if not decoding:
        raise ValueError('CSA2 as_keys is generation\'s (a decode chunk\'s one softmax)')
      return (selected_rows(kv, sel_idx, sel_valid, comp.load_rows), sel_valid), shared
    group = (cfg.sparse_group_dkv and cfg.sparse_impl == 'fused' and not decoding and
             bool(self.selection_readers))
    later, sink = 0, None
    if group and self.owns_index:
      later = len(self.selection_readers)
    elif group:  # take this layer's sink; the last reader drops the entry
      sink = shared.sinks[role.index_source][self.selection_readers.index(role.layer)]
      if role.layer == self.selection_readers[-1]:
        shared = shared.without_sinks(role.index_source)
    if merged_backward(cfg, shared) and cfg.sparse_impl == 'fused':
      partial, mass_btk = compressed_branch(q_bthd, kv, sel_idx, sel_valid, with_mass=distill,
                                            later=later, sink=sink, sinks_key=role.layer,
                                            dkv_tile=cfg.sparse_dkv_tile)
    else:
      o_bthd, lse_bth, *mass = compressed_partial(
          q_bthd, kv, sel_idx, sel_valid, impl=cfg.sparse_impl, chunk=cfg.sparse_chunk,
          with_mass=distill, load_rows=comp.load_rows, later=later, sink=sink,
          dkv_tile=cfg.sparse_dkv_tile)
      if later:
        *mass, sinks = mass
        shared = shared.with_sinks({role.layer: sinks})
      partial, mass_btk = (o_bthd, lse_bth), (mass[0] if distill else None)
    if distill:
      student_btk = selected_scores(q_idx, w_bth, k_bnc, sel_idx, sel_valid,
                                    impl=cfg.selected_scores_impl,
                                    chunk=cfg.sparse_chunk)
      shared = shared.add_indexer_totals(*idx_lib.indexer_distillation(
          student_btk, mass_btk, sel_valid, select_impl=cfg.select_impl))
    return partial, shared


def merged_backward(cfg: ModelConfig, shared: Shared) -> bool:
  """Whether the attention kernels' partials join the layer's softmax as `softmax_merge.Branch`es
  (model.merged_backward; training and evaluation, not generation's cached attention)."""
  return cfg.merged_backward and shared.decode is None

