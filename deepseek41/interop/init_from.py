"""Start a new run from the weights of another checkpoint (`checkpoint.init_from`), e.g. one
`deepseek41.tools.convert import` wrote: its parameters and router biases, with this run's fresh
optimizer state and step 0 (docs/hf_interop.md, "Training from imported weights").

The source checkpoint is restored under its own saved config (its optimizer layout may differ
from this run's), then its model is checked against this run's: the model keys must agree
(execution-only keys aside) and every parameter must have this run's shape.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from deepseek41.config import RunConfig
from deepseek41.train.checkpoint import EXECUTION_ONLY_MODEL_KEYS, CheckpointError, Checkpointer

log = logging.getLogger(__name__)


def _step_dir(path: str) -> tuple[str, int]:
  path = os.path.abspath(path)
  step, parent = os.path.basename(path), os.path.dirname(path)
  if not (os.path.isdir(path) and step.isdigit() and os.path.basename(parent) == 'checkpoints'):
    raise CheckpointError(f'checkpoint.init_from={path!r} is not a checkpoint step directory '
                          '(WORKDIR/checkpoints/<step>)')
  return os.path.dirname(parent), int(step)


def load_initial_weights(cfg: RunConfig, state, mesh, tx=None):
  """`state` (a fresh initialisation) with params and router biases from checkpoint.init_from."""
  from deepseek41.interop.hf_convert import _leaves, saved_run_config
  from deepseek41.config import resolve
  from deepseek41.train import state as state_lib
  from deepseek41.train.optimizer import make_optimizer
  del tx  # the source is restored with its own optimizer layout, then dropped
  workdir, step = _step_dir(cfg.checkpoint.init_from)
  ckpt = Checkpointer(workdir, cfg.checkpoint, primary=False)
  try:
    saved = ckpt.read_json_item(step, 'config')
    src_cfg = saved_run_config(saved)
    src = resolve(src_cfg)
    differ = [k for k in sorted(set(saved.get('model', {})) | set(cfg.to_dict()['model']))
              if k not in EXECUTION_ONLY_MODEL_KEYS
              and getattr(src.model, k, None) != getattr(cfg.model, k, None)]
    if differ:
      raise CheckpointError(
          f'checkpoint.init_from: {ckpt.step_dir(step)} holds another model: '
          + ', '.join(f'model.{k} {getattr(src.model, k, None)!r} there, '
                      f'{getattr(cfg.model, k, None)!r} here' for k in differ[:5]))
    src_tx = make_optimizer(src.train)
    abstract = state_lib.abstract_state(src, src_tx)
    shardings = state_lib.state_shardings(abstract, mesh, cfg.mesh.rules)
    ckpt.verify(step)
    target = state_lib.with_shardings(abstract, shardings)
    restored = ckpt.restore_parts(step, {k: target[k] for k in ('params', 'router_bias')})
  finally:
    ckpt.close()
  out = dict(state)
  for group in ('params', 'router_bias'):
    mine, theirs = _leaves(state[group]), _leaves(restored[group])
    for k in mine:
      if k not in theirs or np.shape(theirs[k]) != np.shape(mine[k]):
        raise CheckpointError(f'checkpoint.init_from: {group} {k} has shape '
                              f'{np.shape(theirs.get(k))} there, {np.shape(mine[k])} here')
    flat, treedef = jax.tree_util.tree_flatten(state[group])
    out[group] = jax.tree_util.tree_unflatten(
        treedef, [x.astype(m.dtype) for x, m in zip(jax.tree.leaves(restored[group]), flat)])
  log.info('parameters and router biases from %s (step %d); optimizer and step start fresh',
           ckpt.step_dir(step), step)
  return out
