"""log.wandb_project: the trainer logs every written step to a W&B run of its own work directory
(a stand-in `wandb` module records the calls: the package itself is an optional extra), and a
missing package is named."""

import sys
import types

import pytest

from deepseek41.config import ConfigError
from deepseek41.train.trainer import train
from tests.helpers import small_config


class _Recorder:
  def __init__(self):
    self.inits, self.logs, self.finished = [], [], 0

  def module(self):
    mod = types.ModuleType('wandb')
    recorder = self

    class Run:
      def log(self, data, step):
        recorder.logs.append((step, dict(data)))

      def finish(self):
        recorder.finished += 1

    def init(**kwargs):
      recorder.inits.append(kwargs)
      return Run()
    mod.init = init
    return mod


def test_steps_go_to_one_wandb_run_per_workdir(tmp_path, monkeypatch):
  rec = _Recorder()
  monkeypatch.setitem(sys.modules, 'wandb', rec.module())
  config = small_config(**{'log.wandb_project': 'ablations', 'train.steps': 2})
  train(config, str(tmp_path / 'run'))
  train(small_config(**{'log.wandb_project': 'ablations', 'train.steps': 3}),
        str(tmp_path / 'run'))  # resumed: the same W&B run
  first, second = rec.inits
  assert first['project'] == 'ablations' and first['mode'] == 'offline'
  assert first['id'] == second['id'] and first['resume'] == 'allow'
  assert first['dir'] == str(tmp_path / 'run') and first['config']['model']['d_model'] == 32
  assert [s for s, _ in rec.logs] == [1, 2, 3] and 'loss' in rec.logs[0][1]
  assert rec.finished == 2


def test_missing_wandb_is_named(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb raises ImportError
  with pytest.raises(ConfigError, match=r"log\.wandb_project: .*pip install -e '\.\[wandb\]'"):
    train(small_config(**{'log.wandb_project': 'p'}), str(tmp_path / 'run'))
