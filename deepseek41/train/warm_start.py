"""Where a run's state comes from before its first step (docs/design.md, "Objectives").

- Resume: the newest checkpoint of the run's own work directory, whole (optimizer state, step,
  RNG and data position included), once it is checked to fit the configured model.
- A fresh run: initialised, then loaded with what the run starts from: the objective's warm
  starts (the DSpark backbone, `dspark.backbone_checkpoint`), then `checkpoint.init_from` (another
  run's checkpoint, e.g. an HF import `deepseek41.tools.convert import` wrote; docs/hf_interop.md,
  "Training from imported weights"). Only parameters and router biases are read; the optimizer
  state and the step start fresh.

One check reads a step directory a config key names (`step_directory`); one rule says whether a
checkpoint holds this run's model (`model_differences`: only the keys that choose how the model
is executed may differ); a resume continues the optimizer that wrote the checkpoint
(`check_same_optimizer`: `train.optimizer` may not change); one path restores another checkpoint's
weights (`restore_weights`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import jax
import numpy as np

from deepseek41.config import (LAYOUT_VERSION, MeshConfig, RunConfig, config_from_saved, resolve,
                               upgrade_saved_model)
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import (EXECUTION_ONLY_MODEL_KEYS, CheckpointError, Checkpointer,
                                         complete_steps)
from deepseek41.train.objectives import BACKBONE, MODEL, Objective, WarmStart, objective_for
from deepseek41.train.optimizer import make_optimizer

log = logging.getLogger(__name__)

# Sections compared on resume beyond the model: a difference is reported, never refused.
_RUN_SECTIONS = ('data', 'train', 'mesh', 'checkpoint', 'log', 'dspark', 'tasks')
# [I] How many entries a CSA2 query selects: no weight depends on it. A warm start
# (checkpoint.init_from) may change it, e.g. a wide selection while a short stage learns the
# tasks, then the model's own (benchmarks/gpu_longctx.sh SHORT_EXTRA); a resume may not.
SELECTION_SIZE_KEYS = ('index_topk', 'candidate_topk_blocks')
INIT_FROM = 'checkpoint.init_from'


# ---- the rules ---------------------------------------------------------------------------------


def step_directory(key: str, path: str) -> tuple[str, int]:
  """(work directory, step) of `path`, the value of config key `key`: WORKDIR/checkpoints/<step>."""
  full = os.path.abspath(path) if path else ''
  step, parent = os.path.basename(full), os.path.dirname(full)
  if not (full and os.path.isdir(full) and step.isdigit()
          and os.path.basename(parent) == 'checkpoints'):
    raise CheckpointError(f'{key}={path!r} is not a checkpoint step directory '
                          '(WORKDIR/checkpoints/<step>)')
  return os.path.dirname(parent), int(step)


def model_differences(saved_model: dict, model_now: dict, tolerated: tuple[str, ...] = ()
                      ) -> tuple[list[str], list[str]]:
  """How a checkpoint's saved model section differs from this run's, one 'model.<key>: ...' line
  per key: (the differences that make it another model, those in keys that only choose how the
  model is executed or that the caller tolerates, e.g. `SELECTION_SIZE_KEYS` for a warm start).
  The execution keys resolve from 'auto' per backend, so they never block: a GPU checkpoint
  resumes on the CPU. Replaced keys are compared as their successors (`upgrade_saved_model`: a
  checkpoint saved with `model.csa2` holds the same model as one with the matching
  `model.attention_variant`)."""
  lines = _diff(_as_json(upgrade_saved_model(saved_model)), _as_json(model_now), 'model')
  allowed = set(EXECUTION_ONLY_MODEL_KEYS) | set(tolerated)
  same_model = [d for d in lines if d.split(':')[0].split('.')[-1] in allowed]
  return [d for d in lines if d not in same_model], same_model


def layout_problems(meta: dict, layout: dict, entries: tuple[str, ...] | None = None) -> list[str]:
  """How a checkpoint's `meta` item (its layout version and every leaf's shape and dtype)
  differs from `layout` (state_lib.state_layout); `entries`: compare only those state entries."""
  problems = []
  if meta.get('layout_version') != LAYOUT_VERSION:
    problems.append(f'layout version: checkpoint {meta.get("layout_version")} != '
                    f'now {LAYOUT_VERSION}')
  saved_layout, now_layout = meta.get('layout', {}), _as_json(layout)
  if entries is not None:
    saved_layout = {p: v for p, v in saved_layout.items()
                    if any(p.startswith(f"['{e}']") for e in entries)}
  for path in sorted(set(saved_layout) | set(now_layout)):
    if path not in now_layout:
      problems.append(f'state{path}: in checkpoint {saved_layout[path]}, absent in the model')
    elif path not in saved_layout:
      problems.append(f'state{path}: in the model {now_layout[path]}, absent in checkpoint')
    elif saved_layout[path] != now_layout[path]:
      problems.append(f'state{path}: checkpoint shape/dtype {saved_layout[path]} != '
                      f'model {now_layout[path]}')
  return problems


def check_same_optimizer(step_dir: str, saved_cfg: dict, now_cfg: dict) -> None:
  """Raise CheckpointError naming `train.optimizer` if the checkpoint's optimizer state was
  written by another optimizer than this run's (checked before the layout, which differs too:
  the key is the cause). Checkpoints from before the key existed were AdamW's."""
  then = saved_cfg.get('train', {}).get('optimizer', 'adamw')
  now = now_cfg['train']['optimizer']
  if then != now:
    raise CheckpointError(
        f'train.optimizer: checkpoint {step_dir} holds the state of {then!r}, this run trains with '
        f'{now!r}; an optimizer state continues only under the optimizer that wrote it. Resume '
        f'with train.optimizer={then!r}, or start a fresh --workdir from its weights '
        f'(checkpoint.init_from={step_dir}: the new optimizer starts fresh).')


