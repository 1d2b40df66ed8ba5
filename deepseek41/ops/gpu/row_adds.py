"""Adding gradient tiles into rows with Pallas-on-Triton atomics, shared by the kernels that
scatter a gradient (the sparse key/value gradients, the indexer's key gradient, the experts'
combine), and the Triton launch parameters they share."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from deepseek41.ops.contracts import MIN_DOT

try:  # private to jax, so guarded: another jax keeps its own atomics (below)
  from jax._src.pallas.triton import lowering as _triton_lowering
except ImportError:
  _triton_lowering = None


def _relax_pallas_triton_atomics():
  """Make Pallas-on-Triton atomics relaxed instead of acquire-release.

  Triton's own `tl.atomic_add` takes `sem=`, but Pallas passes no choice and defaults to
  acquire-release, which orders every one of the backward's key/value-gradient adds (nothing
  here synchronises through them). Relaxed adds made the backward at configs/ablation_1b.py's
  shapes 2.6x faster (docs/performance.md section 9.2). This sets the default of the lowering's
  helper, so it holds for every Pallas Triton atomic in the process: the project's are all
  gradient adds through `add_rows`, which nothing reads back before the kernel ends.
  Left alone if the helper's signature is not the one this was written against.
  """
  if _triton_lowering is None:
    return
  try:
    tt = _triton_lowering.tt_dialect
    defaults = _triton_lowering._atomic_rmw.__defaults__
    if defaults == (None, tt.MemSemantic.ACQUIRE_RELEASE, tt.MemSyncScope.GPU):
      _triton_lowering._atomic_rmw.__defaults__ = (None, tt.MemSemantic.RELAXED,
                                                   tt.MemSyncScope.GPU)
  except AttributeError:  # another jax: keep its (correct, slower) default
    pass


_relax_pallas_triton_atomics()


def add_rows(ref, rows_k, col0, vals_kc, *, n, interpret):
  """ref[rows_k, col0:col0 + c] += vals_kc with (relaxed) atomics. Invalid slots all point at the
  dummy row n: on the GPU they are masked out of the atomics, so they do not serialise on one
  row; the interpreter takes no mask, and callers cut row n off."""
  bk, c = vals_kc.shape
  cols_c = col0 + jnp.arange(c, dtype=jnp.int32)
  mask = None if interpret else jnp.broadcast_to((rows_k < n)[:, None], (bk, c))
  plt.atomic_add(ref, (jnp.broadcast_to(rows_k[:, None], (bk, c)),
                       jnp.broadcast_to(cols_c[None, :], (bk, c))), vals_kc, mask=mask)


def padded_rows(n):
  """Rows of kv with the zero dummy row n that invalid slots point at, rounded for Triton."""
  return -(-(n + 1) // MIN_DOT) * MIN_DOT


def compiler_params(num_warps, num_stages):
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
