"""The LM head and its token cross-entropy: the plain path and a fused, chunked one.

Plain (`model.head_chunk = 0`): `head_logits` makes the fp32 logits of every token, [B, T, V],
and `cross_entropy_sum` reduces them; autodiff keeps them (and makes their cotangent) for the
backward. At 8 x 4,096 tokens and the 1B model's 16,384-token vocabulary that is 2 GB each; at
65,536 tokens and V4.1's 129,280, 34 GB.

Fused (`head_cross_entropy_sum`): the same sum, computed `chunk` positions of every row at a time
(all B rows together, so a batch split over devices stays split). The forward keeps each token's
log-sum-exp (fp32 [B, T]) and nothing over the vocabulary; the backward recomputes one chunk's
logits at a time and turns them into that chunk's gradients. Memory over the vocabulary is one
chunk's [B, chunk, V] in fp32 plus an fp32 [D, V] gradient accumulator, whatever T is; the price
is one more [tokens, D] x [D, V] product (the recomputed logits).

On a mesh it is plain jnp that GSPMD partitions (the vocabulary split over `tensor` by the head's
annotation), with two arrangements so that nothing the loop carries or walks is split along the
loop: the chunks take every n-th position (a sequence split over `context` splits each chunk),
and W's gradient is accumulated per token shard, summed over the shards once after the loop.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepseek41.ops.parallel.per_device import axis_size, token_split


@jax.custom_vjp
def head_logits(x_btd, w_dv):
  """fp32 logits [B, T, V] of compute-dtype x and W, whose backward runs in the compute dtype.

  Autodiff of the fp32-output product would transpose it with the fp32 cotangent, promoting
  the bf16 operand: two fp32 (TF32) GEMMs of [tokens, vocab] on the GPU, 6.5 ms of the
  8 x 4,096 step (docs/performance.md section 23). Rounding the cotangent to x's dtype first
  makes them bf16 GEMMs like every other layer's backward (W's gradient is rounded to W's
  dtype either way). With fp32 compute (the CPU) nothing changes.
  """
  return jnp.einsum('btd,dv->btv', x_btd, w_dv, preferred_element_type=jnp.float32)


def _head_logits_fwd(x_btd, w_dv):
  return head_logits(x_btd, w_dv), (x_btd, w_dv)


def _head_logits_bwd(res, g_btv):
  x_btd, w_dv = res
  g_btv = g_btv.astype(x_btd.dtype)
  dx_btd = jnp.einsum('btv,dv->btd', g_btv, w_dv)
  dw_dv = jnp.einsum('btd,btv->dv', x_btd, g_btv, preferred_element_type=jnp.float32)
  return dx_btd, dw_dv.astype(w_dv.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def cross_entropy_sum(logits_btv, targets_bt, mask_bt):
  """Sum of masked token CE in fp32, and the count of real targets."""
  logits_btv = logits_btv.astype(jnp.float32)
  lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  tgt_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
  mask = mask_bt.astype(jnp.float32)
  return jnp.sum((lse_bt - tgt_bt) * mask), jnp.sum(mask)


def head_cross_entropy_sum_reference(h_btd, w_dv, targets_bt, mask_bt):
  """The plain path: (CE sum, real targets) through the whole logits [B, T, V]."""
  return cross_entropy_sum(head_logits(h_btd, w_dv), targets_bt, mask_bt)


def chunk_layout(t: int, chunk: int) -> tuple[int, int]:
  """(chunks, positions per chunk) for T positions at most `chunk` at a time: the fewest
  chunks, as even as they come (so the padding is under one position per chunk)."""
  if chunk < 1:
    raise ValueError(f'the fused cross-entropy needs chunk >= 1 (model.head_chunk), got {chunk}')
  n = -(-t // chunk)
  return n, -(-t // n)


def _chunked(x_bt, n: int, c: int):
  """[B, T, ...] -> [n, B, c, ...], chunk k holding positions k, k + n, k + 2n, ... (zero
  padding past T). Strided, not contiguous: a sequence split over devices in contiguous blocks
  (context parallelism) splits each chunk's c positions the same way, so the loop runs over an
  axis no device splits."""
  b, t = x_bt.shape[:2]
  x = jnp.pad(x_bt, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x_bt.ndim - 2))
  return jnp.moveaxis(x.reshape(b, c, n, *x_bt.shape[2:]), 2, 0)


def _unchunked(x_nbc, t: int):
  """`_chunked`'s inverse: [n, B, c, ...] -> [B, T, ...]."""
  n, b, c = x_nbc.shape[:3]
  return jnp.moveaxis(x_nbc, 0, 2).reshape(b, n * c, *x_nbc.shape[3:])[:, :t]


