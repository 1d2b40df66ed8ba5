"""The CSA2 lightning indexer: top-k, candidate pool, training signal (docs/architecture.md 3.7).

    keys  (KV sources):     k_j   = quantize(RoPE_c(k_norm(latent_j W_k), pos_j))        [N, d_I]
    query (index sources):  q_t,h = quantize(RoPE_c((q_r,t W_qb^I)_h, positions_t))  [T, H_I, d_I]
                            w_t,h = x_t W_w                                            [T, H_I]
    score:                  I[t,j] = sum_h w[t,h] H_I^-1/2 relu(q[t,h] . k[j]) d_I^-1/2  (fp32;
                            ops/index_scores.py: the reference and the kernels)
    selection:              the best min(k, #eligible) eligible entries, eligible = visible
                            (and inside the candidate pool for Reindex layers)
    candidate pool:         block b of a query's document = its compressed entries
                            [first + b*block_size, first + (b+1)*block_size), first = the
                            document's first entry (as a document alone in a row sees them, so a
                            packed document's pool does not depend on where it sits in the row);
                            block score = max over visible entries; the block of the query's
                            newest visible entry is forced in; the top min(topk_blocks, #blocks
                            with a visible entry) blocks are kept

Everything is a pure function of per-query rows, so the scalable path runs it on query chunks
(`q_bthc[:, t0:t1]`, `visible_btn(seg[:, t0:t1], comp, row_offset=t0)`) and never builds
[T, N] for a whole long sequence; `candidate_blocks` is the block-level form ([Tq, N/block]
block scores -> kept block ids) that is published, `pool_entry_mask` maps it back to entries.

Deterministic ties: selection runs `jax.lax.top_k`, whose documented contract is that of equal
values the lower index comes first. Two details make that contract sufficient: ineligible entries
get -inf (eligible scores are clipped to finite values, so they always rank above every ineligible
entry), and -0.0 is rewritten as +0.0 first, because top_k orders floats totally (-0.0 < +0.0),
and relu makes exact zeros (of either sign, depending on w) common.

select_impl (model.select_impl): 'top_k' runs `jax.lax.top_k` (it sorts whole rows on the GPU);
'threshold' runs the exact threshold-select kernel (ops/gpu/topk_select.py; in the Pallas
interpreter on the CPU), which picks the same SET, ties included, but fills the slots in
ascending entry index order instead of descending score. Nothing downstream reads the slot order as a ranking:
attention, the pool mask and the KL are sums over slots (their float summation order changes,
so results agree to rounding, not bit for bit). Only `recall_per_query` (a logged diagnostic)
breaks ties by lowest slot: student scores tied as the selection keys were sit in ascending
entry order either way, but exact ties of the teacher mass straddling its top quarter can
resolve differently.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import ModelConfig
from deepseek41.model.norms import RMSNorm
from deepseek41.model.params import normal_param
from deepseek41.model.rope import apply_rope, rope_for_role
from deepseek41.ops.parallel.per_device import batch_local
from deepseek41.ops.sparse_attention import selection_mask
from deepseek41.ops.topk_select import threshold_select

SELECT_IMPLS = ('top_k', 'threshold')


def identity(x):
  return x


# ---------------------------------------------------------------------------------------------
# Selection


def _ranking_key(scores, eligible):
  """Scores as a top_k key: ineligible -inf, eligible clipped finite, -0.0 -> +0.0."""
  s = scores.astype(jnp.float32)
  big = jnp.finfo(jnp.float32).max
  s = jnp.where(s == 0, 0.0, jnp.clip(s, -big, big))
  return jnp.where(eligible, s, -jnp.inf)


def _pad_last(x, k: int, value):
  extra = k - x.shape[-1]
  if extra <= 0:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)], constant_values=value)


def block_max(key_bcb):
  """The max of each block of entries (the last axis): the first top-k stage's key and a
  candidate block's score. At 64K tokens these reductions over the score slabs were 3% of a
  GPU step (docs/performance.md 28); benchmarks/train_variant.py times other formulations."""
  return jnp.max(key_bcb, axis=-1)


def _top_slots(key_btn, k: int, select_impl: str):
  """(idx_btk int32, valid_btk bool): the k best keys > -inf per row (ties: lowest index), k slots
  (also when N < k), invalid slots idx 0. top_k: descending key; threshold: ascending index."""
  if select_impl == 'threshold':  # the kernel, or its reference for rows too long for it
    return threshold_select(key_btn, k)
  if select_impl != 'top_k':
    raise ValueError(f'select_impl must be one of {SELECT_IMPLS}, got {select_impl!r}')
  # Per device: GSPMD cannot split top_k's custom call (it would gather the whole batch).
  vals_btk, idx_btk = batch_local(lambda key: jax.lax.top_k(key, min(k, key.shape[-1])), key_btn)
  valid_btk = vals_btk > -jnp.inf
  idx_btk = jnp.where(valid_btk, idx_btk, 0).astype(jnp.int32)
  return _pad_last(idx_btk, k, 0), _pad_last(valid_btk, k, False)


def select_topk(scores_btn, visible_btn, k: int, allowed_btn=None, select_impl: str = 'top_k'):
  """(idx_btk int32, valid_btk bool): the best min(k, #eligible) eligible entries per query.

  eligible = visible (& allowed_btn, the candidate pool, if given). Ties by lowest entry index.
  Slot order: select_impl 'top_k' descending score, 'threshold' ascending entry index (the same
  set). Slots past the eligible count are invalid with idx 0 (safe to gather, ignore by
  `valid`). Always k slots, also when N < k. No gradient flows through it.
  """
  eligible_btn = visible_btn if allowed_btn is None else visible_btn & allowed_btn
  key_btn = _ranking_key(jax.lax.stop_gradient(scores_btn), eligible_btn)
  return _top_slots(key_btn, k, select_impl)


def select_topk_blocked(scores_btn, visible_btn, k: int, block: int, allowed_btn=None,
                        select_impl: str = 'top_k'):
  """`select_topk` in two exact stages: top-k blocks by their max, then top-k inside them.

  The fast path for long rows: `jax.lax.top_k` sorts whole rows on the GPU, so one top-k over N
  costs far more than one over N/block plus one over k*block (docs/performance.md). Exact, ties
  included: an entry outside the k best blocks (ordered by max, then lowest block) is beaten by
  each of those blocks' first maximum, so it cannot be among the k best entries. The kept blocks
  are put back in ascending order, so ties among entries still resolve by lowest index.
  select_impl 'threshold' runs both stages with the threshold kernel (ops/gpu/topk_select.py), whose
  slots come out ascending already (so no sort; the entries' slots end up in ascending order).
  """
  eligible_btn = visible_btn if allowed_btn is None else visible_btn & allowed_btn
  n = scores_btn.shape[-1]
  if block <= 1 or k * block >= n:
    return select_topk(scores_btn, eligible_btn, k, select_impl=select_impl)
  m = -(-n // block)
  key_btn = _pad_last(_ranking_key(jax.lax.stop_gradient(scores_btn), eligible_btn),
                      m * block, -jnp.inf)
  key_btmb = key_btn.reshape(key_btn.shape[:-1] + (m, block))
  blk_btk, kept_btk = _top_slots(block_max(key_btmb), k, select_impl)
  if select_impl == 'top_k':  # put the kept blocks in ascending order, empty ones last
    blk_btk = jnp.sort(jnp.where(kept_btk, blk_btk, m), axis=-1)
    kept_btk = blk_btk < m
    blk_btk = jnp.minimum(blk_btk, m - 1)
  cand_btkb = jnp.take_along_axis(key_btmb, blk_btk[..., None], axis=-2)
  cand_btc = jnp.where(kept_btk[..., None], cand_btkb, -jnp.inf).reshape(
      blk_btk.shape[:-1] + (k * block,))
  pos_btk, valid_btk = _top_slots(cand_btc, k, select_impl)
  entry_btk = jnp.take_along_axis(blk_btk, pos_btk // block, axis=-1) * block + pos_btk % block
  return jnp.where(valid_btk, entry_btk, 0).astype(jnp.int32), valid_btk


# ---------------------------------------------------------------------------------------------
# Hierarchical candidates (the candidate-source layer)


def newest_visible_bt(visible_btn):
  """int32 [B, T]: the largest visible entry index per query, -1 if none."""
  n = visible_btn.shape[-1]
  return jnp.max(jnp.where(visible_btn, jnp.arange(n, dtype=jnp.int32), -1), axis=-1)


def block_scores(scores_btn, visible_btn, first_bt, block_size: int):
  """fp32 [B, T, M], M = ceil(N / block_size): per block of the query's document, the max over
  its visible entries, -inf if none. Block b = entries [first + b*block_size, +block_size).

  first_bt: the document's first entry (`compressor.document_first_entry_bt`). The row is read
  shifted by `first` (one gather of the chunk's scores), so the document's blocks are
  consecutive runs of the shifted row.
  """
  key_btn = _ranking_key(scores_btn, visible_btn)
  n = key_btn.shape[-1]
  m = -(-n // block_size)
  col_btc = jnp.maximum(first_bt, 0)[..., None] + jnp.arange(m * block_size, dtype=jnp.int32)
  shifted_btc = jnp.where(col_btc < n,
                          jnp.take_along_axis(key_btn, jnp.minimum(col_btc, n - 1), axis=-1),
                          -jnp.inf)
  return block_max(shifted_btc.reshape(shifted_btc.shape[:-1] + (m, block_size)))


def candidate_blocks(block_scores_btm, newest_bt, first_bt, block_size: int, topk_blocks: int,
                     select_impl: str = 'top_k'):
  """(blk_idx_btk int32, blk_valid_btk bool), k = topk_blocks slots: the kept blocks per query.

  Blocks are numbered within the query's document (`block_scores`). The block holding
  `newest_bt` (the newest visible entry, -1 = none) is forced in (+inf); then the top
  min(topk_blocks, #blocks with score > -inf) blocks, ties by lowest block index. Invalid slots
  have idx 0. Slot order as `select_topk` (select_impl 'threshold': ascending block index).
  """
  m = block_scores_btm.shape[-1]
  newest_blk_bt = (newest_bt - first_bt) // block_size
  forced_btm = (jnp.arange(m, dtype=jnp.int32) == newest_blk_bt[..., None]) & \
      (newest_bt >= 0)[..., None]
  key_btm = jnp.where(forced_btm, jnp.inf, block_scores_btm)
  key_btm = jnp.where(key_btm == 0, 0.0, key_btm)
  return _top_slots(jax.lax.stop_gradient(key_btm), topk_blocks, select_impl)


def pool_entry_mask(blk_idx_btk, blk_valid_btk, first_bt, block_size: int, n: int):
  """bool [B, T, N]: the entries of the kept blocks (numbered within each query's document).

  Entries before the document's first entry are outside every block; the caller ANDs the mask
  with the visibility (a kept block also covers entries the query cannot see yet).

  Write first = a*block_size + phase. Column c (c >= -1) of the row holds entries
  [c*block_size + phase, +block_size), the document's block c - a: an entry e sits in column
  e // block_size, or the one before it if e % block_size < phase. So only the [T, M] block
  mask is gathered (by a); the entries are its repeats, selected by phase.
  """
  m = -(-n // block_size)
  kept_btm = selection_mask(blk_idx_btk, blk_valid_btk, m)
  first_bt = jnp.maximum(first_bt, 0)
  a_bt, phase_bt = first_bt // block_size, first_bt % block_size
  doc_blk_btc = jnp.arange(-1, m, dtype=jnp.int32) - a_bt[..., None]  # columns -1 .. m-1
  col_btc = (doc_blk_btc >= 0) & jnp.take_along_axis(kept_btm, jnp.clip(doc_blk_btc, 0, m - 1),
                                                      axis=-1)

  def entries(col_btm):
    return jnp.repeat(col_btm, block_size, axis=-1)[..., :n]
  r_n = jnp.arange(n, dtype=jnp.int32) % block_size
  return jnp.where(r_n >= phase_bt[..., None], entries(col_btc[..., 1:]),
                   entries(col_btc[..., :-1]))


def pool_entries(blk_idx_btk, blk_valid_btk, first_bt, block_size: int, n: int):
  """(entry_btp int32, in_pool_btp bool), P = k x block_size: the entries of the kept blocks
  (`pool_entry_mask`'s entries, as a list), in ascending entry order so that ties among them
  resolve by lowest index as over the whole row. Slots past the row's N or of empty blocks are
  out of the pool (entry 0)."""
  big = jnp.iinfo(jnp.int32).max
  blk_btk = jnp.sort(jnp.where(blk_valid_btk, blk_idx_btk, big), axis=-1)
  kept_btk = (blk_btk < big) & (first_bt >= 0)[..., None]
  start_btk = jnp.maximum(first_bt, 0)[..., None] + jnp.where(kept_btk, blk_btk, 0) * block_size
  entry_btkj = start_btk[..., None] + jnp.arange(block_size, dtype=jnp.int32)
  in_pool_btkj = kept_btk[..., None] & (entry_btkj < n)
  shape = blk_idx_btk.shape[:-1] + (blk_idx_btk.shape[-1] * block_size,)
  return (jnp.where(in_pool_btkj, entry_btkj, 0).reshape(shape).astype(jnp.int32),
          in_pool_btkj.reshape(shape))


# ---------------------------------------------------------------------------------------------
# Indexer training signal


def _masked_log_softmax(scores_btn, mask_btn):
  """log softmax over the mask (0 outside it and in rows with an empty mask); NaN-safe grads."""
  s_btn = scores_btn.astype(jnp.float32)
  masked_btn = jnp.where(mask_btn, s_btn, -jnp.inf)
  row_max_bt1 = jax.lax.stop_gradient(jnp.max(masked_btn, axis=-1, keepdims=True))
  row_max_bt1 = jnp.where(jnp.isfinite(row_max_bt1), row_max_bt1, 0.0)
  denom_bt1 = jnp.sum(jnp.exp(masked_btn - row_max_bt1), axis=-1, keepdims=True)
  lse_bt1 = row_max_bt1 + jnp.log(jnp.where(denom_bt1 > 0, denom_bt1, 1.0))
  return jnp.where(mask_btn, s_btn - lse_bt1, 0.0)


def indexer_kl_per_query(scores_btn, teacher_btn, mask_btn):
  """(kl_bt, counted_bt): KL(p || softmax(scores over mask)) per query, p = teacher over the mask.

  The teacher (a nonnegative mass, e.g. attention probabilities summed over heads) is
  stop-gradient'ed and renormalised over the mask. A query counts iff its mask is non-empty and
  the teacher puts positive mass on it (otherwise there is no target: kl 0, not counted).
  """
  teacher_btn = jax.lax.stop_gradient(teacher_btn).astype(jnp.float32)
  mass_btn = jnp.where(mask_btn, jnp.maximum(teacher_btn, 0.0), 0.0)
  total_bt1 = jnp.sum(mass_btn, axis=-1, keepdims=True)
  counted_bt = total_bt1[..., 0] > 0
  p_btn = mass_btn / jnp.where(total_bt1 > 0, total_bt1, 1.0)
  logq_btn = _masked_log_softmax(scores_btn, mask_btn)
  pos_btn = p_btn > 0
  logp_btn = jnp.log(jnp.where(pos_btn, p_btn, 1.0))
  kl_bt = jnp.sum(jnp.where(pos_btn, p_btn * (logp_btn - logq_btn), 0.0), axis=-1)
  return jnp.where(counted_bt, kl_bt, 0.0), counted_bt


def recall_per_query(scores_btn, teacher_btn, mask_btn, k: int, select_impl: str = 'top_k'):
  """float32 [B, T]: |student top-k & teacher top-k| / |teacher top-k|, 0 where nothing counts.

  Both tops are taken over the mask; the teacher's is its min(k, #positive) largest positive
  entries (ties by lowest index). A query counts iff the teacher has positive mass in the mask.
  select_impl: as `select_topk` (the same sets either way).
  """
  n = scores_btn.shape[-1]
  teacher_btn = jax.lax.stop_gradient(teacher_btn).astype(jnp.float32)
  s_idx_btk, s_valid_btk = select_topk(scores_btn, mask_btn, k, select_impl=select_impl)
  student_top_btn = selection_mask(s_idx_btk, s_valid_btk, n)
  t_idx_btk, t_valid_btk = select_topk(teacher_btn, mask_btn & (teacher_btn > 0), k,
                                       select_impl=select_impl)
  hits_bt = jnp.sum(jnp.take_along_axis(student_top_btn, t_idx_btk, axis=-1) & t_valid_btk,
                    axis=-1)
  return hits_bt / jnp.maximum(jnp.sum(t_valid_btk, axis=-1), 1).astype(jnp.float32)


def indexer_distillation(student_btk, mass_btk, valid_btk, select_impl: str = 'top_k'):
  """(kl_sum, counted, recall_sum) of one index source over its selected entries.

  student: the indexer scores of the selected slots; mass: the attention probability the layer
  put on them (the teacher); valid: the slots in use. KL as `indexer_kl_per_query`; recall of the
  teacher's top quarter of the slots by the student's top quarter (`recall_per_query`, its tops
  taken by `select_impl`: XLA's top_k was ~1% of a GPU step for this metric). Sums over counted
  queries: the model divides by `counted` once every index source has added its share.
  """
  kl_bt, counted_bt = indexer_kl_per_query(student_btk, mass_btk, valid_btk)
  top = max(1, student_btk.shape[-1] // 4)
  recall_bt = recall_per_query(jax.lax.stop_gradient(student_btk), mass_btk, valid_btk, top,
                               select_impl=select_impl)
  counted = counted_bt.astype(jnp.float32)
  return jnp.sum(kl_bt), jnp.sum(counted), jnp.sum(recall_bt * counted)


# ---------------------------------------------------------------------------------------------
# Modules


class IndexKeys(nnx.Module):
  """Indexer keys of a KV-source layer (parameters: wk, k_norm); shared by its index sources."""

  def __init__(self, cfg: ModelConfig, index_head_dim: int, rngs: nnx.Rngs):
    if cfg.rope_head_dim > index_head_dim:
      raise ValueError(f'index_head_dim={index_head_dim} is smaller than the rope slice '
                       f'(rope_head_dim={cfg.rope_head_dim})')
    self.cfg = cfg
    self.wk = normal_param(rngs, (cfg.head_dim, index_head_dim), ('kv_latent', 'index_dim'),
                           cfg.init_std)
    self.k_norm = RMSNorm(index_head_dim, cfg.rms_norm_eps)

  def __call__(self, latent_bnd, pos_bn, quantize: Callable = identity):
    """k_bnc = quantize(RoPE_compress(k_norm(latent W_k), pos_bn)); latent is PRE-RoPE."""
    k_bnc = self.k_norm(latent_bnd @ self.wk[...].astype(latent_bnd.dtype))
    return quantize(apply_rope(k_bnc, pos_bn, rope_for_role(self.cfg, 'compress')))


class IndexQuery(nnx.Module):
  """Indexer query and head weights of an index-source layer (parameters: wq_b, weights_proj)."""

  def __init__(self, cfg: ModelConfig, index_heads: int, index_head_dim: int, rngs: nnx.Rngs):
    if cfg.rope_head_dim > index_head_dim:
      raise ValueError(f'index_head_dim={index_head_dim} is smaller than the rope slice '
                       f'(rope_head_dim={cfg.rope_head_dim})')
    self.cfg = cfg
    self.wq_b = normal_param(rngs, (cfg.q_lora_rank, index_heads, index_head_dim),
                             ('q_lora', 'index_heads', 'index_dim'), cfg.init_std,
                             stack_axes=(1,))  # Muon orthogonalises each head's slice
    self.weights_proj = normal_param(rngs, (cfg.d_model, index_heads), ('embed', 'index_heads'),
                                     cfg.init_std)

  def __call__(self, q_r_btr, x_btd, positions_bt, quantize: Callable = identity):
    """(q_bthc, w_bth): q = quantize(RoPE_compress(q_r W_qb^I)) at the query positions; w fp32.

    q_r_btr is the layer's normed low-rank query (attention's q_norm(x W_qa)); x_btd its normed
    input. The H^-1/2 and C^-1/2 factors are applied by the scorer (ops/index_scores.py).
    """
    dt = q_r_btr.dtype
    q_bthc = jnp.einsum('btr,rhc->bthc', q_r_btr, self.wq_b[...].astype(dt))
    q_bthc = quantize(apply_rope(q_bthc, positions_bt, rope_for_role(self.cfg, 'compress')))
    w_bth = (x_btd @ self.weights_proj[...].astype(x_btd.dtype)).astype(jnp.float32)
    return q_bthc, w_bth
