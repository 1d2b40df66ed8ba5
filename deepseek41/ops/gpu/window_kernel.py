"""Fused sliding-window attention over the shared latent: GPU kernels (Pallas, Triton backend).

Same contract as `swa_attention.swa_partial` (docs/architecture.md sections 3.3, 3.5): query t
sees key u iff `t - window < u <= t`, both in the same non-padding document and, with span ids,
not both in one image span; one latent row is the key and the value of every head. Returns the
partial `(o_bthd in kv's dtype, lse_bth fp32)`, lse -inf (and o 0) where nothing is visible.

Layout: q is viewed as [B, T*H, d], so a block of `block_q` queries is `block_q * H` rows
(query-major, head-minor) and every key tile loaded serves all heads of those queries (MQA).
The masks are computed in the kernel from the segment / span ids (no [T, T] or [T, H, W] array
in HBM); each program walks only the key blocks that cover `[t0 - window + 1, t0 + block_q)`.

- forward: one program per (row, query block), online softmax over its key blocks.
- dq: one program per query block recomputes P from the saved lse; it also writes
  `delta - dlse` per row (delta = sum_d dO * o), which the dkv program reads. Given delta itself
  (`window_backward_fused`: the merged softmax's D), it reads no o.
- dkv: one program per key block (key-block-major: no atomics, deterministic) walks the query
  blocks within `window` after it; key = value, so dkv = dS^T q * scale + P^T dO in fp32.
  The lse cotangent enters as dS = P * (dP - delta + dlse): downstream merges partials by lse.

d = 512 is wide: the fp32 [rows, d] accumulator (o, dq or dkv) is what limits the block. With
32 rows it is 64 KB, 128 registers per thread at 4 warps. Every product and accumulator is
split over d in `block_d` chunks; each tile is loaded once (a loop-invariant one before the
loop) and feeds all of its products from shared memory, and the pipeline depth is chosen per
kernel to fit shared memory. See `window_partial_fused` for the defaults.

Costs against the minimum: a query block scores whole key blocks (for the <= 129 keys its rows
can see, 128-160 at 32-key steps, 192 at the 16-head forward's 64), the backward recomputes S
and dP in both programs (7 matrix products where a kernel with atomics would do 5), and a dkv
block reads the q and dO rows of ~(64 + 127) queries.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT
from deepseek41.ops.gpu.sparse_kernel import with_o
from deepseek41.ops.launch import droppable, name_outputs, pad_axis
ROWS = 32     # default query rows (queries x heads) per forward / dq block (at least H)
ROWS_DKV = 32  # default query rows per dkv step (at least H: one query)
SMEM_BUDGET = 200 * 1024


class _Static(NamedTuple):
  heads: int
  window: int
  scale: float
  bq: int       # queries per forward / dq block
  bk: int       # keys per forward step
  bk_dq: int    # keys per dq step
  bq_dkv: int   # queries per dkv step
  bk_dkv: int   # keys per dkv block
  bd: int       # d chunk of the contractions
  spans: bool
  num_warps: int
  stages: tuple[int, int, int]  # software-pipeline depth of the fwd, dq and dkv kernels
  interpret: bool


# ---------------------------------------------------------------------------------------------
# In-kernel helpers


def _dot(a, b, contract=(1, 0)):
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=jnp.float32)


def _row_queries(first_t, rows, heads):
  """int32 [rows]: the query position of each (query, head) row of a block."""
  return first_t + jax.lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(heads))


def _visible(t_q, seg_q, span_q, u_k, seg_k, span_k, window):
  """Broadcast visibility of key u_k to query t_q (any shapes that broadcast to the tile)."""
  vis = (u_k <= t_q) & (u_k > t_q - window) & (seg_k == seg_q) & (seg_q != 0)
  if span_q is not None:  # the query's own span is span_attention's branch
    vis = vis & ~((span_k == span_q) & (span_q != 0))
  return vis


def _col(x):
  return None if x is None else x[:, None]


def _row(x):
  return None if x is None else x[None, :]


def _load_ids(seg_ref, span_ref, idx, spans):
  return seg_ref[idx], (span_ref[idx] if spans else None)


def _sum(terms):
  return functools.reduce(operator.add, terms)


def _chunks(d, bd):
  return [pl.ds(c * bd, bd) for c in range(d // bd)]


def _key_blocks(t0, bk, st: _Static):
  """First and one-past-last block of `bk` keys covering queries [t0, t0 + bq)."""
  lo = jax.lax.div(jnp.maximum(t0 - st.window + 1, 0), jnp.int32(bk))
  hi = jax.lax.div(t0 + st.bq - 1, jnp.int32(bk)) + 1
  return lo, hi


# ---------------------------------------------------------------------------------------------
# Kernels


def _tiles(ref, rows, chunks):
  """The [rows, d] tile `ref[rows]` as d chunks, each loaded once (and reused by every dot)."""
  return [ref[rows, c] for c in chunks]


def _contract(a_chunks, b_chunks):
  """a . b^T over d, summed over the chunks: [m, n] fp32."""
  return _sum(_dot(a, b, (1, 1)) for a, b in zip(a_chunks, b_chunks))


def _query_block(seg_ref, span_ref, q_ref, kv_ref, st: _Static):
  """(rows, dt, chunks, t0, t_r, seg_r, span_r) of this program's query block."""
  rows, d = q_ref.shape
  chunks = _chunks(d, st.bd)
  t0 = pl.program_id(0) * st.bq
  t_r = _row_queries(t0, rows, st.heads)
  seg_r, span_r = _load_ids(seg_ref, span_ref, t_r, st.spans)
  return rows, kv_ref.dtype, chunks, t0, t_r, seg_r, span_r


