"""benchmarks/summarize_longctx.py: the variants' reports side by side, each named by its variant."""

import importlib
import json
import os

import pytest

from tests.helpers import REPO_ROOT


def _task(label, depth, correct, answers):
  task, length = label.split('@')
  return dict(task=task, label=label, length=int(length), depth=depth, correct=correct,
              answers=answers, acc=correct / answers)


@pytest.fixture
def summarize(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, 'benchmarks'))
  return importlib.import_module('summarize_longctx')  # a script beside the benchmarks


@pytest.fixture
def reports(tmp_path):
  """gpu_longctx.sh's file names: longctx_<variant>.json."""
  paths = []
  for variant, right in (('dense', 3), ('window', 1)):
    report = {'workdir': f'/tmp/longctx_{variant}', 'step': 4,
              'tasks': [_task('passkey@256', 0.0, right, 4), _task('passkey@256', 1.0, 4, 4)],
              'heldout_loss': {'passkey': 0.5}}
    path = tmp_path / f'longctx_{variant}.json'
    path.write_text(json.dumps(report))
    paths.append(str(path))
  return paths


def test_columns_are_the_variants_and_accuracy_is_over_depths(summarize, reports, capsys):
  assert summarize.main(reports) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split() == ['accuracy', 'dense', 'window']
  assert lines[1].split() == ['passkey@256', '0.875', '0.625']  # (3 + 4) / 8, (1 + 4) / 8


def test_plot_draws_every_variant(summarize, reports, tmp_path, capsys):
  pytest.importorskip('matplotlib')
  plot = tmp_path / 'variants.png'
  assert summarize.main([*reports, f'--plot={plot}']) == 0
  assert f'wrote {plot}' in capsys.readouterr().out
  assert os.path.getsize(plot) > 1000


def test_runs_of_one_variant_are_pooled(summarize, reports, tmp_path, capsys):
  """A second dense run (another seed, another directory): its answers join the first's."""
  other = {'workdir': '/tmp/longctx_dense', 'step': 4,
           'tasks': [_task('passkey@256', 0.0, 1, 4), _task('passkey@256', 1.0, 0, 4)],
           'heldout_loss': {'passkey': 1.5}}
  (tmp_path / 'seed1').mkdir()
  path = tmp_path / 'seed1' / 'longctx_dense.json'
  path.write_text(json.dumps(other))
  assert summarize.main([*reports, str(path)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == 'dense: 2 runs pooled'
  assert lines[1].split() == ['accuracy', 'dense', 'window']
  assert lines[2].split() == ['passkey@256', '0.500', '0.625']  # (3 + 4 + 1 + 0) / 16
  assert lines[-1].split() == ['passkey', '1.000', '0.500']  # held-out losses averaged


def test_plot_title_is_the_figures_not_a_panels(summarize, reports, tmp_path, monkeypatch):
  """The figure's title says what is shown; it read the last panel's ('window: passkey')."""
  # the submodule itself: `matplotlib.figure` exists only once something imported it, which an
  # earlier test of the same worker may or may not have done
  figure = pytest.importorskip('matplotlib.figure')
  titles = []
  save = figure.Figure.savefig
  monkeypatch.setattr(figure.Figure, 'savefig',
                      lambda fig, *a, **k: (titles.append(fig._suptitle.get_text()),
                                            save(fig, *a, **k)))
  assert summarize.main([*reports, f'--plot={tmp_path / "v.png"}']) == 0
  assert titles == ['accuracy by depth and context length (teacher-forced)']


def test_an_interrupted_evaluation_is_named_partial(summarize, reports, capsys):
  """A report the eval command wrote before it was stopped ("complete": false) says so."""
  with open(reports[0]) as f:
    cut = json.load(f)
  cut['complete'] = False
  with open(reports[0], 'w') as f:
    json.dump(cut, f)
  assert summarize.main(reports) == 0
  header = capsys.readouterr().out.splitlines()[0]
  assert 'dense (partial)' in header and 'window (partial)' not in header
