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
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepseek41.eval.report import comparison_map  # noqa: E402  (stdlib only at import)


def _load(path: str) -> tuple[str, dict]:
  name = os.path.splitext(os.path.basename(path))[0]
  with open(path) as f:
    return name.removeprefix('longctx_') or name, json.load(f)


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
  reports = [_load(p) for p in paths]
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
  sys.exit(main(sys.argv[1:]))
