"""Train and eval steps: pure functions of (state, batch), jitted with shardings by the trainer.

The loss is the token-weighted mean next-token cross-entropy over the whole global batch plus the
balance term. With gradient accumulation the batch is split into `A` microbatches; each one's
objective is `ce_sum_m / N_global + w * balance_m / A`, so the summed gradients equal those of one
big step exactly (up to summation order). Router loads are summed over all microbatches, then the
sign rule updates the biases once per step from the global-batch loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deepseek41.config import RunConfig
from deepseek41.model.moe import update_router_bias
from deepseek41.ops.cross_entropy import cross_entropy_sum, head_cross_entropy_sum
from deepseek41.train.optimizer import learning_rate_schedule, step_optimizer


@dataclasses.dataclass(frozen=True)
class ModelDef:
  """Static pieces needed to rebuild the model from state: the graph and the optimizer."""
  graphdef: Any
  tx: Any


def merge_model(graphdef, params, biases) -> nnx.Module:
  """The model from its graph, its parameters and its router biases."""
  return nnx.merge(graphdef, params, biases)


def head_loss_sums(model, out, batch):
  """(CE sum, real targets) of the backbone's forward output `out`: the fp32 logits [B, T, V],
  or with `model.head_chunk` the head's input h [B, T, D] (`Transformer.forward(head=False)`),
  which the fused head + cross-entropy takes a chunk of positions at a time
  (ops/cross_entropy.py), never holding the whole logits."""
  chunk = model.cfg.head_chunk
  if chunk:
    return head_cross_entropy_sum(out, model.head_weight(), batch['targets'], batch['loss_mask'],
                                  chunk)
  return cross_entropy_sum(out, batch['targets'], batch['loss_mask'])


def forward_loss(md: ModelDef, params, biases, batch):
  model = merge_model(md.graphdef, params, biases)
  out, aux, _ = model.forward(batch, head=not model.cfg.head_chunk)
  with jax.named_scope('loss'):
    ce_sum, n = head_loss_sums(model, out, batch)
  return ce_sum, n, aux


def _microbatches(batch, a: int):
  return jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)


def accumulate_gradients(cfg: RunConfig, md: ModelDef, params, biases, batch):
  """Gradients of the global-batch objective, summed over `grad_accum_steps` microbatches.

  Returns (grads, ce_sum, n_tokens, load_lme, balance, dropped, indexer_lr) where dropped is
  int32 [expert assignments, Engram lookups] and indexer_lr is [indexer loss, indexer recall]
  averaged over microbatches.
  """
  a = cfg.train.grad_accum_steps
  w_bal = cfg.model.balance_loss_weight
  n_global = jnp.maximum(jnp.sum(batch['loss_mask'].astype(jnp.float32)), 1.0)

  w_idx = cfg.model.indexer_loss_weight

  def objective(p, mb):
    ce_sum, n, aux = forward_loss(md, p, biases, mb)
    # The indexer term only reaches indexer weights (its inputs are detached in model/csa2.py).
    return (ce_sum / n_global + w_bal * aux['balance'] / a + w_idx * aux['indexer_loss'] / a,
            (ce_sum, n, aux))

  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def accumulate(carry, mb):
    (_, (ce_sum, n, aux)), grads = grad_fn(params, mb)
    g_acc, ce_acc, n_acc, load_acc, bal_acc, drop_acc, idx_acc = carry
    idx = jnp.stack([aux['indexer_loss'], aux['indexer_recall']]) / a
    return (jax.tree.map(jnp.add, g_acc, grads), ce_acc + ce_sum, n_acc + n,
            load_acc + aux['load_lme'], bal_acc + aux['balance'] / a,
            drop_acc + jnp.stack([aux['dropped'], aux['engram_dropped']]), idx_acc + idx), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  num_layers, num_experts = cfg.model.num_layers, cfg.model.n_routed_experts
  init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
          jnp.zeros((num_layers, 2, num_experts), jnp.float32), jnp.zeros((), jnp.float32),
          jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.float32))
  out, _ = jax.lax.scan(accumulate, init, _microbatches(batch, a))
  return out


def _per_layer(biases, num_layers: int):
  """The router biases' leaves (one per layer, in layer order) and their tree structure.

  Layer order is the flattening order: the blocks are an nnx.List, whose keys are the ints
  0..L-1 and flatten in numeric order. A count other than L is a model this step cannot serve.
  """
  leaves, treedef = jax.tree.flatten(biases)
  if len(leaves) != num_layers:
    raise ValueError(f'expected one router bias per layer ({num_layers}), got {len(leaves)}')
  return leaves, treedef


def updated_router_biases(biases, load_lme, rate: float):
  """Apply the sign rule to each layer's bias from that layer's loads ([L, M, E])."""
  leaves, treedef = _per_layer(biases, load_lme.shape[0])
  return jax.tree.unflatten(treedef, [update_router_bias(bias_me, load_lme[layer], rate)
                                      for layer, bias_me in enumerate(leaves)])


def stacked_router_biases(biases):
  """[L, M, E]: every layer's per-modality correction biases, in layer order (`_per_layer`)."""
  return jnp.stack(jax.tree.leaves(biases))


def make_train_step(cfg: RunConfig, md: ModelDef):
  """(state, batch[, schedule]) -> (state, metrics). `schedule`: the learning-rate schedule's
  numbers (`optimizer.schedule_values`) as an argument, as the trainer passes them; without it
  the step applies md.tx, its schedule compiled in."""

  def train_step(state, batch, schedule=None):
    params, biases = state['params'], state['router_bias']
    grads, ce_sum, n, load_lme, balance, dropped, indexer = accumulate_gradients(
        cfg, md, params, biases, batch)

    with jax.named_scope('optimizer'):
      tx = step_optimizer(cfg.train, md.tx, schedule)
      updates, opt = tx.update(grads, state['opt'], params)
      new_params = optax.apply_updates(params, updates)
      new_biases = updated_router_biases(biases, load_lme, cfg.model.router_bias_rate)
    new_state = {'params': new_params, 'router_bias': new_biases, 'opt': opt,
                 'step': state['step'] + 1, 'rng': state['rng']}
    with jax.named_scope('metrics'):
      metrics = {
          'loss': ce_sum / jnp.maximum(n, 1.0),
          'balance_loss': balance,
          'grad_norm': optax.tree.norm(grads),
          'lr': learning_rate_schedule(cfg.train, schedule)(state['step']),
          'tokens': n,
          'routed_tokens': jnp.sum(batch['segment_ids'] > 0),  # every real position routes
          'dropped': dropped[0],
          'engram_dropped': dropped[1],
          'load_lme': load_lme,
          'bias_lme': stacked_router_biases(new_biases),
          'indexer_loss': indexer[0],
          'indexer_recall': indexer[1],
      }
    return new_state, metrics

  return train_step


def make_eval_step(md: ModelDef):
  def eval_step(state, batch):
    ce_sum, n, _ = forward_loss(md, state['params'], state['router_bias'], batch)
    return {'ce_sum': ce_sum, 'tokens': n}
  return eval_step
