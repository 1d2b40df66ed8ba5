"""The DSpark stage (docs/architecture.md section 3.14): the drafter trained on a backbone.

Frozen (`dspark.stage = 'frozen'`): the backbone comes from `dspark.backbone_checkpoint` (a
pretraining checkpoint step) at the run's first start and is never updated: its parameters are
their own state entry (`state['frozen']`), outside the optimizer, and only DSpark's are
differentiated, so no gradient into the backbone is ever computed. Its router biases stay as
restored.

Post-training (`dspark.stage = 'post_training'`): backbone and drafter train together; the drafter
reads the backbone's features, embedding, head and target distributions through a stop-gradient
(model/drafting.py), so its loss never reaches the backbone.

Each step draws `dspark.anchors_per_sequence` anchors per row (state['rng'] folded with the step);
evaluation uses the same anchors every time (the train seed) and reports the acceptance of
rejection sampling and the confidence head's calibration (model/dspark_objective.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deepseek41.config import RunConfig
from deepseek41.model import dspark_objective
from deepseek41.model.drafting import BACKBONE, DRAFTER, DraftingModel
from deepseek41.model.dspark import Drafts
from deepseek41.model.inventory import dspark_parameters
from deepseek41.model.params import RouterBias
from deepseek41.train.checkpoint import CheckpointError
from deepseek41.train.flops import FlopsPerToken, flops_per_token
from deepseek41.train.objectives import base
from deepseek41.train.optimizer import learning_rate_schedule, step_optimizer
from deepseek41.train.step import (ModelDef, head_loss_sums, stacked_router_biases,
                                   updated_router_biases)

log = logging.getLogger(__name__)


def split(model: DraftingModel, frozen: bool) -> base.Split:
  """The backbone's parameters held fixed (frozen) or trained with the drafter's."""
  if frozen:
    graphdef, fixed, params, biases = nnx.split(
        model, nnx.All(nnx.Param, nnx.PathContains(BACKBONE)), nnx.Param, RouterBias)
    return base.Split(graphdef, params, fixed, biases)
  graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
  return base.Split(graphdef, params, None, biases)


def merge(graphdef, params, fixed, biases) -> DraftingModel:
  return nnx.merge(graphdef, params, biases) if fixed is None else \
      nnx.merge(graphdef, fixed, params, biases)


def step_key(rng_data, step):
  return jax.random.fold_in(jax.random.wrap_key_data(rng_data), step)


def draft_loss(cfg: RunConfig, drafts: Drafts, targets_nkv):
  ds = cfg.dspark
  return dspark_objective.draft_loss(drafts.logits_nkv, targets_nkv, drafts.labels_nk,
                                     drafts.conf_logit_nk, drafts.valid_nk,
                                     ce_weight=ds.ce_weight, l1_weight=ds.l1_weight,
                                     bce_weight=ds.bce_weight, gamma=ds.slot_decay)


def _draft_loads(drafts: Drafts):
  return jnp.stack([a['load_me'] for a in drafts.auxes])


def _under(path, key: str) -> bool:
  return bool(path) and getattr(path[0], 'key', None) == key


def replace_under(tree, key: str, new_leaves_fn):
  """`tree` with the leaves below its top-level `key` replaced by new_leaves_fn(those leaves, in
  flattening order); the tree structure is unchanged."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  picked = [i for i, (path, _) in enumerate(flat) if _under(path, key)]
  new = list(new_leaves_fn([flat[i][1] for i in picked]))
  if len(new) != len(picked):
    raise ValueError(f'{len(new)} leaves for the {len(picked)} below {key!r}')
  leaves = [x for _, x in flat]
  for i, x in zip(picked, new):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _bias_rule(load_lme, rate: float):
  """The sign rule of pretraining (train/step.py) on one module's per-layer bias leaves."""
  return lambda leaves: updated_router_biases(leaves, load_lme, rate)


