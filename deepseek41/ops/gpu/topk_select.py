"""Exact top-k without a sort: a threshold (radix) select kernel (Pallas, Triton backend).

The contract and the jnp reference are ops/topk_select.py's: per row, `jax.lax.top_k`'s set of
keys > -inf, the selected indices ascending in the first slots, invalid slots idx 0.

`jax.lax.top_k` sorts whole rows on the GPU. The kernel instead finds the k-th largest key and
keeps everything above it, one row (or a few short rows) per program, the row held in registers:

- order-preserving image: the fp32 bits as int32, negative floats with their low 31 bits
  flipped, so that int32 order is the floats' total order.
- threshold: the k-th largest image, built bit by bit from the top (as an unsigned prefix):
  32 steps, each one compare over the row and one sum (count of keys >= candidate prefix).
- selection: every key > threshold, plus the first need = k - #greater keys equal to it in index
  order, never -inf. One exclusive cumsum of (greater << 16 | equal) gives, per key, how many
  greater and how many equal keys precede it: the ties' rank, and the slot of a selected key,
  #greater before + min(#equal before, need).
- compaction: each selected key's column index is stored at its slot (a scatter with computed
  offsets). Unselected lanes are routed to a dump slot (k), so no lane needs a mask (the
  interpreter cannot take one) and no two selected lanes share an address; on the GPU they are
  masked off as well. Slot k + 1 holds the number selected, from which the caller derives
  `valid`; slots past it are never written (so nothing needs initialising, and no two stores of
  one program race).

Cost per row of length L: 33 compare-and-sum passes over the row in registers, one scan; HBM
traffic is reading the row once and writing k + 2 int32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from deepseek41.ops import launch

INT_MIN = -2 ** 31
LOW31 = 2 ** 31 - 1
MIN_L = 16           # shortest padded row: rows shorter than this are padded with -inf
MAX_L = 16384        # longest row held on chip (16 warps x 32 keys per thread)
PACK = 1 << 16       # two counts in one int32 (each < 2^15)
ROW_ELEMS = 4096     # keys per program when rows are short (several rows per program)


def _sortable_int(x):
  """int32 image of fp32 x whose signed order is the floats' total order (-0.0 < +0.0)."""
  s = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(s < 0, s ^ LOW31, s)


NEG_INF_IMAGE = INT_MIN + 0x007FFFFF   # _sortable_int(-inf): 0xFF800000 ^ 0x7FFFFFFF


def _kernel(x_ref, o_ref, *, k, interpret):
  # x: [br, Lp] keys (-inf padded); o: [br, kp] slots 0..k-1, dump slot k, count at k + 1
  br, lp = x_ref.shape
  s_rl = _sortable_int(x_ref[...])

  def step(i, prefix_r1):
    # prefix: the threshold's high bits so far, as an unsigned bit pattern held in int32
    cand_r1 = prefix_r1 | jax.lax.shift_left(jnp.int32(1), 31 - i)
    ge_r1 = jnp.sum((s_rl >= (cand_r1 ^ INT_MIN)).astype(jnp.int32), axis=1, keepdims=True)
    return jnp.where(ge_r1 >= k, cand_r1, prefix_r1)
  thr_r1 = jax.lax.fori_loop(0, 32, step, jnp.zeros((br, 1), jnp.int32)) ^ INT_MIN

  fin_rl = s_rl > NEG_INF_IMAGE
  gt_rl = (s_rl > thr_r1) & fin_rl
  eq_rl = (s_rl == thr_r1) & fin_rl
  # One scan and one sum serve both counts: keys > threshold in the high half, equal keys in
  # the low half (counts < 2^15, MAX_L).
  packed_rl = gt_rl.astype(jnp.int32) * PACK + eq_rl.astype(jnp.int32)
  total_r1 = jnp.sum(packed_rl, axis=1, keepdims=True)
  need_r1 = k - (total_r1 >> 16)                      # > 0: the threshold is the k-th key
  before_rl = jnp.cumsum(packed_rl, axis=1) - packed_rl
  gt_before_rl, eq_before_rl = before_rl >> 16, before_rl & (PACK - 1)
  sel_rl = gt_rl | (eq_rl & (eq_before_rl < need_r1))  # ties: the first `need` in index order
  slot_rl = jnp.where(sel_rl, gt_before_rl + jnp.minimum(eq_before_rl, need_r1), k)
  rows_rl = jnp.broadcast_to(jnp.arange(br, dtype=jnp.int32)[:, None], (br, lp))
  cols_rl = jnp.broadcast_to(jnp.arange(lp, dtype=jnp.int32)[None, :], (br, lp))
  if interpret:  # the interpreter takes no mask: the dump slot absorbs the unselected lanes
    o_ref[rows_rl, slot_rl] = cols_rl
  else:
    plt.store(o_ref.at[rows_rl, slot_rl], cols_rl, mask=sel_rl)
  o_ref[:, pl.ds(k + 1, 1)] = (total_r1 >> 16) + jnp.minimum(total_r1 & (PACK - 1), need_r1)


