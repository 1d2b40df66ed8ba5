"""One softmax over several key sets and a sink, differentiated against the merged statistics.

A layer's attention is one softmax over the union of its branches' keys (window, compressed
entries, image span) plus a per-head sink with value 0. Each branch b yields a partial (o_b,
normalised over its own keys, lse_b), and

    L = log(sum_b exp(lse_b) + exp(sink)),    O = sum_b exp(lse_b - L) o_b.

For any key j of any branch, with p_j = exp(s_j - L) its probability in the merged softmax and
D = sum_d dO * O per query and head,

    dS_j = p_j (dO . v_j - D),        d sink = -sum over queries of exp(sink - L) D.

A flash-style kernel's backward computes dS = P (dO . v - D) from the (lse, dO, D) it is
given; given the merged (L, dO, D) it computes exactly its branch's share above. Autodiff
through the merge instead hands each branch dO_b = a_b dO and dlse_b = a_b (dO . o_b - D),
a_b = exp(lse_b - L): a [T, H, d] cotangent written and a [T, H, d] partial read once more per
branch, which the kernel then reads again (docs/performance.md 29).

The layer's output is O rotated back by the inverse RoPE (model/attention.py), an orthogonal map
R per query and head, so D = sum_d dO * O = sum_d d(RO) * RO: the backward reads D off the
rotated output and its cotangent, and O itself is never kept. `merge` applies R (`rope`) in the
same pass as the merge, as one elementwise fusion, and the backward its transpose.

`merge` takes plain partials (o, lse), differentiated as autodiff would, and `Branch`es: a
partial computed without a gradient plus the backward that gives its inputs' gradients from the
merged statistics. The rotated output and L are the only activations the backward keeps of the
attention core (named as kernel outputs, so `train.remat=block_keep_attention` saves them).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from deepseek41.ops.launch import name_outputs


class Merged(NamedTuple):
  """What a branch's backward gets: D = sum_d dO * O, the merged log-sum-exp (sink included)
  and the merged output's cotangent dO, all [B, T, H(, d)]."""
  delta_bth: jax.Array
  lse_bth: jax.Array
  do_bthd: jax.Array


class Branch(NamedTuple):
  """A key set of the merged softmax whose partial was computed outside the gradient.

  backward(args, merged, d_handoffs) -> args' cotangents, a tuple like args with None for the
  non-differentiable ones.
  handoffs: {name: pytree of arrays} that `merge` returns as zeros of the same shapes, for the
  layer to publish; their cotangents reach `backward` as d_handoffs (a dict like it). They carry
  the sparse kernels' deferred key/value gradient from later layers (ops/gpu/sparse_kernel.py).
  """
  o_bthd: jax.Array
  lse_bth: jax.Array
  args: tuple
  backward: Callable
  handoffs: dict = {}


def merge_stats(partials, sink_h):
  """(O fp32, L fp32) of partials [(o_bthd, lse_bth), ...] and the sink (shapes as above).

  The sink is finite, so the shift is finite and a query no branch sees gets exactly O = 0 with
  finite gradients; only a -inf sink with nothing visible leaves it undefined, where L = 0
  (every weight is then 0, so any value works)."""
  if not partials:
    raise ValueError('the attention softmax needs at least one (o, lse) partial')
  sink_h = jnp.asarray(sink_h, jnp.float32)
  lses_bth = [lse.astype(jnp.float32) for _, lse in partials]
  shift_bth = sink_h
  for lse in lses_bth:
    shift_bth = jnp.maximum(shift_bth, lse)
  shift_bth = jax.lax.stop_gradient(jnp.where(jnp.isfinite(shift_bth), shift_bth, 0.0))
  weights = [jnp.exp(lse - shift_bth) for lse in lses_bth]
  denom_bth = jnp.exp(sink_h - shift_bth)
  for w in weights:
    denom_bth = denom_bth + w
  denom_bth = jnp.where(denom_bth > 0, denom_bth, 1.0)
  o_bthd = sum(o.astype(jnp.float32) * (w / denom_bth)[..., None]
               for (o, _), w in zip(partials, weights))
  return o_bthd, shift_bth + jnp.log(denom_bth)


