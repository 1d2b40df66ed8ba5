"""Dropless grouped GEMM for the routed experts on the GPU: Pallas kernels (Triton lowering).

They compute on the padded expert-sorted layout of ops/grouped_gemm.py (`make_layout`), which
also holds their plain jnp references:

  gmm(x_md, w_edf, tile_expert_t)        y_mf = x_m @ W_{e(m)}    grid (row tiles, F/bn)
  gmm(..., transpose_rhs=True)           y_md = x_m @ W_{e(m)}^T  (dx; W^T is never written)
  tgmm(x_md, dy_mf, group_tiles_e1)      dW_e = x_e^T @ dy_e      grid (E, D/bd, F/bf)

FP8 (`grouped_matmul_fp8`, model.fp8 = 'rowwise'): gmm also takes e4m3 operands with float32
scales per row of x and per (expert, output column) of W, applied in the epilogue to the float32
accumulator (acc * sx[:, None] * sw[e, None, :]); the output is x's compute dtype, not fp8. The
forward and dgrad run so; the weight gradient tgmm stays in the compute dtype: its contraction
runs over each group's tokens, and per-group column scales would need a segment reduction.

Each program of gmm loads its expert's weight tiles by a dynamic index into the whole [E, D, F]
weight and loops over the contraction in block_k steps with a float32 accumulator; each program
of tgmm loops over its expert's row tiles (a dynamic trip count; zero trips give a zero gradient
for an expert without rows). `grouped_matmul` ties them into a custom VJP, so forward and
backward of a grouped projection are all kernels; `projection` picks them, or within the
planner's shapes-only mode (ops/launch.py) their stand-in.

Only the weights given are assumed local: with expert parallelism a device passes its local
expert slice and a layout built over local expert ids.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT
from deepseek41.ops.fp8_matmul import quantize_rowwise
from deepseek41.ops.launch import pad_axis


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Kernel tiling (static). gmm: [block_m, block_n] output tiles, block_k contraction steps.

  tgmm: [block_d, block_f] weight-gradient tiles, contracting over rows in block_r steps (at
  most block_m: the groups are whole row tiles). Block sizes are powers of two >= 16; a block
  larger than its dimension, or not dividing it, is halved until it divides (dimensions are
  zero-padded to a multiple of 16 first).
  """
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3
  block_d: int = 128
  block_f: int = 128
  block_r: int = 64
  tgmm_warps: int = 8
  tgmm_stages: int = 3
  # The weight gradient's kernel: 'triton' (tgmm below) or 'mosaic' (jax's Hopper Mosaic GPU
  # transposed ragged dot, 1.4-2.2x faster in docs/performance.md 9.7; GPU only, sm_90, D and F
  # multiples of 128), falling back to tgmm where it cannot run.
  wgrad: str = 'triton'
  # The fused gate+up+SwiGLU kernel's output width (ops/gpu/fused_experts.py): two float32
  # accumulators (gate and up) of [block_m, swiglu_block_n] hold the registers of gmm's one
  # [128, 256], hence half of GPU_TILES' block_n. Not yet measured on the GPU.
  swiglu_block_n: int = 128


# H200 (Hopper, bf16), measured alone at configs/ablation_1b.py's and the released expert shapes
# (docs/performance.md section 27): gmm's 128 x 256 output tiles with 64-deep steps hold a
# 128-register-per-thread fp32 accumulator in 8 warps and 3 stages of (128x64 + 64x256) bf16
# in 144 KB of shared memory (of 227 KB); they were 8-13% faster than 128 x 128 at the 1B
# shapes' 1,024-wide outputs (a 384-wide output fits back to 128) and 18-21% at the released
# ones. tgmm's [256, 128] weight-gradient tiles over 32-row steps were 9% faster than
# [128, 128] over 64. block_m = 128 pads each expert by < 128 rows: at 1B (3072 rows per
# expert) about 2%.
GPU_TILES = Tiles(block_n=256, block_d=256, block_r=32, wgrad='mosaic')
# Interpret mode (CPU tests): small tiles so that loops over tiles and contraction steps, and
# groups spanning several tiles, are all exercised at test shapes.
INTERPRET_TILES = Tiles(block_m=32, block_n=16, block_k=16, block_d=16, block_f=32, block_r=16,
                        swiglu_block_n=16)


