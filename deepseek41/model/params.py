"""Parameter creation with logical axis names (DESIGN.md "Parameters and state").

Every parameter is an `nnx.Param` carrying `logical_axes` metadata; `sharding.py` maps those
names to mesh axes through the config's rules table. We use our own metadata key rather than
flax's `out_sharding`, so creating a model never needs an ambient mesh: shardings are applied
once, by `jax.jit(..., out_shardings=...)` at initialisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
  """MoE correction bias: training state updated by the sign rule, never by the optimizer."""


def dtype_of(name: str):
  return {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}[name]


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
                 std: float, dtype=jnp.float32) -> nnx.Param:
  assert len(shape) == len(axes), (shape, axes)
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


def const_param(value: float, shape: tuple[int, ...], axes: tuple[str | None, ...],
                dtype=jnp.float32) -> nnx.Param:
  assert len(shape) == len(axes), (shape, axes)
  return nnx.Param(jnp.full(shape, value, dtype), logical_axes=tuple(axes))
