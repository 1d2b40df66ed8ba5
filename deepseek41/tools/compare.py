"""Compare runs: final and best values, the config keys that differ, and the curves.

    python -m deepseek41.tools.compare RUN_DIR [RUN_DIR ...] [--metrics=loss,eval_loss]
        [--out=curves.png | curves.html] [--smooth=0.9]

Reads each work directory's `metrics.jsonl` (a run still writing it is fine: a cut-off last line
is skipped) and `config.json` (the resolved config the trainer writes at its start). Prints one
table of the last and best value of each metric per run and one of the config keys whose values
differ; with `--out`, draws every metric against the step and against the tokens seen (step x
batch x sequence length), one colour per run (matplotlib: `pip install -e '.[plot]'`).
`--smooth` is an exponential moving average weight (0 = raw), applied to the drawn curves only
(not to held-out `eval*` metrics, logged too rarely for an average).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import sys

from absl import app, flags

METRICS = flags.DEFINE_list('metrics', ['loss', 'eval_loss'], 'Metrics to tabulate and draw.')
OUT = flags.DEFINE_string('out', '', 'Write the curves to this .png or .html file.')
SMOOTH = flags.DEFINE_float('smooth', 0.0, 'EMA weight for the drawn curves, in [0, 1).')

# Metrics where larger is better; every other one is best at its minimum (losses, ECE, times).
HIGHER_IS_BETTER = ('accept', 'recall', 'tokens_per_s', 'mfu', 'images_per_s')


class CompareError(ValueError):
  """A run directory or a flag that cannot be used; the message names it."""


def read_run(workdir: str) -> dict:
  """{'name', 'records': [metrics dicts], 'config': dict or {}} of one work directory."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.isfile(path):
    raise CompareError(f'{workdir}: no metrics.jsonl (not a deepseek41 work directory, or the '
                       'run has not logged a step yet)')
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # the line a running trainer is writing
  config = {}
  config_path = os.path.join(workdir, 'config.json')
  if os.path.isfile(config_path):
    with open(config_path) as f:
      config = json.load(f)
  return {'name': os.path.basename(os.path.normpath(workdir)), 'records': records,
          'config': config}


def series(run: dict, metric: str) -> list[tuple[int, float]]:
  """(step, value) of every record that has the metric (finite values only)."""
  out = []
  for r in run['records']:
    v = r.get(metric)
    if isinstance(v, (int, float)) and math.isfinite(v):
      out.append((int(r['step']), float(v)))
  return out


def tokens_per_step(run: dict) -> int | None:
  train, data = run['config'].get('train', {}), run['config'].get('data', {})
  if 'batch_size' in train and 'seq_len' in data:
    return int(train['batch_size']) * int(data['seq_len'])
  return None


def summary(runs: list[dict], metrics: list[str]) -> list[dict]:
  """Per run and metric: last value and step, best value and step (None where never logged)."""
  rows = []
  for run in runs:
    for metric in metrics:
      points = series(run, metric)
      row = {'run': run['name'], 'metric': metric, 'last': None, 'last_step': None,
             'best': None, 'best_step': None}
      if points:
        higher = any(h in metric for h in HIGHER_IS_BETTER)
        best = max(points, key=lambda p: p[1]) if higher else min(points, key=lambda p: p[1])
        row.update(last=points[-1][1], last_step=points[-1][0], best=best[1], best_step=best[0])
      rows.append(row)
  return rows


def _flatten(d: dict, prefix: str = '') -> dict:
  out = {}
  for k, v in d.items():
    key = f'{prefix}{k}'
    if isinstance(v, dict):
      out.update(_flatten(v, key + '.'))
    else:
      out[key] = v
  return out


def config_differences(runs: list[dict]) -> dict[str, list]:
  """Config key -> its value in each run, for the keys whose values are not all equal."""
  flat = [_flatten(run['config']) for run in runs]
  keys = sorted(set().union(*flat))
  missing = object()
  out = {}
  for key in keys:
    values = [f.get(key, missing) for f in flat]
    if any(v != values[0] for v in values):
      out[key] = ['(absent)' if v is missing else v for v in values]
  return out


def _fmt(v) -> str:
  if v is None:
    return '-'
  return f'{v:.4g}' if isinstance(v, float) else str(v)


