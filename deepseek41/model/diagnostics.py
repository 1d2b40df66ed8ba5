"""Why a long-context retrieval failed: each CSA2 layer's selection against dense attention.

The indexer's logged recall (csa2.py) compares it with the layer's attention over the entries it
already selected. Here the reference is the DENSE attention over every visible entry: for query
row t of a CSA2 layer, with its own queries q_t,h and its KV source's entries kv_j,

    p_t(j)   = mean_h softmax over visible j of (q_t,h . kv_j / sqrt(d))   the dense mass
    D_t      = the min(index_topk, #visible) entries of largest p_t (ties: the lower index)
    S_t      = the selection the layer attends to (its index source's)
    recall_t = |S_t n D_t| / |D_t|          mass_t = sum over j in S_t of p_t(j)

and, given the row each query should retrieve (`answer_rows_bt`, e.g. where a passkey or an
MQAR value sits), whether that row's entry (row // ratio) is visible yet, selected, among D_t,
and whether the sliding window reads the row anyway. A failure then reads as: not visible (the
group is incomplete), not in D_t (dense attention itself does not look there), in D_t but not
selected (the indexer missed it), or selected (the miss is elsewhere).

One measure is about speed, not retrieval: `neighbour_shared_t` = |S_t n S_t-1| / |S_t|, the
share of a query's picks its predecessor in the document also picked. The tile-merged key/value
gradient (model.sparse_dkv_tile, ops/gpu/merged_dkv.py) pays only where it is high: a tile of
tau queries sharing s with each neighbour holds about K (1 + (tau - 1)(1 - s)) distinct entries.

Plain jnp, `chunk` queries at a time: one chunk's [B, chunk, H, N] scores exist, never [T, N];
given `rows_bm` (`Probe.rows_bm`: the task evaluation passes its answer rows, `probe_rows`)
only those query rows are scored, O(M N) a layer rather than O(T N).
The API (the eval command and the trainer's evaluation call these):

    stats = selection_diagnostics(model, batch, answer_rows_bt=None, chunk=256)
        {layer: SelectionStats} for every CSA2 layer (empty for the dense and window variants);
        jit it like a forward (nnx.jit), batch as the model takes it (tokens, segment_ids,
        positions, ...; no targets needed).
    summarize(stats, query_mask_bt=None) -> {'dense_recall/L3': ..., 'dense_recall': ..., ...}
        host floats: per layer and averaged over layers, over the rows of the mask.
    selection_totals(stats, query_mask_bt=None) -> {layer: [len(FIELDS), 2]} (sums and rows,
        on the device, adding up over batches) and summarize_totals(totals): the same means
        over many batches (the task evaluation's, train/evaluation.py).

The model's forward measures the same along the way when given a Probe (`Transformer.forward(
batch, probe=Probe(answer_rows_bt))`: the stats in aux['selection']), so the task evaluation
gets its logits and the diagnostics from one forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.model.compressor import CompressedKV, query_rows, visible_at_rows_btn
from deepseek41.model.shared import Probe, Shared
from deepseek41.ops.chunking import map_query_chunks


class SelectionStats(NamedTuple):
  """One CSA2 layer's per-query diagnostics, each [B, T]."""
  counted: jax.Array             # bool: the query sees at least one entry
  recall: jax.Array              # fp32 |S n D| / |D| (0 where not counted)
  mass: jax.Array                # fp32 dense mass on the selection
  answered: jax.Array            # bool: the query has an answer row (answer_rows_bt >= 0)
  answer_visible: jax.Array      # bool: the answer's entry is complete and in the document
  answer_selected: jax.Array     # bool: ... and selected
  answer_in_dense_topk: jax.Array  # bool: ... and among the dense top-k
  answer_in_window: jax.Array    # bool: the sliding window reads the answer row
  answer_mass: jax.Array         # fp32 dense mass on the answer's entry
  neighbour_counted: jax.Array   # bool: the query and the row before it (same document) pick
  neighbour_shared: jax.Array    # fp32 |S_t n S_t-1| / |S_t| (0 where not counted)