def check_fits(ckpt: Checkpointer, step: int, layout: dict, config_dict: dict) -> list[str]:
  """Raise CheckpointError if checkpoint `step` does not fit the configured model (its layout,
  its model keys); return the differences that do not matter (other run settings, execution
  choices), for the log."""
  meta = ckpt.read_json_item(step, 'meta')
  saved_cfg = ckpt.read_json_item(step, 'config')
  now_cfg = _as_json(config_dict)
  check_same_optimizer(ckpt.step_dir(step), saved_cfg, now_cfg)
  another_model, execution = model_differences(saved_cfg.get('model', {}), now_cfg['model'])
  problems = layout_problems(meta, layout) + another_model
  if problems:
    raise CheckpointError(
        f'checkpoint {ckpt.step_dir(step)} does not fit the configured model:\n  ' +
        '\n  '.join(problems) +
        '\nUse the config the checkpoint was written with, or a fresh --workdir.')
  warnings = []
  for section in _RUN_SECTIONS:
    if section in saved_cfg:  # checkpoints from before a section existed: nothing to compare
      warnings += _diff(saved_cfg[section], now_cfg[section], section)
  return warnings + execution


# ---- another checkpoint's weights --------------------------------------------------------------


def restore_weights(key: str, path: str, cfg: RunConfig, mesh) -> tuple[Objective, dict, str]:
  """(the objective that wrote it, its weights, its step directory) of the checkpoint at `path`,
  which config key `key` names: the model's state entries only (no optimizer state is read),
  restored onto `mesh` under the checkpoint's own config. Raises CheckpointError naming `key` if
  it holds another model than this run's."""
  workdir, step = step_directory(key, path)
  ckpt = Checkpointer(workdir, cfg.checkpoint, primary=False)
  try:
    step_dir, source, abstract = _checked_source(key, ckpt, step, cfg)
    objective = objective_for(source)
    _verify(ckpt, step)
    target = state_lib.with_shardings(
        abstract, state_lib.state_shardings(abstract, mesh, cfg.mesh.rules))
    restored = ckpt.restore_parts(step, {k: target[k] for k in objective.model_entries})
  finally:
    ckpt.close()
  return objective, restored, step_dir