def default_tiles(wgrad: str | None = None) -> Tiles:
  """The platform's tiles (the interpreter's on the CPU), with the weight-gradient kernel
  `wgrad` if given (model.grouped_wgrad)."""
  tiles = INTERPRET_TILES if launch.interpreted() else GPU_TILES
  return tiles if wgrad is None else dataclasses.replace(tiles, wgrad=wgrad)


# ---- kernels -----------------------------------------------------------------------------------


def fit_block(block: int, dim: int) -> int:
  """The largest power of two <= block that divides dim (dim a multiple of MIN_DOT)."""
  b = max(MIN_DOT, block)
  while dim % b:
    b //= 2
  return b


# Shared memory one Hopper block may use (227 KB of the SM's 228 KB). Triton keeps num_stages
# copies of a contraction step's operand tiles there; a launch asking for more fails at run time
# ("Shared memory size limit exceeded"), which no CPU test sees.
SHARED_MEMORY_BYTES = 227 * 1024


def fit_stages(num_stages: int, stage_bytes: int, budget: int = SHARED_MEMORY_BYTES) -> int:
  """The most pipeline stages, at most num_stages and at least 1, whose operand tiles (stage_bytes
  a step) fit in shared memory."""
  return max(1, min(num_stages, budget // stage_bytes))


def dot_precision(dtype):
  # float32 operands: exact products (IEEE), not Triton's TF32 default; bf16 is exact anyway.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def compiler_params(num_warps, num_stages, interpret):
  if interpret:
    return None
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _gmm_kernel(te_ref, x_ref, w_ref, *refs, bn, bk, k_steps, transpose_rhs, precision,
                scaled):
  # te: [1] this tile's expert; x: [bm, Kdim] the tile's rows; w: the whole [E, ., .] weight;
  # scaled (fp8): sx [bm] the rows' scales, sw the whole [E, N] column scales; o: [bm, bn]
  sx_ref, sw_ref, o_ref = refs if scaled else (None, None, refs[0])
  e = te_ref[0]
  j = pl.program_id(1)

  @pl.when(e >= 0)
  def _():
    def step(s, acc_mn):
      x_mk = x_ref[:, pl.ds(s * bk, bk)]
      if transpose_rhs:  # w is [E, N, K]: contract the last dims, no transposed copy in HBM
        w_nk = w_ref[e, pl.ds(j * bn, bn), pl.ds(s * bk, bk)]
        dims = (((1,), (1,)), ((), ()))
        return acc_mn + jax.lax.dot_general(x_mk, w_nk, dims, precision=precision,
                                            preferred_element_type=jnp.float32)
      w_kn = w_ref[e, pl.ds(s * bk, bk), pl.ds(j * bn, bn)]
      return acc_mn + jnp.dot(x_mk, w_kn, precision=precision,
                              preferred_element_type=jnp.float32)
    acc_mn = jax.lax.fori_loop(0, k_steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    if scaled:
      acc_mn = acc_mn * sx_ref[...][:, None] * sw_ref[e, pl.ds(j * bn, bn)][None, :]
    o_ref[...] = acc_mn.astype(o_ref.dtype)

  @pl.when(e < 0)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=('transpose_rhs', 'tiles', 'interpret', 'out_dtype'))
def gmm(x_md, w_edf, tile_expert_t, scale_x_m=None, scale_w_en=None, *,
        transpose_rhs: bool = False, tiles: Tiles = GPU_TILES, interpret: bool | None = None,
        out_dtype=None):
  """y_m = x_m @ W_{e(m)} ([M, F]), or x_m @ W_{e(m)}^T ([M, D]) with transpose_rhs.

  x_md: [M_pad, Kdim] rows in the padded layout (M_pad a multiple of the row tile, which is
  M_pad / len(tile_expert_t)); rows of tiles marked -1 come out 0. Output in out_dtype (default
  x's dtype). FP8: x and W in e4m3 with float32 scale_x_m [M_pad] and scale_w_en [E, N] (N the
  output columns: F, or D with transpose_rhs), multiplied into the float32 accumulator.
  interpret: the Pallas interpreter or not (None: ops/launch.py's rule).
  """
  interpret = launch.interpreted(interpret)
  m_pad, kdim = x_md.shape
  n_tiles = tile_expert_t.shape[0]
  bm = m_pad // n_tiles
  assert bm * n_tiles == m_pad and bm >= MIN_DOT and bm & (bm - 1) == 0, (m_pad, n_tiles)
  scaled = scale_x_m is not None
  assert scaled == (scale_w_en is not None), 'fp8 gmm takes both scales'
  out_dtype = out_dtype or x_md.dtype
  w_edf = w_edf.astype(x_md.dtype)
  ndim = w_edf.shape[1] if transpose_rhs else w_edf.shape[2]
  assert (w_edf.shape[2] if transpose_rhs else w_edf.shape[1]) == kdim, (x_md.shape, w_edf.shape)
  # Odd widths: zero columns of x and zero rows/columns of W add nothing.
  x_md = pad_axis(x_md, 1, MIN_DOT)
  w_edf = pad_axis(pad_axis(w_edf, 1, MIN_DOT), 2, MIN_DOT)
  kp = x_md.shape[1]
  np_ = w_edf.shape[1] if transpose_rhs else w_edf.shape[2]
  bk, bn = fit_block(tiles.block_k, kp), fit_block(tiles.block_n, np_)
  e, r, c = w_edf.shape
  kernel = functools.partial(_gmm_kernel, bn=bn, bk=bk, k_steps=kp // bk,
                             transpose_rhs=transpose_rhs, precision=dot_precision(x_md.dtype),
                             scaled=scaled)
  in_specs = [pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
              pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
              pl.BlockSpec((e, r, c), lambda i, j: (0, 0, 0))]
  operands = [tile_expert_t.astype(jnp.int32).reshape(n_tiles, 1), x_md, w_edf]
  if scaled:
    scale_w_en = pad_axis(scale_w_en.astype(jnp.float32), 1, MIN_DOT)
    in_specs += [pl.BlockSpec((bm,), lambda i, j: (i,)),
                 pl.BlockSpec((e, np_), lambda i, j: (0, 0))]
    operands += [scale_x_m.astype(jnp.float32), scale_w_en]
  y = launch.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m_pad, np_), out_dtype),
      grid=(n_tiles, np_ // bn),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages, interpret),
      interpret=interpret,
      name=('moe_gmm_t' if transpose_rhs else 'moe_gmm') + ('_fp8' if scaled else ''),
  )(*operands)
  return y[:, :ndim]


