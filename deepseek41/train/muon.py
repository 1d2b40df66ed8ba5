"""The matrix updates of `train.optimizer=muon_hybrid` (docs/architecture.md section 4.2): Muon's
Newton-Schulz orthogonalisation, and the Sinkhorn-balanced update of the token tables.

Both are stateless optax transforms that follow `optax.trace` (heavy-ball momentum with the
Nesterov look-ahead, the momentum of both updates): each output is independent of its input's
scale, so the momentum's normalisation (a sum, or an EMA's (1 - beta) times it) cannot matter.

What is optax's and what is ours: the momentum, the weight decay, the learning rate and the
split into groups are optax's (`optax.trace`, `add_decayed_weights`, `scale_by_learning_rate`,
`optax.partition`; train/optimizer.py). The orthogonalisation is ours, on optax.contrib.muon's
conventions (Frobenius pre-scaling, the Gram matrix of the shorter side, batch axes vmapped as
in `MuonDimensionNumbers`; tests/unit/test_optimizer.py holds it equal to optax.contrib's in
fp32), because `optax.contrib.scale_by_muon` iterates in its momentum's dtype (we iterate in
bf16 on an fp32 momentum, `train.muon_ns_dtype`) and keeps its coefficients in the optimizer
state (a resumed run would keep the checkpoint's whatever the config says). The Sinkhorn update
is ours: optax has none.

Layouts come from the parameters' metadata, set where each is created (model/params.py): the
`stack_axes` of a stack of matrices (experts, Q heads, output groups) and a token table's
`token_axis`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deepseek41.model.params import stack_axes_of, token_axis_of

# Added to the Frobenius norm before the first iteration: a zero momentum (a weight no loss
# reached) stays zero.
NS_EPS = 1e-7


def ns_coefficients(coeffs: tuple[tuple[float, ...], ...], steps: tuple[int, ...]) -> np.ndarray:
  """[k, 3]: the (a, b, c) of each of the k iterations, phase by phase (`train.muon_ns_coeffs`
  repeated `train.muon_ns_steps` times)."""
  return np.asarray([abc for abc, n in zip(coeffs, steps) for _ in range(n)], np.float32)


def newton_schulz(x_mn: jax.Array, coeffs_k3: np.ndarray, dtype=jnp.float32) -> jax.Array:
  """~U V^T of x = U S V^T (its polar factor), fp32.

  x is scaled to unit Frobenius norm (every singular value in [0, 1]), then each iteration maps
  X -> a X + (b A + c A^2) X with A = X X^T, i.e. every singular value s -> a s + b s^3 + c s^5:
  fast coefficients push small ones up, stable ones (2, -1.5, 0.5) settle them at 1. Iterates in
  `dtype` on the Gram matrix of the shorter side.
  """
  return polar_of_unit(unit_frobenius(x_mn, (), dtype), coeffs_k3).astype(jnp.float32)


def unit_frobenius(u: jax.Array, stack: tuple[int, ...], dtype) -> jax.Array:
  """Each matrix of the stack `u` over its Frobenius norm (+ NS_EPS), computed in fp32, stored
  in `dtype`: the iterations' input."""
  matrix_axes = tuple(a for a in range(u.ndim) if a not in stack)
  x = u.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=matrix_axes, keepdims=True))
  return (x / (norm + NS_EPS)).astype(dtype)


def polar_of_unit(x_unit: jax.Array, coeffs_k3: np.ndarray) -> jax.Array:
  """Newton-Schulz on one unit-norm matrix (its input axes flattened), in its own dtype.

  The iterations are unrolled with their coefficients as constants: a loop would add a
  condition and a coefficient slice to each of them, per weight."""
  shape = x_unit.shape
  x = x_unit.reshape(-1, shape[-1])
  wide = x.shape[0] <= x.shape[1]
  x = x if wide else x.T
  eye = jnp.eye(x.shape[0], dtype=x.dtype)
  for a, b, c in np.asarray(coeffs_k3, np.float64).tolist():
    gram = x @ x.T
    # a X + (b A + c A^2) X as (a I + b A + c A^2) X: a I joins the small [m, m] polynomial,
    # so no elementwise pass over the [m, n] matrix remains (on the H100 that add was a launch
    # per matrix per iteration and a third of the optimizer's elementwise time, section 39).
    x = (a * eye + b * gram + c * (gram @ gram)) @ x
  return (x if wide else x.T).reshape(shape)


