"""The DSpark stage (docs/architecture.md section 3.14): the drafter trained on a backbone.

`dspark.stage = 'frozen'`: the backbone comes from `dspark.backbone_checkpoint` (a pretraining
checkpoint step) at the run's first start and is never updated: its parameters are their own
state entry (`state['frozen']`), outside the optimizer, and only DSpark's are differentiated, so
no gradient into the backbone is ever computed. Its router biases stay as restored.

`dspark.stage = 'post_training'`: backbone and drafter train together; the drafter reads the
backbone's features, embedding, head and target distributions through a stop-gradient, so its
loss never reaches the backbone.

Each step draws `dspark.anchors_per_sequence` anchors per row (state['rng'] folded with the step);
evaluation uses the same anchors every time (the train seed) and reports the acceptance of
rejection sampling and the confidence head's calibration (model/dspark_objective.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deepseek41.config import RunConfig
from deepseek41.model import dspark_objective as objective
from deepseek41.model.dspark import DSpark, Drafts, sample_anchors, target_logits
from deepseek41.model.params import RouterBias
from deepseek41.model.transformer import Transformer
from deepseek41.train.checkpoint import CheckpointError, Checkpointer

log = logging.getLogger(__name__)

BACKBONE, DRAFTER = 'backbone', 'dspark'


class DraftingModel(nnx.Module):
  """The backbone and its drafter, side by side (parameter paths `backbone/...`, `dspark/...`)."""

  def __init__(self, cfg: RunConfig, rngs: nnx.Rngs, remat: str = 'none'):
    self.backbone = Transformer(cfg.model, rngs, remat=remat,
                                sequence_parallel=cfg.mesh.sequence_parallel,
                                remat_layers=cfg.train.remat_layers)
    self.dspark = DSpark(cfg.model, cfg.dspark, rngs)


def frozen(cfg: RunConfig) -> bool:
  return cfg.dspark.stage == 'frozen'


def split(model: DraftingModel, cfg: RunConfig):
  """(graphdef, trainable params, frozen params or None, router biases)."""
  if frozen(cfg):
    graphdef, fixed, params, biases = nnx.split(
        model, nnx.All(nnx.Param, nnx.PathContains(BACKBONE)), nnx.Param, RouterBias)
    return graphdef, params, fixed, biases
  graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
  return graphdef, params, None, biases


def merge(graphdef, params, fixed, biases) -> DraftingModel:
  return nnx.merge(graphdef, params, biases) if fixed is None else \
      nnx.merge(graphdef, fixed, params, biases)


def step_key(rng_data, step):
  return jax.random.fold_in(jax.random.wrap_key_data(rng_data), step)


def drafts_and_targets(model: DraftingModel, cfg: RunConfig, batch, key):
  """The backbone's forward (logits [B,T,V], aux), DSpark's drafts and the targets' logits,
  with nothing of the drafter's flowing back into the backbone."""
  logits_btv, aux, captured = model.backbone.forward(batch, capture_layers=model.dspark.targets)
  sg = jax.lax.stop_gradient
  anchors = sample_anchors(key, batch['segment_ids'], cfg.dspark.anchors_per_sequence)
  m_btd = model.dspark.context(sg(captured))
  drafts = model.dspark(m_btd, batch, anchors, sg(model.backbone.embed[...]),
                        sg(model.backbone.head[...]))
  return logits_btv, aux, drafts, target_logits(sg(logits_btv), anchors, cfg.dspark.block_size)


def draft_loss(cfg: RunConfig, drafts: Drafts, targets_nkv):
  ds = cfg.dspark
  return objective.draft_loss(drafts.logits_nkv, targets_nkv, drafts.labels_nk,
                              drafts.conf_logit_nk, drafts.valid_nk, ce_weight=ds.ce_weight,
                              l1_weight=ds.l1_weight, bce_weight=ds.bce_weight,
                              gamma=ds.slot_decay)


def _draft_loads(drafts: Drafts):
  return jnp.stack([a['load_me'] for a in drafts.auxes])


def _under(path, key: str) -> bool:
  return bool(path) and getattr(path[0], 'key', None) == key


def replace_under(tree, key: str, new_leaves_fn):
  """`tree` with the leaves below its top-level `key` replaced by new_leaves_fn(those leaves, in
  flattening order); the tree structure is unchanged."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  picked = [i for i, (path, _) in enumerate(flat) if _under(path, key)]
  new = new_leaves_fn([flat[i][1] for i in picked])
  leaves = [x for _, x in flat]
  for i, x in zip(picked, new):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _bias_rule(load_lme, rate: float):
  """The sign rule of pretraining (train/step.py) on one module's per-layer bias leaves."""
  from deepseek41.train.step import updated_router_biases
  return lambda leaves: updated_router_biases(leaves, load_lme, rate)