def check_warm_starts(cfg: RunConfig, workdir: str) -> None:
  """Before anything compiles: if the run in `workdir` starts fresh (no checkpoint of its own),
  every checkpoint it starts from exists and holds this model, so a wrong path or another
  model's checkpoint fails in seconds with the key named, not after minutes of compilation.
  Reads only the checkpoints' config and layout items. A resume ignores the warm starts."""
  if complete_steps(os.path.join(workdir, 'checkpoints')):
    return
  for start in _warm_starts(cfg):
    source_dir, step = step_directory(start.key, start.path)
    source_ckpt = Checkpointer(source_dir, cfg.checkpoint, primary=False)
    try:
      _checked_source(start.key, source_ckpt, step, cfg)
    finally:
      source_ckpt.close()


def _checked_source(key: str, ckpt: Checkpointer, step: int, cfg: RunConfig
                    ) -> tuple[str, RunConfig, dict]:
  """(step directory, the config its weights restore under, that config's abstract state) of
  checkpoint `step` of `ckpt`, which config key `key` names; raises CheckpointError naming `key`
  unless it holds this run's model, leaf for leaf."""
  step_dir = ckpt.step_dir(step)
  saved = ckpt.read_json_item(step, 'config')
  another_model, same_model = model_differences(
      saved.get('model', {}), cfg.to_dict()['model'],
      SELECTION_SIZE_KEYS if key == INIT_FROM else ())
  if same_model:
    log.info('%s: the same model, run otherwise: %s', key, '; '.join(same_model))
  if another_model:
    raise CheckpointError(
        f'{key}: {step_dir} holds another model: ' + '; '.join(another_model[:5])
        + (f' (and {len(another_model) - 5} more)' if len(another_model) > 5 else '')
        + '. Give a checkpoint of this model, or set the model section to the one it was '
        'trained with.')
  source = _source_config(cfg, saved)
  entries = objective_for(source).model_entries
  abstract = state_lib.abstract_state(source, make_optimizer(source.train))
  problems = layout_problems(ckpt.read_json_item(step, 'meta'),
                             state_lib.state_layout({k: abstract[k] for k in entries}), entries)
  if problems:
    raise CheckpointError(f'{key}: {step_dir} does not hold the weights its config describes: '
                          + '; '.join(problems[:5]))
  return step_dir, source, abstract


def _source_config(cfg: RunConfig, saved: dict) -> RunConfig:
  """The config a checkpoint's weights are restored under: this run's with the checkpoint's own
  dspark section (which objective wrote it, the drafter's shape). Its model section is this
  run's: `model_differences` leaves only execution choices to differ, and those shape no weight."""
  c = config_from_saved(cfg.to_dict())
  c.dspark = config_from_saved(saved, ('dspark',)).dspark
  devices = math.prod(getattr(cfg.mesh, axis) for axis in MeshConfig.AXES)
  return resolve(c, num_devices=devices)


def load_warm_start(cfg: RunConfig, objective: Objective, state: dict, start: WarmStart,
                    mesh) -> dict:
  """`state` with the weights `start` names: its whole model (MODEL) or its backbone (BACKBONE),
  every leaf by name and shape; nothing else of `state` changes."""
  source, restored, step_dir = restore_weights(start.key, start.path, cfg, mesh)
  if start.part == BACKBONE:
    mine, theirs = objective.backbone_weights(state), source.backbone_weights(restored)
    grafted = {g: _grafted(start.key, step_dir, g, mine[g], state_lib.named_leaves(theirs[g]))
               for g in ('params', 'router_bias')}
    out = objective.with_backbone(state, grafted)
    what = 'the backbone'
  elif start.part == MODEL:  # trained and frozen parameters alike, whatever their split there
    theirs = {'params': {}, 'router_bias': state_lib.named_leaves(restored['router_bias'])}
    for entry in ('params', 'frozen'):
      theirs['params'].update(state_lib.named_leaves(restored.get(entry, {})))
    out = dict(state)
    for entry in objective.model_entries:
      group = 'router_bias' if entry == 'router_bias' else 'params'
      out[entry] = _grafted(start.key, step_dir, entry, state[entry], theirs[group])
    what = 'the parameters and router biases'
  else:
    raise ValueError(f'{start.key}: a warm start loads {MODEL!r} or {BACKBONE!r}, not '
                     f'{start.part!r}')
  log.info('%s: %s from %s; the optimizer state and the step start fresh', start.key, what,
           step_dir)
  return out