def stage_loss(cfg: RunConfig, graphdef, params, fixed, biases, batch, key,
               with_drafter: bool = True):
  """(objective, (ce_sum, n, aux, drafts, targets_nkv, draft loss, terms)) of the stage.

  Frozen (`fixed`, the backbone, given): the drafter's loss (+ its MoE balance term).
  Post-training: the backbone's pretraining objective plus that; `with_drafter=False` leaves the
  drafter's part out (the test that it never reaches the backbone compares the two).
  """
  m = cfg.model
  model = merge(graphdef, params, fixed, biases)
  out, aux, drafts, targets_nkv = model.drafts_and_targets(batch, key)
  ce_sum, n = head_loss_sums(model.backbone, out, batch)
  d_loss, terms = draft_loss(cfg, drafts, targets_nkv)
  loss = jnp.zeros((), jnp.float32)
  if with_drafter:
    loss = d_loss + m.balance_loss_weight * sum(a['balance'] for a in drafts.auxes)
  if fixed is None:  # the backbone keeps training on its own objective
    loss = loss + ce_sum / jnp.maximum(n, 1.0) + m.balance_loss_weight * aux['balance'] \
        + m.indexer_loss_weight * aux['indexer_loss']
  return loss, (ce_sum, n, aux, drafts, targets_nkv, d_loss, terms)


def make_train_step(cfg: RunConfig, graphdef, tx, frozen: bool):
  """The stage's update step (grad_accum_steps is 1: the config check); `schedule` as in
  train/step.py's."""
  m = cfg.model

  def train_step(state, batch, schedule=None):
    params, fixed, biases = state['params'], state.get('frozen'), state['router_bias']
    key = step_key(state['rng'], state['step'])
    loss_fn = lambda p: stage_loss(cfg, graphdef, p, fixed, biases, batch, key)
    (_, (ce_sum, n, aux, drafts, targets_nkv, d_loss, terms)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(params)
    with jax.named_scope('optimizer'):
      updates, opt = step_optimizer(cfg.train, tx, schedule).update(grads, state['opt'], params)
      new_params = optax.apply_updates(params, updates)
      rate = m.router_bias_rate
      new_biases = replace_under(biases, DRAFTER, _bias_rule(_draft_loads(drafts), rate))
      if not frozen:
        new_biases = replace_under(new_biases, BACKBONE, _bias_rule(aux['load_lme'], rate))
    new_state = {**state, 'params': new_params, 'opt': opt, 'router_bias': new_biases,
                 'step': state['step'] + 1}
    backbone_loss = ce_sum / jnp.maximum(n, 1.0)
    accept = dspark_objective.acceptance_metrics(drafts.logits_nkv, targets_nkv, drafts.valid_nk)
    metrics = {
        'loss': d_loss if frozen else backbone_loss,
        'balance_loss': aux['balance'],
        'grad_norm': optax.tree.norm(grads),
        'lr': learning_rate_schedule(cfg.train, schedule)(state['step']),
        'tokens': n,
        'routed_tokens': jnp.sum(batch['segment_ids'] > 0),
        'dropped': aux['dropped'],
        'engram_dropped': aux['engram_dropped'],
        'load_lme': aux['load_lme'],
        'bias_lme': stacked_router_biases(new_biases[BACKBONE]),
        'indexer_loss': aux['indexer_loss'],
        'indexer_recall': aux['indexer_recall'],
        'extra': {'backbone_loss': backbone_loss, 'dspark_loss': d_loss, **terms, **accept},
    }
    return new_state, metrics

  return train_step


def make_eval_step(cfg: RunConfig, graphdef):
  """Held-out: the backbone's CE and, at fixed anchors, each slot's acceptance and confidence."""
  key = jax.random.key(cfg.train.seed)

  def eval_step(state, batch):
    model = merge(graphdef, state['params'], state.get('frozen'), state['router_bias'])
    out, _, drafts, targets_nkv = model.drafts_and_targets(batch, key)
    ce_sum, n = head_loss_sums(model.backbone, out, batch)
    return {'ce_sum': ce_sum, 'tokens': n,
            'alpha_nk': dspark_objective.acceptance_nk(drafts.logits_nkv, targets_nkv),
            'conf_logit_nk': drafts.conf_logit_nk, 'valid_nk': drafts.valid_nk}
  return eval_step


def held_out_metrics(outputs: list[dict]) -> dict[str, float]:
  """Acceptance and calibration over the evaluation batches' anchors (host side)."""
  if not outputs:
    return {}
  cat = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in
         ('alpha_nk', 'conf_logit_nk', 'valid_nk')}
  alpha, conf, valid = cat['alpha_nk'], cat['conf_logit_nk'], cat['valid_nk']
  out = {f'eval_{k}': float(v) for k, v in
         dspark_objective.acceptance_summary(alpha, valid).items()}
  t_k = dspark_objective.fit_temperatures(conf, alpha, valid)
  out.update({f'eval_{k}': float(v) for k, v in
              dspark_objective.calibration_metrics(conf, alpha, valid, t_k).items()})
  out.update({f'eval_dspark_temperature/{k + 1}': float(t) for k, t in enumerate(np.asarray(t_k))})
  return out