def _token_shards(b: int, c: int):
  """((batch shards, context shards), the spec that splits a [batch shards, context shards, D,
  V] array over them) for a chunk [B, c] on the mesh in context; ((1, 1), None) without one.

  W's gradient sums over every token. Carried through the loop as one [D, V] sum, GSPMD would
  reduce it over the devices that split the tokens in every chunk (a W-sized all-reduce per
  chunk); one partial sum per token shard, each on its own devices, is reduced once at the end.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (1, 1), None
  axes, ctx = token_split(mesh, b, c)
  shards = (math.prod(axis_size(mesh, a) for a in axes), axis_size(mesh, ctx) if ctx else 1)
  if shards == (1, 1):
    return shards, None
  return shards, P(axes or None, ctx, P.UNCONSTRAINED, P.UNCONSTRAINED)


def _chunk_logits(h_bcd, w_dv):
  return jnp.einsum('bcd,dv->bcv', h_bcd, w_dv, preferred_element_type=jnp.float32)


def _forward(h_btd, w_dv, targets_bt, mask_bt, chunk: int):
  """(CE sum, real targets, per-token log-sum-exp [B, T], the chunked inputs)."""
  n, c = chunk_layout(h_btd.shape[1], chunk)
  mask_bt = mask_bt.astype(jnp.float32)
  xs = (_chunked(h_btd, n, c), _chunked(targets_bt, n, c), _chunked(mask_bt, n, c))

  # Each token's (log-sum-exp, masked CE), summed after the loop: a sum carried through it would
  # be reduced over the devices that split the tokens once a chunk.
  def one_chunk(x):
    h_bcd, t_bc, m_bc = x
    logits_bcv = _chunk_logits(h_bcd, w_dv)
    lse_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
    tgt_bc = jnp.take_along_axis(logits_bcv, t_bc[..., None], axis=-1)[..., 0]
    return lse_bc, (lse_bc - tgt_bc) * m_bc

  lse_nbc, ce_nbc = jax.lax.map(one_chunk, xs)
  return jnp.sum(ce_nbc), jnp.sum(mask_bt), _unchunked(lse_nbc, h_btd.shape[1]), xs


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def head_cross_entropy_sum(h_btd, w_dv, targets_bt, mask_bt, chunk: int):
  """(CE sum, real targets) of the head W over the final hidden states h, `chunk` positions
  at a time; equals `head_cross_entropy_sum_reference` to fp32 rounding, and its gradients
  (w.r.t. h and W; the count has none) equal the plain path's: the logits' cotangent rounded to
  h's dtype before the two products, as `head_logits` does."""
  ce_sum, count, _, _ = _forward(h_btd, w_dv, targets_bt, mask_bt, chunk)
  return ce_sum, count


def _fused_fwd(h_btd, w_dv, targets_bt, mask_bt, chunk):
  ce_sum, count, lse_bt, xs = _forward(h_btd, w_dv, targets_bt, mask_bt, chunk)
  # The chunked inputs, not h: the backward walks them in that layout.
  return (ce_sum, count), (xs, w_dv, lse_bt)


def _fused_bwd(chunk, res, g):
  (h_nbcd, t_nbc, m_nbc), w_dv, lse_bt = res
  b, t = lse_bt.shape
  n, c = chunk_layout(t, chunk)
  g_ce = g[0]  # the count's cotangent reaches nothing: it counts the mask
  dt = h_nbcd.dtype
  (p, q), spec = _token_shards(b, c)

  def per_shard(x_bc):  # [B, c, ...] -> [p, B / p, q, c / q, ...]
    return x_bc.reshape(p, b // p, q, c // q, *x_bc.shape[2:])

  def constrain(dw_pqdv):
    return dw_pqdv if spec is None else jax.lax.with_sharding_constraint(dw_pqdv, spec)

  def one_chunk(dw_pqdv, x):
    h_bcd, t_bc, m_bc, lse_bc = x
    p_bcv = jnp.exp(_chunk_logits(h_bcd, w_dv) - lse_bc[..., None])
    onehot_bcv = jax.nn.one_hot(t_bc, w_dv.shape[1], dtype=jnp.float32)
    dlogits_bcv = ((p_bcv - onehot_bcv) * (g_ce * m_bc)[..., None]).astype(dt)
    dh_bcd = jnp.einsum('bcv,dv->bcd', dlogits_bcv, w_dv).astype(dt)
    dw_pqdv = dw_pqdv + jnp.einsum('pbqcd,pbqcv->pqdv', per_shard(h_bcd),
                                   per_shard(dlogits_bcv), preferred_element_type=jnp.float32)
    return constrain(dw_pqdv), dh_bcd

  init = constrain(jnp.zeros((p, q, *w_dv.shape), jnp.float32))
  dw_pqdv, dh_nbcd = jax.lax.scan(one_chunk, init,
                                  (h_nbcd, t_nbc, m_nbc, _chunked(lse_bt, n, c)))
  return _unchunked(dh_nbcd, t), jnp.sum(dw_pqdv, axis=(0, 1)).astype(w_dv.dtype), None, None


head_cross_entropy_sum.defvjp(_fused_fwd, _fused_bwd)
