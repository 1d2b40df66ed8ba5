"""Pallas kernels on a mesh: each device runs the kernel on its own rows of the batch.

GSPMD cannot partition a `pallas_call`: under jit with batch-sharded operands it gathers them
and every device runs the whole batch. `batch_local` runs the kernel inside a `shard_map` that
splits the leading (batch) dimension over the mesh axes that split the batch (data, fsdp,
expert), so each device computes its own rows only; the other axes see replicated operands
(tensor shards compute the same rows, which is correct but not yet split by head). Without a
mesh in context, or when no such axis divides the batch, the kernel runs as it is.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ('data', 'fsdp', 'expert')   # sharding.py's mesh axes that the batch rules use


def axis_size(mesh, axis: str) -> int:
  return mesh.shape[axis] if axis in mesh.axis_names else 1


def dividing_axes(mesh, axes, dim: int) -> tuple[str, ...]:
  """The axes (in order, size > 1) whose product still divides dim."""
  out, size = [], 1
  for a in axes:
    n = axis_size(mesh, a)
    if n > 1 and dim % (size * n) == 0:
      out.append(a)
      size *= n
  return tuple(out)


def batch_local(fn, *args, replicated: tuple[int, ...] = ()):
  """fn(*args) with every array argument split along its leading dimension over the batch axes,
  except the positions in `replicated` (weights), and every output split the same way.

  None arguments pass through. fn may be differentiable (a custom_vjp kernel): the replicated
  arguments' gradients are summed over the batch axes by shard_map's transpose.
  """
  mesh = jax.sharding.get_abstract_mesh()
  batched = [a for i, a in enumerate(args) if a is not None and i not in replicated]
  if mesh.empty or not batched:
    return fn(*args)
  axes = dividing_axes(mesh, BATCH_AXES, batched[0].shape[0])
  if not axes:
    return fn(*args)
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*xs):
    full = [None] * len(args)
    for i, x in zip(present, xs):
      full[i] = x
    return fn(*full)
  specs = tuple(P() if i in replicated else P(axes) for i in present)
  # check_vma=False: pallas_call has no replication rule.
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(axes), check_vma=False)(
      *(args[i] for i in present))
