"""`python -m deepseek41.train --config=configs/tiny.py --workdir=/tmp/run [--config.train.steps=200]`.

Starts or resumes the run in --workdir (it resumes from the newest complete checkpoint there).
Multi-host: pass --coordinator_address, --num_processes and --process_id on every host (or rely
on jax.distributed's auto-detection on TPU / SLURM with --distributed).
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a get_config() file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory: config, metrics, checkpoints.')
_STOP_AT = flags.DEFINE_integer('stop_at_step', None, 'End this invocation (with a checkpoint) at '
                                'this step; the schedule still spans train.steps.')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize().')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process index.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  # Our own progress at INFO; libraries (Orbax, JAX, Grain) only when they warn.
  logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(levelname)s %(message)s',
                      datefmt='%H:%M:%S', force=True)
  logging.getLogger('deepseek41').setLevel(logging.INFO)
  logging.getLogger('absl').setLevel(logging.WARNING)
  import jax
  if _DISTRIBUTED.value or _COORDINATOR.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
  from deepseek41.config import ConfigError
  from deepseek41.data.shards import DataError
  from deepseek41.train.checkpoint import CheckpointError
  from deepseek41.train.trainer import TrainingDiverged, train
  try:
    result = train(_CONFIG.value, _WORKDIR.value, stop_at_step=_STOP_AT.value)
  except (ConfigError, DataError, CheckpointError, TrainingDiverged, FileNotFoundError) as e:
    logging.error('%s', e)
    sys.exit(2)
  logging.getLogger('deepseek41').info('finished at step %d (loss %s, eval loss %s)%s', result.step, result.last_loss,
               result.last_eval_loss, ' after a stop signal' if result.stopped_by_signal else '')


def check_overrides(argv: list[str]) -> str | None:
  """Name an unknown `--config.a.b=c` key before absl turns it into a bare AttributeError."""
  from deepseek41.config import base_config
  schema = base_config()
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    key = arg[len('--config.'):].split('=', 1)[0]
    node = schema
    for i, part in enumerate(key.split('.')):
      if not hasattr(node, 'keys') or part not in node:
        known = ', '.join(sorted(node.keys())) if hasattr(node, 'keys') else ''
        where = '.'.join(key.split('.')[:i]) or 'the config'
        return (f'unknown config key {key!r} in {arg!r}' +
                (f'; {where} has: {known}' if known else ''))
      node = node[part]
  return None


def run():
  """Console-script entry point (`ds41-train`)."""
  problem = check_overrides(sys.argv)
  if problem:
    print(f'error: {problem}', file=sys.stderr)
    sys.exit(2)
  app.run(main)


if __name__ == '__main__':
  run()
