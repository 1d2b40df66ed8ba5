"""CSA2 of one layer across the role table (docs/architecture.md sections 3.6-3.8).

    KV source (Full):  compress this layer's attention input -> entries (kv, latent, layout);
                       index keys from the pre-RoPE latent; publish both for the layers it serves
    index source:      score the visible entries of its KV source with its own query -> top-k
      Full + candidates: also publish the best `candidate_topk_blocks` blocks per query
      Reindex:           score only inside the candidate source's pool
    Reuse:             take the latest index source's selection; compute nothing

Everything a later layer needs travels in `shared`, a dict of arrays threaded through the layers.
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

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from deepseek41.config import SWA, LayerRole, ModelConfig, layer_roles
from deepseek41.model import indexer as idx_lib
from deepseek41.model.compressor import Compressor, document_first_entry_bt, visible_btn
from deepseek41.model.indexer import IndexKeys, IndexQuery
from deepseek41.ops.chunking import map_query_chunks
from deepseek41.ops.index_scores import SCORERS, index_scores_reference
from deepseek41.ops.selected_scores import selected_scores
from deepseek41.ops.sparse_attention import compressed_branch, compressed_partial
from deepseek41.quant import get_fake_quant


INDEXER_TOTALS = 'indexer'  # shared[...]: [sum of per-query KL, queries counted, sum of recall]
# The checkpoint name of an index source's selection (and published candidate blocks): block
# remat saves them (model/transformer.py), so the backward does not rescore and reselect.
SELECTION = 'csa2_selection'
# shared[DECODE]: generation's cache keeper (generate/decode.py); its `attention` and `publish`
# replace the in-sequence versions for a chunk of new tokens.
DECODE = 'decode'


def _kv_key(layer):
  return f'kv{layer}'


def _sel_key(layer):
  return f'sel{layer}'


def _pool_key(layer):
  return f'pool{layer}'


# shared[SINKS + str(layer)]: an index source's zero-valued sinks, one per later reader of its
# selection, through which their backward hands it the key/value-gradient coefficients
# (model.sparse_group_dkv). Nothing stores them in the forward (tools/plan.py counts none).
SINKS = 'sinks'


def _sinks_key(layer):
  return f'{SINKS}{layer}'


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


def select_chunked(q_bthc, w_bth, k_bnc, segment_ids_bt, comp, *, topk: int, chunk: int,
                   block_size: int, pool=None, publish_blocks: int = 0, topk_block: int = 0,
                   scores_fn: Callable = index_scores_reference, row_offset=0,
                   select_impl: str = 'top_k', groups: int = 1):
  """Top-k entries per query, processed `chunk` queries at a time.

  topk_block > 1: exact two-stage top-k over blocks of that many entries (`select_topk_blocked`).
  scores_fn: the indexer scorer, one of ops/index_scores.py's `SCORERS`.
  row_offset: row index of the first query (the entries cover the whole row from 0).
  select_impl: 'top_k' or 'threshold' (model.select_impl; the same entries, see model/indexer.py).
  groups: the chunks run in up to this many runs, each over the entries it can see
  (`causal_groups`, model.index_causal_groups); the same selection for any value.

  pool: (blk_idx_btk, blk_valid_btk) of the candidate source, restricting the choice (Reindex);
  its blocks are numbered within each query's document (indexer.block_scores), whose first
  entry this layer finds the same way, in the same KV source's entries.
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
    if n < k_bnc.shape[1]:  # visibility reads only the entries' segment ids and last rows
      k_run = k_bnc[:, :n]
      comp_run = comp.replace(seg_bn=comp.seg_bn[:, :n], last_bn=comp.last_bn[:, :n])

    def per_chunk(c, offset):
      offset = offset + row_offset + first_row
      rows_c = offset + jnp.arange(c['q'].shape[1], dtype=jnp.int32)
      limit_bc = jnp.broadcast_to((rows_c + 1) // comp.ratio, c['seg'].shape)
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

  runs = causal_groups(q_bthc.shape[1], chunk, groups, row_offset, comp.ratio, k_bnc.shape[1])
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

  def publish_kv(self, x_btd, batch, shared: dict) -> dict:
    """Compress this KV-source layer's attention input and publish entries and index keys."""
    if DECODE in shared:  # generation: append to the layer's cache, publish all of it
      return shared[DECODE].publish(self, x_btd, batch, shared)
    cfg = self.cfg
    comp = self.compressor(x_btd, batch['segment_ids'], batch['positions'],
                           quantize=get_fake_quant(cfg.kv_quant))
    k_bnc = self.index_keys(jax.lax.stop_gradient(comp.latent_bnd), comp.pos_bn,
                            quantize=get_fake_quant(cfg.index_quant))
    return {**shared, _kv_key(self.role.layer): (comp, k_bnc)}

  def __call__(self, x_btd, q_r_btr, q_bthd, batch, shared: dict):
    """Returns (the compressed branch's partial (o, lse) or `softmax_merge.Branch`, the updated
    `shared`); a Branch's handoffs (the deferred key/value gradient's sinks) are published by
    the layer after the merge."""
    cfg, role = self.cfg, self.role
    seg, pos = batch['segment_ids'], batch['positions']
    row_offset = batch.get('row_offset', 0)  # CED prefill: the query rows are a tail
    shared = dict(shared)
    if self.owns_kv and _kv_key(role.layer) not in shared:  # (else published by `publish_kv`)
      shared = self.publish_kv(x_btd, batch, shared)
    comp, k_bnc = shared[_kv_key(role.kv_source)]
    if self.owns_index:
      q_idx, w_bth = self.index_query(jax.lax.stop_gradient(q_r_btr),
                                      jax.lax.stop_gradient(x_btd), pos,
                                      quantize=get_fake_quant(cfg.index_quant))
      pool = shared.get(_pool_key(cfg.candidate_source_layer_id)) if role.uses_candidates else None
      sel_idx, sel_valid, blocks = select_chunked(
          jax.lax.stop_gradient(q_idx), jax.lax.stop_gradient(w_bth),
          jax.lax.stop_gradient(k_bnc), seg, comp, topk=cfg.index_topk,
          chunk=cfg.sparse_chunk, block_size=cfg.candidate_block_size, pool=pool,
          publish_blocks=cfg.candidate_topk_blocks if role.publishes_candidates else 0,
          topk_block=cfg.index_topk_block, scores_fn=SCORERS[cfg.index_impl],
          row_offset=row_offset, select_impl=cfg.select_impl, groups=cfg.index_causal_groups)
      sel_idx, sel_valid, blocks = checkpoint_name((sel_idx, sel_valid, blocks), SELECTION)
      shared[_sel_key(role.layer)] = (sel_idx, sel_valid)
      if blocks is not None:
        shared[_pool_key(role.layer)] = blocks
    sel_idx, sel_valid = shared[_sel_key(role.index_source)]
    # Only an index source in training needs the per-slot mass (its indexer's distillation
    # target); generation computes no indexer loss.
    distill = self.owns_index and DECODE not in shared
    kv = comp.kv_bnd if comp.load_rows else comp.kv_bnd.astype(q_bthd.dtype)
    group = (cfg.sparse_group_dkv and cfg.sparse_impl == 'fused' and DECODE not in shared and
             bool(self.selection_readers))
    later, sink = 0, None
    if group and self.owns_index:
      later = len(self.selection_readers)
    elif group:  # take this layer's sink; the last reader drops the entry
      sinks = shared[_sinks_key(role.index_source)]
      sink = sinks[self.selection_readers.index(role.layer)]
      if role.layer == self.selection_readers[-1]:
        del shared[_sinks_key(role.index_source)]
    if merged_backward(cfg, shared) and cfg.sparse_impl == 'fused':
      partial, mass_btk = compressed_branch(q_bthd, kv, sel_idx, sel_valid, with_mass=distill,
                                            later=later, sink=sink,
                                            sinks_key=_sinks_key(role.layer))
    else:
      o_bthd, lse_bth, *mass = compressed_partial(
          q_bthd, kv, sel_idx, sel_valid, impl=cfg.sparse_impl, chunk=cfg.sparse_chunk,
          with_mass=distill, load_rows=comp.load_rows, later=later, sink=sink)
      if later:
        *mass, shared[_sinks_key(role.layer)] = mass
      partial, mass_btk = (o_bthd, lse_bth), (mass[0] if distill else None)
    if distill:
      student_btk = selected_scores(q_idx, w_bth, k_bnc, sel_idx, sel_valid,
                                    impl=cfg.selected_scores_impl,
                                    chunk=cfg.sparse_chunk)
      kl_sum, counted, recall_sum = idx_lib.indexer_distillation(student_btk, mass_btk, sel_valid,
                                                                 select_impl=cfg.select_impl)
      totals = shared.get(INDEXER_TOTALS, jnp.zeros(3, jnp.float32))
      shared[INDEXER_TOTALS] = totals + jnp.stack([kl_sum, counted, recall_sum])
    return partial, shared


def merged_backward(cfg: ModelConfig, shared: dict) -> bool:
  """Whether the attention kernels' partials join the layer's softmax as `softmax_merge.Branch`es
  (model.merged_backward; training and evaluation, not generation's cached attention)."""
  return cfg.merged_backward and DECODE not in shared

