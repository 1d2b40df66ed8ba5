"""Where every Pallas kernel launches: compiled, interpreted, or as its buffers only.

One rule says where a kernel runs (`interpreted`): in the Pallas interpreter on the CPU (the
tests' platform), compiled on the GPU and the TPU. The platform is the mesh in context's (a
deviceless TPU compile's mesh is the TPU's), else the default backend's. A kernel's own
`interpret=` argument (tests, benchmarks) overrides the rule; None defers to it. Every kernel
of ops/gpu/ and ops/tpu/ launches through `pallas_call` here, which applies the rule, and no
other module decides interpretation (tests/kernels/test_kernel_launch.py holds both).

Beside the launch, what jit and remat see of a kernel: `droppable` wraps a forward kernel in a
jit, `name_outputs` names kernel outputs for `train.remat=block_keep_attention`, and `pad_axis`
pads an operand to whole blocks of a kernel's grid.

Shapes only (tools.plan). tools.plan reads a GPU run's memory from the CPU compiler. A Pallas or
cuDNN kernel on the GPU holds nothing in device memory beyond its operands and results; on the
CPU the same program would go through the Pallas interpreter (whose loops copy the operands:
about twice the routed experts' temporaries) or XLA's dense attention (which keeps the [P, P]
probabilities that a flash kernel never writes). Within `shapes_only()` the kernels that support
it trace as `opaque` calls with exactly their operands and results: the Pallas kernels through
`pallas_call` (so every custom VJP around them keeps the GPU's residuals), the grouped GEMMs and
the vision tower's flash attention at their own level. jit caches what it traced, so a program
traced within must not run: the stand-ins raise if it does. (The reverse, a kernel wrapper
traced outside and reused within at the same shapes, would plan the interpreter's buffers; the
tools.plan CLI plans in a fresh process.)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

# The checkpoint name of the CSA2 kernels' outputs (the sparse and window kernels', the indexer's
# selected scores, the merged softmax's): `train.remat=block_keep_attention` saves them, so the
# backward pass does not run the forward kernels again. A custom_vjp's residuals are values of
# their own to a remat policy, so each forward rule names them as well as its caller names the
# outputs.
KERNEL_OUTPUTS = 'csa2_kernel_outputs'

_SHAPES_ONLY = contextvars.ContextVar('kernels_shapes_only', default=False)


# ---- where a kernel runs -------------------------------------------------------------------------


def platform() -> str:
  """The platform the kernels compile for: the mesh in context's, else the default backend's."""
  device = getattr(jax.sharding.get_abstract_mesh(), 'abstract_device', None)
  return getattr(device, 'platform', None) or jax.default_backend()


def interpreted(requested: bool | None = None) -> bool:
  """Whether a kernel runs in the Pallas interpreter: `requested` if given (a test's choice),
  else only where nothing compiles it, the CPU."""
  return platform() == 'cpu' if requested is None else bool(requested)


def pallas_call(kernel, *, out_shape, interpret: bool | None = None, **kwargs):
  """`pl.pallas_call`, interpreted where `interpreted(interpret)` says; or within `shapes_only()` a
  call whose results (`out_shape`) are opaque functions of every operand: the kernel's buffers
  and nothing more, wherever it sits (inside a custom VJP, a shard_map), so a program keeps
  exactly the residuals the GPU's would.

  A launch that equals an earlier one (`_launch_key`) reuses its `pl.pallas_call`, whose jit
  keeps the kernel's trace per operand type: a fresh one would trace the kernel body again at
  every call site (each layer's mHC sites, each layer's attention), half of the 1B step's
  tracing time, which a restart pays before its first step (docs/performance.md section 58).
  """
  if not active():
    interpret = interpreted(interpret)
    try:
      key = _launch_key((kernel, out_shape, interpret, sorted(kwargs.items())))
    except (TypeError, ValueError):  # an operand-like value (or an empty cell): afresh
      return pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, **kwargs)
    if key not in _LAUNCHES:
      if len(_LAUNCHES) >= _MAX_LAUNCHES:
        _LAUNCHES.clear()
      _LAUNCHES[key] = pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, **kwargs)
    return _LAUNCHES[key]

  def call(*operands):
    leaves, treedef = jax.tree.flatten(out_shape)
    return treedef.unflatten([opaque(s.shape, s.dtype, *operands) for s in leaves])
  return call


_LAUNCHES: dict = {}
_MAX_LAUNCHES = 4096


def _launch_key(v, depth: int = 0):
  """A hashable value equal for launches that build the same kernel: functions by their code,
  closure and defaults (the block specs' index maps are new lambdas at every call), wrappers by
  what they wrap, partials, dataclasses (block specs, compiler params) and containers by their
  parts, anything else by its own hash. TypeError for what has none (arrays, tracers) or nests
  too deep (a closure that holds itself): that launch is not shared."""
  if depth > 32:
    raise TypeError('a launch nested too deep to key')
  key = functools.partial(_launch_key, depth=depth + 1)
  if isinstance(v, functools.partial):
    return ('partial', key(v.func), key(v.args),
            key(sorted(v.keywords.items())))
  if isinstance(v, types.FunctionType):
    cells = tuple(c.cell_contents for c in v.__closure__ or ())
    return ('function', v.__code__, id(v.__globals__), key(cells),
            key(v.__defaults__), key(sorted((v.__kwdefaults__ or {}).items())))
  if callable(v) and hasattr(v, '__wrapped__'):  # e.g. Pallas's wrapper of an index map
    return ('wrapped', type(v), key(v.__wrapped__))
  if isinstance(v, (list, tuple)):
    return (type(v).__name__,) + tuple(key(x) for x in v)
  if isinstance(v, dict):
    return ('dict', key(sorted(v.items())))
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    return (type(v),) + tuple(key(getattr(v, f.name)) for f in dataclasses.fields(v))
  hash(v)
  return v


# ---- shapes only (tools.plan) --------------------------------------------------------------------


@contextlib.contextmanager
def shapes_only():
  """Within: the kernels trace as their operands and results only (module docstring)."""
  token = _SHAPES_ONLY.set(True)
  try:
    yield
  finally:
    _SHAPES_ONLY.reset(token)


def active() -> bool:
  """Whether the kernels trace as their buffers only (within `shapes_only()`)."""
  return _SHAPES_ONLY.get()


def _never_run(*_):
  raise RuntimeError('a compile-only stand-in of a kernel ran: a program traced within '
                     'launch.shapes_only() was executed; trace it outside to run it')


def opaque(shape, dtype, *operands):
  """A [shape] dtype result that depends on `operands` and holds no other buffer."""
  return jax.pure_callback(_never_run, jax.ShapeDtypeStruct(shape, dtype), *operands)


# ---- what jit and remat see of a kernel ----------------------------------------------------------


def droppable(kernel):
  """A forward kernel (a pallas_call) wrapped in a jit. JAX's dead-code rule for pallas_call
  keeps every call, so a remat that saved the outputs would still trace the kernel into its
  recomputation; a jit whose outputs nobody uses is dropped whole."""
  return jax.jit(kernel)


def name_outputs(*xs):
  """`checkpoint_name(x, KERNEL_OUTPUTS)` of each x (None passes through)."""
  return tuple(None if x is None else checkpoint_name(x, KERNEL_OUTPUTS) for x in xs)


def pad_axis(x, axis, multiple):
  """x zero-padded along `axis` to a multiple of `multiple`."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)
