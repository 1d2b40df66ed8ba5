"""The optimizer: `train.optimizer` = `adamw` (every parameter) or `muon_hybrid`
(docs/architecture.md section 4.2), with warm-up then cosine / WSD / constant,
global-norm clipping, selective weight decay and per-group learning-rate multiples.

muon_hybrid trains each parameter by its group, read from its variable type and metadata where it
was created (model/params.py), never from its path (`hybrid_group`):

    TokenTable (embedding, LM head, Engram and Markov tables)  Sinkhorn-balanced Nesterov update
    elementwise or 1-D (norms, biases, sinks, scales, mHC's
      static base and scale)                                    AdamW, no weight decay
    every other weight (a matrix, or a stack of matrices)       Muon

The router's correction biases are not parameters: the sign rule moves them (train/step.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deepseek41.config import TrainConfig
from deepseek41.model.params import EngramTable, TokenTable, VisionParam, dtype_of, is_elementwise
from deepseek41.train.muon import ns_coefficients, scale_by_orthogonalization, scale_by_sinkhorn

MUON, SINKHORN, ADAMW = 'muon', 'sinkhorn', 'adamw'


# The train keys the schedule's numbers come from. They reach the update step as an argument
# (`schedule_values`), not as constants in its program: runs that differ only in these (a
# learning-rate sweep, a run extended to more steps) share one compiled step, and a restart that
# changes them loads the one it compiled (the executable store's key leaves them out).
SCHEDULE_KEYS = ('lr', 'steps', 'warmup_steps', 'min_lr_ratio', 'wsd_decay_fraction')


def schedule_values(t: TrainConfig) -> dict[str, np.ndarray]:
  """The schedule's numbers as f32 scalars (`learning_rate_schedule`). Every difference of two
  config values is taken here, in double precision, as the schedule always computed them."""
  warmup = max(t.warmup_steps, 0)
  total = max(t.steps, 1)
  final = t.lr * t.min_lr_ratio
  rest = max(total - warmup, 1)
  decay = max(rest * t.wsd_decay_fraction, 1.0)
  values = {'lr': t.lr, 'final': final, 'lr_minus_final': t.lr - final, 'warmup': warmup,
            'warmup_or_1': max(warmup, 1), 'rest': rest, 'decay': decay,
            'decay_start': total - decay}
  return {k: np.float32(v) for k, v in values.items()}


def learning_rate_schedule(t: TrainConfig, values=None) -> optax.Schedule:
  """lr of the update with optimizer count c (0-based): warm-up reaches t.lr at update `warmup_steps`.

  Warm-up is linear from lr/warmup (the first update already moves), then `cosine` decays to
  lr * min_lr_ratio at the last step, `wsd` holds lr and decays linearly over the last
  `wsd_decay_fraction` of the post-warm-up steps, `constant` holds lr. `values`: the numbers of
  `schedule_values(t)`, traced where the step takes them as an argument; by default, constants.
  """
  v = schedule_values(t) if values is None else values

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    warm = v['lr'] * jnp.minimum(step / v['warmup_or_1'], 1.0)
    progress = jnp.clip((step - v['warmup']) / v['rest'], 0.0, 1.0)
    if t.schedule == 'cosine':
      main = v['final'] + v['lr_minus_final'] * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    elif t.schedule == 'wsd':
      frac = jnp.clip((step - v['decay_start']) / v['decay'], 0.0, 1.0)
      main = v['lr'] - v['lr_minus_final'] * frac
    else:
      main = jnp.full_like(step, v['lr'])
    return jnp.where(step <= v['warmup'], warm, main)  # step >= 1: no warm-up when it is 0

  return schedule


def step_optimizer(t: TrainConfig, tx: optax.GradientTransformation, values=None):
  """The optimizer an update step applies: `tx`, its schedule compiled in, or with the step's
  schedule argument (`schedule_values`) the same optimizer reading it. Their states are alike."""
  return tx if values is None else make_optimizer(t, values)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _mask(params, keep):
  """tree of bools shaped like params: keep(v) for each variable (or bare array) v."""
  return jax.tree.map(lambda v: jax.tree.map(lambda _: keep(v), v), params, is_leaf=_is_variable)


def decay_mask(params):
  """Weight decay only on matrices: norms, biases, sinks and scales (`const_param`s, marked
  elementwise; most are 1-D, the Engram per-stream norm weights are [n, D]) are left alone."""
  def decays(v):
    if _is_variable(v):
      return v.get_value().ndim >= 2 and not is_elementwise(v)
    return v.ndim >= 2
  return _mask(params, decays)


def _require_variables(params) -> None:
  if not any(_is_variable(x) for x in jax.tree.leaves(params, is_leaf=_is_variable)):
    raise ValueError('parameter groups are variable types: pass the nnx.State of the model\'s '
                     'parameters, not bare arrays')


def group_mask(params, kind: type[nnx.Variable]):
  """tree of bools shaped like params: True on the variables of type `kind` (an nnx filter)."""
  _require_variables(params)
  return _mask(params, lambda v: isinstance(v, kind))


def engram_table_mask(params):
  """True on the Engram tables (`EngramTable`), which take `engram_table_lr_multiplier`."""
  return group_mask(params, EngramTable)


def vision_mask(params):
  """True on the vision encoder, aligner and delimiters (`VisionParam`), which take
  `vision_lr_multiplier`."""
  return group_mask(params, VisionParam)


def hybrid_group(var: nnx.Variable) -> str:
  """The muon_hybrid update that trains `var` (the module docstring's table)."""
  if isinstance(var, TokenTable):
    return SINKHORN
  if is_elementwise(var) or var.get_value().ndim < 2:
    return ADAMW
  return MUON


def hybrid_labels(params):
  """The group of each variable (`hybrid_group`): a prefix of the params tree, so the groups'
  optimizer states hold whole variables (with their sharding metadata) or nothing."""
  _require_variables(params)
  return jax.tree.map(hybrid_group, params, is_leaf=_is_variable)


def _scaled(schedule: optax.Schedule, multiplier: float) -> optax.Schedule:
  return schedule if multiplier == 1.0 else (lambda count: multiplier * schedule(count))


def named(name: str, tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` with its update under the profile scope `name` (the `optimizer` scope's table names
  the groups: benchmarks/trace_summary.py)."""
  def update_fn(updates, state, params=None):
    with jax.named_scope(name):
      return tx.update(updates, state, params)
  return optax.GradientTransformation(tx.init, update_fn)


def muon_hybrid(t: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """Muon for matrices, the Sinkhorn-balanced update for token tables, AdamW for the rest; one
  schedule (train.lr) for all, the matrix groups' updates scaled to AdamW's RMS (train/muon.py)."""

  def momentum_group(momentum, direction, weight_decay, multiplier):
    parts = [named('momentum', optax.trace(decay=momentum, nesterov=True)), direction]
    if weight_decay > 0:
      parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(_scaled(schedule, multiplier)))
    return optax.chain(*parts)

  coeffs = ns_coefficients(t.muon_ns_coeffs, t.muon_ns_steps)
  return optax.partition({
      MUON: named('muon', momentum_group(
          t.muon_momentum,
          named('newton_schulz', scale_by_orthogonalization(
              coeffs, dtype_of(t.muon_ns_dtype), t.muon_rms_match, t.muon_batch_mib << 20)),
          t.weight_decay, t.muon_lr_multiplier)),
      SINKHORN: named('sinkhorn', momentum_group(
          t.sinkhorn_momentum,
          named('balance', scale_by_sinkhorn(t.sinkhorn_normalizations, t.sinkhorn_tau,
                                             t.sinkhorn_eps, t.sinkhorn_gamma)),
          t.sinkhorn_weight_decay, t.sinkhorn_lr_multiplier)),
      ADAMW: named('adamw', optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps,
                                        weight_decay=t.weight_decay, mask=decay_mask)),
  }, hybrid_labels)


def make_optimizer(t: TrainConfig, schedule_values=None) -> optax.GradientTransformation:
  """`schedule_values`: `learning_rate_schedule`'s (a step's argument); by default constants."""
  schedule = learning_rate_schedule(t, schedule_values)
  parts = []
  if t.grad_clip_norm > 0:
    parts.append(named('clip', optax.clip_by_global_norm(t.grad_clip_norm)))
  if t.optimizer == 'muon_hybrid':
    parts.append(muon_hybrid(t, schedule))
  else:
    parts.append(optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=decay_mask))
  if t.engram_table_lr_multiplier != 1.0:
    parts.append(optax.masked(optax.scale(t.engram_table_lr_multiplier), engram_table_mask))
  if t.vision_lr_multiplier != 1.0:
    parts.append(optax.masked(optax.scale(t.vision_lr_multiplier), vision_mask))
  return optax.chain(*parts)