def _fwd_kernel(seg_ref, span_ref, q_ref, kv_ref, o_ref, lse_ref, *, st: _Static):
  # seg/span: [T] of this row; q: [rows, d] of this block; kv: [T, d]; o: [rows, d]; lse: [rows]
  rows, dt, chunks, t0, t_r, seg_r, span_r = _query_block(seg_ref, span_ref, q_ref, kv_ref, st)
  q_rc = _tiles(q_ref, slice(None), chunks)  # loop-invariant: loaded once, stays on chip
  lo, hi = _key_blocks(t0, st.bk, st)

  def block(j, carry):
    m_r, l_r, acc = carry
    keys = pl.ds(j * st.bk, st.bk)
    kv_kc = _tiles(kv_ref, keys, chunks)  # one load serves QK^T and PV
    seg_k, span_k = _load_ids(seg_ref, span_ref, keys, st.spans)
    vis_rk = _visible(t_r[:, None], seg_r[:, None], _col(span_r),
                      j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)[None, :], seg_k[None, :],
                      _row(span_k), st.window)
    s_rk = jnp.where(vis_rk, _contract(q_rc, kv_kc) * st.scale, -jnp.inf)
    m_new_r = jnp.maximum(m_r, jnp.max(s_rk, axis=1))
    shift_r = jnp.where(m_new_r == -jnp.inf, 0.0, m_new_r)  # nothing seen yet: any finite shift
    alpha_r = jnp.exp(m_r - shift_r)
    p_rk = jnp.exp(s_rk - shift_r[:, None])
    l_r = l_r * alpha_r + jnp.sum(p_rk, axis=1)
    p_rk = p_rk.astype(dt)
    acc = tuple(a * alpha_r[:, None] + _dot(p_rk, kv) for a, kv in zip(acc, kv_kc))
    return m_new_r, l_r, acc

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          tuple(jnp.zeros((rows, st.bd), jnp.float32) for _ in chunks))
  m_r, l_r, acc = jax.lax.fori_loop(lo, hi, block, init)
  seen_r = l_r > 0
  inv_r = 1.0 / jnp.where(seen_r, l_r, 1.0)
  for a, c in zip(acc, chunks):
    o_ref[:, c] = (a * inv_r[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen_r, m_r + jnp.log(jnp.where(seen_r, l_r, 1.0)), -jnp.inf)


def _dq_kernel(seg_ref, span_ref, q_ref, kv_ref, o_ref, do_ref, lse_ref, dlse_ref, dq_ref,
               delta_ref, *, st: _Static):
  # As the forward, plus o/dO: [rows, d], lse/dlse: [rows]; writes dq [rows, d], delta [rows].
  # o_ref None (`with_o`): the dlse input holds delta itself (the merged softmax's D).
  rows, dt, chunks, t0, t_r, seg_r, span_r = _query_block(seg_ref, span_ref, q_ref, kv_ref, st)
  q_rc = _tiles(q_ref, slice(None), chunks)
  do_rc = _tiles(do_ref, slice(None), chunks)
  if o_ref is None:
    delta_r = dlse_ref[...]
  else:
    delta_r = _sum(jnp.sum(g.astype(jnp.float32) * o_ref[:, c].astype(jnp.float32), axis=1)
                   for g, c in zip(do_rc, chunks)) - dlse_ref[...]
  delta_ref[...] = delta_r
  lse_r = lse_ref[...]
  lse_r = jnp.where(lse_r == -jnp.inf, 0.0, lse_r)  # such a row sees nothing: P is all 0
  bk = st.bk_dq
  lo, hi = _key_blocks(t0, bk, st)

  def block(j, dq):
    keys = pl.ds(j * bk, bk)
    kv_kc = _tiles(kv_ref, keys, chunks)  # one load serves QK^T, dO V^T and dS V
    seg_k, span_k = _load_ids(seg_ref, span_ref, keys, st.spans)
    vis_rk = _visible(t_r[:, None], seg_r[:, None], _col(span_r),
                      j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :], seg_k[None, :],
                      _row(span_k), st.window)
    p_rk = jnp.where(vis_rk, jnp.exp(_contract(q_rc, kv_kc) * st.scale - lse_r[:, None]), 0.0)
    ds_rk = (p_rk * (_contract(do_rc, kv_kc) - delta_r[:, None])).astype(dt)
    return tuple(a + _dot(ds_rk, kv) for a, kv in zip(dq, kv_kc))

  dq = jax.lax.fori_loop(lo, hi, block,
                         tuple(jnp.zeros((rows, st.bd), jnp.float32) for _ in chunks))
  for a, c in zip(dq, chunks):
    dq_ref[:, c] = (a * st.scale).astype(dq_ref.dtype)