def stage_flops_per_token(cfg: RunConfig, fpt: FlopsPerToken, frozen: bool) -> FlopsPerToken:
  """Model FLOPs per batch token of the stage: the backbone's forward only when frozen (its
  whole training step otherwise), plus the drafter's training on its anchor rows (6 x the
  weights a draft row multiplies, the backbone's head included) and its main projection."""
  ds, m = cfg.dspark, cfg.model
  drafter = dspark_parameters(cfg)
  rows_per_token = ds.anchors_per_sequence * ds.block_size / cfg.data.seq_len
  backbone = fpt.total / 3 if frozen else fpt.total
  total = backbone + 6 * (drafter['active_per_draft_token'] + m.d_model * m.vocab_size) \
      * rows_per_token + 6 * drafter['per_context_token']
  return dataclasses.replace(fpt, total=total, formula=(
      f'DSpark stage FLOPs/token = {"backbone forward" if frozen else "backbone step"} '
      f'{backbone:.4g} + drafter 6 x ({drafter["active_per_draft_token"]:,.0f} + head '
      f'{m.d_model * m.vocab_size:,}) x {rows_per_token:.4g} rows/token + main projection '
      f'6 x {drafter["per_context_token"]:,} = {total:.4g}'))


class DSparkStage(base.Objective):
  """The drafter on a frozen backbone (`frozen`), or drafter and backbone together."""

  has_drafter = True

  def __init__(self, cfg: RunConfig, *, frozen: bool):
    super().__init__(cfg)
    self.frozen = frozen
    self.model_entries = ('params', 'router_bias', 'frozen') if frozen else \
        ('params', 'router_bias')

  def build_model(self, rngs: nnx.Rngs) -> DraftingModel:
    cfg = self.cfg
    return DraftingModel(cfg.model, cfg.dspark, rngs, remat=cfg.train.remat,
                         sequence_parallel=cfg.mesh.sequence_parallel,
                         remat_layers=cfg.train.remat_layers)

  def split(self, model: DraftingModel) -> base.Split:
    return split(model, self.frozen)

  def merge(self, graphdef, weights: Mapping[str, Any]) -> DraftingModel:
    return merge(graphdef, weights['params'], weights.get('frozen'), weights['router_bias'])

  def make_train_step(self, md: ModelDef):
    return make_train_step(self.cfg, md.graphdef, md.tx, self.frozen)

  def make_eval_step(self, md: ModelDef):
    return make_eval_step(self.cfg, md.graphdef)

  def flops_per_token(self) -> FlopsPerToken:
    fpt = flops_per_token(self.cfg.model, self.cfg.data.seq_len)
    return stage_flops_per_token(self.cfg, fpt, self.frozen)

  def held_out_metrics(self, outputs: list[dict]) -> dict[str, float]:
    return held_out_metrics(outputs)

  def warm_starts(self) -> tuple[base.WarmStart, ...]:
    """The backbone from `dspark.backbone_checkpoint`: required when frozen; without it,
    post-training starts backbone and drafter from their initialization."""
    path = self.cfg.dspark.backbone_checkpoint
    if path:
      return (base.WarmStart('dspark.backbone_checkpoint', path, base.BACKBONE),)
    if self.frozen:
      raise CheckpointError('dspark.backbone_checkpoint: the frozen DSpark stage starts from a '
                            'pretraining checkpoint; set it to WORKDIR/checkpoints/<step>')
    log.info('dspark.stage=post_training without dspark.backbone_checkpoint: the backbone and '
             'its drafter both start from initialization and train together')
    return ()

  def _held(self) -> str:
    return 'frozen' if self.frozen else 'params'

  def backbone_weights(self, weights: Mapping[str, Any]) -> dict[str, Any]:
    return {'params': weights[self._held()][BACKBONE],
            'router_bias': weights['router_bias'][BACKBONE]}

  def with_backbone(self, state: dict, backbone: Mapping[str, Any]) -> dict:
    held = self._held()
    out = {**state, 'router_bias': replace_under(
        state['router_bias'], BACKBONE, lambda _: jax.tree.leaves(backbone['router_bias']))}
    out[held] = replace_under(state[held], BACKBONE,
                              lambda _: jax.tree.leaves(backbone['params']))
    return out

  def reader_models(self, graphdef, weights: Mapping[str, Any]):
    drafting = self.merge(graphdef, weights)
    return drafting.backbone, drafting.dspark