def _pad_to(x, rows, cols):
  r, l = x.shape
  if rows == r and cols == l:
    return x
  return jnp.pad(x, ((0, rows - r), (0, cols - l)), constant_values=-jnp.inf)


def default_launch(l: int):
  """(rows per program, num_warps) for rows of length l: one row per program from 4096 keys on,
  ~32 keys per thread (L = 4096: 4 warps, 8192: 8 warps, 16384: 16 warps)."""
  lp = max(MIN_L, pl.next_power_of_2(l))
  rows = max(1, ROW_ELEMS // lp)
  return rows, min(16, max(4, rows * lp // 1024))


@functools.partial(jax.jit, static_argnames=('k', 'block_rows', 'num_warps', 'interpret'))
def topk_threshold(key_rl, k: int, *, block_rows: int | None = None, num_warps: int | None = None,
                   interpret: bool | None = None):
  """(idx_rk int32, valid_rk bool): exact top-k of each row of key_rl [..., L], as
  `topk_threshold_reference` (selected indices ascending, invalid slots idx 0, keys > -inf only).

  Rows are held on chip: L <= MAX_L, else ValueError (ops/topk_select.threshold_select then
  takes `topk_threshold_reference`, the same output).
  block_rows: rows per program (a power of two; default `default_launch`). `interpret`: the
  Pallas interpreter or not (None: ops/launch.py's rule).
  """
  interpret = launch.interpreted(interpret)
  lead, l = key_rl.shape[:-1], key_rl.shape[-1]
  if l > MAX_L:
    raise ValueError(f'topk_threshold holds a row on chip: L <= {MAX_L}, got {l}')
  x_rl = key_rl.astype(jnp.float32).reshape(-1, l)
  r = x_rl.shape[0]
  auto_rows, auto_warps = default_launch(l)
  br = min(block_rows or auto_rows, pl.next_power_of_2(max(r, 1)))
  lp = max(MIN_L, pl.next_power_of_2(l))
  rp = -(-r // br) * br
  kp = pl.next_power_of_2(k + 2)
  x_rl = _pad_to(x_rl, rp, lp)
  params = None
  if not interpret:
    params = plt.CompilerParams(num_warps=num_warps or auto_warps, num_stages=1)
  raw_rk = launch.pallas_call(
      functools.partial(_kernel, k=k, interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((rp, kp), jnp.int32),
      grid=(rp // br,),
      in_specs=[pl.BlockSpec((br, lp), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((br, kp), lambda i: (i, 0)),
      compiler_params=params,
      interpret=interpret,
      name='csa2_topk_threshold',
  )(x_rl)[:r]
  valid_rk = jnp.arange(k, dtype=jnp.int32) < raw_rk[:, k + 1:k + 2]
  idx_rk = jnp.where(valid_rk, raw_rk[:, :k], 0)
  return idx_rk.reshape(lead + (k,)), valid_rk.reshape(lead + (k,))
