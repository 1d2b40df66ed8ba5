"""One Triton lowering per distinct kernel in a program, not one per call.

A program calls the same kernel with the same shapes once per layer: the 1B training step at
8 x 4,096 makes 144 Pallas calls of 42 distinct kernels. Pallas lowers each call's kernel jaxpr
to a Triton module afresh, in Python, and that was 7.8 of the 12.1 s that lowering the step
took on the 2-core CPU (docs/performance.md section 37); a restart pays it again before the
persistent compilation cache can even be asked. The Triton module is a function of the kernel's
jaxpr, its grid mapping and the target alone, so equal ones are lowered once per process and
the module reused (its serialisation is what the program embeds).

The key is the printed jaxpr and grid mapping (every primitive, parameter, literal, shape and
index map) with the kernel's name, the platform and the compute capability. Only the source
locations inside a reused module are those of its first call (they reach nothing but debug info).
This patches Pallas's private lowering function: where it is not the one this was written
against, nothing is patched and every call lowers as before.
"""

from __future__ import annotations

import collections
import hashlib
import inspect

try:  # private to jax, so guarded
  from jax._src.pallas.triton import lowering as _triton_lowering
except ImportError:
  _triton_lowering = None

# Distinct kernels kept per process (each a Triton module of tens of KB); the oldest go first.
MAX_KERNELS = 512
_EXPECTED_PARAMS = ['jaxpr', 'grid_mapping', 'platform', 'compute_capability', 'mlir_ctx']


def kernel_key(jaxpr, grid_mapping, platform: str, compute_capability) -> str:
  """What determines a kernel's Triton module, as a digest."""
  text = '\n'.join((jaxpr.debug_info.func_name, str(jaxpr), repr(grid_mapping), str(platform),
                    str(compute_capability)))
  return hashlib.sha256(text.encode()).hexdigest()


class _Memo:
  def __init__(self, lower):
    self.lower = lower
    self.modules: collections.OrderedDict[str, object] = collections.OrderedDict()
    self.hits = self.misses = 0

  def __call__(self, jaxpr, grid_mapping, platform, compute_capability, mlir_ctx):
    key = kernel_key(jaxpr, grid_mapping, platform, compute_capability)
    if key in self.modules:
      self.hits += 1
      self.modules.move_to_end(key)
      return self.modules[key]
    self.misses += 1
    result = self.lower(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx=mlir_ctx)
    self.modules[key] = result
    if len(self.modules) > MAX_KERNELS:
      self.modules.popitem(last=False)
    return result


def install() -> _Memo | None:
  """Memoize Pallas's Triton lowering (once per process); the memo, or None where unpatched."""
  if _triton_lowering is None:
    return None
  current = _triton_lowering.lower_jaxpr_to_triton_module
  if isinstance(current, _Memo):
    return current
  try:
    params = list(inspect.signature(current).parameters)
  except (TypeError, ValueError):
    return None
  if params != _EXPECTED_PARAMS:  # another jax: lower every call, as Pallas does
    return None
  memo = _Memo(current)
  _triton_lowering.lower_jaxpr_to_triton_module = memo
  return memo