def _tgmm_kernel(lo_ref, hi_ref, x_ref, dy_ref, o_ref, *, steps_per_tile, br, precision):
  # lo, hi: [1] the expert's tile range; x: [M_pad, bd]; dy: [M_pad, bf]; o: [bd, bf]
  def step(t, acc_df):
    x_rd = x_ref[pl.ds(t * br, br), :]
    dy_rf = dy_ref[pl.ds(t * br, br), :]
    return acc_df + jax.lax.dot_general(x_rd, dy_rf, (((0,), (0,)), ((), ())),
                                        precision=precision, preferred_element_type=jnp.float32)
  acc_df = jax.lax.fori_loop(lo_ref[0] * steps_per_tile, hi_ref[0] * steps_per_tile, step,
                             jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc_df.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=('block_m', 'out_dtype', 'tiles', 'interpret'))
def tgmm(x_md, dy_mf, group_tiles_e1, *, block_m: int, out_dtype=None, tiles: Tiles = GPU_TILES,
         interpret: bool | None = None):
  """dW_e = x_e^T @ dy_e over each expert's row tiles: [E, D, F] (E = len(group_tiles_e1) - 1).

  Rows outside the groups must be zero in x or dy (the padded layout guarantees it). Experts with
  no tiles get zeros. Output in out_dtype (default x's dtype), accumulated in float32.
  interpret as `gmm`'s.
  """
  interpret = launch.interpreted(interpret)
  m_pad, d = x_md.shape
  f = dy_mf.shape[1]
  n_experts = group_tiles_e1.shape[0] - 1
  dt = x_md.dtype
  x_md = pad_axis(x_md, 1, MIN_DOT)
  dy_mf = pad_axis(dy_mf.astype(dt), 1, MIN_DOT)
  dp, fp = x_md.shape[1], dy_mf.shape[1]
  bd, bf = fit_block(tiles.block_d, dp), fit_block(tiles.block_f, fp)
  g = group_tiles_e1.astype(jnp.int32)
  br = fit_block(min(tiles.block_r, block_m), block_m)
  kernel = functools.partial(_tgmm_kernel, steps_per_tile=block_m // br, br=br,
                             precision=dot_precision(dt))
  dw = launch.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((n_experts, dp, fp), out_dtype or dt),
      grid=(n_experts, dp // bd, fp // bf),
      in_specs=[pl.BlockSpec((None, 1), lambda e, i, j: (e, 0)),
                pl.BlockSpec((None, 1), lambda e, i, j: (e, 0)),
                pl.BlockSpec((m_pad, bd), lambda e, i, j: (0, i)),
                pl.BlockSpec((m_pad, bf), lambda e, i, j: (0, j))],
      out_specs=pl.BlockSpec((None, bd, bf), lambda e, i, j: (e, i, j)),
      compiler_params=compiler_params(tiles.tgmm_warps, tiles.tgmm_stages, interpret),
      interpret=interpret,
      name='moe_tgmm',
  )(g[:-1].reshape(n_experts, 1), g[1:].reshape(n_experts, 1), x_md, dy_mf)
  return dw[:, :d, :f]


