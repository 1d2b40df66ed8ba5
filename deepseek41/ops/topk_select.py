"""Exact top-k in the threshold kernel's slot format: the jnp reference and the dispatch.

Contract (the indexer's selection, model/indexer.py, select_impl='threshold'): per row of a fp32
key array, the k largest keys, of equal keys the lower index first (exactly `jax.lax.top_k`'s
set), keeping only keys > -inf. Returns (idx int32 [..., k], valid bool [..., k]): the selected
entries in ASCENDING index order in slots 0 .. min(k, #keys > -inf) - 1; later slots are invalid
with idx 0. Floats are ordered totally, as top_k orders them (-0.0 < +0.0); keys must not be NaN.

`jax.lax.top_k` sorts whole rows on the GPU; the kernel (ops/gpu/topk_select.py) finds the k-th
largest key and keeps everything above it, the row held on chip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deepseek41.ops.gpu.topk_select import MAX_L, topk_threshold
from deepseek41.ops.parallel.per_device import batch_local


def topk_threshold_reference(key_rl, k: int):
  """(idx_rk int32, valid_rk bool): `jax.lax.top_k`'s set, in the kernel's slot format.

  The jnp reference: top_k over each row of key_rl [..., L], keys > -inf only, the selected
  indices sorted ascending into the first slots, invalid slots idx 0. Any k (k > L pads).
  """
  l = key_rl.shape[-1]
  vals_rk, idx_rk = jax.lax.top_k(key_rl.astype(jnp.float32), min(k, l))
  idx_rk = jnp.sort(jnp.where(vals_rk > -jnp.inf, idx_rk, l), axis=-1)   # invalid -> last
  if k > l:
    idx_rk = jnp.pad(idx_rk, [(0, 0)] * (idx_rk.ndim - 1) + [(0, k - l)], constant_values=l)
  valid_rk = idx_rk < l
  return jnp.where(valid_rk, idx_rk, 0).astype(jnp.int32), valid_rk


def threshold_select(key_rl, k: int):
  """`topk_threshold_reference`'s output by the kernel, on each device's rows (on the CPU in the
  Pallas interpreter, for tests); rows longer than the kernel holds on chip (MAX_L) take the
  reference."""
  if key_rl.shape[-1] > MAX_L:
    return topk_threshold_reference(key_rl, k)
  return batch_local(functools.partial(topk_threshold, k=k), key_rl)
