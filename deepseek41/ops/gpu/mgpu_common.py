"""What the Mosaic GPU attention kernels share (window_mgpu.py, sparse_mgpu.py): where they run
(ops/launch.py's rule), the wgmma tile of query rows, the online softmax's starting state in the
WGMMA layout, the P·V product, which jax 0.11.2's Mosaic GPU interpreter cannot run as compiled
(the kernels' docstrings), and the write-back of o and lse."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deepseek41.ops import launch

ROWS = 64  # query rows per CTA: one wgmma M tile
LOG2E = math.log2(math.e)  # scores kept in log2 units: exp2 is the fast path


def interpret_params(requested=None):
  """The `interpret=` of a Mosaic GPU kernel (`plgpu.kernel`): the given interpreter parameters
  (a test's, e.g. `detect_races=True`), else the interpreter's defaults where
  `launch.interpreted(requested)` says, else False (compiled)."""
  if isinstance(requested, plgpu.InterpretGPUParams):
    return requested
  return plgpu.InterpretGPUParams() if launch.interpreted(requested) else False


def launch_kernel(body, *, out_type, interpret, **kwargs):
  """`plgpu.kernel(body, ...)` with `interpret` (already `interpret_params`'s); within
  `launch.shapes_only()` a call whose results are opaque functions of its operands (tools.plan:
  the kernel's buffers and nothing more, as `launch.pallas_call` does for Pallas kernels)."""
  if launch.active():
    return lambda *operands: [launch.opaque(s.shape, s.dtype, *operands) for s in out_type]
  return plgpu.kernel(body, out_type=out_type, interpret=interpret, **kwargs)


def softmax_start(d_half: int):
  """(running max -inf, running sum 0, fp32 [ROWS, d_half] accumulator 0) in the WGMMA layout."""
  rows = plgpu.Layout.WGMMA.reduce(1)
  return (plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), rows),
          plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows),
          plgpu.layout_cast(jnp.zeros((ROWS, d_half), jnp.float32), plgpu.Layout.WGMMA))


def accumulate(acc, a, b_smem, interpret: bool, a_in_smem: bool = False):
  """acc + a @ b_smem, in place in the accumulator's registers (a in registers, or in shared
  memory with `a_in_smem`).

  The interpreter runs neither `run_state` over a wgmma accumulator nor a wgmma whose A operand
  is in registers: there the product is a plain dot of the loaded tiles."""
  if interpret:
    return acc + jnp.dot(a[...] if a_in_smem else a, b_smem[...],
                         preferred_element_type=jnp.float32)

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b_smem)
  return pl.run_state(body)(plgpu.ACC.init(acc))


def store_o_and_lse(w, o_smem, o_gmem, lse_r, lse_smem, lse_gmem, *, lse_as_int32: bool = False):
  """Warpgroup w's d half of o (already in `o_smem`) to `o_gmem`, and, from warpgroup 0 (both hold
  the same statistics), the rows' lse through `lse_smem` (as int32 bits where it shares an
  int32 buffer) to `lse_gmem`."""
  @pl.when(w == 0)
  def _():
    lse_smem[...] = jax.lax.bitcast_convert_type(lse_r, jnp.int32) if lse_as_int32 else lse_r
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem)

  @pl.when(w == 0)
  def _():
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
  plgpu.wait_smem_to_gmem(0)
