"""Metric writers: console progress, WORKDIR/metrics.jsonl, TensorBoard and (optionally) W&B.

metrics.jsonl holds one line per step of the run as it continues: a run resumed from the
checkpoint of step S first drops the lines of steps after S (they were written by a run that
stopped, or was killed, before saving them, and are trained again), so no step appears twice.
TensorBoard event files are append-only; its viewer shows the newest value of a step.

A metrics.jsonl that cannot be written is a WorkdirError at start-up (`check_writable`, before
anything is compiled). One that fails during the run (a full disk, a file system gone read-only)
does not raise where the line is written: the writer keeps the error (`error`) and goes on
logging to the console only, and the trainer saves a checkpoint at the step boundary and stops
with MetricsWriteError.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys

from tensorboardX import SummaryWriter
from tqdm import tqdm

from deepseek41.config import ConfigError
from deepseek41.train.workdir import WorkdirError

log = logging.getLogger(__name__)

FILE_NAME = 'metrics.jsonl'


class MetricsWriteError(RuntimeError):
  """metrics.jsonl could not be written during the run; the message names it and the cause."""


def check_writable(workdir: str) -> None:
  """Raise WorkdirError if the work directory's metrics.jsonl exists but cannot be read and
  appended to (a new one is created in the work directory, which the lock showed writable)."""
  path = os.path.join(workdir, FILE_NAME)
  if not os.path.lexists(path):
    return
  try:
    with open(path, 'r+'):  # read (a resume drops later steps) and write, changing nothing
      pass
  except OSError as e:
    raise _unusable(path, e) from e


def _unusable(path: str, e: OSError) -> WorkdirError:
  return WorkdirError(f'{path} cannot be written ({e.strerror or e}): the run appends its '
                      'metrics there; fix the file\'s permissions (or move it aside) or choose '
                      'another --workdir')


class MetricsWriter:
  """Writes one JSON object per logged step; only the primary process writes."""

  def __init__(self, workdir: str, *, tensorboard: bool, progress_bar: bool, total_steps: int,
               start_step: int, enabled: bool = True, wandb_project: str = '',
               wandb_mode: str = 'offline', run_config: dict | None = None):
    self.enabled = enabled
    self.path = os.path.join(workdir, FILE_NAME)
    self.error: MetricsWriteError | None = None  # the first failed write of metrics.jsonl
    try:
      if enabled:
        drop_steps_after(self.path, start_step)
      self.jsonl = open(self.path, 'a') if enabled else None
    except OSError as e:
      raise _unusable(self.path, e) from e
    self.tb = None
    if enabled and tensorboard:
      self.tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    self.wandb = None
    if enabled and wandb_project:
      self.wandb = _wandb_run(workdir, wandb_project, wandb_mode, run_config or {})
    self.bar = None
    if enabled and progress_bar:
      self.bar = tqdm(total=total_steps, initial=start_step, desc='train', unit='step',
                      dynamic_ncols=True, file=sys.stderr, mininterval=1.0)

  def write(self, step: int, scalars: dict[str, float]):
    if not self.enabled:
      return
    clean = {k: (float(v) if v is not None and math.isfinite(float(v)) else None)
             for k, v in scalars.items()}
    if self.jsonl is not None:
      try:
        self.jsonl.write(json.dumps({'step': int(step), **clean}) + '\n')
        self.jsonl.flush()
      except OSError as e:
        self._failed(step, e)
    if self.tb is not None:
      for k, v in clean.items():
        if v is not None:
          self.tb.add_scalar(k, v, step)
      self.tb.flush()
    if self.wandb is not None:
      self.wandb.log({k: v for k, v in clean.items() if v is not None}, step=int(step))
    summary = ' '.join(f'{k}={clean[k]:.4g}' for k in
                       ('loss', 'eval_loss', 'backbone_loss', 'dspark_accept_len',
                        'eval_dspark_accept_len', 'eval_dspark_ece', 'indexer_loss',
                        'indexer_recall', 'grad_norm', 'lr', 'tokens_per_s', 'mfu',
                        'peak_memory_gb')
                       if clean.get(k) is not None)
    if self.bar is not None:
      self.bar.write(f'step {step}: {summary}')
    else:
      log.info('step %d: %s', step, summary)

  def _failed(self, step: int, e: OSError) -> None:
    """Keep the error for the trainer (it saves and stops at the step boundary); the console
    goes on logging every step."""
    self.error = MetricsWriteError(f'cannot write {self.path} at step {step} '
                                   f'({e.strerror or e})')
    log.error('%s; the run saves a checkpoint and stops at this step boundary. Step lines from '
              'here on are only in the log.', self.error)
    jsonl, self.jsonl = self.jsonl, None
    try:
      jsonl.close()  # flushes what it still holds: may fail again, and that is known
    except OSError:
      pass

  def advance(self, step: int, loss: float | None = None):
    if self.bar is not None:
      if loss is not None:
        self.bar.set_postfix(loss=f'{loss:.4f}', refresh=False)
      self.bar.update(step - self.bar.n)  # redraws at most every mininterval

  def close(self):
    if self.bar is not None:
      self.bar.close()
    if self.tb is not None:
      self.tb.close()
    if self.wandb is not None:
      self.wandb.finish()
    if self.jsonl is not None:
      self.jsonl.close()


def _wandb_run(workdir: str, project: str, mode: str, run_config: dict):
  """One W&B run per work directory: its id comes from the directory, so a resumed training
  run continues the same W&B run."""
  try:
    import wandb
  except ImportError:
    raise ConfigError("log.wandb_project: set, but the wandb package is missing: "
                      "pip install -e '.[wandb]' (or leave log.wandb_project empty)") from None
  path = os.path.abspath(workdir)
  return wandb.init(project=project, mode=mode, dir=path, name=os.path.basename(path),
                    id='ds41-' + hashlib.sha1(path.encode()).hexdigest()[:12], resume='allow',
                    config=run_config)


def drop_steps_after(path: str, step: int) -> int:
  """Remove the lines of steps > `step` (all lines for a start from scratch, `step` 0) from a
  metrics.jsonl; returns how many were dropped. The file is replaced atomically."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      record_step = json.loads(line)['step']
    except (ValueError, KeyError, TypeError):
      continue  # a line cut short by a kill
    if 0 < step and record_step <= step:
      keep.append(line if line.endswith('\n') else line + '\n')
  dropped = len(lines) - len(keep)
  if dropped:
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
      f.writelines(keep)
    os.replace(tmp, path)
    log.info('metrics.jsonl: dropped %d line(s) after step %d, written by a run that did not '
             'checkpoint them', dropped, step)
  return dropped
