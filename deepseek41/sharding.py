"""Mesh construction and the logical-axis -> mesh-axis rules (docs/design.md "Parameters and
state").

One device is the degenerate mesh (every axis of size 1): there is no separate single-device path.
Meshes use `AxisType.Auto` (GSPMD propagation): docs/design.md "Sharding on the JAX stack" lists
the ops that fail in the Explicit mode `jax.make_mesh` picks by default.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from deepseek41.config import MeshConfig

Rules = tuple[tuple[str, tuple[str, ...]], ...]


def make_mesh(mc: MeshConfig, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  shape = mc.shape
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f'mesh {dict(zip(mc.AXES, shape))} needs {int(np.prod(shape))} devices, '
                     f'{len(devices)} present')
  axis_types = (AxisType.Auto,) * len(shape)
  try:
    return jax.make_mesh(shape, mc.AXES, axis_types=axis_types, devices=devices)
  except (ValueError, NotImplementedError):
    # jax.make_mesh gives each mesh axis whole physical axes of a TPU torus; a mesh with more
    # axes than the torus (or sizes that cut one) needs physical axes split.
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, mc.AXES, axis_types=axis_types)


def logical_to_spec(axes: tuple[str | None, ...], rules: Rules, mesh: Mesh | None = None) -> P:
  """Map logical names to a PartitionSpec; a mesh axis is used at most once per tensor.

  Axes of size 1 are dropped so the spec stays readable; a mesh axis already used by an earlier
  dimension of the same tensor is skipped (e.g. `experts` and `expert_mlp` both asking for it).
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in axes:
    mesh_axes = []
    for a in table.get(name, ()) if name is not None else ():
      if a in used or (mesh is not None and mesh.shape[a] == 1):
        continue
      mesh_axes.append(a)
      used.add(a)
    out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes))
  return P(*out)


def _fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """Drop mesh axes that do not divide a dimension (tiny test models on many devices)."""
  fitted = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if entry is None:
      fitted.append(None)
      continue
    names = entry if isinstance(entry, tuple) else (entry,)
    keep, size = [], 1
    for n in names:
      if dim % (size * mesh.shape[n]) == 0:
        keep.append(n)
        size *= mesh.shape[n]
    fitted.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  return P(*fitted)


def fitted_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], rules: Rules, mesh) -> P:
  """The spec a tensor of this shape gets: its rules, less the mesh axes that do not divide it."""
  return _fit_spec(logical_to_spec(axes, rules, mesh), shape, mesh)


def variable_sharding(var: nnx.Variable, rules: Rules, mesh: Mesh) -> NamedSharding:
  axes = var.get_metadata().get('logical_axes')
  value = var.get_value()
  if axes is None:
    return NamedSharding(mesh, P())
  return NamedSharding(mesh, fitted_spec(axes, value.shape, rules, mesh))


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(('batch',) + (None,) * (ndim - 1), rules, mesh))
