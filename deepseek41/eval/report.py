"""The evaluation report as a table, a JSON file and (with the `plot` extra) a heat map of
accuracy by depth and context length per task, like the needle-in-a-haystack plots."""

from __future__ import annotations

import json
import os


def _cell(x, fmt='.3f') -> str:
  return '-' if x is None else format(x, fmt)


# The selection's columns (model/diagnostics.py): the JSON also holds the dense mass on the
# selection and on the answer's entry, and every measure per CSA2 layer.
SELECTION_COLUMNS = (('dense_recall', 'dense recall'), ('answer_visible', 'visible'),
                     ('answer_in_dense_topk', 'in dense top-k'), ('answer_selected', 'selected'),
                     ('answer_in_window', 'in window'),
                     ('neighbour_shared', 'neighbour shared'))


def finished_cells(report: dict) -> int:
  """How many task cells the report holds, teacher-forced and decoded."""
  return len(report.get('tasks', [])) + len(report.get('generated', []))


def table(report: dict) -> str:
  """The report as text: the held-out losses, then one line per task, length and depth; then
  the selection's measures per task, length and depth (or why there are none)."""
  lines = [f'{report["workdir"]} step {report["step"]} (model positions: '
           f'{report["max_positions"]}; {report["examples"]} documents per task, length and '
           'depth)']
  if report.get('complete') is False:
    lines.append(f'INTERRUPTED: {finished_cells(report)} of {report.get("cells", "?")} task '
                 'cells finished')
  if report.get('heldout_loss'):
    lines.append('held-out loss: ' + ', '.join(
        f'{name} {_cell(v)}' for name, v in report['heldout_loss'].items()) +
        ' (a task: its answer tokens)')
  if report.get('heldout_note'):
    lines.append(f'held-out loss: none ({report["heldout_note"]})')
  decoded = {(g['label'], g['depth']): g for g in report.get('generated', [])}
  head = f'{"task":<16} {"depth":>6} {"answers":>8} {"acc":>7} {"token acc":>10} ' \
         f'{"answer loss":>12}' + (f' {"decoded acc":>12}' if decoded else '')
  lines += ['', head, '-' * len(head)]
  for t in report['tasks']:
    line = (f'{t["label"]:<16} {_cell(t["depth"], "g"):>6} {t["answers"]:>8} '
            f'{_cell(t["acc"]):>7} {_cell(t["token_acc"]):>10} {_cell(t["answer_loss"]):>12}')
    if decoded:
      line += f' {_cell(decoded[(t["label"], t["depth"])]["acc"]):>12}'
    lines.append(line)
  if report.get('selection_note'):
    lines += ['', f'selection: none ({report["selection_note"]})']
  elif any('selection' in t for t in report['tasks']):
    lines += ['', 'selection of the CSA2 layers at the rows that predict an answer token (mean '
              'over the layers; per layer in the JSON):']
    head = f'{"task":<16} {"depth":>6} ' + ' '.join(f'{title:>{max(len(title), 7)}}'
                                                     for _, title in SELECTION_COLUMNS)
    lines += [head, '-' * len(head)]
    for t in report['tasks']:
      sel = t.get('selection', {})
      lines.append(f'{t["label"]:<16} {_cell(t["depth"], "g"):>6} ' + ' '.join(
          f'{_cell(sel.get(name)):>{max(len(title), 7)}}' for name, title in SELECTION_COLUMNS))
  return '\n'.join(lines)


def progress_lines(report: dict, shown: int, seconds: float) -> list[str]:
  """One line for each task cell of `report` past the first `shown` (teacher-forced, then
  decoded), numbered against the cells due; `seconds` is how long the new ones took."""
  cells = [('', t) for t in report.get('tasks', [])] + \
      [('decoded ', g) for g in report.get('generated', [])]
  new = cells[shown:]
  return [f'[{shown + i + 1}/{report.get("cells", "?")}] {kind}{c["label"]}'
          + ('' if c['depth'] is None else f' depth {c["depth"]:g}')
          + f': acc {_cell(c["acc"])} ({c.get("correct", "?")} of {c["answers"]})'
          + ('' if i < len(new) - 1 else f', {seconds:.1f} s')
          for i, (kind, c) in enumerate(new)]


def write_json(report: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + '.tmp', 'w') as f:
    json.dump(report, f, indent=2, allow_nan=False)
  os.replace(path + '.tmp', path)


def _draw_task(ax, mine: list[dict], title: str):
  """One task's accuracy (color and number) by depth (rows; one row for a task without depth)
  and context length (columns); returns the image for the color bar."""
  lengths = sorted({t['length'] for t in mine})
  labels = {t['length']: t['label'].split('@')[1] for t in mine}
  depths = sorted({t['depth'] for t in mine}, key=lambda d: -1 if d is None else d)
  acc = [[next((t['acc'] for t in mine if t['length'] == n and t['depth'] == d), None)
          for n in lengths] for d in depths]
  grid = [[float('nan') if a is None else a for a in row] for row in acc]
  image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap='RdYlGn', aspect='auto')
  for i, row in enumerate(acc):
    for j, a in enumerate(row):
      if a is not None:
        ax.text(j, i, f'{a:.2f}', ha='center', va='center', fontsize=8)
  ax.set_xticks(range(len(lengths)), [labels[n] for n in lengths])
  ax.set_yticks(range(len(depths)), ['all' if d is None else f'{d:g}' for d in depths])
  ax.set_xlabel('context length')
  ax.set_ylabel('depth' if depths != [None] else '')
  ax.set_title(title)
  return image


def heat_map(report: dict, path: str, key: str = 'tasks') -> None:
  """One panel per task: accuracy by depth and context length. Needs matplotlib
  (`pip install -e '.[plot]'`)."""
  comparison_map([(None, report)], path, key,
                 title=f'{os.path.basename(report["workdir"])} step {report["step"]}')


def comparison_map(reports: list[tuple[str | None, dict]], path: str, key: str = 'tasks',
                   title: str | None = None) -> None:
  """One row of task panels per (name, report), e.g. the attention variants of one experiment
  side by side (benchmarks/summarize_longctx.py --plot); a task a report lacks is left blank.
  Needs matplotlib."""
  import matplotlib  # optional: the `plot` extra
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  names = list(dict.fromkeys(t['task'] for _, r in reports for t in r[key]))
  fig, axes = plt.subplots(len(reports), len(names),
                           figsize=(4.5 * len(names), 0.4 + 3.2 * len(reports)),
                           squeeze=False, layout='constrained')
  how = 'decoded' if key == 'generated' else 'teacher-forced'
  image = None
  for row, (label, report) in zip(axes, reports):
    for ax, name in zip(row, names):
      mine = [t for t in report[key] if t['task'] == name]
      if not mine:
        ax.axis('off')
        continue
      panel = f'{name} ({how})' if label is None else f'{label}: {name}'
      image = _draw_task(ax, mine, panel)
  if image is not None:
    fig.colorbar(image, ax=axes.ravel().tolist(), label='accuracy')
  fig.suptitle(title or f'accuracy by depth and context length ({how})', fontsize=10)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
