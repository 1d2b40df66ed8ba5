"""AdamW with warm-up then cosine / WSD / constant, global-norm clipping, selective weight decay."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deepseek41.config import TrainConfig
from deepseek41.model.params import EngramTable, VisionParam, is_elementwise
from deepseek41.ops.adamw_kernel import (Hyper, adamw_leaf, adamw_leaf_reference, block_size,
                                         step_scalars)


def learning_rate_schedule(t: TrainConfig) -> optax.Schedule:
  """lr of the update with optimizer count c (0-based): warm-up reaches t.lr at update `warmup_steps`.

  Warm-up is linear from lr/warmup (the first update already moves), then `cosine` decays to
  lr * min_lr_ratio at the last step, `wsd` holds lr and decays linearly over the last
  `wsd_decay_fraction` of the post-warm-up steps, `constant` holds lr.
  """
  warmup = max(t.warmup_steps, 0)
  total = max(t.steps, 1)
  final = t.lr * t.min_lr_ratio

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    warm = t.lr * jnp.minimum(step / max(warmup, 1), 1.0)
    rest = max(total - warmup, 1)
    progress = jnp.clip((step - warmup) / rest, 0.0, 1.0)
    if t.schedule == 'cosine':
      main = final + (t.lr - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    elif t.schedule == 'wsd':
      decay = max(rest * t.wsd_decay_fraction, 1.0)
      frac = jnp.clip((step - (total - decay)) / decay, 0.0, 1.0)
      main = t.lr + (final - t.lr) * frac
    else:
      main = jnp.full_like(step, t.lr)
    return jnp.where(step <= warmup, warm, main) if warmup else main

  return schedule


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


def group_mask(params, kind: type[nnx.Variable]):
  """tree of bools shaped like params: True on the variables of type `kind` (an nnx filter)."""
  if not any(_is_variable(x) for x in jax.tree.leaves(params, is_leaf=_is_variable)):
    raise ValueError('parameter groups are variable types: pass the nnx.State of the model\'s '
                     'parameters, not bare arrays')
  return _mask(params, lambda v: isinstance(v, kind))


def engram_table_mask(params):
  """True on the Engram tables (`EngramTable`), which take `engram_table_lr_multiplier`."""
  return group_mask(params, EngramTable)


def vision_mask(params):
  """True on the vision encoder, aligner and delimiters (`VisionParam`), which take
  `vision_lr_multiplier`."""
  return group_mask(params, VisionParam)


def _optax_parts(t: TrainConfig) -> list[tuple[str, optax.GradientTransformation]]:
  parts = []
  if t.grad_clip_norm > 0:
    parts.append(('clip', optax.clip_by_global_norm(t.grad_clip_norm)))
  parts.append(('adamw', optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                                     weight_decay=t.weight_decay, mask=decay_mask)))
  if t.engram_table_lr_multiplier != 1.0:
    parts.append(('engram', optax.masked(optax.scale(t.engram_table_lr_multiplier),
                                         engram_table_mask)))
  if t.vision_lr_multiplier != 1.0:
    parts.append(('vision', optax.masked(optax.scale(t.vision_lr_multiplier), vision_mask)))
  return parts


def reference_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  """The optimizer as a chain of optax transforms: the definition `fused_optimizer` must equal."""
  return optax.chain(*(tx for _, tx in _optax_parts(t)))


class FusedAdamW(NamedTuple):
  """`reference_optimizer` with `apply`: the update and its application in one pass per leaf.

  `init` and `update` are the chain's own (so the state, and checkpoints, are the same);
  `apply(grads, state, params) -> (params', state')` equals `update` followed by
  `optax.apply_updates`, but runs each large leaf through `ops/adamw_kernel.py` on the GPU
  (XLA makes several passes of the chain: docs/performance.md section 23) and the rest through
  the kernel's jnp reference. tests/test_optimizer.py holds it equal to the chain.
  """
  init: Any
  update: Any
  apply: Any


def fused_optimizer(t: TrainConfig, use_kernel: bool = True) -> FusedAdamW:
  parts = _optax_parts(t)
  names = [name for name, _ in parts]
  reference = optax.chain(*(tx for _, tx in parts))
  schedule = learning_rate_schedule(t)
  groups = [(engram_table_mask, t.engram_table_lr_multiplier) if n == 'engram' else
            (vision_mask, t.vision_lr_multiplier) for n in names if n in ('engram', 'vision')]
  interpret = jax.default_backend() != 'gpu'

  def apply(grads, state, params):
    adam, decay_state, sched = state[names.index('adamw')]
    if not (isinstance(adam, optax.ScaleByAdamState)
            and isinstance(sched, optax.ScaleByScheduleState)):
      raise TypeError(f'unexpected AdamW state layout: {type(adam)}, {type(sched)}')
    g_leaves, treedef = jax.tree.flatten(grads)
    p_leaves = treedef.flatten_up_to(params)
    mu_leaves = treedef.flatten_up_to(adam.mu)
    nu_leaves = treedef.flatten_up_to(adam.nu)
    decays = treedef.flatten_up_to(decay_mask(params))
    in_group = [treedef.flatten_up_to(mask(params)) for mask, _ in groups]

    count_inc = optax.safe_increment(adam.count)
    scalars_8 = step_scalars(optax.tree.norm(grads) if t.grad_clip_norm > 0 else None,
                             1 - t.b1 ** count_inc, 1 - t.b2 ** count_inc, -schedule(sched.count))
    out = []
    for i, (g, p, mu, nu) in enumerate(zip(g_leaves, p_leaves, mu_leaves, nu_leaves)):
      multiplier = 1.0
      for (_, m), members in zip(groups, in_group):
        multiplier = multiplier * m if members[i] else multiplier
      h = Hyper(t.b1, t.b2, t.eps, t.grad_clip_norm, t.weight_decay if decays[i] else 0.0,
                multiplier)
      if use_kernel and block_size(p.size):
        out.append(adamw_leaf(g, p, mu, nu, scalars_8, h, interpret=interpret))
      else:
        out.append(adamw_leaf_reference(g, p, mu, nu, scalars_8, h))
    new_adam = optax.ScaleByAdamState(count=count_inc,
                                      mu=treedef.unflatten([m for _, m, _ in out]),
                                      nu=treedef.unflatten([v for _, _, v in out]))
    new_state = list(state)
    new_state[names.index('adamw')] = (
        new_adam, decay_state, optax.ScaleByScheduleState(count=optax.safe_increment(sched.count)))
    return treedef.unflatten([p for p, _, _ in out]), tuple(new_state)

  return FusedAdamW(reference.init, reference.update, apply)


def apply_gradients(tx, grads, state, params):
  """(params', state'): one optimizer step, in one pass per leaf where `tx` can."""
  if isinstance(tx, FusedAdamW):
    return tx.apply(grads, state, params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def make_optimizer(t: TrainConfig):
  if t.optimizer_impl == 'optax':
    return reference_optimizer(t)
  return fused_optimizer(t)