def matrix_fans(shape: tuple[int, ...], stack: tuple[int, ...]) -> tuple[int, int]:
  """(fan_in, fan_out) of each matrix of a stack: its last axis is the output side, the other
  axes that are not `stack` the input side (w_o [heads, head_dim, d]: heads x head_dim in)."""
  inputs = [n for a, n in enumerate(shape[:-1]) if a not in stack]
  return math.prod(inputs), shape[-1]


def _over_stack(fn, stack: tuple[int, ...]):
  """fn of one matrix, mapped over the stack axes. They are vmapped, never merged or moved, so a
  sharded one (the experts over `expert`, the heads over `tensor`) stays split: each device
  orthogonalises its own matrices."""
  for axis in sorted(stack):  # the outermost vmap takes the highest axis: the others keep theirs
    fn = jax.vmap(fn, in_axes=axis, out_axes=axis)
  return fn


def orthogonalize_together(us: list[jax.Array], stack: tuple[int, ...], coeffs_k3: np.ndarray,
                           dtype=jnp.float32) -> list[jax.Array]:
  """Each matrix of the stacks `us` (one shape, stack axes `stack`: the layers' copies of a
  weight) replaced by its Newton-Schulz polar factor, in `dtype`, as one batch: their unit
  matrices stacked on a new leading axis, so each iteration is three batched matmuls for all of
  them rather than three per weight (on the 1B model, 181 weights in 14 shapes). Stacking on a
  new axis keeps every other axis's sharding."""
  units = [unit_frobenius(u, stack, dtype) for u in us]
  if len(units) == 1:
    return [_over_stack(lambda m: polar_of_unit(m, coeffs_k3), stack)(units[0])]
  batch = _over_stack(lambda m: polar_of_unit(m, coeffs_k3),
                      (0,) + tuple(a + 1 for a in stack))(jnp.stack(units))
  return [batch[i] for i in range(len(us))]


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _per_variable(updates, fn):
  """`updates` with each variable's value replaced by fn(value, variable): the metadata (layout)
  is the parameter's, since gradients of an nnx.State keep it."""
  _require_variables(jax.tree.leaves(updates, is_leaf=_is_variable))
  return jax.tree.map(lambda v: v.replace(fn(v.get_value(), v)) if _is_variable(v) else v,
                      updates, is_leaf=_is_variable)


def scale_by_orthogonalization(coeffs_k3: np.ndarray, dtype, rms: float,
                               batch_bytes: int = 0) -> optax.GradientTransformation:
  """Muon's direction: each matrix's polar factor, scaled to RMS `rms` (its entries' RMS is
  1 / sqrt(max(fan_in, fan_out)) before: Moonlight's match to AdamW's update RMS, so one learning
  rate serves both groups).

  Weights of one shape, layout and dtype are orthogonalised as one batch of at most
  `batch_bytes` (in `dtype`; 0: each on its own): the batch is a transient copy of them."""
  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates, is_leaf=_is_variable)
    _require_variables(leaves)
    out = list(leaves)
    for batch in _batches(leaves, jnp.dtype(dtype).itemsize, batch_bytes):
      stack = stack_axes_of(leaves[batch[0]])
      us = [leaves[i].get_value() for i in batch]
      scale = rms * math.sqrt(max(matrix_fans(us[0].shape, stack)))
      for i, u, polar in zip(batch, us, orthogonalize_together(us, stack, coeffs_k3, dtype)):
        out[i] = leaves[i].replace((scale * polar.astype(jnp.float32)).astype(u.dtype))
    return jax.tree.unflatten(treedef, out), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _batches(leaves, itemsize: int, batch_bytes: int) -> list[list[int]]:
  """Indices of the variables in `leaves` grouped by what a batch needs equal (shape, dtype,
  stack axes, logical axes: the sharding), in their order, each group cut into runs of at most
  batch_bytes (at least one variable each)."""
  groups: dict[tuple, list[int]] = {}
  for i, var in enumerate(leaves):
    if _is_variable(var):
      value = var.get_value()
      key = (value.shape, str(value.dtype), stack_axes_of(var),
             tuple(var.get_metadata().get('logical_axes', ())))
      groups.setdefault(key, []).append(i)
  batches = []
  for indices in groups.values():
    run, run_bytes = [], 0
    for i in indices:
      size = leaves[i].get_value().size * itemsize
      if run and run_bytes + size > batch_bytes:
        batches.append(run)
        run, run_bytes = [], 0
      run.append(i)
      run_bytes += size
    batches.append(run)
  return batches


