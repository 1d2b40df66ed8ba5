"""`python -m deepseek41.eval --workdir=RUN [--step=N] --tasks=passkey@4k,mqar@16k
[--depths=0,0.5,1] [--examples=N] [--batch_size=N] [--heldout_batches=N] [--generate]
[--noselection] [--out=PREFIX]`

Restores a checkpoint (default: the newest) of a training run, a DSpark stage or an HF import,
and reports the held-out loss per data source and each task's accuracy per context length and
depth: teacher-forced through the model's forward (an answer is right when every one of its
tokens is the argmax), and with --generate also greedily decoded. For a CSA2 model the same
forward measures each CSA2 layer's selection against dense attention at the rows that predict
an answer (the indexer's recall of the dense top-k, whether the answer's entry is visible,
among the dense top-k, selected, in the sliding window; --noselection skips it). Prints the
tables and writes PREFIX.json (default WORKDIR/eval/step<N>; the selection per layer too) and,
where matplotlib is installed (the `plot` extra), the heat map PREFIX.png (PREFIX_decoded.png
for --generate). Exit status 2 on bad input, naming it.

PREFIX.json is written as the evaluation goes, after each task, length and depth, with
"complete": false until the end: a SIGTERM or Ctrl-C (a preemption, a job's time limit) stops
it with the cells it finished kept there and listed (exit status 143 or 130). Run the same
command again and it resumes: the held-out losses and finished cells of an interrupted
PREFIX.json of the same checkpoint and options are kept, the rest evaluated (--noresume
starts over).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from absl import app, flags, logging

from deepseek41.config import ConfigError, parse_task_specs
from deepseek41.data.shards import DataError
from deepseek41.eval import report as report_lib
from deepseek41.eval.restore import EvalError, open_checkpoint
from deepseek41.eval.run import Options, evaluate

_WORKDIR = flags.DEFINE_string('workdir', None, 'Work directory of a run (or an HF import).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).')
_TASKS = flags.DEFINE_string('tasks', None, 'task@length,... e.g. passkey@4k,mqar@256 (tasks: '
                             'mqar, passkey, needle; default: the run\'s train.eval_tasks).')
_DEPTHS = flags.DEFINE_list('depths', None, 'Depths in [0, 1] (default: tasks.eval_depths).')
_EXAMPLES = flags.DEFINE_integer('examples', None, 'Documents per task, length and depth '
                                 '(default: tasks.eval_examples).')
_BATCH = flags.DEFINE_integer('batch_size', 0, 'Rows per batch (0: about the training '
                              'batch\'s tokens at each length).')
_HELDOUT = flags.DEFINE_integer('heldout_batches', None, 'Held-out batches per source '
                                '(default: train.eval_batches; 0: no held-out loss).')
_GENERATE = flags.DEFINE_bool('generate', False, 'Also decode each answer greedily.')
_SELECTION = flags.DEFINE_bool('selection', True, 'CSA2 models: also measure each CSA2 layer\'s '
                               'selection against dense attention at the answers (the dense '
                               'and window variants select nothing).')
_OUT = flags.DEFINE_string('out', None, 'Output path prefix (default: WORKDIR/eval/step<N>).')
_PLOT = flags.DEFINE_bool('plot', True, 'Write the heat map (needs matplotlib).')
_RESUME = flags.DEFINE_bool('resume', True, 'Keep the finished cells of an interrupted '
                            'PREFIX.json of the same checkpoint and options.')


class Interrupted(Exception):
  """SIGTERM or SIGINT during the evaluation."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise_interrupted(signum, frame):
  del frame
  raise Interrupted(signum)


def _previous_report(path: str) -> dict | None:
  """The report at `path`, if there is a readable one (the eval command writes it atomically;
  anything else there is left to be overwritten)."""
  try:
    with open(path) as f:
      report = json.load(f)
  except (OSError, ValueError):
    return None
  return report if isinstance(report, dict) else None


def main(argv) -> int:
  del argv
  logging.set_verbosity(logging.WARNING)  # the checkpoint library's per-read lines
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, _raise_interrupted)
  partial: dict = {}  # the report as last written
  shown = {'cells': None, 'since': time.monotonic()}  # progress lines printed so far

  def progress(report: dict):
    report_lib.write_json(report, prefix + '.json')
    partial['report'] = report
    done = report_lib.finished_cells(report)
    if shown['cells'] is None:  # after the held-out losses (or the cells a resume keeps)
      print(f'{report["cells"] - done} of {report["cells"]} task cells to evaluate '
            f'({prefix}.json after each)', file=sys.stderr, flush=True)
    else:
      for line in report_lib.progress_lines(report, shown['cells'],
                                            time.monotonic() - shown['since']):
        print(line, file=sys.stderr, flush=True)
    shown.update(cells=done, since=time.monotonic())

  try:
    if not _WORKDIR.value:
      raise EvalError('--workdir is required')
    try:
      depths = None if _DEPTHS.value is None else tuple(float(d) for d in _DEPTHS.value)
    except ValueError:
      raise EvalError(f'--depths: {",".join(_DEPTHS.value)} are not numbers') from None
    ck = open_checkpoint(_WORKDIR.value, _STEP.value)
    prefix = _OUT.value or os.path.join(ck.workdir, 'eval', f'step{ck.step}')
    spec = ck.cfg.train.eval_tasks if _TASKS.value is None else _TASKS.value
    specs = parse_task_specs(spec, '--tasks')
    if not specs:
      raise EvalError('--tasks: give at least one task@length (e.g. passkey@4k); the run has '
                      'no train.eval_tasks')
    previous = _previous_report(prefix + '.json') if _RESUME.value else None
    report = evaluate(ck, Options(specs=specs, examples=_EXAMPLES.value, depths=depths,
                                  rows=_BATCH.value, heldout_batches=_HELDOUT.value,
                                  generate=_GENERATE.value, selection=_SELECTION.value),
                      progress=progress, previous=previous)
  except (EvalError, ConfigError, DataError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except Interrupted as e:
    report = partial.get('report')
    if report is None:
      print(f'interrupted ({e}) before anything was written', file=sys.stderr)
    else:
      print(report_lib.table(report))
      print(f'interrupted ({e}): {prefix}.json holds the {report_lib.finished_cells(report)} '
            f'of {report["cells"]} task cells that finished ("complete": false)', file=sys.stderr)
    return 128 + e.signum
  for signum in (signal.SIGTERM, signal.SIGINT):  # the last write is atomic either way
    signal.signal(signum, signal.SIG_DFL)
  report_lib.write_json(report, prefix + '.json')
  print(report_lib.table(report))
  if report.get('resumed'):
    print(f'resumed: {report["resumed"]} of the {report["cells"]} task cells were kept from '
          f'the interrupted {prefix}.json')
  written = [prefix + '.json']
  if _PLOT.value:
    try:
      report_lib.heat_map(report, prefix + '.png')
      written.append(prefix + '.png')
      if 'generated' in report:
        report_lib.heat_map(report, prefix + '_decoded.png', key='generated')
        written.append(prefix + '_decoded.png')
    except ImportError:
      print('no heat map: matplotlib is not installed (pip install -e \'.[plot]\')')
  print('wrote ' + ', '.join(written))
  return 0


def run():
  app.run(lambda argv: sys.exit(main(argv)))


if __name__ == '__main__':
  run()
