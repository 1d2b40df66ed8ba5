"""Parameter creation with logical axis names and parameter groups (docs/design.md "Parameters
and state").

Every parameter is an `nnx.Param` carrying `logical_axes` metadata; `sharding.py` maps those
names to mesh axes through the config's rules table. We use our own metadata key rather than
flax's `out_sharding`, so creating a model never needs an ambient mesh: shardings are applied
once, by `jax.jit(..., out_shardings=...)` at initialisation.

Groups that train differently are variable types, fixed where the parameter is created:
`TokenTable` (a table with a row per token: the embedding, the LM head, DSpark's Markov tables;
the Sinkhorn-balanced update of `train.optimizer=muon_hybrid`), its subclass `EngramTable` (the
Engram memory rows, `train.engram_table_lr_multiplier`) and `VisionParam` (the ViT, aligner and
span delimiters, `train.vision_lr_multiplier`). The optimizer, the step and tools.info select
them with nnx filters (`isinstance`), never from parameter paths. The types do not appear in the
state's paths, so checkpoints keep their layout.

Two metadata entries describe a weight's layout to the matrix optimizers (train/muon.py), set
where it is created: `stack_axes`, the axes that index a stack of independent matrices (a MoE
layer's routed experts, the heads of a Q projection, the groups of the grouped output
projection), each orthogonalised on its own; and a `TokenTable`'s `token_axis`, the axis whose
entries are tokens (0 for the embedding, 1 for the [d_model, vocab] head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
  """MoE correction bias: training state updated by the sign rule, never by the optimizer."""


class TokenTable(nnx.Param):
  """A table with a row per token (or hashed n-gram): only the rows a batch touches get a
  gradient. `token_axis` metadata: which axis the rows are (default 0)."""


class EngramTable(TokenTable):
  """Rows of an Engram memory table: looked up per token, learning at their own rate."""


class VisionParam(nnx.Param):
  """A weight of the vision encoder, aligner or span delimiters: learning at its own rate."""


def dtype_of(name: str):
  return {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}[name]


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
                 std: float, kind: type[nnx.Param] = nnx.Param, *,
                 stack_axes: tuple[int, ...] = (), token_axis: int | None = None) -> nnx.Param:
  """A weight drawn N(0, std^2) in fp32 (`cast_params` sets the stored dtype, once, for all).

  `stack_axes`: the axes indexing independent matrices (experts, heads, groups); `token_axis`:
  a `TokenTable`'s row axis when not 0 (see the module docstring)."""
  assert len(shape) == len(axes), (shape, axes)
  assert not stack_axes or (all(0 <= a < len(shape) for a in stack_axes)
                            and len(stack_axes) <= len(shape) - 2), (shape, stack_axes)
  assert token_axis is None or (issubclass(kind, TokenTable) and 0 <= token_axis < len(shape))
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  layout = {'stack_axes': tuple(stack_axes)} if stack_axes else {}
  if token_axis is not None:
    layout['token_axis'] = token_axis
  return kind(value, logical_axes=tuple(axes), **layout)


def const_param(value: float, shape: tuple[int, ...], axes: tuple[str | None, ...],
                kind: type[nnx.Param] = nnx.Param) -> nnx.Param:
  """A constant-initialised elementwise parameter (scale, bias, sink): `elementwise` marks it
  as no matmul weight for the FLOP count (deepseek41/model/inventory.py)."""
  assert len(shape) == len(axes), (shape, axes)
  return kind(jnp.full(shape, value, jnp.float32), logical_axes=tuple(axes), elementwise=True)


def is_elementwise(var: nnx.Variable) -> bool:
  return bool(var.get_metadata().get('elementwise', False))


def stack_axes_of(var: nnx.Variable) -> tuple[int, ...]:
  """The axes of `var` that index independent matrices (none: one matrix)."""
  return tuple(var.get_metadata().get('stack_axes', ()))


def token_axis_of(var: nnx.Variable) -> int:
  """The axis of a `TokenTable` whose entries are tokens."""
  return int(var.get_metadata().get('token_axis', 0))


def cast_params(module: nnx.Module, dtype) -> nnx.Module:
  """Store every floating `nnx.Param` of `module` in `dtype` (`model.param_dtype`), in place.

  Only `nnx.Param`s: the MoE correction biases (`RouterBias`) stay fp32, because the sign rule
  moves them by `model.router_bias_rate` (1e-3) per step, below bf16's resolution (2^-8
  relative) once a bias exceeds ~0.25, so in bf16 they would stop moving.
  """
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Param) and jnp.issubdtype(var.get_value().dtype, jnp.floating):
      var.set_value(var.get_value().astype(dtype))
  return module