def _dkv_kernel(seg_ref, span_ref, q_ref, kv_ref, do_ref, lse_ref, delta_ref, dkv_ref, *,
                st: _Static):
  # seg/span: [T]; q/dO: [T*H, d] of this row; kv/dkv: [bk_dkv, d] of this key block;
  # lse/delta: [T*H] of this row.
  bk, d = kv_ref.shape
  rows = st.bq_dkv * st.heads
  dt = kv_ref.dtype
  chunks = _chunks(d, st.bd)
  n_q = seg_ref.shape[0] // st.bq_dkv
  k0 = pl.program_id(0) * bk
  u_k = k0 + jnp.arange(bk, dtype=jnp.int32)
  seg_k, span_k = _load_ids(seg_ref, span_ref, pl.ds(k0, bk), st.spans)
  kv_kc = _tiles(kv_ref, slice(None), chunks)
  # Queries that see this block: [k0, k0 + bk - 1 + window - 1].
  lo = jax.lax.div(k0, jnp.int32(st.bq_dkv))
  hi = jnp.minimum(jax.lax.div(k0 + bk + st.window - 2, jnp.int32(st.bq_dkv)) + 1, n_q)

  def block(i, acc):
    r = pl.ds(i * rows, rows)
    q_rc, do_rc = _tiles(q_ref, r, chunks), _tiles(do_ref, r, chunks)  # each used twice
    t_r = _row_queries(i * st.bq_dkv, rows, st.heads)
    seg_r, span_r = _load_ids(seg_ref, span_ref, t_r, st.spans)
    vis_kr = _visible(t_r[None, :], seg_r[None, :], _row(span_r), u_k[:, None], seg_k[:, None],
                      _col(span_k), st.window)
    lse_r = lse_ref[r]
    lse_r = jnp.where(lse_r == -jnp.inf, 0.0, lse_r)
    p_kr = jnp.where(vis_kr, jnp.exp(_contract(kv_kc, q_rc) * st.scale - lse_r[None, :]), 0.0)
    ds_kr = (p_kr * (_contract(kv_kc, do_rc) - delta_ref[r][None, :]) * st.scale).astype(dt)
    p_kr = p_kr.astype(dt)
    return tuple(a + _dot(ds_kr, q) + _dot(p_kr, g) for a, q, g in zip(acc, q_rc, do_rc))

  acc = jax.lax.fori_loop(lo, hi, block,
                          tuple(jnp.zeros((bk, st.bd), jnp.float32) for _ in chunks))
  for a, c in zip(acc, chunks):
    dkv_ref[:, c] = a.astype(dkv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers on padded, flattened arrays: q_brd [B, T*H, d], kv_btd, ids_bt [B, T].
# Grids are (blocks, B): axis 0 is CUDA's x, the only one allowed more than 65535 programs (T =
# 131072 at one query per block), and the fastest, so neighbouring blocks (which share keys or
# queries through L2) run together.


def _params(st: _Static, kernel: int):
  if st.interpret:
    return None
  return plt.CompilerParams(num_warps=st.num_warps, num_stages=st.stages[kernel])


def _auto_stages(resident: int, per_step: int) -> int:
  """Pipeline depth whose shared memory fits: tiles loaded once plus `stages` per-step copies.

  H200: 227 KB per block; keep ~27 KB for Triton's own scratch (layout conversions).
  """
  return 2 if resident + 2 * per_step <= SMEM_BUDGET else 1


def _row_spec(shape):
  """The whole of one batch row (the kernels index it themselves)."""
  return pl.BlockSpec((None,) + shape, lambda i, b: (b,) + (0,) * len(shape))


def _block_spec(shape):
  """Block i of a batch row along the first axis."""
  return pl.BlockSpec((None,) + shape, lambda i, b: (b, i) + (0,) * (len(shape) - 1))


def _forward(st: _Static, q_brd, kv_btd, seg_bt, span_bt):
  b, n_rows, d = q_brd.shape
  t = seg_bt.shape[1]
  rows = st.bq * st.heads
  return droppable(launch.pallas_call(
      functools.partial(_fwd_kernel, st=st),
      out_shape=[jax.ShapeDtypeStruct((b, n_rows, d), kv_btd.dtype),
                 jax.ShapeDtypeStruct((b, n_rows), jnp.float32)],
      grid=(t // st.bq, b),
      in_specs=[_row_spec((t,)), _row_spec((t,)), _block_spec((rows, d)), _row_spec((t, d))],
      out_specs=[_block_spec((rows, d)), _block_spec((rows,))],
      compiler_params=_params(st, 0),
      interpret=st.interpret,
      name='swa_window_fwd',
  ))(seg_bt, span_bt, q_brd, kv_btd)


def _backward(st: _Static, q_brd, kv_btd, seg_bt, span_bt, o_brd, lse_br, do_brd, dlse_br):
  """(dq, dkv, delta). o_brd None: dlse_br is delta itself (`window_backward_fused`)."""
  b, n_rows, d = q_brd.shape
  t = seg_bt.shape[1]
  rows = st.bq * st.heads
  outputs = () if o_brd is None else (o_brd,)
  dq_brd, delta_br = launch.pallas_call(
      with_o(functools.partial(_dq_kernel, st=st), not outputs),
      out_shape=[jax.ShapeDtypeStruct((b, n_rows, d), q_brd.dtype),
                 jax.ShapeDtypeStruct((b, n_rows), jnp.float32)],
      grid=(t // st.bq, b),
      in_specs=[_row_spec((t,)), _row_spec((t,)), _block_spec((rows, d)), _row_spec((t, d))] +
      [_block_spec((rows, d))] * (len(outputs) + 1) + [_block_spec((rows,))] * 2,
      out_specs=[_block_spec((rows, d)), _block_spec((rows,))],
      compiler_params=_params(st, 1),
      interpret=st.interpret,
      name='swa_window_dq',
  )(seg_bt, span_bt, q_brd, kv_btd, *outputs, do_brd, lse_br, dlse_br)
  dkv_btd = launch.pallas_call(
      functools.partial(_dkv_kernel, st=st),
      out_shape=jax.ShapeDtypeStruct((b, t, d), kv_btd.dtype),
      grid=(t // st.bk_dkv, b),
      in_specs=[_row_spec((t,)), _row_spec((t,)), _row_spec((n_rows, d)),
                _block_spec((st.bk_dkv, d)), _row_spec((n_rows, d)), _row_spec((n_rows,)),
                _row_spec((n_rows,))],
      out_specs=_block_spec((st.bk_dkv, d)),
      compiler_params=_params(st, 2),
      interpret=st.interpret,
      name='swa_window_dkv',
  )(seg_bt, span_bt, q_brd, kv_btd, do_brd, lse_br, delta_br)
  return dq_brd, dkv_btd, delta_br


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _window_partial(st, q_brd, kv_btd, seg_bt, span_bt):
  return tuple(_forward(st, q_brd, kv_btd, seg_bt, span_bt))


def _window_partial_fwd(st, q_brd, kv_btd, seg_bt, span_bt):
  o_brd, lse_br = _forward(st, q_brd, kv_btd, seg_bt, span_bt)
  return (o_brd, lse_br), (q_brd, kv_btd, seg_bt, span_bt, *name_outputs(o_brd, lse_br))


def _window_partial_bwd(st, res, cts):
  q_brd, kv_btd, seg_bt, span_bt, o_brd, lse_br = res
  do_brd, dlse_br = cts
  dq_brd, dkv_btd, _ = _backward(st, q_brd, kv_btd, seg_bt, span_bt, o_brd, lse_br,
                                 do_brd.astype(q_brd.dtype), dlse_br.astype(jnp.float32))
  return dq_brd, dkv_btd, None, None


_window_partial.defvjp(_window_partial_fwd, _window_partial_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry point


def _pow2(x):
  return x > 0 and x & (x - 1) == 0


TILE_ARGS = ('block_q', 'block_k', 'block_k_dq', 'block_q_dkv', 'block_k_dkv', 'block_d',
             'num_warps', 'num_stages')


def _setup(q_bthd, kv_btd, span_ids_bt, *, window: int, scale: float | None,
           interpret: bool, block_q: int | None = None, block_k: int | None = None,
           block_k_dq: int = 32, block_q_dkv: int | None = None, block_k_dkv: int = 32,
           block_d: int = 128, num_warps: int | None = None,
           num_stages: int | tuple[int, int, int] | None = None):
  """(the kernels' static choices, the block T is padded to a multiple of): the defaults and
  checks of `window_partial_fused`, shared by `window_backward_fused`."""
  t, h, d = q_bthd.shape[1:]
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  block_q = block_q or max(1, ROWS // h)
  block_q_dkv = block_q_dkv or max(1, ROWS_DKV // h)
  block_k = block_k or (64 if block_q * h <= ROWS else 32)
  num_warps = num_warps or (4 if max(block_q, block_q_dkv) * h <= 32 else 8)
  bd = min(block_d, d)
  blocks = (block_q, block_k, block_k_dq, block_q_dkv, block_k_dkv)
  if d % bd or not all(map(_pow2, (h, bd) + blocks)):
    raise ValueError(f'window_partial_fused needs power-of-two heads and blocks and d a multiple '
                     f'of block_d; got H={h}, d={d}, block_d={bd}, blocks (block_q, block_k, '
                     f'block_k_dq, block_q_dkv, block_k_dkv) {blocks}')
  if not interpret and min(block_q * h, block_k, block_k_dq, block_q_dkv * h, block_k_dkv,
                           bd) < MIN_DOT:
    raise ValueError(f'Triton matrix products need every dimension >= {MIN_DOT}: rows '
                     f'{block_q * h} / {block_q_dkv * h}, keys {block_k} / {block_k_dq} / '
                     f'{block_k_dkv}, d chunk {bd}')
  row_bytes = d * jnp.dtype(kv_btd.dtype).itemsize
  if isinstance(num_stages, int):
    num_stages = (num_stages,) * 3
  if num_stages and len(num_stages) != 3:
    raise ValueError(f'num_stages is one depth or a (forward, dq, dkv) triple; got {num_stages}')
  stages = tuple(num_stages) if num_stages else (
      _auto_stages(block_q * h * row_bytes, block_k * row_bytes),
      _auto_stages(2 * block_q * h * row_bytes, block_k_dq * row_bytes),
      _auto_stages(block_k_dkv * row_bytes, 2 * block_q_dkv * h * row_bytes))
  block = max(blocks)  # all powers of two
  st = _Static(heads=h, window=min(window, t), scale=scale, bq=block_q, bk=block_k,
               bk_dq=block_k_dq, bq_dkv=block_q_dkv, bk_dkv=block_k_dkv, bd=bd,
               spans=span_ids_bt is not None, num_warps=num_warps, stages=stages,
               interpret=interpret)
  return st, block


def _pad_rows(x_bt, block, dtype=None):
  """[B, T, ...] zero-padded to whole blocks along T (segment id 0: padding)."""
  return pad_axis(x_bt if dtype is None else x_bt.astype(dtype), 1, block)


def _ids(segment_ids_bt, span_ids_bt, block):
  seg_bt = _pad_rows(segment_ids_bt, block, jnp.int32)
  span_bt = jnp.zeros_like(seg_bt) if span_ids_bt is None else _pad_rows(span_ids_bt, block,
                                                                          jnp.int32)
  return seg_bt, span_bt


@functools.partial(jax.jit, static_argnames=('window', 'scale', 'interpret') + TILE_ARGS)
def window_partial_fused(q_bthd, kv_btd, segment_ids_bt, *, window: int,
                         scale: float | None = None, span_ids_bt=None,
                         interpret: bool | None = None,
                         block_q: int | None = None, block_k: int | None = None,
                         block_k_dq: int = 32,
                         block_q_dkv: int | None = None, block_k_dkv: int = 32,
                         block_d: int = 128, num_warps: int | None = None,
                         num_stages: int | tuple[int, int, int] | None = None):
  """The window branch as a partial: (o_bthd in kv's dtype, lse_bth fp32), differentiable.

  Blocks (powers of two; T is padded with segment id 0 to whole blocks):
  - forward / dq: `block_q` queries (default 32 // H, at least 1: 2 at H = 16, so 32 rows; 1 at
    H = 64) against `block_k` keys per forward step and `block_k_dq` = 32 per dq step. The
    forward takes 64 keys where its block has at most 32 rows (at 16 heads 10% faster at 64K
    than 32 keys; 64-key dq steps were slower: docs/performance.md section 27) and 32 above
    (at 64 heads, 64 rows and two stages of 64 keys would need ~190 KB for the tiles alone);
  - dkv: `block_k_dkv` = 32 keys against `block_q_dkv` queries per step (default 32 // H, at
    least 1);
  - `block_d` = 128: the d chunk of every product and accumulator.
  Registers bound the blocks at d = 512: each fp32 [32, 512] accumulator (o, dq, dkv) is 128
  registers per thread at 4 warps, one warp group; `num_warps` defaults to 4 where the blocks
  have at most 32 rows and 8 otherwise (64 rows at 4 warps would spill). Measured on the H200
  at configs/ablation_1b.py's shapes (docs/performance.md section 9), these defaults take the
  forward+backward at 64K from 20.1 ms (64-row blocks, 8 warps) to 9.5 ms, below XLA's chunked
  path (11.0 ms). Shared memory bounds the pipelining: the loop-invariant tiles (q; q and dO;
  kv) stay on chip and each step's tiles are multi-buffered, so `num_stages` (one for all three
  kernels or a (forward, dq, dkv) tuple; default per kernel) is 2 where that fits in ~200 KB and
  1 otherwise.
  interpret: the Pallas interpreter or not (None: ops/launch.py's rule; the CPU tests').
  """
  b, t, h, d = q_bthd.shape
  st, block = _setup(q_bthd, kv_btd, span_ids_bt, window=window, scale=scale,
                     interpret=launch.interpreted(interpret), block_q=block_q, block_k=block_k,
                     block_k_dq=block_k_dq, block_q_dkv=block_q_dkv, block_k_dkv=block_k_dkv,
                     block_d=block_d, num_warps=num_warps, num_stages=num_stages)
  t_pad = -(-t // block) * block
  q_brd = _pad_rows(q_bthd, block, kv_btd.dtype).reshape(b, t_pad * h, d)
  seg_bt, span_bt = _ids(segment_ids_bt, span_ids_bt, block)
  o_brd, lse_br = name_outputs(*_window_partial(st, q_brd, _pad_rows(kv_btd, block), seg_bt,
                                                span_bt))
  return o_brd.reshape(b, t_pad, h, d)[:, :t], lse_br.reshape(b, t_pad, h)[:, :t]


# A jit, as the partial's: every layer's call of one shape lowers to one program (the CPU
# interpreter's kernel loops, inlined per call, would otherwise multiply the compile time).
@functools.partial(jax.jit, static_argnames=('window', 'scale', 'interpret') + TILE_ARGS)
def window_backward_fused(q_bthd, kv_btd, segment_ids_bt, delta_bth, lse_bth, do_bthd, *,
                          window: int, scale: float | None = None, span_ids_bt=None,
                          interpret: bool | None = None, **tiles):
  """(dq_bthd, dkv_btd): the window branch's gradients given D = sum_d dO * O, the log-sum-exp
  and the output cotangent of the softmax it is part of, with no log-sum-exp cotangent.

  Passing the merged softmax's (D, L, dO) gives this branch's exact share of the merged gradient
  (ops/softmax_merge.py). Tiles and `interpret` as `window_partial_fused`.
  """
  b, t, h, d = q_bthd.shape
  st, block = _setup(q_bthd, kv_btd, span_ids_bt, window=window, scale=scale,
                     interpret=launch.interpreted(interpret), **tiles)
  t_pad = -(-t // block) * block
  dt = kv_btd.dtype

  def rows(x_bthd, dtype):
    return _pad_rows(x_bthd, block, dtype).reshape(b, t_pad * h, -1)
  seg_bt, span_bt = _ids(segment_ids_bt, span_ids_bt, block)
  dq_brd, dkv_btd, _ = _backward(st, rows(q_bthd, dt), _pad_rows(kv_btd, block), seg_bt, span_bt,
                                 None, rows(lse_bth[..., None], jnp.float32)[..., 0],
                                 rows(do_bthd, dt), rows(delta_bth[..., None], jnp.float32)[..., 0])
  return dq_brd.reshape(b, t_pad, h, d)[:, :t], dkv_btd[:, :t]
