"""A checkpoint of any run, restored for evaluation: a pretraining run, a DSpark stage, an HF
import (`tools.convert import`). Its own config builds the model, with the execution choices
re-resolved for the devices at hand and the routed experts dropless (as held-out evaluation
runs them); its weights come through train/warm_start.py's restore (the model's entries only,
checksums verified), and the objective that wrote them says where the backbone lies."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from deepseek41.config import (ConfigError, RunConfig, base_config, config_from_saved,
                               execution_only_keys, resolve)
from deepseek41.data.engram_vocab import compression_map
from deepseek41.data.pipeline import tokenizer_path_of
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import Tokenizer, load_tokenizer
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import CheckpointError, Checkpointer
from deepseek41.train.evaluation import eval_config
from deepseek41.train.objectives import Objective
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.warm_start import restore_weights

# The execution choices with an `auto` rule: resolved for the devices that evaluate.
_EXECUTION_KEYS = tuple(sorted(k for k in execution_only_keys('model')
                               if base_config().model[k] == 'auto'))


class EvalError(ValueError):
  """Bad input to evaluation; the message names the culprit (flag, work directory, step)."""


@dataclasses.dataclass
class Checkpoint:
  workdir: str
  step: int
  cfg: RunConfig           # the run's config, as evaluation computes it (eval_config)
  objective: Objective
  graphdef: Any            # the evaluation model's
  weights: dict            # the objective's model entries
  mesh: Any
  tokenizer: Tokenizer
  tokenizer_path: str
  engram_map: np.ndarray | None


def reading_config(saved: dict) -> RunConfig:
  """The saved config with its execution choices back to `auto`, a mesh of every device over
  data and no remat: resolvable wherever evaluation runs."""
  c = config_from_saved(saved)
  for key in _EXECUTION_KEYS:
    c.model[key] = 'auto'
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor, c.mesh.context = -1, 1, 1, 1, 1
  c.train.remat = 'none'
  # The held-out batch splits over every device here (the run's may have been fewer).
  devices = jax.device_count()
  c.train.grad_accum_steps = 1
  c.train.batch_size = -(-c.train.batch_size // devices) * devices
  return resolve(c)


def run_tokenizer(workdir: str, cfg: RunConfig) -> tuple[Tokenizer, str]:
  """The checkpoint's tokenizer: WORKDIR/tokenizer.json (the trainer's copy),
  WORKDIR/tokenizer/tokenizer.json (an HF import's), else the one its data section names."""
  for path in (os.path.join(workdir, 'tokenizer.json'),
               os.path.join(workdir, 'tokenizer', 'tokenizer.json')):
    if os.path.isfile(path):
      return load_tokenizer(path), path
  try:
    path = tokenizer_path_of(cfg.data)
  except DataError as e:
    raise EvalError(f'{workdir} has no tokenizer.json, and its data config gives none ({e}); '
                    'the tasks encode their text with the run\'s tokenizer: copy it to '
                    f'{workdir}/tokenizer.json') from None
  return load_tokenizer(path), path


def _reader(workdir: str) -> Checkpointer:
  """The work directory's checkpoints, read only: it never saves, so it never deletes."""
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise EvalError(f'--workdir={workdir} has no checkpoints/ directory: give the work '
                    'directory of a training run (or of `tools.convert import`)')
  settings = resolve(base_config(), backend='cpu', num_devices=1).checkpoint
  return Checkpointer(workdir, dataclasses.replace(settings, max_to_keep=None,
                                                   async_save=False), primary=False)


def open_checkpoint(workdir: str, step: int | None = None) -> Checkpoint:
  """Checkpoint `step` (default: the newest) of `workdir`, restored for evaluation."""
  workdir = os.path.abspath(workdir)
  ckpt = _reader(workdir)
  try:
    steps = sorted(ckpt.manager.all_steps())
    if not steps:
      raise EvalError(f'--workdir={workdir}: checkpoints/ holds no complete checkpoint')
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise EvalError(f'--step={step}: no checkpoint of that step in {workdir}/checkpoints '
                      f'(there are: {", ".join(map(str, steps))})')
    saved = ckpt.read_json_item(step, 'config')
    step_dir = ckpt.step_dir(step)
  finally:
    ckpt.close()
  try:
    cfg = reading_config(saved)
  except ConfigError as e:
    raise EvalError(f'{step_dir}: its config does not resolve here: {e}') from None
  tokenizer, tokenizer_path = run_tokenizer(workdir, cfg)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise EvalError(f'{workdir}: the tokenizer {tokenizer_path} has {tokenizer.vocab_size} ids, '
                    f'the model {cfg.model.vocab_size}')
  mesh = make_mesh(cfg.mesh)
  try:
    objective, weights, _ = restore_weights('--step', step_dir, cfg, mesh)
  except CheckpointError as e:
    raise EvalError(str(e)) from None
  cfg = eval_config(cfg)
  graphdef = state_lib.model_def(cfg, make_optimizer(cfg.train)).graphdef
  return Checkpoint(workdir=workdir, step=step, cfg=cfg, objective=objective, graphdef=graphdef,
                    weights=weights, mesh=mesh, tokenizer=tokenizer,
                    tokenizer_path=tokenizer_path,
                    engram_map=compression_map(cfg.model, tokenizer.hf,
                                               f'the tokenizer {tokenizer_path}'))