# ---- differentiable grouped projection ---------------------------------------------------------


def _differentiable(product, weight_grad, doc: str):
  """A grouped projection (x_md, w_edf, tile_expert_t, group_tiles_e1, tiles, interpret) -> y_mf
  with its backward: product(a_mk, w_edf, tile_expert_t, transpose_rhs, tiles, interpret) gives
  y and dx (in a's dtype), weight_grad(x_md, dy_mf, w_edf, tile_expert_t, group_tiles_e1, tiles,
  interpret) dW."""
  def matmul(x_md, w_edf, tile_expert_t, group_tiles_e1, tiles: Tiles, interpret: bool):
    del group_tiles_e1
    return product(x_md, w_edf, tile_expert_t, False, tiles, interpret)
  matmul.__doc__ = doc
  matmul = jax.custom_vjp(matmul, nondiff_argnums=(4, 5))

  def fwd(x_md, w_edf, tile_expert_t, group_tiles_e1, tiles, interpret):
    y = matmul(x_md, w_edf, tile_expert_t, group_tiles_e1, tiles, interpret)
    return y, (x_md, w_edf, tile_expert_t, group_tiles_e1)

  def bwd(tiles, interpret, res, dy_mf):
    x_md, w_edf, tile_expert_t, group_tiles_e1 = res
    dy_mf = dy_mf.astype(x_md.dtype)
    dx_md = product(dy_mf, w_edf, tile_expert_t, True, tiles, interpret)
    dw_edf = weight_grad(x_md, dy_mf, w_edf, tile_expert_t, group_tiles_e1, tiles, interpret)
    return dx_md, dw_edf, None, None

  matmul.defvjp(fwd, bwd)
  return matmul


def mosaic_wgrad_supported(d: int, f: int, dtype) -> bool:
  """Where jax's Mosaic GPU transposed ragged dot takes the weight gradient: a Hopper GPU,
  16-bit operands, D and F whole 128-blocks."""
  if jax.default_backend() != 'gpu' or jnp.dtype(dtype).itemsize != 2 or d % 128 or f % 128:
    return False
  return getattr(jax.devices()[0], 'compute_capability', '') == '9.0'


_MOSAIC_WGRAD = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def tgmm_mosaic(x_md, dy_mf, group_tiles_e1, *, block_m: int, out_dtype=None):
  """tgmm through jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu: each expert's
  group is its whole row tiles (the zero padding rows add nothing)."""
  rows_e = (group_tiles_e1[1:] - group_tiles_e1[:-1]) * block_m
  dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
      x_md, dy_mf.astype(x_md.dtype), group_sizes=rows_e.astype(jnp.int32), **_MOSAIC_WGRAD)
  return dw.astype(out_dtype or x_md.dtype)


