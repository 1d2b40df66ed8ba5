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

from deepseek41.config import ConfigError, RunConfig, resolve
from deepseek41.data.engram_vocab import compression_map
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import Tokenizer
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import CheckpointError
from deepseek41.train.evaluation import eval_config
from deepseek41.train.objectives import Objective
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.reading import checkpoint_step, portable_config, run_tokenizer
from deepseek41.train.warm_start import restore_weights

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
  """The saved config, portable (train/reading.py) and without remat: resolvable wherever
  evaluation runs."""
  c = portable_config(saved)
  c.train.remat = 'none'
  # The held-out batch splits over every device here (the run's may have been fewer).
  devices = jax.device_count()
  c.train.grad_accum_steps = 1
  c.train.batch_size = -(-c.train.batch_size // devices) * devices
  return resolve(c)


def open_checkpoint(workdir: str, step: int | None = None) -> Checkpoint:
  """Checkpoint `step` (default: the newest) of `workdir`, restored for evaluation."""
  workdir = os.path.abspath(workdir)
  try:
    step, step_dir, saved = checkpoint_step(workdir, step)
  except CheckpointError as e:
    raise EvalError(str(e)) from None
  try:
    cfg = reading_config(saved)
  except ConfigError as e:
    raise EvalError(f'{step_dir}: its config does not resolve here: {e}') from None
  try:
    tokenizer, tokenizer_path = run_tokenizer(workdir, cfg.data)
  except DataError as e:
    raise EvalError(str(e)) from None
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
