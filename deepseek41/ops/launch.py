"""Compile-only stand-ins of the GPU's kernels, for programs that are compiled and never run.

tools.plan reads a GPU run's memory from the CPU compiler. A Pallas or cuDNN kernel on the GPU
holds nothing in device memory beyond its operands and results; on the CPU the same program
would go through the Pallas interpreter (whose loops copy the operands: about twice the routed
experts' temporaries) or XLA's dense attention (which keeps the [P, P] probabilities that a
flash kernel never writes). Within `shapes_only()` the kernels that support it trace as
`opaque` calls with exactly their operands and results: the Pallas kernels through
`pallas_call` (so every custom VJP around them keeps the GPU's residuals), the grouped GEMMs and
the vision tower's flash attention at their own level. jit caches what it traced, so a program
traced within must not run: the stand-ins raise if it does. (The reverse, a kernel wrapper
traced outside and reused within at the same shapes, would plan the interpreter's buffers; the
tools.plan CLI plans in a fresh process.)
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.experimental import pallas as pl

_SHAPES_ONLY = contextvars.ContextVar('kernels_shapes_only', default=False)


@contextlib.contextmanager
def shapes_only():
  """Within: the kernels trace as their operands and results only (module docstring)."""
  token = _SHAPES_ONLY.set(True)
  try:
    yield
  finally:
    _SHAPES_ONLY.reset(token)


def active() -> bool:
  return _SHAPES_ONLY.get()


def _never_run(*_):
  raise RuntimeError('a compile-only stand-in of a kernel ran: a program traced within '
                     'launch.shapes_only() was executed; trace it outside to run it')


def opaque(shape, dtype, *operands):
  """A [shape] dtype result that depends on `operands` and holds no other buffer."""
  return jax.pure_callback(_never_run, jax.ShapeDtypeStruct(shape, dtype), *operands)


def pallas_call(kernel, *, out_shape, **kwargs):
  """`pl.pallas_call`, or within `shapes_only()` a call whose results (`out_shape`) are opaque
  functions of every operand: the kernel's buffers and nothing more, wherever it sits (inside a
  custom VJP, a shard_map), so a program keeps exactly the residuals the GPU's would."""
  if not active():
    return pl.pallas_call(kernel, out_shape=out_shape, **kwargs)

  def call(*operands):
    leaves, treedef = jax.tree.flatten(out_shape)
    return treedef.unflatten([opaque(s.shape, s.dtype, *operands) for s in leaves])
  return call