def stage_loss(cfg: RunConfig, graphdef, params, fixed, biases, batch, key,
               with_drafter: bool = True):
  """(objective, (ce_sum, n, aux, drafts, targets_nkv, draft loss, terms)) of the stage.

  Frozen: the drafter's loss (+ its MoE balance term). Post-training: the backbone's
  pretraining objective plus that; `with_drafter=False` leaves the drafter's part out (the test
  that it never reaches the backbone compares the two).
  """
  from deepseek41.train.step import cross_entropy_sum
  m = cfg.model
  model = merge(graphdef, params, fixed, biases)
  logits_btv, aux, drafts, targets_nkv = drafts_and_targets(model, cfg, batch, key)
  ce_sum, n = cross_entropy_sum(logits_btv, batch['targets'], batch['loss_mask'])
  d_loss, terms = draft_loss(cfg, drafts, targets_nkv)
  loss = jnp.zeros((), jnp.float32)
  if with_drafter:
    loss = d_loss + m.balance_loss_weight * sum(a['balance'] for a in drafts.auxes)
  if not frozen(cfg):  # the backbone keeps training on its own objective
    loss = loss + ce_sum / jnp.maximum(n, 1.0) + m.balance_loss_weight * aux['balance'] \
        + m.indexer_loss_weight * aux['indexer_loss']
  return loss, (ce_sum, n, aux, drafts, targets_nkv, d_loss, terms)


