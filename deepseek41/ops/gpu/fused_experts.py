"""Routed experts whose GEMMs gather their own rows: the `grouped_fused` backend's Pallas kernels
(Triton lowering) and the custom VJP that ties them (ops/expert_gemm.py, docs/performance.md C).

The layout is ops/grouped_gemm.py's padded expert-sorted one. Where the `grouped` backend first
copies each assignment's token row into an [M_pad, D] buffer, here every program loads its A tile
by ROW INDEX from the un-permuted tokens: `src_m` [M_pad] holds the source token of each padded
row, -1 for group padding (loaded as a zero row, so padding rows stay exactly 0 throughout).

  swiglu_gate_up   h_mf = clipped_swiglu(x[src_m] Wg_e, x[src_m] Wu_e)   grid (row tiles, F/bn)
                   one A tile feeds two float32 accumulators (gate and up), and only h is
                   written; in its backward mode the same programs recompute gate and up and
                   write their cotangents from dh (times each row's routing weight).
  gmm_rows         y_m = scale_m * sum_p a_p[src_m or m] @ W_p,e (or W_p,e^T)  grid (row tiles,
                   N/bn); written as rows, or scatter-added into the token rows with float32
                   atomics (the combine).
  tgmm_rows        dW_e = sum_{m in e} x[rows_x]^T (scale_m * dy[rows_dy])      grid (E, D/bd, F/bf)

Two accumulators rather than one [D, 2F] weight: W_gate|W_up concatenated along F would be a
copy of both weights in HBM every step (they are separate parameters), and the two tiles of one
program share the A tile either way. Two [bm, bn] float32 accumulators hold the registers of one
[bm, 2 bn] one, so the kernel's output tile is half of gmm's (Tiles.swiglu_block_n).

Gate and up are rounded to the compute dtype before the activation, as the `grouped` backend's
GEMM outputs are, and the down projection's rows before their routing weight: the numerics of
`grouped` (and `reference`), without the [M, F] gate and up in HBM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT
from deepseek41.ops.gpu.grouped_gemm import (Tiles, compiler_params, dot_precision, fit_block,
                                             fit_stages, mosaic_wgrad_supported, tgmm_mosaic)
from deepseek41.ops.gpu.row_adds import add_rows
from deepseek41.ops.launch import pad_axis
from deepseek41.ops.swiglu import clipped_swiglu, clipped_swiglu_grads

COMBINES = ('gather', 'atomic')


def _gathered(ref, ok_r, rows_r, cols):
  """ref[rows_r, cols] with the rows where ok_r is false read as zeros."""
  return jnp.where(ok_r[:, None], ref[rows_r, cols], 0).astype(ref.dtype)


def _row_index(src_ref):
  src_r = src_ref[...]
  return src_r >= 0, jnp.maximum(src_r, 0)


# ---- gate + up + SwiGLU ------------------------------------------------------------------------


def _swiglu_kernel(te_ref, src_ref, x_ref, wg_ref, wu_ref, *refs, bn, bk, k_steps, limit,
                   precision, grads, save):
  # te: [1] the tile's expert; src: [bm] the rows' source tokens (-1: padding); x: the whole
  # [N, D] tokens; wg, wu: the whole [E, D, F] weights. grads: dh [bm, bn], scale [bm] in, the
  # gate and up cotangents out; else h out, and with save gate and up too.
  outs = refs[2:] if grads else refs
  e = te_ref[0]
  j = pl.program_id(1)
  dt = x_ref.dtype

  @pl.when(e >= 0)
  def _():
    ok_r, rows_r = _row_index(src_ref)

    def step(s, acc):
      acc_g, acc_u = acc
      x_rk = _gathered(x_ref, ok_r, rows_r, pl.ds(s * bk, bk))
      cols = (e, pl.ds(s * bk, bk), pl.ds(j * bn, bn))
      acc_g += jnp.dot(x_rk, wg_ref[cols], precision=precision,
                       preferred_element_type=jnp.float32)
      acc_u += jnp.dot(x_rk, wu_ref[cols], precision=precision,
                       preferred_element_type=jnp.float32)
      return acc_g, acc_u
    zero = jnp.zeros(outs[0].shape, jnp.float32)
    acc_g, acc_u = jax.lax.fori_loop(0, k_steps, step, (zero, zero))
    gate, up = acc_g.astype(dt), acc_u.astype(dt)
    if grads:
      dh_ref, scale_ref = refs[:2]
      dh = dh_ref[...].astype(jnp.float32) * scale_ref[...][:, None]
      d_gate, d_up = clipped_swiglu_grads(gate, up, dh, limit)
      outs[0][...] = d_gate.astype(outs[0].dtype)
      outs[1][...] = d_up.astype(outs[1].dtype)
    else:
      outs[0][...] = clipped_swiglu(gate, up, limit).astype(outs[0].dtype)
      if save:
        outs[1][...] = gate
        outs[2][...] = up

  @pl.when(e < 0)
  def _():
    for o_ref in outs:
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def swiglu_gate_up(x_nd, src_m, w_gate_edf, w_up_edf, tile_expert_t, *, limit, tiles: Tiles,
                   interpret: bool | None = None, dh_mf=None, scale_m=None, save=False):
  """h_mf = clipped_swiglu(x[src_m] Wg_e, x[src_m] Wu_e) on the padded layout: [M_pad, F].

  save: (h_mf, gate_mf, up_mf), gate and up as the activation took them (compute dtype).

  With dh_mf and scale_m (backward mode): (d_gate_mf, d_up_mf), the cotangents of gate and up for
  the cotangent scale_m * dh_mf of h, gate and up recomputed from the gathered rows.
  Rows with src_m < 0 and the rows of tiles marked -1 come out 0.
  """
  interpret = launch.interpreted(interpret)
  n_tiles = tile_expert_t.shape[0]
  m_pad = src_m.shape[0]
  bm = m_pad // n_tiles
  d, f = w_gate_edf.shape[1:]
  dt = x_nd.dtype
  x_nd = pad_axis(x_nd, 1, MIN_DOT)
  w_gate_edf, w_up_edf = (pad_axis(pad_axis(w.astype(dt), 1, MIN_DOT), 2, MIN_DOT)
                          for w in (w_gate_edf, w_up_edf))
  dp, fp = w_gate_edf.shape[1:]
  bk, bn = fit_block(tiles.block_k, dp), fit_block(tiles.swiglu_block_n, fp)
  grads = dh_mf is not None
  save = save and not grads
  kernel = functools.partial(_swiglu_kernel, bn=bn, bk=bk, k_steps=dp // bk, limit=limit,
                             precision=dot_precision(dt), grads=grads, save=save)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
  in_specs = [pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
              pl.BlockSpec((bm,), lambda i, j: (i,)),
              whole(x_nd), whole(w_gate_edf), whole(w_up_edf)]
  operands = [tile_expert_t.astype(jnp.int32).reshape(n_tiles, 1), src_m.astype(jnp.int32),
              x_nd, w_gate_edf, w_up_edf]
  row_tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
  if grads:
    in_specs += [row_tile, pl.BlockSpec((bm,), lambda i, j: (i,))]
    operands += [pad_axis(dh_mf.astype(dt), 1, MIN_DOT), scale_m.astype(jnp.float32)]
  n_out = 2 if grads else 3 if save else 1
  # A step's x row tile [bm, bk] and the gate and up tiles [bk, bn] (fit_stages).
  stages = fit_stages(tiles.num_stages, (bm + 2 * bn) * bk * jnp.dtype(dt).itemsize)
  out = launch.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct((m_pad, fp), dt) for _ in range(n_out)),
      grid=(n_tiles, fp // bn),
      in_specs=in_specs,
      out_specs=tuple(row_tile for _ in range(n_out)),
      compiler_params=compiler_params(tiles.num_warps, stages, interpret),
      interpret=interpret,
      name='moe_swiglu_bwd' if grads else 'moe_swiglu_save' if save else 'moe_swiglu',
  )(*operands)
  out = tuple(o[:, :f] for o in out)
  return out if n_out > 1 else out[0]


# ---- grouped GEMM on gathered rows, scaled rows, scattered rows --------------------------------


def _gmm_kernel(te_ref, *refs, n_pairs, gather, scaled, scatter, transpose_rhs, bn, bk,
                k_steps, round_to, precision, n_dest, interpret):
  # refs: [src [bm]] a_0..a_p (whole [N, K] if gathered, else [bm, K] row tiles), w_0..w_p (whole
  # [E, ., .]), [scale [bm]], [dest [bm]] then the output ([bm, bn] rows, or with scatter the
  # whole [n_dest + 1, N] float32 sum, also given as the last input it aliases).
  refs = list(refs)
  src_ref = refs.pop(0) if gather else None
  a_refs, w_refs = refs[:n_pairs], refs[n_pairs:2 * n_pairs]
  refs = refs[2 * n_pairs:]
  scale_ref = refs.pop(0) if scaled else None
  dest_ref = refs.pop(0) if scatter else None
  o_ref = refs[-1]
  e = te_ref[0]
  j = pl.program_id(1)
  bm = (dest_ref if scatter else o_ref).shape[0]

  @pl.when(e >= 0)
  def _():
    ok_r, rows_r = _row_index(src_ref) if gather else (None, None)

    def step(s, acc_mn):
      cols = pl.ds(s * bk, bk)
      for a_ref, w_ref in zip(a_refs, w_refs):
        a_mk = _gathered(a_ref, ok_r, rows_r, cols) if gather else a_ref[:, cols]
        if transpose_rhs:  # w is [E, N, K]: contract the last dims, no transposed copy in HBM
          w_nk = w_ref[e, pl.ds(j * bn, bn), cols]
          acc_mn += jax.lax.dot_general(a_mk, w_nk, (((1,), (1,)), ((), ())),
                                        precision=precision, preferred_element_type=jnp.float32)
        else:
          acc_mn += jnp.dot(a_mk, w_ref[e, cols, pl.ds(j * bn, bn)], precision=precision,
                            preferred_element_type=jnp.float32)
      return acc_mn
    acc_mn = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((bm, bn), jnp.float32))
    if round_to is not None:
      acc_mn = acc_mn.astype(round_to).astype(jnp.float32)
    if scaled:
      acc_mn = acc_mn * scale_ref[...][:, None]
    if scatter:
      add_rows(o_ref, dest_ref[...], j * bn, acc_mn, n=n_dest, interpret=interpret)
    else:
      o_ref[...] = acc_mn.astype(o_ref.dtype)

  if not scatter:  # the scatter's unused tiles add nothing
    @pl.when(e < 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def gmm_rows(pairs, tile_expert_t, *, src_m=None, scale_m=None, dest_m=None, n_dest=None,
             transpose_rhs=False, round_to=None, out_dtype=None, tiles: Tiles,
             interpret: bool | None = None):
  """y_m = scale_m * sum_p a_p[src_m] @ W_p,e(m) (W^T with transpose_rhs) on the padded layout.

  pairs: ((a, w_edf), ...) with a the [N, Kdim] rows src_m indexes (src_m < 0: a zero row), or
  without src_m the [M_pad, Kdim] layout rows themselves; the products of one row tile add into
  one float32 accumulator. round_to: a dtype each row is rounded to before its scale.
  Without dest_m: the [M_pad, Ncols] rows in out_dtype (default a's dtype), tiles marked -1 zero.
  With dest_m (the combine): the rows scatter-added with float32 atomics into the token rows
  dest_m of an [n_dest, Ncols] float32 sum (dest_m = n_dest: added nowhere).
  """
  interpret = launch.interpreted(interpret)
  a0, w0 = pairs[0]
  dt = a0.dtype
  n_tiles = tile_expert_t.shape[0]
  m_pad = (src_m if src_m is not None else a0).shape[0]
  bm = m_pad // n_tiles
  ncols = w0.shape[1] if transpose_rhs else w0.shape[2]
  a_list = [pad_axis(a.astype(dt), 1, MIN_DOT) for a, _ in pairs]
  w_list = [pad_axis(pad_axis(w.astype(dt), 1, MIN_DOT), 2, MIN_DOT) for _, w in pairs]
  kp = a_list[0].shape[1]
  np_ = w_list[0].shape[1] if transpose_rhs else w_list[0].shape[2]
  bk, bn = fit_block(tiles.block_k, kp), fit_block(tiles.block_n, np_)
  gather, scaled, scatter = src_m is not None, scale_m is not None, dest_m is not None
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
  rows = pl.BlockSpec((bm,), lambda i, j: (i,))
  in_specs = [pl.BlockSpec((None, 1), lambda i, j: (i, 0))]
  operands = [tile_expert_t.astype(jnp.int32).reshape(n_tiles, 1)]
  if gather:
    in_specs.append(rows)
    operands.append(src_m.astype(jnp.int32))
  in_specs += [whole(a) if gather else pl.BlockSpec((bm, kp), lambda i, j: (i, 0))
               for a in a_list] + [whole(w) for w in w_list]
  operands += a_list + w_list
  if scaled:
    in_specs.append(rows)
    operands.append(scale_m.astype(jnp.float32))
  kernel = functools.partial(
      _gmm_kernel, n_pairs=len(pairs), gather=gather, scaled=scaled, scatter=scatter,
      transpose_rhs=transpose_rhs, bn=bn, bk=bk, k_steps=kp // bk, round_to=round_to,
      precision=dot_precision(dt), n_dest=n_dest, interpret=interpret)
  # Each pair's [bm, bk] row tile and [bk, bn] weight tile a step: two pairs (dx's gate and up)
  # at GPU_TILES' 3 stages would ask for 288 KB.
  stages = fit_stages(tiles.num_stages, len(pairs) * (bm + bn) * bk * jnp.dtype(dt).itemsize)
  params = dict(grid=(n_tiles, np_ // bn),
                compiler_params=compiler_params(tiles.num_warps, stages, interpret),
                interpret=interpret)
  if not scatter:
    y = launch.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m_pad, np_), out_dtype or dt),
        in_specs=in_specs, out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        name='moe_gmm_rows', **params)(*operands)
    return y[:, :ncols]
  # One spare row takes the padding rows' adds (masked out of the atomics on the GPU).
  sum_nd = jnp.zeros((n_dest + 1, np_), jnp.float32)
  y = launch.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(sum_nd.shape, jnp.float32),
      in_specs=in_specs + [rows, whole(sum_nd)], out_specs=whole(sum_nd),
      input_output_aliases={len(operands) + 1: 0}, name='moe_gmm_scatter', **params)(
          *operands, dest_m.astype(jnp.int32), sum_nd)
  return y[:n_dest, :ncols]


def _tgmm_kernel(lo_ref, hi_ref, *refs, steps_per_tile, br, precision, gather_x, gather_dy,
                 scaled):
  # lo, hi: [1] the expert's tile range; x: [M_pad or N, bd]; dy: [M_pad or N, bf], each with its
  # whole [M_pad] row index when gathered; scale [M_pad]; o: [bd, bf]
  refs = list(refs)
  xsrc_ref = refs.pop(0) if gather_x else None
  x_ref = refs.pop(0)
  dysrc_ref = refs.pop(0) if gather_dy else None
  dy_ref = refs.pop(0)
  scale_ref = refs.pop(0) if scaled else None
  o_ref = refs[0]

  def load(ref, src_ref, rows):
    if src_ref is None:
      return ref[rows, :]
    src_r = src_ref[rows]
    return _gathered(ref, src_r >= 0, jnp.maximum(src_r, 0), pl.ds(0, ref.shape[1]))

  def step(t, acc_df):
    rows = pl.ds(t * br, br)
    x_rd = load(x_ref, xsrc_ref, rows)
    dy_rf = load(dy_ref, dysrc_ref, rows)
    if scaled:
      dy_rf = (dy_rf.astype(jnp.float32) * scale_ref[rows][:, None]).astype(dy_ref.dtype)
    return acc_df + jax.lax.dot_general(x_rd, dy_rf, (((0,), (0,)), ((), ())),
                                        precision=precision, preferred_element_type=jnp.float32)
  acc_df = jax.lax.fori_loop(lo_ref[0] * steps_per_tile, hi_ref[0] * steps_per_tile, step,
                             jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc_df.astype(o_ref.dtype)


def tgmm_rows(x, dy, group_tiles_e1, *, block_m: int, rows_x=None, rows_dy=None, scale_m=None,
              out_dtype=None, tiles: Tiles, interpret: bool | None = None):
  """dW_e = sum over expert e's padded rows m of x[rows_x[m]]^T (scale_m * dy[rows_dy[m]]).

  x, dy: [N, .] token rows indexed by rows_x / rows_dy ([M_pad], < 0: a zero row), or without
  them the [M_pad, .] layout rows (zero outside the groups). dy is rounded to x's dtype after its
  scale, as the product's operand. Experts with no tiles get zeros. [E, D, F] in out_dtype.
  """
  interpret = launch.interpreted(interpret)
  dt = x.dtype
  d, f = x.shape[1], dy.shape[1]
  n_experts = group_tiles_e1.shape[0] - 1
  x = pad_axis(x, 1, MIN_DOT)
  dy = pad_axis(dy.astype(dt), 1, MIN_DOT)
  dp, fp = x.shape[1], dy.shape[1]
  bd, bf = fit_block(tiles.block_d, dp), fit_block(tiles.block_f, fp)
  br = fit_block(min(tiles.block_r, block_m), block_m)
  g = group_tiles_e1.astype(jnp.int32)
  whole = lambda a: pl.BlockSpec(a.shape, lambda e, i, j: (0,) * a.ndim)  # noqa: E731
  in_specs = [pl.BlockSpec((None, 1), lambda e, i, j: (e, 0))] * 2
  operands = [g[:-1].reshape(n_experts, 1), g[1:].reshape(n_experts, 1)]
  for a, rows, block, col in ((x, rows_x, bd, lambda e, i, j: (0, i)),
                              (dy, rows_dy, bf, lambda e, i, j: (0, j))):
    if rows is not None:
      in_specs.append(whole(rows))
      operands.append(rows.astype(jnp.int32))
    in_specs.append(pl.BlockSpec((a.shape[0], block), col))
    operands.append(a)
  if scale_m is not None:
    in_specs.append(whole(scale_m))
    operands.append(scale_m.astype(jnp.float32))
  # A step's [br, bd] rows of x and [br, bf] of dy (fit_stages).
  stages = fit_stages(tiles.tgmm_stages, br * (bd + bf) * jnp.dtype(dt).itemsize)
  kernel = functools.partial(_tgmm_kernel, steps_per_tile=block_m // br, br=br,
                             precision=dot_precision(dt), gather_x=rows_x is not None,
                             gather_dy=rows_dy is not None, scaled=scale_m is not None)
  dw = launch.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((n_experts, dp, fp), out_dtype or dt),
      grid=(n_experts, dp // bd, fp // bf),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bd, bf), lambda e, i, j: (e, i, j)),
      compiler_params=compiler_params(tiles.tgmm_warps, stages, interpret),
      interpret=interpret,
      name='moe_tgmm_rows',
  )(*operands)
  return dw[:, :d, :f]


# ---- the block: forward and backward -----------------------------------------------------------


def gather_sum(rows_md, row_nk, ok_nk):
  """sum_k rows_md[row_nk] over the ok assignments, float32 [N, Ncols]: the transpose of a
  gather of token rows through its inverse map, and the `gather` combine (no atomics)."""
  taken_nkd = jnp.where(ok_nk[..., None], rows_md[row_nk].astype(jnp.float32), 0.0)
  return jnp.sum(taken_nkd, axis=1)


def _layout_rows(a, rows_m, scale_m=None):
  """a[rows_m] (zero where rows_m < 0) in a's dtype, times scale_m: the rows a gathering kernel
  reads, materialised for a kernel that cannot gather (the Mosaic weight gradient)."""
  a_md = jnp.where((rows_m >= 0)[:, None], a[jnp.maximum(rows_m, 0)], 0).astype(a.dtype)
  if scale_m is None:
    return a_md
  return (a_md.astype(jnp.float32) * scale_m[:, None]).astype(a.dtype)


def _weight_grad(x, rows_x, dy, rows_dy, scale_m, group_tiles_e1, block_m, out_dtype, tiles,
                 interpret):
  if tiles.wgrad == 'mosaic' and not interpret and mosaic_wgrad_supported(
      x.shape[1], dy.shape[1], x.dtype):
    x_md = x if rows_x is None else _layout_rows(x, rows_x)
    dy_mf = dy.astype(x.dtype)
    dy_mf = _layout_rows(dy_mf, rows_dy, scale_m) if rows_dy is not None else dy_mf
    return tgmm_mosaic(x_md, dy_mf, group_tiles_e1, block_m=block_m, out_dtype=out_dtype)
  return tgmm_rows(x, dy, group_tiles_e1, block_m=block_m, rows_x=rows_x, rows_dy=rows_dy,
                   scale_m=scale_m, out_dtype=out_dtype, tiles=tiles, interpret=interpret)


def _down_combine(h_mf, w_down_efd, weight_m, src_m, tile_expert_t, row_nk, ok_nk, combine,
                  out_dtype, tiles, interpret):
  """sum_k weight_nk * (h W_down)[row of (n, k)], summed in float32: [N, D]."""
  n = row_nk.shape[0]
  kw = dict(scale_m=weight_m, round_to=h_mf.dtype, tiles=tiles, interpret=interpret)
  if combine == 'atomic':
    dest_m = jnp.where(src_m >= 0, src_m, n)
    return gmm_rows(((h_mf, w_down_efd),), tile_expert_t, dest_m=dest_m, n_dest=n, **kw)
  out_md = gmm_rows(((h_mf, w_down_efd),), tile_expert_t, out_dtype=out_dtype, **kw)
  return gather_sum(out_md, row_nk, ok_nk)


def _forward(x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t,
             group_tiles_e1, row_nk, ok_nk, limit, combine, out_dtype, tiles, interpret,
             save=False):
  """(y_nd, (h_mf, gate_mf, up_mf)), gate and up None unless saved."""
  del group_tiles_e1
  h_gu = swiglu_gate_up(x_nd, src_m, w_gate_edf, w_up_edf, tile_expert_t, limit=limit,
                        tiles=tiles, interpret=interpret, save=save)
  h_gu = h_gu if save else (h_gu, None, None)
  y_nd = _down_combine(h_gu[0], w_down_efd, weight_m, src_m, tile_expert_t, row_nk, ok_nk,
                       combine, out_dtype, tiles, interpret)
  return y_nd.astype(out_dtype), h_gu


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13, 14, 15))
def fused_expert_block(x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t,
                       group_tiles_e1, row_nk, ok_nk, limit, combine, out_dtype, tiles,
                       interpret, recompute=True):
  """y_n = sum_k weight_nk * Expert_{idx_nk}(x_n) on the padded layout, rows gathered in-kernel.

  x_nd [N, D] tokens (compute dtype); weight_m float32 [M_pad] each padded row's routing weight
  (0 on padding); src_m int32 [M_pad] its token (-1 on padding); tile_expert_t, group_tiles_e1
  the layout's tiles; (row_nk, ok_nk) the inverse map, each assignment's row and whether it has
  one. Differentiable in x, weight_m and the three weights. Returns y in out_dtype.

  combine (static), the down projection's epilogue, which scales each row by its routing weight
  in float32 after rounding it to the compute dtype:
    'gather': writes the weighted rows [M_pad, D] in out_dtype and sums each token's K rows in
      float32 through the inverse map: in bf16 2 M_pad D bytes written, 2 N K D read (4 and 4 in
      float32, where the caller asks for an unrounded sum: the expert-parallel partials), then
      y; deterministic. In bf16 each weighted row is rounded once before the sum.
    'atomic': scatter-adds them into a float32 [N, D] sum with atomics: no [M_pad, D] buffer,
      4 N D bytes zeroed and read back plus 4 M_pad D of atomic adds (read-modify-write in L2,
      reaching HBM as the sum's lines are evicted); the order of the adds, so the last bits of
      y, vary from run to run.

  recompute (static), how the backward gets gate and up:
    True: recomputed from the gathered rows (the forward kernel again, its epilogue applying
      SwiGLU's derivative): two [M_pad, F] residuals of every MoE layer are not kept alive from
      forward to backward, for the FLOPs of the gate and up GEMMs once more (2 of the block's 9
      GEMMs' worth, +22%), and x's rows read again.
    False: the differentiated forward's kernel also writes gate and up (4 M_pad F bytes in bf16,
      kept to the backward, read once there by SwiGLU's derivative in XLA); a forward that is not
      differentiated still writes h only.
  Same numbers either way. h [M_pad, F] is kept (the down projection's weight
  gradient and the routing weights' gradient read it). The dgrad of the down projection gathers
  dy's token rows in its A loads; the two dgrads of x add into one accumulator, and their
  [M_pad, D] rows are summed per token through the inverse map (a gather, no atomics); the weight
  gradients gather their token rows in tgmm's loads (with the Mosaic weight gradient,
  Tiles.wgrad='mosaic', those rows are materialised, as Mosaic's kernel cannot gather).
  """
  del recompute
  return _forward(x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t,
                  group_tiles_e1, row_nk, ok_nk, limit, combine, out_dtype, tiles, interpret)[0]


def _block_fwd(x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t,
               group_tiles_e1, row_nk, ok_nk, limit, combine, out_dtype, tiles, interpret,
               recompute):
  y_nd, h_gu = _forward(x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t,
                        group_tiles_e1, row_nk, ok_nk, limit, combine, out_dtype, tiles,
                        interpret, save=not recompute)
  return y_nd, (x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t,
                group_tiles_e1, row_nk, ok_nk, h_gu)


def _block_bwd(limit, combine, out_dtype, tiles, interpret, recompute, res, dy_nd):
  del combine, out_dtype
  (x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m, tile_expert_t, group_tiles_e1,
   row_nk, ok_nk, (h_mf, gate_mf, up_mf)) = res
  dt = x_nd.dtype
  bm = src_m.shape[0] // tile_expert_t.shape[0]
  kw = dict(tiles=tiles, interpret=interpret)
  dy_nd = dy_nd.astype(dt)
  # dh before the routing weight: each row's dy gathered from its token, times W_down^T.
  dhu_mf = gmm_rows(((dy_nd, w_down_efd),), tile_expert_t, src_m=src_m, transpose_rhs=True, **kw)
  d_weight_m = jnp.sum(dhu_mf.astype(jnp.float32) * h_mf.astype(jnp.float32), axis=1)
  dw_down = _weight_grad(h_mf, None, dy_nd, src_m, weight_m, group_tiles_e1, bm,
                         w_down_efd.dtype, **kw)
  if recompute:
    d_gate_mf, d_up_mf = swiglu_gate_up(x_nd, src_m, w_gate_edf, w_up_edf, tile_expert_t,
                                        limit=limit, dh_mf=dhu_mf, scale_m=weight_m, **kw)
  else:  # what the kernel's backward epilogue computes, on the saved gate and up
    d_gate_mf, d_up_mf = clipped_swiglu_grads(
        gate_mf, up_mf, dhu_mf.astype(jnp.float32) * weight_m[:, None], limit)
  dx_md = gmm_rows(((d_gate_mf, w_gate_edf), (d_up_mf, w_up_edf)), tile_expert_t,
                   transpose_rhs=True, **kw)
  dx_nd = gather_sum(dx_md, row_nk, ok_nk).astype(dt)
  dw_gate = _weight_grad(x_nd, src_m, d_gate_mf, None, None, group_tiles_e1, bm,
                         w_gate_edf.dtype, **kw)
  dw_up = _weight_grad(x_nd, src_m, d_up_mf, None, None, group_tiles_e1, bm, w_up_edf.dtype,
                       **kw)
  return (dx_nd, d_weight_m, dw_gate, dw_up, dw_down, None, None, None, None, None)


fused_expert_block.defvjp(_block_fwd, _block_bwd)
