"""AdamW with warm-up then cosine / WSD / constant, global-norm clipping, selective weight decay."""

from __future__ import annotations

import jax
import optax

from deepseek41.config import TrainConfig


def learning_rate_schedule(t: TrainConfig) -> optax.Schedule:
  warmup = optax.linear_schedule(0.0, t.lr, max(t.warmup_steps, 1))
  rest = max(t.steps - t.warmup_steps, 1)
  final = t.lr * t.min_lr_ratio
  if t.schedule == 'cosine':
    main = optax.cosine_decay_schedule(t.lr, rest, alpha=t.min_lr_ratio)
  elif t.schedule == 'wsd':
    decay = max(int(round(rest * t.wsd_decay_fraction)), 1)
    main = optax.join_schedules(
        [optax.constant_schedule(t.lr), optax.linear_schedule(t.lr, final, decay)], [rest - decay])
  else:
    main = optax.constant_schedule(t.lr)
  if t.warmup_steps == 0:
    return main
  return optax.join_schedules([warmup, main], [t.warmup_steps])


def decay_mask(params):
  """Weight decay only on matrices: norms, biases, sinks and scales are 1-D and are left alone."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  parts = []
  if t.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(t.grad_clip_norm))
  parts.append(optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                           weight_decay=t.weight_decay, mask=decay_mask))
  return optax.chain(*parts)