def make_train_step(cfg: RunConfig, graphdef, tx):
  """The stage's update step (grad_accum_steps is 1: the config check)."""
  from deepseek41.train.optimizer import learning_rate_schedule
  from deepseek41.train.step import stacked_router_biases
  schedule = learning_rate_schedule(cfg.train)
  m = cfg.model

  def train_step(state, batch):
    params, fixed, biases = state['params'], state.get('frozen'), state['router_bias']
    key = step_key(state['rng'], state['step'])
    loss_fn = lambda p: stage_loss(cfg, graphdef, p, fixed, biases, batch, key)
    (_, (ce_sum, n, aux, drafts, targets_nkv, d_loss, terms)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(params)
    updates, opt = tx.update(grads, state['opt'], params)
    rate = m.router_bias_rate
    new_biases = replace_under(biases, DRAFTER, _bias_rule(_draft_loads(drafts), rate))
    if not frozen(cfg):
      new_biases = replace_under(new_biases, BACKBONE, _bias_rule(aux['load_lme'], rate))
    new_state = {**state, 'params': optax.apply_updates(params, updates), 'opt': opt,
                 'router_bias': new_biases, 'step': state['step'] + 1}
    backbone_loss = ce_sum / jnp.maximum(n, 1.0)
    accept = objective.acceptance_metrics(drafts.logits_nkv, targets_nkv, drafts.valid_nk)
    metrics = {
        'loss': d_loss if frozen(cfg) else backbone_loss,
        'balance_loss': aux['balance'],
        'grad_norm': optax.tree.norm(grads),
        'lr': schedule(state['step']),
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
  from deepseek41.train.step import cross_entropy_sum
  key = jax.random.key(cfg.train.seed)

  def eval_step(state, batch):
    model = merge(graphdef, state['params'], state.get('frozen'), state['router_bias'])
    logits_btv, _, drafts, targets_nkv = drafts_and_targets(model, cfg, batch, key)
    ce_sum, n = cross_entropy_sum(logits_btv, batch['targets'], batch['loss_mask'])
    return {'ce_sum': ce_sum, 'tokens': n,
            'alpha_nk': objective.acceptance_nk(drafts.logits_nkv, targets_nkv),
            'conf_logit_nk': drafts.conf_logit_nk, 'valid_nk': drafts.valid_nk}
  return eval_step


def held_out_metrics(outputs: list[dict]) -> dict[str, float]:
  """Acceptance and calibration over the evaluation batches' anchors (host side)."""
  cat = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in
         ('alpha_nk', 'conf_logit_nk', 'valid_nk')}
  alpha, conf, valid = cat['alpha_nk'], cat['conf_logit_nk'], cat['valid_nk']
  out = {f'eval_{k}': float(v) for k, v in objective.acceptance_summary(alpha, valid).items()}
  t_k = objective.fit_temperatures(conf, alpha, valid)
  out.update({f'eval_{k}': float(v) for k, v in
              objective.calibration_metrics(conf, alpha, valid, t_k).items()})
  out.update({f'eval_dspark_temperature/{k + 1}': float(t) for k, t in enumerate(np.asarray(t_k))})
  return out


def stage_flops_per_token(cfg: RunConfig, fpt):
  """Model FLOPs per batch token of the stage: the backbone's forward only when frozen (its
  whole training step otherwise), plus the drafter's training on its anchor rows (6 x the
  weights a draft row multiplies, the backbone's head included) and its main projection."""
  from deepseek41.model.inventory import dspark_parameters
  ds, m = cfg.dspark, cfg.model
  drafter = dspark_parameters(cfg)
  rows_per_token = ds.anchors_per_sequence * ds.block_size / cfg.data.seq_len
  backbone = fpt.total / 3 if frozen(cfg) else fpt.total
  total = backbone + 6 * (drafter['active_per_draft_token'] + m.d_model * m.vocab_size) \
      * rows_per_token + 6 * drafter['per_context_token']
  return dataclasses.replace(fpt, total=total, formula=(
      f'DSpark stage FLOPs/token = {"backbone forward" if frozen(cfg) else "backbone step"} '
      f'{backbone:.4g} + drafter 6 x ({drafter["active_per_draft_token"]:,.0f} + head '
      f'{m.d_model * m.vocab_size:,}) x {rows_per_token:.4g} rows/token + main projection '
      f'6 x {drafter["per_context_token"]:,} = {total:.4g}'))


# ---- the backbone, from a pretraining checkpoint ------------------------------------------------


def backbone_config(cfg: RunConfig) -> RunConfig:
  return dataclasses.replace(cfg, dspark=dataclasses.replace(cfg.dspark, stage='off'))


def load_backbone(cfg: RunConfig, state, mesh, tx):
  """`state` with the backbone's parameters and router biases from dspark.backbone_checkpoint.

  The checkpoint must be one of a pretraining run of this model (its layout and model config are
  checked as a resume's are; what differs is listed). Its optimizer state is read and dropped.
  """
  from deepseek41.train import state as state_lib
  path = os.path.abspath(cfg.dspark.backbone_checkpoint)
  if not cfg.dspark.backbone_checkpoint:
    raise CheckpointError('dspark.backbone_checkpoint: the DSpark stage starts from a '
                          'pretraining checkpoint; set it to WORKDIR/checkpoints/<step>')
  step_name, parent = os.path.basename(path), os.path.dirname(path)
  if not (os.path.isdir(path) and step_name.isdigit() and os.path.basename(parent) == 'checkpoints'):
    raise CheckpointError(f'dspark.backbone_checkpoint={cfg.dspark.backbone_checkpoint!r} is not '
                          'a checkpoint step directory (WORKDIR/checkpoints/<step>)')
  bcfg = backbone_config(cfg)
  abstract = state_lib.abstract_state(bcfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, cfg.mesh.rules)
  ckpt = Checkpointer(os.path.dirname(parent), cfg.checkpoint, primary=False)
  step = int(step_name)
  try:
    benign = ckpt.validate(step, state_lib.state_layout(abstract), bcfg.to_dict())
    if benign:
      log.info('the backbone checkpoint was written with other run settings (not the model): '
               '%s', '; '.join(benign))
  except CheckpointError as e:  # the model keys that differ first, then how many tensors
    lines = [l.strip() for l in str(e).splitlines()[1:-1]]
    model_keys = [l for l in lines if l.startswith('model.')]
    tensors = [l for l in lines if l.startswith('state')]
    raise CheckpointError(
        f'dspark.backbone_checkpoint: {path} is not a checkpoint of this backbone: '
        + '; '.join(model_keys or tensors[:3] or lines)
        + (f' ({len(tensors)} state tensors differ in shape or presence)' if tensors else '')
        + '. Give a pretraining checkpoint of this model, or set the model section to the one '
        'the backbone was trained with.') from None
  restored = ckpt.restore(step, state_lib.with_shardings(abstract, shardings), None)
  ckpt.close()

  def graft(source):  # the same modules below `backbone`: the same leaves in the same order
    def leaves_of(old):
      new = jax.tree.leaves(source)
      if [np.shape(x) for x in new] != [np.shape(x) for x in old]:
        raise CheckpointError(f'dspark.backbone_checkpoint: {path} does not match the backbone '
                              'leaf for leaf')
      return new
    return leaves_of
  out = {**state, 'router_bias': replace_under(state['router_bias'], BACKBONE,
                                               graft(restored['router_bias']))}
  held = 'frozen' if frozen(cfg) else 'params'
  out[held] = replace_under(state[held], BACKBONE, graft(restored['params']))
  log.info('backbone restored from %s (step %d)', path, step)
  return out