def _require_variables(leaves) -> None:
  if leaves and not any(_is_variable(x) for x in leaves):
    raise ValueError('the muon_hybrid updates read each parameter\'s layout from its variable: '
                     'pass the nnx.State of the model\'s parameters, not bare arrays')


def sinkhorn_balance(u_tc: jax.Array, normalizations: int, tau: float, eps: float) -> jax.Array:
  """A [tokens, columns] momentum balanced: rows and columns rescaled to unit L2 norm in turn,
  rows first and last (`normalizations` of them, odd), then times sqrt(columns), so every live row
  has RMS 1. Rows whose norm is at most tau x the mean row norm (tokens the recent batches did
  not contain: their momentum has decayed) are dead: they stay zero rather than being blown up
  to a full row's step.

  Kept as diag(r) x diag(c): each normalisation updates the row scales r or the column scales c
  from one read of x, and x is written once, at the end (`sinkhorn_balance_reference` rewrites
  the table in every normalisation: three passes over it where this takes one)."""
  x = u_tc.astype(jnp.float32)
  row_norm = jnp.linalg.norm(x, axis=1)
  alive = row_norm > tau * jnp.mean(row_norm)
  r = jnp.where(alive, inverse_norm(row_norm, eps), 0.0)  # the first normalisation: rows
  c = jnp.ones((x.shape[1],), jnp.float32)
  for k in range(1, normalizations):
    norms = jnp.linalg.norm(r[:, None] * x * c[None, :], axis=1 if k % 2 == 0 else 0)
    if k % 2 == 0:
      r = r * inverse_norm(norms, eps)
    else:
      c = c * inverse_norm(norms, eps)
  return math.sqrt(u_tc.shape[1]) * (r[:, None] * x * c[None, :])


def sinkhorn_balance_reference(u_tc: jax.Array, normalizations: int, tau: float,
                               eps: float) -> jax.Array:
  """`sinkhorn_balance` as the definition reads: the table itself normalised line by line."""
  x = u_tc.astype(jnp.float32)
  row_norm = jnp.linalg.norm(x, axis=1, keepdims=True)
  x = jnp.where(row_norm > tau * jnp.mean(row_norm), x, 0.0)
  for k in range(normalizations):
    x = unit_lines(x, axis=1 if k % 2 == 0 else 0, eps=eps)
  return math.sqrt(u_tc.shape[1]) * x


def inverse_norm(norm: jax.Array, eps: float) -> jax.Array:
  """1 / (norm + eps) where norm > 0, and 0 where it is zero: at most 1 / eps, so finite for
  every finite input, whatever the device does with tiny squares (the GPU flushes them to zero)
  or with a zero line's 0 / eps."""
  return jnp.where(norm > 0, 1.0 / (norm + eps), 0.0)


def unit_lines(x: jax.Array, axis: int, eps: float) -> jax.Array:
  """x / (|x| + eps) along axis, as x times its `inverse_norm`."""
  return x * inverse_norm(jnp.linalg.norm(x, axis=axis, keepdims=True), eps)


def scale_by_sinkhorn(normalizations: int, tau: float, eps: float, gamma: float
                      ) -> optax.GradientTransformation:
  """The token tables' direction: gamma x the Sinkhorn-balanced momentum of each [rows, columns]
  table (its rows along the table's `token_axis`)."""
  def update_fn(updates, state, params=None):
    del params

    def direction(u, var):
      if u.ndim != 2:
        raise ValueError(f'a TokenTable is a [rows, columns] matrix; got shape {u.shape}')
      rows_first = jnp.moveaxis(u, token_axis_of(var), 0)
      balanced = sinkhorn_balance(rows_first, normalizations, tau, eps)
      return (gamma * jnp.moveaxis(balanced, 0, token_axis_of(var))).astype(u.dtype)
    return _per_variable(updates, direction), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)
