"""The CSA2 lightning indexer: scores, top-k selection, candidate pool (ARCHITECTURE.md 3.7).

    keys  (KV sources):     k_j   = quantize(RoPE_c(k_norm(latent_j W_k), pos_j))        [N, d_I]
    query (index sources):  q_t,h = quantize(RoPE_c((q_r,t W_qb^I)_h, positions_t))  [T, H_I, d_I]
                            w_t,h = x_t W_w                                            [T, H_I]
    score:                  I[t,j] = sum_h w[t,h] H_I^-1/2 relu(q[t,h] . k[j]) d_I^-1/2  (fp32)
    selection:              the best min(k, #eligible) eligible entries, eligible = visible
                            (and inside the candidate pool for Reindex layers)
    candidate pool:         blocks of `block_size` entries, block score = max over visible
                            entries; the block of the query's newest visible entry is forced in;
                            the top min(topk_blocks, #blocks with a visible entry) blocks are kept

Everything is a pure function of per-query rows, so the scalable path runs it on query chunks
(`q_bthc[:, t0:t1]`, `visible_btn(seg[:, t0:t1], comp, row_offset=t0)`) and never builds
[T, N] for a whole long sequence; `candidate_blocks` is the block-level form ([Tq, N/block]
block scores -> kept block ids) for that path.

Deterministic ties: selection runs `jax.lax.top_k`, whose documented contract is that of equal
values the lower index comes first. Two details make that contract sufficient: ineligible entries
get -inf (eligible scores are clipped to finite values, so they always rank above every ineligible
entry), and -0.0 is rewritten as +0.0 first, because top_k orders floats totally (-0.0 < +0.0),
and relu makes exact zeros (of either sign, depending on w) common.

Indexer training helpers (`indexer_kl_loss`, `recall_at_k`) are pure functions; wiring the
distillation target is the caller's.
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


def identity(x):
  return x


# ---------------------------------------------------------------------------------------------
# Scores


def index_scores(q_bthc, w_bth, k_bnc):
  """fp32 [B, T, N]: I[t,j] = sum_h w[t,h] * H^-1/2 * relu(q[t,h] . k[j]) * C^-1/2.

  Materialises [B, T, H, N]: pass query chunks in the scalable path. The reference for the
  fused GPU kernel `deepseek41.ops.index_scores.index_scores_fused`.
  """
  h, c = q_bthc.shape[-2], q_bthc.shape[-1]
  dots_bthn = jnp.einsum('bthc,bnc->bthn', q_bthc, k_bnc, preferred_element_type=jnp.float32)
  w_bth = w_bth.astype(jnp.float32) * (h ** -0.5 * c ** -0.5)
  return jnp.einsum('bthn,bth->btn', jax.nn.relu(dots_bthn), w_bth)


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


def select_topk(scores_btn, visible_btn, k: int, allowed_btn=None):
  """(idx_btk int32, valid_btk bool): the best min(k, #eligible) eligible entries per query.

  eligible = visible (& allowed_btn, the candidate pool, if given). Slots are in descending score
  order, ties by lowest entry index; slots past the eligible count are invalid with idx 0 (safe to
  gather, ignore by `valid`). Always k slots, also when N < k. No gradient flows through it.
  """
  eligible_btn = visible_btn if allowed_btn is None else visible_btn & allowed_btn
  key_btn = _ranking_key(jax.lax.stop_gradient(scores_btn), eligible_btn)
  vals_btk, idx_btk = jax.lax.top_k(key_btn, min(k, key_btn.shape[-1]))
  valid_btk = vals_btk > -jnp.inf
  idx_btk = jnp.where(valid_btk, idx_btk, 0).astype(jnp.int32)
  return _pad_last(idx_btk, k, 0), _pad_last(valid_btk, k, False)


def select_topk_blocked(scores_btn, visible_btn, k: int, block: int, allowed_btn=None):
  """`select_topk` in two exact stages: top-k blocks by their max, then top-k inside them.

  The fast path for long rows: `jax.lax.top_k` sorts whole rows on the GPU, so one top-k over N
  costs far more than one over N/block plus one over k*block (PERFORMANCE.md). Exact, ties
  included: an entry outside the k best blocks (ordered by max, then lowest block) is beaten by
  each of those blocks' first maximum, so it cannot be among the k best entries. The kept blocks
  are put back in ascending order, so ties among entries still resolve by lowest index.
  """
  eligible_btn = visible_btn if allowed_btn is None else visible_btn & allowed_btn
  n = scores_btn.shape[-1]
  if block <= 1 or k * block >= n:
    return select_topk(scores_btn, eligible_btn, k)
  m = -(-n // block)
  key_btn = _pad_last(_ranking_key(jax.lax.stop_gradient(scores_btn), eligible_btn),
                      m * block, -jnp.inf)
  key_btmb = key_btn.reshape(key_btn.shape[:-1] + (m, block))
  blk_vals_btk, blk_btk = jax.lax.top_k(jnp.max(key_btmb, axis=-1), k)
  blk_btk = jnp.sort(jnp.where(blk_vals_btk > -jnp.inf, blk_btk, m), axis=-1)  # empty -> last
  kept_btk = blk_btk < m
  blk_btk = jnp.minimum(blk_btk, m - 1)
  cand_btkb = jnp.take_along_axis(key_btmb, blk_btk[..., None], axis=-2)
  cand_btc = jnp.where(kept_btk[..., None], cand_btkb, -jnp.inf).reshape(
      blk_btk.shape[:-1] + (k * block,))
  vals_btk, pos_btk = jax.lax.top_k(cand_btc, k)
  entry_btk = jnp.take_along_axis(blk_btk, pos_btk // block, axis=-1) * block + pos_btk % block
  valid_btk = vals_btk > -jnp.inf
  return jnp.where(valid_btk, entry_btk, 0).astype(jnp.int32), valid_btk


def topk_mask(idx_btk, valid_btk, n: int):
  """bool [B, T, N] from a selection (for the dense reference attention and tests)."""
  b, t, _ = idx_btk.shape
  target_btk = jnp.where(valid_btk, idx_btk, n)  # out of range -> dropped
  bi = jnp.arange(b)[:, None, None]
  ti = jnp.arange(t)[None, :, None]
  return jnp.zeros((b, t, n), bool).at[bi, ti, target_btk].set(True, mode='drop')


# ---------------------------------------------------------------------------------------------
# Hierarchical candidates (the candidate-source layer)


def newest_visible_bt(visible_btn):
  """int32 [B, T]: the largest visible entry index per query, -1 if none (dense form).

  The O(T) equivalent without a mask is compressor.newest_visible_entry_bt.
  """
  n = visible_btn.shape[-1]
  return jnp.max(jnp.where(visible_btn, jnp.arange(n, dtype=jnp.int32), -1), axis=-1)


def block_scores(scores_btn, visible_btn, block_size: int):
  """fp32 [B, T, M], M = ceil(N / block_size): max over each block's visible entries, -inf if none.

  Blocks are consecutive entry indices starting at entry 0 of the row.
  """
  key_btn = _ranking_key(scores_btn, visible_btn)
  n = key_btn.shape[-1]
  m = -(-n // block_size)
  key_btn = _pad_last(key_btn, m * block_size, -jnp.inf)
  return jnp.max(key_btn.reshape(key_btn.shape[:-1] + (m, block_size)), axis=-1)


def candidate_blocks(block_scores_btm, newest_bt, block_size: int, topk_blocks: int):
  """(blk_idx_btk int32, blk_valid_btk bool), k = topk_blocks slots: the kept blocks per query.

  The block holding `newest_bt` (the newest visible entry, -1 = none) is forced in (+inf); then
  the top min(topk_blocks, #blocks with score > -inf) blocks, ties by lowest block index. Invalid
  slots have idx 0. This is the block-level form the scalable path tops over [Tq, N/block_size].
  """
  m = block_scores_btm.shape[-1]
  forced_btm = (jnp.arange(m, dtype=jnp.int32) == (newest_bt // block_size)[..., None]) & \
      (newest_bt >= 0)[..., None]
  key_btm = jnp.where(forced_btm, jnp.inf, block_scores_btm)
  key_btm = jnp.where(key_btm == 0, 0.0, key_btm)
  vals_btk, idx_btk = jax.lax.top_k(jax.lax.stop_gradient(key_btm), min(topk_blocks, m))
  valid_btk = vals_btk > -jnp.inf
  idx_btk = jnp.where(valid_btk, idx_btk, 0).astype(jnp.int32)
  return _pad_last(idx_btk, topk_blocks, 0), _pad_last(valid_btk, topk_blocks, False)


def blocks_to_entries(blk_idx_btk, blk_valid_btk, block_size: int, n: int):
  """(entry_idx_btc int32, entry_valid_btc bool), C = k * block_size: the entries of kept blocks.

  Entries past N (the last, partial block) are invalid with idx 0. For the scalable Reindex
  path: gather these keys, score them, top-k among them, map back through entry_idx.
  """
  off = jnp.arange(block_size, dtype=jnp.int32)
  idx_btkc = blk_idx_btk[..., None] * block_size + off
  valid_btkc = blk_valid_btk[..., None] & (idx_btkc < n)
  shape = blk_idx_btk.shape[:-1] + (-1,)
  return (jnp.where(valid_btkc, idx_btkc, 0).reshape(shape), valid_btkc.reshape(shape))


def candidate_pool(scores_btn, visible_btn, block_size: int, topk_blocks: int):
  """bool [B, T, N]: the visible entries of the kept candidate blocks (dense form).

  Block-level pieces: `block_scores`, `newest_visible_bt`, `candidate_blocks`.
  """
  n = scores_btn.shape[-1]
  blk_idx_btk, blk_valid_btk = candidate_blocks(
      block_scores(scores_btn, visible_btn, block_size), newest_visible_bt(visible_btn),
      block_size, topk_blocks)
  m = -(-n // block_size)
  kept_btm = topk_mask(blk_idx_btk, blk_valid_btk, m)
  return jnp.repeat(kept_btm, block_size, axis=-1)[..., :n] & visible_btn


# ---------------------------------------------------------------------------------------------
# Indexer training helpers


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


def indexer_kl_loss(scores_btn, teacher_btn, mask_btn):
  """Scalar: mean over counted queries of KL(teacher || softmax(scores over mask)); 0 if none.

  Gradient flows to `scores_btn` only (the teacher is stop-gradient'ed). Also stop the indexer's
  inputs (q_r, x, latent) upstream if only the indexer weights should learn from it (section 4).
  """
  kl_bt, counted_bt = indexer_kl_per_query(scores_btn, teacher_btn, mask_btn)
  count = jnp.sum(counted_bt.astype(jnp.float32))
  return jnp.sum(kl_bt) / jnp.maximum(count, 1.0)


def recall_at_k(selected, teacher_btn, k: int):
  """Scalar: mean over queries of |selected & teacher top-k| / |teacher top-k|.

  `selected`: a bool [B, T, N] mask or an (idx_btk, valid_btk) pair from `select_topk`. The
  teacher's top-k is its min(k, #positive) largest positive entries (ties by lowest index);
  queries where the teacher has no positive mass are not counted (result 1.0 if none counts).
  """
  teacher_btn = jax.lax.stop_gradient(teacher_btn).astype(jnp.float32)
  n = teacher_btn.shape[-1]
  if isinstance(selected, (tuple, list)):
    selected = topk_mask(selected[0], selected[1], n)
  t_idx_btk, t_valid_btk = select_topk(teacher_btn, teacher_btn > 0, k)
  hit_btk = jnp.take_along_axis(selected, t_idx_btk, axis=-1) & t_valid_btk
  denom_bt = jnp.sum(t_valid_btk, axis=-1).astype(jnp.float32)
  counted_bt = denom_bt > 0
  recall_bt = jnp.sum(hit_btk, axis=-1) / jnp.maximum(denom_bt, 1.0)
  count = jnp.sum(counted_bt.astype(jnp.float32))
  return jnp.where(count > 0, jnp.sum(jnp.where(counted_bt, recall_bt, 0.0)) /
                   jnp.maximum(count, 1.0), 1.0)


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
                             ('q_lora', 'index_heads', 'index_dim'), cfg.init_std)
    self.weights_proj = normal_param(rngs, (cfg.d_model, index_heads), ('embed', 'index_heads'),
                                     cfg.init_std)

  def __call__(self, q_r_btr, x_btd, positions_bt, quantize: Callable = identity):
    """(q_bthc, w_bth): q = quantize(RoPE_compress(q_r W_qb^I)) at the query positions; w fp32.

    q_r_btr is the layer's normed low-rank query (attention's q_norm(x W_qa)); x_btd its normed
    input. The H^-1/2 and C^-1/2 factors are applied in `index_scores`, not here.
    """
    dt = q_r_btr.dtype
    q_bthc = jnp.einsum('btr,rhc->bthc', q_r_btr, self.wq_b[...].astype(dt))
    q_bthc = quantize(apply_rope(q_bthc, positions_bt, rope_for_role(self.cfg, 'compress')))
    w_bth = (x_btd @ self.weights_proj[...].astype(x_btd.dtype)).astype(jnp.float32)
    return q_bthc, w_bth
