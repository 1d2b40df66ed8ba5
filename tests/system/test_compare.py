"""tools.compare on two synthetic runs: the table of last and best values, the config keys that
differ, a run still writing its metrics, the PNG and HTML outputs, and named bad input."""

import json
import os
import subprocess
import sys

import pytest

from deepseek41.tools import compare
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def _run(directory, losses, residual, torn=False):
  os.makedirs(directory)
  with open(os.path.join(directory, 'metrics.jsonl'), 'w') as f:
    for i, loss in enumerate(losses):
      f.write(json.dumps({'step': 10 * (i + 1), 'loss': loss, 'tokens_per_s': 1000.0 + i,
                          'eval_loss': loss + 0.5 if i % 2 else None}) + '\n')
    if torn:
      f.write('{"step": 90, "loss": 1.')  # the line a running trainer is in the middle of
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump({'model': {'residual': residual, 'd_model': 128},
               'train': {'batch_size': 8, 'seed': 0}, 'data': {'seq_len': 128}}, f)
  return str(directory)


def test_table_differences_and_curves(tmp_path):
  a = _run(tmp_path / 'plain', [5.0, 4.0, 4.5, 3.9], 'plain')
  b = _run(tmp_path / 'mhc', [5.0, 3.5, 3.0, 3.2], 'mhc_single_pass', torn=True)
  runs = [compare.read_run(a), compare.read_run(b)]
  rows = {(r['run'], r['metric']): r for r in compare.summary(runs, ['loss', 'tokens_per_s'])}
  assert (rows['plain', 'loss']['last'], rows['plain', 'loss']['best_step']) == (3.9, 40)
  assert (rows['mhc', 'loss']['best'], rows['mhc', 'loss']['best_step']) == (3.0, 30)
  assert rows['mhc', 'tokens_per_s']['best'] == 1003.0  # higher is better for throughput
  assert compare.config_differences(runs) == {'model.residual': ['plain', 'mhc_single_pass']}
  text = compare.report(runs, ['loss', 'eval_loss'])
  assert '| mhc | loss | 3.2 (40) | 3 (30) |' in text and 'model.residual' in text
  assert compare.smoothed([1.0, 3.0], 0.5) == [1.0, 1.0 * 0.25 / 0.75 + 3.0 * 0.5 / 0.75]
  # the training loss is drawn smoothed, the held-out loss (two points here) as logged
  assert compare.drawn_series(runs[0], 'loss', 0.5)[1][1] == pytest.approx(4.0 * 2 / 3 + 5.0 / 3)
  assert compare.drawn_series(runs[0], 'eval_loss', 0.5) == ([20, 40], [4.5, 4.4])

  png, html = tmp_path / 'out' / 'curves.png', tmp_path / 'curves.html'
  compare.draw(runs, ['loss', 'eval_loss'], str(png), smooth=0.5)
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10_000
  compare.draw(runs, ['loss'], str(html))
  assert 'data:image/png;base64,' in html.read_text() and 'model.residual' in html.read_text()


def test_cli_and_bad_input(tmp_path):
  a = _run(tmp_path / 'a', [2.0, 1.0], 'plain')
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.compare', a, a,
                        '--metrics=loss,nope', f'--out={tmp_path}/c.png'],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
  assert out.returncode == 0, out.stderr
  assert 'the configs do not differ' in out.stdout and os.path.isfile(tmp_path / 'c.png')
  assert 'never logged by these runs: nope' in out.stderr
  bad = subprocess.run([sys.executable, '-m', 'deepseek41.tools.compare', str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
  assert bad.returncode == 2 and 'no metrics.jsonl' in bad.stderr
  # a run without config.json (metrics copied off a machine): drawn against the step only
  os.remove(os.path.join(a, 'config.json'))
  bare = subprocess.run([sys.executable, '-m', 'deepseek41.tools.compare', a,
                         f'--out={tmp_path}/bare.png'],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
  assert bare.returncode == 0, bare.stderr
  assert 'no train.batch_size and data.seq_len in the config.json of a' in bare.stderr
  width = lambda png: int.from_bytes(png.read_bytes()[16:20], 'big')  # the IHDR chunk
  assert width(tmp_path / 'bare.png') < 0.6 * width(tmp_path / 'c.png')  # one column of two
  with pytest.raises(compare.CompareError, match='.png or an .html'):
    compare.draw([compare.read_run(a)], ['loss'], str(tmp_path / 'x.pdf'))
