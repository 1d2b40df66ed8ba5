"""Side by side: the accuracy of each task at each length (mean over depths) in several reports
of `python -m deepseek41.eval` (e.g. the three variants of benchmarks/gpu_longctx.sh).

    python3 benchmarks/summarize_longctx.py OUT/longctx_csa2.json OUT/longctx_dense.json ... \
        [--plot=PATH.png]

Standard library only (`--plot`, the reports' heat maps one row each, needs matplotlib:
deepseek41/eval/report.py). One column per report (named by its file, less gpu_longctx.sh's
`longctx_`), one row per task@length; then, for the reports of CSA2 models, the selection at the
answers (model/diagnostics.py: the share of answers whose entry the layers select, the indexer's
recall of the dense top-k, and the share of a query's picks the row before it also picked, which
sets the merged key/value gradient's worth, docs/performance.md part B; a report without
selection shows '-'); the last rows are the held-out losses per source.

Reports with one name (the same variant's runs with other seeds, in other directories) are
pooled into one column: each task, length and depth counts all their answers, the selection
measures are weighted by answers, the held-out losses averaged.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepseek41.eval.report import comparison_map  # noqa: E402  (stdlib only at import)


def _load(path: str) -> tuple[str, dict]:
  """(name, report): the file's name without gpu_longctx.sh's `longctx_` (the variant)."""
  name = os.path.splitext(os.path.basename(path))[0]
  with open(path) as f:
    report = json.load(f)
  name = name.removeprefix('longctx_') or name
  if report.get('complete') is False:  # an interrupted evaluation's cells so far
    name += ' (partial)'
  return name, report


def _pool_tasks(entries: list[dict]) -> list[dict]:
  """One entry per (label, depth): answers summed, accuracy and the selection's top-level
  measures over all of them."""
  groups: dict[tuple, list[dict]] = {}
  for t in entries:
    groups.setdefault((t['label'], t['depth']), []).append(t)
  out = []
  for runs in groups.values():
    answers = sum(t['answers'] for t in runs)
    merged = {k: runs[0][k] for k in ('task', 'length', 'label', 'depth')}
    merged.update(answers=answers, correct=sum(t['correct'] for t in runs))
    merged['acc'] = merged['correct'] / answers if answers else 0.0
    measures = {m for t in runs for m in t.get('selection', {}) if m != 'layers'}
    if measures:
      merged['selection'] = {
          m: sum(t['selection'][m] * t['answers'] for t in runs) / answers
          for m in measures if answers and all(m in t.get('selection', {}) for t in runs)}
    out.append(merged)
  return out


def pooled(reports: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
  """The reports with one name merged into one (module docstring), in first-seen order."""
  groups: dict[str, list[dict]] = {}
  for name, report in reports:
    groups.setdefault(name, []).append(report)
  out = []
  for name, runs in groups.items():
    if len(runs) == 1:
      out.append((name, runs[0]))
      continue
    merged = {'runs': len(runs),
              'tasks': _pool_tasks([t for r in runs for t in r.get('tasks', [])])}
    if any('generated' in r for r in runs):
      merged['generated'] = _pool_tasks([t for r in runs for t in r.get('generated', [])])
    sources = {s for r in runs for s in r.get('heldout_loss', {})}
    merged['heldout_loss'] = {
        s: sum(r['heldout_loss'][s] for r in runs) / len(runs)
        for s in sources if all(s in r.get('heldout_loss', {}) for r in runs)}
    out.append((name, merged))
  return out


def by_label(report: dict, key: str = 'tasks') -> dict[str, float]:
  """task@length -> accuracy over all its depths."""
  totals: dict[str, list[int]] = {}
  for t in report.get(key, []):
    right, asked = totals.setdefault(t['label'], [0, 0])
    totals[t['label']] = [right + t['correct'], asked + t['answers']]
  return {label: right / asked for label, (right, asked) in totals.items() if asked}


def selection_by_label(report: dict, measure: str) -> dict[str, float]:
  """task@length -> the selection's `measure` (mean over layers) over all its depths, each depth
  weighted by its answers."""
  totals: dict[str, list[float]] = {}
  for t in report.get('tasks', []):
    value = t.get('selection', {}).get(measure)
    if value is not None:
      total, asked = totals.setdefault(t['label'], [0.0, 0])
      totals[t['label']] = [total + value * t['answers'], asked + t['answers']]
  return {label: total / asked for label, (total, asked) in totals.items() if asked}


def main(args: list[str]) -> int:
  plots = [a.split('=', 1)[1] for a in args if a.startswith('--plot=')]
  paths = [a for a in args if not a.startswith('--plot=')]
  if not paths:
    print(__doc__.strip())
    return 2
  reports = pooled([_load(p) for p in paths])
  for name, report in reports:
    if report.get('runs'):
      print(f'{name}: {report["runs"]} runs pooled')
  for plot in plots:
    try:
      comparison_map(reports, plot)
    except ImportError:
      print(f'--plot={plot}: needs matplotlib (pip install -e \'.[plot]\')', file=sys.stderr)
      return 2
    print(f'wrote {plot}')
  width = max(12, *(len(name) for name, _ in reports)) + 2

  def table(title: str, rows: list[str], value) -> None:
    print(f'{title:<16}' + ''.join(f'{name:>{width}}' for name, _ in reports))
    for row in rows:
      cells = [value(r, row) for _, r in reports]
      print(f'{os.path.basename(row):<16}' + ''.join(
          f'{"-" if c is None else format(c, ".3f"):>{width}}' for c in cells))

  labels = list(dict.fromkeys(label for _, r in reports for label in by_label(r)))
  table('accuracy', labels, lambda r, label: by_label(r).get(label))
  if any('generated' in r for _, r in reports):
    print()
    table('decoded', labels, lambda r, label: by_label(r, 'generated').get(label))
  if any('selection' in t for _, r in reports for t in r.get('tasks', [])):
    for measure, title in (('answer_selected', 'answer selected'),
                           ('dense_recall', 'dense recall'),
                           ('neighbour_shared', 'picks shared with the row before')):
      print()
      table(title, labels, lambda r, label, m=measure: selection_by_label(r, m).get(label))
  sources = list(dict.fromkeys(s for _, r in reports for s in r.get('heldout_loss', {})))
  if sources:
    print()
    table('held-out loss', sources, lambda r, s: r.get('heldout_loss', {}).get(s))
  return 0


if __name__ == '__main__':
  signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the tables quietly
  sys.exit(main(sys.argv[1:]))
