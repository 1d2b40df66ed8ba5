"""AdamW with warm-up then cosine / WSD / constant, global-norm clipping, selective weight decay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deepseek41.config import TrainConfig
from deepseek41.model.params import EngramTable, VisionParam, is_elementwise


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


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  parts = []
  if t.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(t.grad_clip_norm))
  parts.append(optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                           weight_decay=t.weight_decay, mask=decay_mask))
  if t.engram_table_lr_multiplier != 1.0:
    parts.append(optax.masked(optax.scale(t.engram_table_lr_multiplier), engram_table_mask))
  if t.vision_lr_multiplier != 1.0:
    parts.append(optax.masked(optax.scale(t.vision_lr_multiplier), vision_mask))
  return optax.chain(*parts)
