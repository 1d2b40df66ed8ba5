"""Orbax checkpoints of a work directory: WORKDIR/checkpoints/<step>/{state,data,config,meta}.

- `state`: the train state pytree (params, optimizer state, step, router biases, RNG), saved
  sharded and restored onto whatever mesh the current run uses.
- `data`: the Grain iterator position (one JSON per process).
- `config`: the resolved run config; `meta`: the layout version and every leaf's shape/dtype.

Restore validates `meta` and `config` against the current model before reading any array, so a
mismatch is reported as a list of differences instead of a shape error deep inside Orbax.
Nothing here ever deletes a checkpoint except Orbax's own retention policy (max_to_keep /
keep_period) after a newer save has committed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import grain
import orbax.checkpoint as ocp

from deepseek41.config import LAYOUT_VERSION, CheckpointConfig

log = logging.getLogger(__name__)

# Model keys that change how the model is executed, not what it computes or stores.
EXECUTION_ONLY_MODEL_KEYS = frozenset({'moe_backend', 'attention_impl', 'compute_dtype',
                                       'capacity_factor', 'sparse_impl', 'sparse_chunk'})


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message names the step directory and what is wrong."""


def _diff(saved: Any, now: Any, prefix: str = '') -> list[str]:
  if isinstance(saved, dict) and isinstance(now, dict):
    out = []
    for k in sorted(set(saved) | set(now)):
      key = f'{prefix}.{k}' if prefix else str(k)
      if k not in now:
        out.append(f'{key}: in checkpoint, absent now')
      elif k not in saved:
        out.append(f'{key}: absent in checkpoint, present now')
      else:
        out += _diff(saved[k], now[k], key)
    return out
  return [] if saved == now else [f'{prefix}: checkpoint {saved!r} != now {now!r}']


def _normalise(x):
  return json.loads(json.dumps(x))


class Checkpointer:
  """One CheckpointManager per work directory."""

  def __init__(self, workdir: str, cfg: CheckpointConfig):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.max_to_keep,
        keep_period=cfg.keep_period or None,
        enable_async_checkpointing=cfg.async_save,
        create=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  # -- discovery -------------------------------------------------------------------------------

  def unfinished_saves(self) -> list[str]:
    return sorted(n for n in os.listdir(self.directory)
                  if re.match(r'^\d+\..*tmp', n) or n.endswith('.tmp'))

  def latest_step(self) -> int | None:
    for name in self.unfinished_saves():
      log.warning('skipping unfinished checkpoint save %s (interrupted while writing)',
                  os.path.join(self.directory, name))
    self.manager.reload()
    return self.manager.latest_step()

  # -- save ------------------------------------------------------------------------------------

  def save(self, step: int, state, data_iter, config_dict: dict, layout: dict,
           force: bool = False) -> bool:
    args = {
        'state': ocp.args.StandardSave(state),
        'config': ocp.args.JsonSave(_normalise(config_dict)),
        'meta': ocp.args.JsonSave({'layout_version': LAYOUT_VERSION, 'step': int(step),
                                   'layout': layout}),
    }
    if data_iter is not None:
      args['data'] = grain.checkpoint.CheckpointSave(data_iter)
    return self.manager.save(step, args=ocp.args.Composite(**args), force=force)

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()

  # -- restore ---------------------------------------------------------------------------------

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def read_json_item(self, step: int, item: str) -> dict:
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          **{item: ocp.args.JsonRestore()}))
      value = restored[item]
    except Exception as e:  # orbax raises many types for missing / truncated files
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} is corrupt or incomplete: cannot read its '
          f'{item!r} item ({type(e).__name__}: {e}). Move that directory aside to resume from '
          'the previous checkpoint.') from e
    if not isinstance(value, dict):
      raise CheckpointError(f'checkpoint {self.step_dir(step)}: {item!r} item is not a JSON object')
    return value

  def validate(self, step: int, layout: dict, config_dict: dict) -> list[str]:
    """Raise if the checkpoint does not fit the model; return warnings for benign differences."""
    meta = self.read_json_item(step, 'meta')
    saved_cfg = self.read_json_item(step, 'config')
    problems = []
    if meta.get('layout_version') != LAYOUT_VERSION:
      problems.append(f'layout version: checkpoint {meta.get("layout_version")} != '
                      f'now {LAYOUT_VERSION}')
    saved_layout = meta.get('layout', {})
    now_layout = _normalise(layout)
    for path in sorted(set(saved_layout) | set(now_layout)):
      if path not in now_layout:
        problems.append(f'state{path}: in checkpoint {saved_layout[path]}, absent in the model')
      elif path not in saved_layout:
        problems.append(f'state{path}: in the model {now_layout[path]}, absent in checkpoint')
      elif saved_layout[path] != now_layout[path]:
        problems.append(f'state{path}: checkpoint shape/dtype {saved_layout[path]} != '
                        f'model {now_layout[path]}')
    now_cfg = _normalise(config_dict)
    model_diffs = [d for d in _diff(saved_cfg.get('model', {}), now_cfg['model'], 'model')
                   if d.split(':')[0].split('.')[-1] not in EXECUTION_ONLY_MODEL_KEYS]
    problems += model_diffs
    if problems:
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} does not fit the configured model:\n  ' +
          '\n  '.join(problems) +
          '\nUse the config the checkpoint was written with, or a fresh --workdir.')
    warnings = []
    for section in ('data', 'train', 'mesh', 'checkpoint', 'log'):
      warnings += _diff(saved_cfg.get(section, {}), now_cfg[section], section)
    warnings += [d for d in _diff(saved_cfg.get('model', {}), now_cfg['model'], 'model')
                 if d not in model_diffs]
    return warnings

  def restore(self, step: int, target, data_iter):
    """Restore the state into `target` (ShapeDtypeStructs with the current shardings)."""
    args = {'state': ocp.args.StandardRestore(target)}
    if data_iter is not None:
      if not os.path.isdir(os.path.join(self.step_dir(step), 'data')):
        raise CheckpointError(f'checkpoint {self.step_dir(step)} has no data iterator state')
      args['data'] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**args))
    except CheckpointError:
      raise
    except Exception as e:
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} could not be restored ({type(e).__name__}: {e}). '
          'Move that directory aside to resume from the previous checkpoint.') from e
    return restored['state']