def _weight_grad(x_md, dy_mf, w_edf, tile_expert_t, group_tiles_e1, tiles, interpret):
  bm = x_md.shape[0] // tile_expert_t.shape[0]
  if tiles.wgrad == 'mosaic' and not interpret and mosaic_wgrad_supported(
      x_md.shape[1], dy_mf.shape[1], x_md.dtype):
    return tgmm_mosaic(x_md, dy_mf, group_tiles_e1, block_m=bm, out_dtype=w_edf.dtype)
  return tgmm(x_md, dy_mf, group_tiles_e1, block_m=bm, out_dtype=w_edf.dtype, tiles=tiles,
              interpret=interpret)


def _gmm(a_mk, w_edf, tile_expert_t, transpose_rhs, tiles, interpret):
  return gmm(a_mk, w_edf, tile_expert_t, transpose_rhs=transpose_rhs, tiles=tiles,
             interpret=interpret)


grouped_matmul = _differentiable(_gmm, _weight_grad, """y_m = x_m @ W_{e(m)} in the padded
  layout; forward and backward are Pallas kernels.

  Padding rows of x must be zero (then they are zero in y, and the weight gradient ignores them).
  """)


def _gmm_fp8(a_mk, w_edf, tile_expert_t, transpose_rhs, tiles, interpret, out_dtype=None):
  """gmm of a_mk in e4m3 per row, W quantized along the contraction (d, or f transposed)."""
  aq_mk, sa_m1 = quantize_rowwise(a_mk, axis=1)
  wq_edf, sw_e = quantize_rowwise(w_edf, axis=2 if transpose_rhs else 1)
  sw_en = sw_e[:, :, 0] if transpose_rhs else sw_e[:, 0, :]
  return gmm(aq_mk, wq_edf, tile_expert_t, sa_m1[:, 0], sw_en, transpose_rhs=transpose_rhs,
             tiles=tiles, interpret=interpret, out_dtype=out_dtype or a_mk.dtype)


grouped_matmul_fp8 = _differentiable(_gmm_fp8, _weight_grad, """grouped_matmul with the
  forward and dgrad in e4m3 (row-wise power-of-two scales, float32 accumulation); the weight
  gradient stays in the compute dtype (module docstring).

  x per row over its contraction, W per (expert, output column); padding rows quantize to 0.
  """)


# ---- compile-only stand-in (tools.plan; ops/launch.py) -----------------------------------------


def projection(fp8: str):
  """The differentiable grouped projection (x_md, w_edf, tile_expert_t, group_tiles_e1, tiles,
  interpret) -> y_mf for model.fp8: the kernels, or their stand-in within
  `launch.shapes_only()`."""
  if launch.active():
    return _OPAQUE[fp8 != 'off']
  return grouped_matmul if fp8 == 'off' else grouped_matmul_fp8


def _opaque_gmm(a_mk, w_edf, tile_expert_t, transpose_rhs: bool, fp8: bool):
  """gmm's buffers: its operands (e4m3 copies and scales with fp8) and its result."""
  n = w_edf.shape[1] if transpose_rhs else w_edf.shape[2]
  operands = (a_mk, w_edf)
  if fp8:
    operands = (*quantize_rowwise(a_mk, axis=1),
                *quantize_rowwise(w_edf, axis=2 if transpose_rhs else 1))
  return launch.opaque((a_mk.shape[0], n), a_mk.dtype, tile_expert_t, *operands)


def _opaque_matmul(fp8: bool):
  def product(a_mk, w_edf, tile_expert_t, transpose_rhs, tiles, interpret):
    del tiles, interpret
    return _opaque_gmm(a_mk, w_edf, tile_expert_t, transpose_rhs, fp8)

  def weight_grad(x_md, dy_mf, w_edf, tile_expert_t, group_tiles_e1, tiles, interpret):
    del tile_expert_t, tiles, interpret  # dW in the compute dtype whatever fp8, as tgmm
    return launch.opaque(w_edf.shape, w_edf.dtype, group_tiles_e1, x_md, dy_mf)
  return _differentiable(product, weight_grad, 'The grouped projection\'s buffers only.')


_OPAQUE = {False: _opaque_matmul(False), True: _opaque_matmul(True)}