def _grafted(key: str, step_dir: str, group: str, mine, theirs: dict[str, Any]):
  """`mine` (a tree of weights) with each leaf replaced by `theirs[its dotted name]`, in its own
  dtype (the same: the dtype is a model key)."""
  named = state_lib.named_leaves(mine)
  for name, x in named.items():
    if name not in theirs:
      raise CheckpointError(f'{key}: {step_dir} has no {group} {name}')
    if np.shape(theirs[name]) != np.shape(x):
      raise CheckpointError(f'{key}: {group} {name} has shape {np.shape(theirs[name])} there, '
                            f'{np.shape(x)} here')
  return jax.tree.unflatten(jax.tree.structure(mine),
                            [theirs[name].astype(x.dtype) for name, x in named.items()])


def load_warm_starts(cfg: RunConfig, state: dict, mesh) -> dict:
  """`state` (a fresh initialisation) with everything the run starts from, in order: the
  objective's warm starts, then `checkpoint.init_from` (the whole model)."""
  objective = objective_for(cfg)
  for start in _warm_starts(cfg):
    state = load_warm_start(cfg, objective, state, start, mesh)
  return state


def _warm_starts(cfg: RunConfig) -> list[WarmStart]:
  """What a fresh run starts from, in the order it is loaded."""
  starts = list(objective_for(cfg).warm_starts())
  if cfg.checkpoint.init_from:
    starts.append(WarmStart(INIT_FROM, cfg.checkpoint.init_from, MODEL))
  return starts


# ---- the run's own state -----------------------------------------------------------------------


def initial_state(cfg: RunConfig, ckpt: Checkpointer, tx, mesh, abstract, shardings,
                  layout: dict, train_iter) -> tuple[dict, int]:
  """(state, step): restored from the newest checkpoint of the run after checking it, or
  initialised and loaded with what the run starts from (`load_warm_starts`)."""
  start = ckpt.latest_step()
  if start is None:
    t0 = time.perf_counter()
    state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
    jax.block_until_ready(state)
    # One program draws every parameter: its compile grows with the parameter count (50-70 s
    # for configs/ablation_1b.py on the H200; docs/performance.md section 10.3), and the
    # persistent compilation cache keeps it for the next fresh start.
    log.info('initialised the parameters and optimizer state in %.1f s (compilation included)',
             time.perf_counter() - t0)
    return load_warm_starts(cfg, state, mesh), 0
  _verify(ckpt, start)
  for w in check_fits(ckpt, start, layout, cfg.to_dict()):
    log.warning('config differs from checkpoint %d: %s', start, w)
  state = ckpt.restore(start, state_lib.with_shardings(abstract, shardings), train_iter)
  log.info('resumed from %s', ckpt.step_dir(start))
  if int(jax.device_get(state['step'])) != start:
    raise RuntimeError(f'checkpoint {start} holds state step {int(state["step"])}')
  return state, start


# ---- helpers -----------------------------------------------------------------------------------


def _verify(ckpt: Checkpointer, step: int) -> None:
  """Checksums first (a corrupt checkpoint raises, naming its files); one without them restores
  with a note."""
  if not ckpt.verify(step):
    log.warning('checkpoint %s has no checksums (written before they were recorded, or the run '
                'stopped right after the save): restoring it unverified', ckpt.step_dir(step))


def _as_json(x):
  return json.loads(json.dumps(x))


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
