"""One softmax over all of a decode chunk's key sets at once, for generation's small chunks.

A layer's attention is one softmax over the union of its key sets (the chunk's own window keys,
the cached window ring, the selected compressed entries) plus the per-head sink with value 0.
Training computes a partial (o, lse) per key set and merges them (ops/softmax_merge.py): each
partial is its own scores product, row maximum, row sum and value product, and the merge one
more pass. For a decode step of one token those are a dozen kernels of a few microseconds each
per layer, the step's cost (docs/performance.md section 67). Here the key sets are one key
axis: one scores product, one softmax with the sink, one value product, the same numbers to
rounding (tests/unit/test_union_attention.py).

Key sets are [B, U, d] (shared by the chunk's queries: the ring, the chunk's own keys) or
[B, T, U, d] (per query: its selected entries); a shared set is broadcast over the chunk's T
queries, so this is for small T only (`model.decode_union_rows`).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp


KEY_TILE = 64  # the key axis' multiple (XLA's GEMM tiles on the GPU)


def union_attention(q_bthd, key_sets: Sequence[tuple[jax.Array, jax.Array]], sink_h,
                    scale: float | None = None):
  """o_bthd fp32: softmax over every visible key of every set and the sink (value 0) of q . k.

  key_sets: (kv [B, U, d] or [B, T, U, d], sees [B, T, U] bool) pairs; a key is its own value
  (the shared K=V latent). A query that sees nothing gets 0 (all its mass on the sink).
  Generation's: no gradient (`max_and_sum_exp`)."""
  b, t, _, d = q_bthd.shape
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  dtype = jnp.result_type(*(kv.dtype for kv, _ in key_sets))
  keys = [(kv if kv.ndim == 4 else jnp.broadcast_to(kv[:, None], (b, t, *kv.shape[1:])))
          .astype(dtype) for kv, _ in key_sets]
  sees = [s for _, s in key_sets]
  # The key axis padded to a whole number of GEMM tiles in the same concatenation: else XLA's
  # GPU GEMMs pad both products' operands in two more kernels a layer (section 67).
  n_keys = sum(k.shape[2] for k in keys)
  pad = -n_keys % KEY_TILE
  if pad:
    keys.append(jnp.zeros((b, t, pad, d), dtype))
    sees.append(jnp.zeros((b, t, pad), bool))
  keys_btsd = jnp.concatenate(keys, axis=2)
  sees_bts = jnp.concatenate(sees, axis=2)
  scores_bths = jnp.einsum('bthd,btsd->bths', q_bthd.astype(dtype), keys_btsd,
                           preferred_element_type=jnp.float32) * scale
  scores_bths = jnp.where(sees_bts[:, :, None, :], scores_bths, -jnp.inf)
  sink_h = jnp.asarray(sink_h, jnp.float32)
  # The sink is finite, so the shift is too, and a query that sees nothing gets exp(-inf) = 0.
  max_bth, sum_bth = max_and_sum_exp(scores_bths)
  shift_bth = jnp.maximum(max_bth, sink_h)
  p_bths = jnp.exp(scores_bths - shift_bth[..., None])
  denom_bth = sum_bth * jnp.exp(max_bth - shift_bth) + jnp.exp(sink_h - shift_bth)
  # p in the keys' dtype for the value product (fp32 accumulation), as the partials' paths do.
  o_bthd = jnp.einsum('bths,btsd->bthd', p_bths.astype(dtype), keys_btsd,
                      preferred_element_type=jnp.float32)
  return o_bthd / denom_bth[..., None]


def max_and_sum_exp(s):
  """(m, l) over the last axis in one pass: m the maximum, l = sum exp(s - m), the online
  softmax's pair (one reduction kernel where max then sum are two); l = 0 where every s is
  -inf. No gradient (generation's)."""
  def combine(a, b):
    (ma, la), (mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    # exp(-inf - -inf) is nan: an all -inf side contributes 0 whatever its count
    scale = lambda mx, lx: jnp.where(mx == -jnp.inf, 0.0, lx * jnp.exp(mx - m))  # noqa: E731
    return m, scale(ma, la) + scale(mb, lb)
  ones = jnp.ones_like(s)
  return jax.lax.reduce((s, ones), (jnp.float32(-jnp.inf), jnp.float32(0.0)), combine,
                        (s.ndim - 1,))