def selection_stats(q_bthd, comp: CompressedKV, sel_idx_btk, sel_valid_btk, segment_ids_bt,
                    answer_rows_bt=None, *, topk: int, window: int, chunk: int = 256,
                    rows_bm=None) -> SelectionStats:
  """The module docstring's quantities for one layer.

  q_bthd [B, T, H, d]: the layer's RoPE'd queries; comp: its KV source's entries (row layout,
  entry j = rows j*r .. j*r + r - 1); sel_*: the selection it attends to; answer_rows_bt int
  [B, T] (row index, -1 = none; None: no answers). The queries are the whole rows (the
  training layout, not CED's tail). rows_bm int [B, M] (-1: padding): measure only these query
  rows, the stats [B, M] (padding counts nowhere); the dense scores cost O(M N) a layer instead
  of O(T N), which is what makes a 64K evaluation at its answer rows cheap (probe_rows).
  """
  b, t = q_bthd.shape[:2]
  n = comp.num_entries
  k = min(topk, n)
  kv_bnd = comp.kv_bnd.astype(jnp.float32)
  scale = 1.0 / math.sqrt(q_bthd.shape[-1])
  answers = jnp.full((b, t), -1, jnp.int32) if answer_rows_bt is None else \
      jnp.asarray(answer_rows_bt, jnp.int32)
  seg_full_bt = jnp.asarray(segment_ids_bt, jnp.int32)
  b_idx = jnp.arange(b)[:, None, None]
  before = ((0, 0), (1, 0), (0, 0))  # row t gets row t - 1's; row 0 gets none
  prev_sel_btk = jnp.pad(sel_idx_btk[:, :-1], before)
  prev_valid_btk = jnp.pad(sel_valid_btk[:, :-1], before)
  prev_seg_bt = jnp.pad(seg_full_bt[:, :-1], before[:2])

  def per_chunk(c, offset):
    del offset  # the rows are c['rows']: contiguous or probe rows alike
    rows_bc = c['rows']
    vis_bcn = visible_at_rows_btn(c['seg'], rows_bc, comp)
    s_bchn = jnp.einsum('bchd,bnd->bchn', c['q'].astype(jnp.float32), kv_bnd) * scale
    s_bchn = jnp.where(vis_bcn[:, :, None, :], s_bchn, -jnp.inf)
    shift = jnp.max(s_bchn, axis=-1, keepdims=True)
    e_bchn = jnp.exp(s_bchn - jnp.where(jnp.isfinite(shift), shift, 0.0))
    p_bcn = jnp.mean(e_bchn / jnp.maximum(jnp.sum(e_bchn, -1, keepdims=True), 1e-30), axis=2)
    vals_bck, dense_bck = jax.lax.top_k(jnp.where(vis_bcn, p_bcn, -jnp.inf), k)
    dense_valid_bck = vals_bck > -jnp.inf
    c_idx = jnp.arange(p_bcn.shape[1])[None, :, None]
    in_dense_bcn = jnp.zeros(p_bcn.shape, bool).at[b_idx, c_idx, dense_bck].max(dense_valid_bck)
    sel_in_dense = jnp.take_along_axis(in_dense_bcn, c['sel'], -1) & c['sel_valid']
    n_dense = jnp.sum(dense_valid_bck, -1)
    counted = n_dense > 0
    mass = jnp.sum(jnp.where(c['sel_valid'], jnp.take_along_axis(p_bcn, c['sel'], -1), 0.0), -1)
    a_bc = c['answer']
    has = a_bc >= 0
    a_entry = jnp.clip(a_bc // comp.ratio, 0, n - 1)[..., None]
    visible = has & jnp.take_along_axis(vis_bcn, a_entry, -1)[..., 0]
    a_seg = jnp.take_along_axis(seg_full_bt, jnp.clip(a_bc, 0, seg_full_bt.shape[1] - 1), -1)
    in_window = has & (a_bc <= rows_bc) & (rows_bc - a_bc < window) & (a_seg == c['seg']) & \
        (c['seg'] != 0)
    # [B, C, K, K] comparisons: the diagnostics' chunk bounds them like the scores
    also_before_bck = jnp.any((c['sel'][..., :, None] == c['prev_sel'][..., None, :]) &
                              c['prev_valid'][..., None, :], -1) & c['sel_valid']
    picks_bc = jnp.sum(c['sel_valid'], -1)
    neighbour = (picks_bc > 0) & jnp.any(c['prev_valid'], -1) & (c['seg'] != 0) & \
        (c['seg'] == c['prev_seg'])
    return SelectionStats(
        counted=counted,
        recall=jnp.where(counted, jnp.sum(sel_in_dense, -1) / jnp.maximum(n_dense, 1), 0.0),
        mass=mass,
        answered=has,
        answer_visible=visible,
        answer_selected=visible & jnp.any((c['sel'] == a_entry) & c['sel_valid'], -1),
        answer_in_dense_topk=visible & jnp.take_along_axis(in_dense_bcn, a_entry, -1)[..., 0],
        answer_in_window=in_window,
        answer_mass=jnp.where(visible, jnp.take_along_axis(p_bcn, a_entry, -1)[..., 0], 0.0),
        neighbour_counted=neighbour,
        neighbour_shared=jnp.where(neighbour, jnp.sum(also_before_bck, -1) /
                                   jnp.maximum(picks_bc, 1), 0.0))

  xs = {'q': q_bthd, 'seg': seg_full_bt, 'sel': sel_idx_btk, 'sel_valid': sel_valid_btk,
        'answer': answers, 'prev_sel': prev_sel_btk, 'prev_valid': prev_valid_btk,
        'prev_seg': prev_seg_bt, 'rows': jnp.broadcast_to(query_rows(0, t), (b, t))}
  if rows_bm is not None:
    measured_bm = jnp.asarray(rows_bm, jnp.int32) >= 0
    at_bm = jnp.clip(jnp.asarray(rows_bm, jnp.int32), 0, t - 1)
    xs = {k: jnp.take_along_axis(v, at_bm.reshape(at_bm.shape + (1,) * (v.ndim - 2)), axis=1)
          for k, v in xs.items()}
    # Padding rows: no document (nothing visible, no neighbour) and no answer.
    xs['seg'] = jnp.where(measured_bm, xs['seg'], 0)
    xs['answer'] = jnp.where(measured_bm, xs['answer'], -1)
  return map_query_chunks(per_chunk, xs, chunk)


def probe_rows(answer_rows_bt: np.ndarray, at_least: int = 256) -> np.ndarray:
  """int32 [B, M]: each batch row's query rows that have an answer (answer_rows_bt >= 0), -1
  after them; M the next power of two of the most any row has, at least `at_least` (one
  query chunk), so that one length's tasks share one compiled evaluation."""
  has_bt = np.asarray(answer_rows_bt) >= 0
  m = max(at_least, 1 << max(int(has_bt.sum(1).max(initial=0)) - 1, 0).bit_length())
  out = np.full((has_bt.shape[0], m), -1, np.int32)
  for i, row in enumerate(has_bt):
    rows = np.flatnonzero(row)
    out[i, :len(rows)] = rows
  return out


def selection_diagnostics(model, batch, answer_rows_bt=None, chunk: int = 256
                          ) -> dict[int, SelectionStats]:
  """{layer: SelectionStats} of every CSA2 layer over one forward of `batch` (the model's
  training-layout forward; the logits are not computed). answer_rows_bt: int [B, T], for each
  query row the row it should retrieve, -1 elsewhere. Teacher-forced, row t predicts token
  t + 1: the row before an answer's i-th token gets the row of the hidden item's i-th token
  (the passkey's digit, the MQAR value) in the context."""
  if not model.cfg.csa2:
    return {}
  batch = model.with_engram_rows(batch)
  x, pre = model.residual_input(batch)
  answers = None if answer_rows_bt is None else jnp.asarray(answer_rows_bt, jnp.int32)
  shared = Shared(probe=Probe(answer_rows_bt=answers, chunk=chunk))
  shared = model.run_blocks(x, pre, batch, shared)[-1]
  return dict(sorted(shared.probe.stats.items()))


FIELDS = {'dense_recall': 'recall', 'dense_mass': 'mass', 'answer_visible': 'answer_visible',
          'answer_selected': 'answer_selected', 'answer_in_dense_topk': 'answer_in_dense_topk',
          'answer_in_window': 'answer_in_window', 'answer_dense_mass': 'answer_mass',
          'neighbour_shared': 'neighbour_shared'}


def selection_totals(stats: dict[int, SelectionStats], query_mask_bt=None
                     ) -> dict[int, jax.Array]:
  """{layer: fp32 [len(FIELDS), 2]}: per FIELDS entry (in order) its sum over the rows of
  `query_mask_bt` (default: all) that count and how many rows count: the dense_* fields over
  the rows that see an entry, the answer_* ones over the rows that have an answer,
  neighbour_shared over the rows whose predecessor in the document picks too. Jittable; the
  totals of several batches add up."""
  out = {}
  for layer, st in stats.items():
    mask = jnp.ones(st.counted.shape, bool) if query_mask_bt is None else \
        jnp.asarray(query_mask_bt, bool)
    seen, answered = mask & st.counted, mask & st.answered
    rows = [seen if name.startswith('dense_') else
            mask & st.neighbour_counted if name.startswith('neighbour') else answered
            for name in FIELDS]
    out[layer] = jnp.stack([jnp.stack([jnp.sum(jnp.where(r, getattr(st, f), 0).astype(
        jnp.float32)), jnp.sum(r, dtype=jnp.float32)]) for r, f in zip(rows, FIELDS.values())])
  return out


def summarize_totals(totals: dict[int, np.ndarray]) -> dict[str, float]:
  """Host floats of `selection_totals` (summed over batches): '<name>/L<layer>' the mean over
  its counted rows, NaN where none counts; '<name>' the mean of the layers' (NaN where every
  layer's is)."""
  out: dict[str, float] = {}
  for layer, t in sorted(totals.items()):
    for (name, _), (total, rows) in zip(FIELDS.items(), np.asarray(t, np.float64)):
      out[f'{name}/L{layer}'] = total / rows if rows else math.nan
  for name in FIELDS if totals else ():
    values = [out[f'{name}/L{layer}'] for layer in totals]
    out[name] = math.nan if np.all(np.isnan(values)) else float(np.nanmean(values))
  return out


def summarize(stats: dict[int, SelectionStats], query_mask_bt=None) -> dict[str, float]:
  """Means over the query rows in `query_mask_bt` (default: all): 'dense_recall/L<layer>' and
  'dense_mass/L<layer>' over the rows that see an entry, the 'answer_*/L<layer>' rates over
  the rows that have an answer; each also averaged over the layers without the suffix. NaN
  where no row counts."""
  return summarize_totals(jax.device_get(selection_totals(stats, query_mask_bt)))