def report(runs: list[dict], metrics: list[str]) -> str:
  lines = ['| run | metric | last (step) | best (step) |', '|---|---|---:|---:|']
  for r in summary(runs, metrics):
    lines.append(f"| {r['run']} | {r['metric']} | {_fmt(r['last'])} ({_fmt(r['last_step'])}) | "
                 f"{_fmt(r['best'])} ({_fmt(r['best_step'])}) |")
  diffs = config_differences(runs)
  lines += ['', 'config keys that differ:' if diffs else 'the configs do not differ']
  if diffs:
    lines += ['| key | ' + ' | '.join(run['name'] for run in runs) + ' |',
              '|---|' + '---|' * len(runs)]
    lines += [f'| {k} | ' + ' | '.join(_fmt(v) for v in vals) + ' |' for k, vals in diffs.items()]
  return '\n'.join(lines)


def smoothed(values: list[float], weight: float) -> list[float]:
  """Exponential moving average, debiased at the start (the first point is itself)."""
  out, avg, norm = [], 0.0, 0.0
  for v in values:
    avg = weight * avg + (1 - weight) * v
    norm = weight * norm + (1 - weight)
    out.append(avg / norm)
  return out


def drawn_series(run: dict, metric: str, smooth: float) -> tuple[list[int], list[float]]:
  """The steps and values drawn for one run's metric: smoothed, except held-out metrics."""
  points = series(run, metric)
  # Held-out metrics come a few points a run: an EMA over them lags by hundreds of steps.
  weight = 0.0 if metric.startswith('eval') else smooth
  return [s for s, _ in points], smoothed([v for _, v in points], weight)


def draw(runs: list[dict], metrics: list[str], out: str, smooth: float = 0.0) -> None:
  """Each metric against the step (left) and the tokens seen (right), one line per run."""
  if not out.endswith(('.png', '.html')):
    raise CompareError(f'--out={out}: write a .png or an .html file')
  if not 0.0 <= smooth < 1.0:
    raise CompareError(f'--smooth={smooth}: must be in [0, 1)')
  try:
    import matplotlib
    matplotlib.use('Agg')  # files only, no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    raise CompareError("--out needs matplotlib: pip install -e '.[plot]'") from None
  # The tokens column only where some run's config.json gives its tokens per step.
  xlabels = ('step', 'tokens') if any(tokens_per_step(r) for r in runs) else ('step',)
  fig, axes = plt.subplots(len(metrics), len(xlabels), figsize=(5.5 * len(xlabels),
                                                                 3.2 * len(metrics)),
                           squeeze=False)
  for row, metric in enumerate(metrics):
    for run in runs:
      steps, values = drawn_series(run, metric, smooth)
      if not steps:
        continue
      axes[row, 0].plot(steps, values, label=run['name'])
      per_step = tokens_per_step(run)
      if per_step and len(xlabels) == 2:
        axes[row, 1].plot([s * per_step for s in steps], values, label=run['name'])
    if len(xlabels) == 2:
      axes[row, 1].xaxis.set_major_formatter(matplotlib.ticker.EngFormatter())  # 150k, 2M
    for col, xlabel in enumerate(xlabels):
      axes[row, col].set_xlabel(xlabel)
      axes[row, col].set_ylabel(metric)
      axes[row, col].grid(alpha=0.3)
    axes[row, 0].legend(fontsize=8)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format='png', dpi=110)
  plt.close(fig)
  directory = os.path.dirname(os.path.abspath(out))
  os.makedirs(directory, exist_ok=True)
  if out.endswith('.png'):
    with open(out, 'wb') as f:
      f.write(buf.getvalue())
    return
  image = base64.b64encode(buf.getvalue()).decode()
  with open(out, 'w') as f:
    f.write('<!doctype html><meta charset="utf-8"><title>deepseek41 runs</title>\n'
            f'<pre>{report(runs, metrics)}</pre>\n'
            f'<img alt="curves" src="data:image/png;base64,{image}">\n')


def main(argv):
  if len(argv) < 2:
    raise app.UsageError('give one or more run directories')
  try:
    runs = [read_run(d) for d in argv[1:]]
    metrics = [m for m in METRICS.value if m]
    logged = set().union(*(set(r) for run in runs for r in run['records']))
    unknown = [m for m in metrics if m not in logged]
    if unknown:
      names = sorted(k for k in logged if k != 'step' and '/' not in k)  # not the per-layer keys
      print(f'note: never logged by these runs: {", ".join(unknown)} (logged: '
            f'{", ".join(names)}, and per-layer keys)', file=sys.stderr)
    print(report(runs, metrics))
    no_tokens = [run['name'] for run in runs if not tokens_per_step(run)]
    if OUT.value and no_tokens:
      print(f'note: no train.batch_size and data.seq_len in the config.json of '
            f'{", ".join(no_tokens)}: drawn against the step only', file=sys.stderr)
    if OUT.value:
      draw(runs, metrics, OUT.value, SMOOTH.value)
      print(f'wrote {OUT.value}')
  except CompareError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def run():
  app.run(main)


if __name__ == '__main__':
  run()
