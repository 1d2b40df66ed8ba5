"""Sliding-window branch of the V4.1 attention core (docs/architecture.md sections 3.3, 3.5, 3.8).

Shared-KV latent MQA: one latent vector per token is both the key and the value of all heads.
Query t sees key u iff `t - window < u <= t` and both lie in the same (non-padding) document.

An attention layer's softmax runs over several key sets (the window here, the selected compressed
entries of section 3.8) plus a per-head sink that only adds `exp(sink_h)` to the denominator. Each
key set is a *branch* that returns a partial `(o_bthd, lse_bth)`: its output normalised over its
own keys only, and the log-sum-exp of its visible scores (-inf where it sees nothing).
`combine_with_sink` merges any number of partials by log-sum-exp and adds the sink, which is
exactly one softmax over the union of the branches' keys plus the sink. Keys that appear in two
branches count twice, as the architecture intends (section 3.6: no de-duplication).

Three implementations of the window branch, same signature, same results:
- `reference`: dense [B, T, H, T] scores, the ground truth for tests and tiny shapes;
- `chunked`: queries in blocks of `chunk`, each block against its own block and just enough
  previous blocks to cover the window; memory and FLOPs linear in T, no loop over blocks.
- `fused`: the Pallas (Triton) kernels of ops/gpu/window_kernel.py, masks computed on chip, with
  their own backward; run by the Pallas interpreter on the CPU (ops/launch.py; the tests). Where
  no gradient flows through the forward (`window_branch`: the backward comes from the merged
  softmax), `fused_forward='mosaic'` runs the Mosaic GPU forward (ops/gpu/window_mgpu.py)
  instead.

Image spans: with `span_ids_bt` given, keys in the query's own image span are left out of the
window; `span_attention.span_partial` supplies all of them (both directions) as another partial.
DSpark's draft rows (the anchor's ring plus their whole block) attend in model/dspark.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from deepseek41.ops.gpu.window_kernel import window_backward_fused, window_partial_fused
from deepseek41.ops.gpu.window_mgpu import window_forward_mgpu
from deepseek41.ops.parallel.per_device import batch_local
from deepseek41.ops.softmax_merge import Branch, merge_stats

IMPLS = ('reference', 'chunked', 'fused')


# ---------------------------------------------------------------------------------------------
# Partials and their merge


def _masked_softmax_partial(scores, mask):
  """Softmax over the last axis restricted to `mask`: (probs, lse), safe when nothing is visible.

  Masked scores become -inf *before* the exp (not zeroed after it): `where` after an overflowing
  exp would send inf * 0 = NaN into the gradient. The row max is only a shift, so it is a
  constant for autodiff; rows with no visible key get probs 0 and lse -inf.
  """
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnorm = jnp.exp(scores - row_max)
  denom = jnp.sum(unnorm, axis=-1, keepdims=True)
  seen = denom > 0
  safe_denom = jnp.where(seen, denom, 1.0)
  probs = unnorm / safe_denom
  lse = jnp.where(seen, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]
  return probs, lse


def combine_with_sink(partials, sink_h, dtype=None):
  """One softmax over the union of the branches' keys plus the sink, from per-branch partials.

  partials: sequence of (o_bthd normalised over the branch's own keys, lse_bth of its visible
  scores, -inf if none). Denominator Z = sum_b exp(lse_b) + exp(sink_h); the result is
  sum_b exp(lse_b - log Z) * o_b (ops/softmax_merge.py). Returns `dtype` (default: the first
  o's). A layer whose branches are fused kernels merges with `softmax_merge.merge` instead.
  """
  return merge_stats(partials, sink_h)[0].astype(dtype or partials[0][0].dtype)


# ---------------------------------------------------------------------------------------------
# Window branch: reference


def window_mask_btu(segment_ids_bt, window: int, span_ids_bt=None):
  """[B, T, T] bool: query t sees key u (causal, within the window, same non-padding document,
  and not in the query's own image span when span ids are given)."""
  t_idx = jnp.arange(segment_ids_bt.shape[1])
  q_pos, k_pos = t_idx[:, None], t_idx[None, :]
  in_window_tu = (k_pos <= q_pos) & (k_pos > q_pos - window)
  same_doc_btu = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  real_query_bt = segment_ids_bt != 0
  mask_btu = in_window_tu[None] & same_doc_btu & real_query_bt[:, :, None]
  if span_ids_bt is not None:
    mask_btu = mask_btu & ~same_span_mask_btu(span_ids_bt)
  return mask_btu


def same_span_mask_btu(span_ids_bt):
  """[B, T, T] bool: both positions lie in the same image span (id > 0)."""
  same_btu = span_ids_bt[:, :, None] == span_ids_bt[:, None, :]
  return same_btu & (span_ids_bt != 0)[:, :, None]


def keyset_partial(q_bthd, kv_bud, sees_btu, scale: float | None = None):
  """The partial (o_bthd fp32, lse_bth) of queries over an explicit key set: latent u (key =
  value) is seen by query t where sees_btu. Dense [T, U] scores: for small key sets (a window
  ring, a draft block's context) and the reference."""
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  scores_bthu = jnp.einsum('bthd,bud->bthu', q_bthd, kv_bud,
                           preferred_element_type=jnp.float32) * scale
  probs_bthu, lse_bth = _masked_softmax_partial(scores_bthu, sees_btu[:, :, None, :])
  # p in the input dtype for the second matmul (fp32 accumulation), as flash kernels do.
  o_bthd = jnp.einsum('bthu,bud->bthd', probs_bthu.astype(kv_bud.dtype), kv_bud,
                      preferred_element_type=jnp.float32)
  return o_bthd, lse_bth


def _swa_partial_reference(q_bthd, kv_btd, segment_ids_bt, window, scale, span_ids_bt=None):
  return keyset_partial(q_bthd, kv_btd, window_mask_btu(segment_ids_bt, window, span_ids_bt),
                        scale)


# ---------------------------------------------------------------------------------------------
# Window branch: chunked


def chunk_geometry(seq_len: int, window: int, chunk: int | None = None):
  """(window, chunk, lookback, padded_len), clamped; a query block sees (lookback+1)*chunk keys.

  A window longer than the sequence is the same as a window of the sequence length. The earliest
  key of block n's first query is `n*chunk - window + 1`, so ceil((window-1)/chunk) earlier blocks
  cover every query of the block (1 when chunk >= window > 1, 0 when window == 1).
  """
  if window < 1:
    raise ValueError(f'window must be >= 1, got {window}')
  window = min(window, seq_len)
  chunk = window if chunk is None else chunk
  if chunk < 1:
    raise ValueError(f'chunk must be >= 1, got {chunk}')
  lookback = -(-(window - 1) // chunk)
  padded_len = -(-seq_len // chunk) * chunk
  return window, chunk, lookback, padded_len


def _with_lookback(x_bnc, lookback: int):
  """[B, N, C, ...] -> [B, N, (lookback+1)*C, ...]: row n holds blocks n-lookback..n in order.

  Blocks before the first are zeros (their segment id 0 masks them).
  """
  if lookback == 0:
    return x_bnc
  n = x_bnc.shape[1]
  pad = [(0, 0)] * x_bnc.ndim
  pad[1] = (lookback, 0)
  x_padded = jnp.pad(x_bnc, pad)
  shifted = [x_padded[:, j:j + n] for j in range(lookback + 1)]  # j = 0 is block n - lookback
  return jnp.concatenate(shifted, axis=2)


def _swa_partial_chunked(q_bthd, kv_btd, segment_ids_bt, window, scale, chunk, span_ids_bt=None):
  b, t, h, d = q_bthd.shape
  window, c, lookback, t_pad = chunk_geometry(t, window, chunk)
  n = t_pad // c
  if t_pad != t:  # padded tail: segment id 0, so it is neither a query nor a key
    q_bthd = jnp.pad(q_bthd, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    kv_btd = jnp.pad(kv_btd, ((0, 0), (0, t_pad - t), (0, 0)))
    segment_ids_bt = jnp.pad(segment_ids_bt, ((0, 0), (0, t_pad - t)))
    if span_ids_bt is not None:
      span_ids_bt = jnp.pad(span_ids_bt, ((0, 0), (0, t_pad - t)))

  q_bnchd = q_bthd.reshape(b, n, c, h, d)
  kv_bnkd = _with_lookback(kv_btd.reshape(b, n, c, d), lookback)
  seg_q_bnc = segment_ids_bt.reshape(b, n, c)
  seg_k_bnk = _with_lookback(seg_q_bnc, lookback)

  # Positions relative to the start of block n: queries 0..c-1, keys -lookback*c..c-1.
  q_pos_c = jnp.arange(c)
  k_pos_k = jnp.arange((lookback + 1) * c) - lookback * c
  in_window_ck = ((k_pos_k[None, :] <= q_pos_c[:, None]) &
                  (k_pos_k[None, :] > q_pos_c[:, None] - window))
  mask_bnck = (in_window_ck[None, None] &
               (seg_q_bnc[..., None] == seg_k_bnk[:, :, None, :]) &
               (seg_q_bnc != 0)[..., None])
  if span_ids_bt is not None:  # the query's own span is span_attention's branch
    span_q_bnc = span_ids_bt.reshape(b, n, c)
    span_k_bnk = _with_lookback(span_q_bnc, lookback)
    mask_bnck = mask_bnck & ~((span_q_bnc[..., None] == span_k_bnk[:, :, None, :]) &
                              (span_q_bnc != 0)[..., None])

  # (c, h) are adjacent in q, so each block is one [c*h, d] x [d, k] matmul with no transpose.
  scores_bnchk = jnp.einsum('bnchd,bnkd->bnchk', q_bnchd, kv_bnkd,
                            preferred_element_type=jnp.float32) * scale
  probs_bnchk, lse_bnch = _masked_softmax_partial(scores_bnchk, mask_bnck[:, :, :, None, :])
  o_bnchd = jnp.einsum('bnchk,bnkd->bnchd', probs_bnchk.astype(kv_bnkd.dtype), kv_bnkd,
                       preferred_element_type=jnp.float32).astype(kv_bnkd.dtype)  # as in sparse
  o_bthd = o_bnchd.reshape(b, t_pad, h, d)[:, :t]
  lse_bth = lse_bnch.reshape(b, t_pad, h)[:, :t]
  return o_bthd, lse_bth


# ---------------------------------------------------------------------------------------------
# Public entry points


def _window_fused(q_bthd, kv_btd, segment_ids_bt, span_ids_bt, *, window, context_axis,
                  fused_forward='triton', **kw):
  """The window kernel on this device's tokens. With the sequence split over `context_axis`,
  the window - 1 keys before the first local query live on the previous shard: they arrive as a
  halo (a ppermute; shard 0 gets padding, segment 0) and the kernel runs on halo + local
  queries, the halo's outputs discarded."""
  kernel = _forward_kernel(fused_forward, kv_btd, span_ids_bt)
  if context_axis is None:
    return kernel(q_bthd, kv_btd, segment_ids_bt, span_ids_bt=span_ids_bt, window=window, **kw)
  halo, with_halo = _halo(context_axis, q_bthd.shape[1], window)
  o_bthd, lse_bth = kernel(_zero_rows(q_bthd, halo), with_halo(kv_btd), with_halo(segment_ids_bt),
                           span_ids_bt=with_halo(span_ids_bt), window=window, **kw)
  return o_bthd[:, halo:], lse_bth[:, halo:]


def _forward_kernel(fused_forward: str, kv_btd, span_ids_bt):
  """The fused forward to run: the Mosaic GPU kernel where asked and where it applies (no image
  spans, a 16-bit latent), else the Triton kernel (differentiable, every case)."""
  if fused_forward not in ('triton', 'mosaic'):
    raise ValueError(f"fused_forward must be 'triton' or 'mosaic', got {fused_forward!r}")
  if (fused_forward == 'mosaic' and span_ids_bt is None
      and kv_btd.dtype in (jnp.bfloat16, jnp.float16)):
    return window_forward_mgpu
  return window_partial_fused


def _halo(context_axis, t_local: int, window: int):
  """(halo length, x -> the previous shard's last `halo` rows of x before this shard's)."""
  shards = jax.lax.axis_size(context_axis)
  halo = window - 1
  if halo > t_local:
    raise ValueError(f'context parallelism: {t_local} tokens per shard cannot hold the '
                     f'{halo}-token window halo (model.sliding_window)')
  forward = [(i, i + 1) for i in range(shards - 1)]

  def with_halo(x):
    if x is None:
      return None
    return jnp.concatenate([jax.lax.ppermute(x[:, t_local - halo:], context_axis, forward), x], 1)
  return halo, with_halo


def _zero_rows(x_bt, n: int):
  """x with n zero rows before its first (the halo's queries: they compute nothing kept)."""
  return jnp.concatenate([jnp.zeros((x_bt.shape[0], n) + x_bt.shape[2:], x_bt.dtype), x_bt], 1)


def _window_backward_local(q_bthd, kv_btd, segment_ids_bt, span_ids_bt, delta_bth, lse_bth,
                           do_bthd, *, window, context_axis, tensor_axis, **kw):
  """`window_backward_fused` on this device's tokens (and heads): (dq, dkv). The halo's rows get
  zero cotangents and D, so they add nothing; their keys' gradient goes back to the shard that
  owns them through the halo's transpose."""
  if context_axis is None:
    dq, dkv = window_backward_fused(q_bthd, kv_btd, segment_ids_bt, delta_bth, lse_bth, do_bthd,
                                    window=window, span_ids_bt=span_ids_bt, **kw)
  else:
    halo, with_halo = _halo(context_axis, q_bthd.shape[1], window)
    kv_x, halo_transpose = jax.vjp(with_halo, kv_btd)
    dq, dkv_x = window_backward_fused(
        _zero_rows(q_bthd, halo), kv_x, with_halo(segment_ids_bt), _zero_rows(delta_bth, halo),
        _zero_rows(lse_bth, halo), _zero_rows(do_bthd, halo), window=window,
        span_ids_bt=with_halo(span_ids_bt), **kw)
    dkv, = halo_transpose(dkv_x)
    dq = dq[:, halo:]
  if tensor_axis is not None:  # each shard's heads add to every key
    dkv = jax.lax.psum(dkv, tensor_axis)
  return dq, dkv


def window_branch(q_bthd, kv_btd, segment_ids_bt, *, window: int, scale: float | None = None,
                  span_ids_bt=None, fused_forward: str = 'triton') -> Branch:
  """The fused window partial as a `softmax_merge.Branch`: its forward now (`fused_forward`:
  model.window_forward's kernel), its backward from the merged softmax's statistics (no
  per-branch cotangents)."""
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  sg = jax.lax.stop_gradient
  o_bthd, lse_bth = swa_partial(sg(q_bthd), sg(kv_btd), segment_ids_bt, window=window,
                                impl='fused', scale=scale, span_ids_bt=span_ids_bt,
                                fused_forward=fused_forward)
  return Branch(o_bthd, lse_bth, (q_bthd, kv_btd, segment_ids_bt, span_ids_bt),
                functools.partial(_window_backward, window=window, scale=scale))


def _window_backward(args, merged, d_handoffs, *, window, scale):
  del d_handoffs
  q_bthd, kv_btd, segment_ids_bt, span_ids_bt = args
  kernel = functools.partial(_window_backward_local, window=window, scale=scale)
  dq, dkv = batch_local(kernel, q_bthd, kv_btd, segment_ids_bt, span_ids_bt, *merged,
                        context_kw='context_axis', tensor_kw='tensor_axis',
                        heads={0: 2, 4: 2, 5: 2, 6: 2}, out_heads=(2, None))
  return dq.astype(q_bthd.dtype), dkv.astype(kv_btd.dtype), None, None


def swa_partial(q_bthd, kv_btd, segment_ids_bt, *, window: int, impl: str = 'chunked',
                chunk: int | None = None, scale: float | None = None, span_ids_bt=None,
                fused_forward: str = 'triton'):
  """The window branch as a partial: (o_bthd normalised over the window, lse_bth fp32).

  q_bthd [B, T, H, d]; kv_btd [B, T, d], the shared K=V latent; segment_ids_bt [B, T] int, 0 =
  padding, documents contiguous within a row. scale defaults to 1/sqrt(d). The chunked output is
  in kv's dtype (bf16 in training: fp32 [T, H, d] partials dominated memory at 128K tokens);
  `combine_with_sink` merges branches in fp32. fused_forward (impl='fused'): 'mosaic' runs the
  Mosaic GPU forward, which has no gradient (`window_branch` only; `_forward_kernel`'s cases).
  """
  if q_bthd.ndim != 4 or kv_btd.ndim != 3 or q_bthd.shape[-1] != kv_btd.shape[-1]:
    raise ValueError(f'expected q [B,T,H,d] and kv [B,T,d], got {q_bthd.shape} and {kv_btd.shape}')
  if q_bthd.shape[:2] != kv_btd.shape[:2] or segment_ids_bt.shape != q_bthd.shape[:2]:
    raise ValueError(f'q {q_bthd.shape}, kv {kv_btd.shape} and segment_ids '
                     f'{segment_ids_bt.shape} disagree on [B, T]')
  if window < 1:
    raise ValueError(f'window must be >= 1, got {window}')
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  if impl == 'reference':
    return _swa_partial_reference(q_bthd, kv_btd, segment_ids_bt, window, scale, span_ids_bt)
  if impl == 'chunked':
    return _swa_partial_chunked(q_bthd, kv_btd, segment_ids_bt, window, scale, chunk,
                                span_ids_bt)
  if impl == 'fused':  # `chunk` is the chunked impl's; the kernel picks its own blocks
    kernel = functools.partial(_window_fused, window=window, scale=scale,
                               fused_forward=fused_forward)
    return batch_local(kernel, q_bthd, kv_btd, segment_ids_bt, span_ids_bt,
                       context_kw='context_axis', heads={0: 2}, out_heads=(2, 2))
  raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')


def swa_attention(q_bthd, kv_btd, segment_ids_bt, sink_h, *, window: int,
                  impl: str = 'reference', chunk: int | None = None, scale: float | None = None):
  """Sliding-window attention with the per-head sink: (o_bthd in q's dtype, lse_bth fp32).

  lse_bth is the log-sum-exp of the visible window scores WITHOUT the sink (-inf where a query
  sees nothing, e.g. padding): the handle for merging with another branch, see module docstring.
  A layer with a compressed branch calls `swa_partial` and `combine_with_sink` directly.
  """
  o_bthd, lse_bth = swa_partial(q_bthd, kv_btd, segment_ids_bt, window=window, impl=impl,
                                chunk=chunk, scale=scale)
  return combine_with_sink([(o_bthd, lse_bth)], sink_h, dtype=q_bthd.dtype), lse_bth
