"""The routed experts' grouped GEMM on the TPU: jax's Pallas (Mosaic) megablox kernel.

    y_af[a] = x_ad[a] @ w_edf[e(a)]     rows sorted by expert, counts_e rows per expert

the contract of `jax.lax.ragged_dot` (ops/expert_gemm.py's `ragged_dot` backend hands it the
expert-sorted rows), rows past sum(counts_e) 0. megablox computes each [tm, tk] x [tk, tn] tile
of a group on the MXU and skips the experts' empty tiles; its backward is the same kernel on the
transposed weights (dx) and its transposed grouped GEMM (dw, `tgmm`), megablox's own VJP.

Rows are padded to whole row tiles (megablox needs M divisible by tm); tm/tk/tn are capped at
the problem size so small test shapes compile. On the CPU the kernels run in the Pallas
interpreter (ops/launch.py's rule; `interpret` overrides it), as the tests run them; without a
TPU the kernel is still compiled for one, deviceless (tests/kernels/test_tpu_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from deepseek41.ops import launch

DEFAULT_TILING = (512, 512, 512)  # (tm, tk, tn): the MXU-friendly default of MaxText-size GEMMs


def _tile(size: int, tile: int, multiple: int) -> int:
  """The tile for a dimension: `tile`, or the dimension rounded up to `multiple` when smaller."""
  return min(tile, -(-size // multiple) * multiple)


def tiling_for(m: int, k: int, n: int, tiling=DEFAULT_TILING) -> tuple[int, int, int]:
  """(tm, tk, tn) for an [m, k] x [E, k, n] grouped GEMM: rows in sublane multiples of 8, the
  contracted and output widths in lane multiples of 128."""
  tm, tk, tn = tiling
  return _tile(m, tm, 8), _tile(k, tk, 128), _tile(n, tn, 128)


@functools.partial(jax.jit, static_argnames=('tiling', 'interpret'))
def grouped_dot(x_ad, w_edf, counts_e, *, tiling=DEFAULT_TILING, interpret: bool | None = None):
  """[A, F] = each expert's rows of x_ad times its [D, F] weight, in x_ad's dtype (f32
  accumulation); differentiable in x_ad and w_edf."""
  a, d = x_ad.shape
  f = w_edf.shape[-1]
  tm, tk, tn = tiling_for(a, d, f, tiling)
  pad = -a % tm
  counts_e = counts_e.astype(jnp.int32)
  # The kernels do not write rows past the groups (in y, nor in dx in the backward): `where`
  # selects 0 there in both directions, as ragged_dot gives.
  live_a1 = (jnp.arange(a) < jnp.sum(counts_e))[:, None]
  x_ad = jnp.where(live_a1, x_ad, 0)
  x_pd = jnp.pad(x_ad, ((0, pad), (0, 0))) if pad else x_ad
  y_pf = megablox.gmm(x_pd, w_edf.astype(x_ad.dtype), counts_e, x_ad.dtype, (tm, tk, tn),
                      None, None, False, launch.interpreted(interpret))
  return jnp.where(live_a1, y_pf[:a], 0).astype(x_ad.dtype)
