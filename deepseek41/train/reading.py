"""What reads a run outside its training (generation, evaluation): the checkpoint step chosen,
its saved config made portable to the devices at hand, and the run's tokenizer. The weights
themselves come through warm_start.restore_weights, as every other restore does."""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from deepseek41.config import base_config, config_from_saved, execution_only_keys, resolve
from deepseek41.data.pipeline import tokenizer_path_of
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import Tokenizer, load_tokenizer
from deepseek41.train.checkpoint import CheckpointError, Checkpointer

# The execution choices with an `auto` rule: a reader resolves them for its own devices.
EXECUTION_AUTO_KEYS = tuple(sorted(k for k in execution_only_keys('model')
                                   if base_config().model[k] == 'auto'))


def checkpoint_step(workdir: str, step: int | None = None) -> tuple[int, str, dict]:
  """(step, its directory, its saved config) of checkpoint `step` of `workdir` (default: the
  newest), read only (the reader never saves, so it never deletes). Raises CheckpointError
  naming --workdir or --step."""
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise CheckpointError(f'--workdir={workdir} has no checkpoints/ directory: give the work '
                          'directory of a training run (or of `tools.convert import`)')
  settings = resolve(base_config(), backend='cpu', num_devices=1).checkpoint
  ckpt = Checkpointer(workdir, dataclasses.replace(settings, max_to_keep=None, async_save=False),
                      primary=False)
  try:
    steps = sorted(ckpt.manager.all_steps())
    if not steps:
      raise CheckpointError(f'--workdir={workdir}: checkpoints/ holds no complete checkpoint')
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise CheckpointError(f'--step={step}: no checkpoint of that step in {workdir}/checkpoints '
                            f'(there are: {", ".join(map(str, steps))})')
    return step, ckpt.step_dir(step), ckpt.read_json_item(step, 'config')
  finally:
    ckpt.close()


def portable_config(saved: dict) -> ml_collections.ConfigDict:
  """The saved config with its execution choices back to `auto` and a mesh of every device
  over data: resolvable wherever the run is read."""
  c = config_from_saved(saved)
  for key in EXECUTION_AUTO_KEYS:
    c.model[key] = 'auto'
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor, c.mesh.context = -1, 1, 1, 1, 1
  return c


def run_tokenizer(workdir: str, data_cfg) -> tuple[Tokenizer, str]:
  """(the run's tokenizer, its path): WORKDIR/tokenizer.json (the trainer's copy),
  WORKDIR/tokenizer/tokenizer.json (an HF import's), else the one its data section names.
  Raises DataError naming the work directory."""
  for path in (os.path.join(workdir, 'tokenizer.json'),
               os.path.join(workdir, 'tokenizer', 'tokenizer.json')):
    if os.path.isfile(path):
      return load_tokenizer(path), path
  try:
    path = tokenizer_path_of(data_cfg)
  except DataError as e:  # synthetic data, a moved cache, an unprepared corpus
    raise DataError(f'{workdir} has no tokenizer.json, and its data config gives none ({e}); '
                    'copy the tokenizer the run trained with to '
                    f'{workdir}/tokenizer.json') from None
  return load_tokenizer(path), path
