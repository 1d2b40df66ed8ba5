"""`python -m deepseek41.train --config=configs/tiny.py --workdir=/tmp/run [--config.train.steps=200]`.

Starts or resumes the run in --workdir (it resumes from the newest complete checkpoint there).
Multi-host: pass --coordinator_address, --num_processes and --process_id on every host (or rely
on jax.distributed's auto-detection on TPU / SLURM with --distributed; with neither, --distributed
exits 2). Launchers: `launch/local.sh NPROC` (one host), `launch/slurm.sbatch`,
`launch/tpu_pod.sh`, `launch/k8s/jobset.yaml` (README, "Several GPUs and hosts").
`--dry_run` builds the mesh against the visible devices, logs the process / device / mesh banner
and the per-device bytes of the state, and exits 0 before compiling anything.

Exit status (sysexits.h values where one fits):
  0   finished (train.steps, or --stop_at_step), with a checkpoint of the last step
  75  stopped by SIGTERM / SIGINT after saving a checkpoint, or during start-up with nothing to
      save (EX_TEMPFAIL): start it again to resume; a scheduler can requeue on 75
  74  writing the work directory failed during the run (EX_IOERR: full or unwritable disk): a
      checkpoint save failed, or did not finish within checkpoint.save_timeout_s (20 min), or
      metrics.jsonl stopped accepting lines (then a checkpoint of that step was saved first);
      complete checkpoints kept
  2   the run cannot start or go on as given: bad config, data, checkpoint or work directory
      (metrics.jsonl included), the work directory locked by another trainer, or a non-finite
      loss
  1   anything else (an unexpected error, with its traceback)
  130 / 143  a third SIGINT / SIGTERM: exited at once without waiting for a save in progress
      (128 + the signal's number); complete checkpoints kept

Signals (train/stop.py): the handler is installed before the flags are parsed and the
libraries imported, and only records the signal. The first stops the run at the next step
boundary with a checkpoint (before the first step: at once, nothing to save), the second is
logged, the third exits at once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from deepseek41.train.stop import STOP

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a get_config() file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory: config, metrics, checkpoints.')
_STOP_AT = flags.DEFINE_integer('stop_at_step', None, 'End this invocation (with a checkpoint) at '
                                'this step; the schedule still spans train.steps.')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize().')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process index.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Resolve the config, build the mesh, log the '
                             'process/device/mesh banner and per-device state bytes; exit 0 '
                             'without compiling.')
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
  distributed = bool(_DISTRIBUTED.value or _COORDINATOR.value)
  if distributed:
    if _cpu_only(jax):
      # Cross-process collectives on the CPU need an implementation (the default has none); it
      # is read when the backend starts, so before initialize() and any device query.
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    try:
      jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                                 num_processes=_NUM_PROCESSES.value,
                                 process_id=_PROCESS_ID.value)
    except ValueError as e:  # values missing or out of range, before any connection
      if 'defined' in str(e):
        # Auto-detection found no cluster and left a value unset; jax's own message
        # ("coordinator_address should be defined.") does not say why.
        logging.error('--distributed: %s jax.distributed found no cluster environment to read '
                      'it from (it detects SLURM job steps (srun), Cloud TPU VMs and GKE TPU '
                      'pods, Open MPI, and Kubernetes Jobs when the `kubernetes` package is '
                      'installed); pass --coordinator_address, --num_processes and '
                      '--process_id, or use launch/local.sh on one host (README, "Several GPUs '
                      'and hosts")', e)
      else:
        logging.error('jax.distributed.initialize: %s', e)
      sys.exit(EXIT_BAD_INPUT)
    STOP.reinstall()  # initialize() gave SIGTERM to its preemption notifier, which only logs it
  from deepseek41.config import ConfigError
  from deepseek41.data.shards import DataError
  from deepseek41.train.checkpoint import CheckpointError, CheckpointSaveError
  from deepseek41.train.trainer import MetricsWriteError, TrainingDiverged, dry_run, train
  from deepseek41.train.workdir import WorkdirError
  try:
    if _DRY_RUN.value:
      dry_run(_CONFIG.value)
      return
    result = train(_CONFIG.value, _WORKDIR.value, stop_at_step=_STOP_AT.value)
  except (CheckpointSaveError, MetricsWriteError) as e:
    logging.error('%s', e)
    # Without waiting for a failed save's threads: one stuck on the disk would hold the exit.
    _exit(EXIT_SAVE_FAILED, now=True)
  except (ConfigError, DataError, CheckpointError, WorkdirError, TrainingDiverged,
          FileNotFoundError) as e:
    logging.error('%s', e)
    _exit(EXIT_BAD_INPUT, now=distributed)
  except Exception:  # noqa: BLE001
    if not distributed:
      raise  # absl prints the traceback and exits 1
    logging.exception('unexpected error in process %d', jax.process_index())
    _exit(1, now=distributed)
  logging.getLogger('deepseek41').info(
      '%s at step %d (loss %s, eval loss %s)',
      'stopped by a signal' if result.stopped_by_signal else 'finished', result.step,
      result.last_loss, result.last_eval_loss)
  if result.stopped_by_signal:
    sys.exit(EXIT_STOPPED)


def _exit(code: int, now: bool):
  """Exit with `code`; `now`: without the interpreter's shutdown. A failed process of a
  multi-process run leaves at once: jax.distributed's exit-time shutdown would wait at a barrier
  for the others, which wait for it in their next collective, so the launcher would see a
  timeout instead of this failure. So does a failed save: the shutdown would join its threads."""
  if not now:
    sys.exit(code)
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _cpu_only(jax) -> bool:
  """True when the run will use the CPU backend, judged without starting a backend."""
  platforms = jax.config.jax_platforms or os.environ.get('JAX_PLATFORMS', '')
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  try:  # no platform asked for: the CPU unless a CUDA or TPU plugin is installed
    return not any(importlib.util.find_spec(m) for m in ('jax_cuda12_plugin', 'jax_cuda13_plugin',
                                                         'libtpu'))
  except (ImportError, ValueError):
    return True


EXIT_STOPPED = 75       # EX_TEMPFAIL: saved after a signal, resumable
EXIT_SAVE_FAILED = 74   # EX_IOERR
EXIT_BAD_INPUT = 2


def check_overrides(argv: list[str]) -> str | None:
  """Name a missing --config file, or an unknown `--config.a.b=c` key, before absl turns it
  into a long traceback."""
  config_file = _config_file(argv)
  if config_file is not None and not os.path.isfile(config_file.split(':', 1)[0]):
    return f'--config file {config_file!r} does not exist'
  from deepseek41.config import base_config, replaced_key_hint
  schema = base_config()
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    key = arg[len('--config.'):].split('=', 1)[0]
    node = schema
    for i, part in enumerate(key.split('.')):
      if not hasattr(node, 'keys') or part not in node:
        if replaced_key_hint(key):
          return f'{replaced_key_hint(key)}; in {arg!r}'
        known = ', '.join(sorted(node.keys())) if hasattr(node, 'keys') else ''
        where = '.'.join(key.split('.')[:i]) or 'the config'
        return (f'unknown config key {key!r} in {arg!r}' +
                (f'; {where} has: {known}' if known else ''))
      node = node[part]
  return None


def _config_file(argv: list[str]) -> str | None:
  """The value of --config in argv (`--config=F` or `--config F`), or None."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith('--config='):
      return arg[len('--config='):]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def run():
  """Console-script entry point (`ds41-train`)."""
  with STOP:  # before the imports and the flag parsing: a stop signal never goes unseen
    problem = check_overrides(sys.argv)
    if problem:
      print(f'error: {problem}', file=sys.stderr)
      sys.exit(2)
    app.run(main)


if __name__ == '__main__':
  run()