def merge(parts, sink_h, dtype=None, rope=None, positions_bt=None):
  """(the merged output in `dtype` (default: the first partial's), [each Branch's handoffs]).

  parts: plain partials (o_bthd, lse_bth) and `Branch`es, in any mix. Without a Branch this is
  plain autodiff through `merge_stats`. rope: None, or `rope(x_bthd, positions_bt, inverse)`, a
  rotation per query and head (model/rope.py `apply_rope` with its frequencies): the output is
  then rope(O, positions_bt, inverse=True)."""
  dtype = jnp.dtype(dtype or parts[0][0].dtype)
  if rope is None:
    rope, positions_bt = _no_rotation, jnp.zeros((), jnp.int32)
  if not any(isinstance(p, Branch) for p in parts):
    return rope(merge_stats(parts, sink_h)[0].astype(dtype), positions_bt, inverse=True), []
  backwards = tuple(p.backward if isinstance(p, Branch) else None for p in parts)
  plain = tuple(None if isinstance(p, Branch) else tuple(p) for p in parts)
  branches = tuple((jax.lax.stop_gradient(p.o_bthd), jax.lax.stop_gradient(p.lse_bth), p.args,
                    p.handoffs) if isinstance(p, Branch) else None for p in parts)
  out_bthd, handoffs = _merge(backwards, dtype, rope, jnp.asarray(sink_h, jnp.float32),
                              positions_bt, plain, branches)
  return out_bthd, [h for h, p in zip(handoffs, parts) if isinstance(p, Branch)]


def _no_rotation(x_bthd, positions_bt, inverse):
  del positions_bt, inverse
  return x_bthd


def _partials(plain, branches):
  return [p if p is not None else b[:2] for p, b in zip(plain, branches)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _merge(backwards, dtype, rope, sink_h, positions_bt, plain, branches):
  return _merge_fwd(backwards, dtype, rope, sink_h, positions_bt, plain, branches)[0]


def _merge_fwd(backwards, dtype, rope, sink_h, positions_bt, plain, branches):
  del backwards
  o_bthd, lse_bth = merge_stats(_partials(plain, branches), sink_h)
  out_bthd = rope(o_bthd.astype(dtype), positions_bt, inverse=True)
  out_bthd, lse_bth = name_outputs(out_bthd, lse_bth)
  handoffs = tuple(None if b is None else jax.tree.map(jnp.zeros_like, b[3]) for b in branches)
  args = tuple(None if b is None else b[2] for b in branches)
  return (out_bthd, handoffs), (sink_h, positions_bt, plain, args, out_bthd, lse_bth)


def _merge_bwd(backwards, dtype, rope, res, cts):
  del dtype
  sink_h, positions_bt, plain, args, out_bthd, lse_bth = res
  dout_bthd, d_handoffs = cts
  # The rotation is orthogonal: D from the rotated output, dO by its transpose.
  delta_bth = jnp.sum(dout_bthd.astype(jnp.float32) * out_bthd.astype(jnp.float32), axis=-1)
  do_bthd = rope(dout_bthd.astype(out_bthd.dtype), positions_bt, inverse=False)
  merged = Merged(delta_bth, lse_bth, do_bthd)
  d_branches = []
  for backward, a, dh in zip(backwards, args, d_handoffs):
    d_branches.append(None if backward is None else (None, None, backward(a, merged, dh), None))
  d_plain = []
  for p in plain:
    if p is None:
      d_plain.append(None)
      continue
    o_b, lse_b = p
    a_bth = jnp.exp(lse_b.astype(jnp.float32) - lse_bth)  # 0 where the branch sees nothing
    dlse_bth = a_bth * (jnp.sum(do_bthd.astype(jnp.float32) * o_b.astype(jnp.float32), axis=-1)
                        - delta_bth)
    d_plain.append(((a_bth[..., None] * do_bthd.astype(jnp.float32)).astype(o_b.dtype),
                    dlse_bth.astype(lse_b.dtype)))
  d_sink_h = -jnp.sum(jnp.exp(sink_h - lse_bth) * delta_bth,
                      axis=tuple(range(delta_bth.ndim - 1)))
  return d_sink_h, None, tuple(d_plain), tuple(d_branches)


_merge.defvjp(_merge_fwd, _merge_bwd)

