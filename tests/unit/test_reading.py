"""train/reading.py: what a reader of a run (generation, evaluation) takes from its work
directory, and the errors that name what is missing."""

import os
import shutil

import pytest

from deepseek41.config import resolve
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import train_tokenizer
from deepseek41.train.checkpoint import CheckpointError, Checkpointer
from deepseek41.train.reading import (EXECUTION_AUTO_KEYS, checkpoint_step, portable_config,
                                      run_tokenizer)
from tests.helpers import small_config


@pytest.fixture
def run(tmp_path):
  """A work directory with checkpoints 2 and 4 of a synthetic-data run (no tokenizer)."""
  cfg = resolve(small_config(), num_devices=1, backend='cpu')
  ck = Checkpointer(str(tmp_path / 'run'), cfg.checkpoint)
  for step in (2, 4):
    ck.save(step, {'x': 1.0}, None, cfg.to_dict(), {})
  ck.close()
  return str(tmp_path / 'run'), cfg


def test_the_newest_step_or_the_one_asked_for(run):
  workdir, cfg = run
  step, step_dir, saved = checkpoint_step(workdir)
  assert step == 4 and step_dir == os.path.join(workdir, 'checkpoints', '4')
  assert saved['model']['d_model'] == cfg.model.d_model
  assert checkpoint_step(workdir, 2)[0] == 2
  with pytest.raises(CheckpointError, match=r'--step=3: no checkpoint .*\(there are: 2, 4\)'):
    checkpoint_step(workdir, 3)


def test_a_work_directory_without_checkpoints_is_named(tmp_path):
  with pytest.raises(CheckpointError, match='has no checkpoints/ directory'):
    checkpoint_step(str(tmp_path))
  (tmp_path / 'checkpoints').mkdir()
  with pytest.raises(CheckpointError, match='holds no complete checkpoint'):
    checkpoint_step(str(tmp_path))


def test_the_portable_config_takes_this_hosts_choices(run):
  workdir, cfg = run
  saved = checkpoint_step(workdir)[2]
  saved['model'].update(attention_impl='fused', compute_dtype='bfloat16')
  saved['mesh'].update(data=1, fsdp=8)
  c = portable_config(saved)
  assert {'attention_impl', 'compute_dtype', 'moe_backend'} <= set(EXECUTION_AUTO_KEYS)
  assert c.model.attention_impl == c.model.compute_dtype == 'auto'
  assert (c.mesh.data, c.mesh.fsdp) == (-1, 1)
  assert resolve(c, num_devices=2, backend='cpu').model.compute_dtype == 'float32'


def test_the_tokenizer_of_the_run_an_import_or_its_data(run, tmp_path):
  workdir, cfg = run
  with pytest.raises(DataError, match=r'has no tokenizer.json, and its data config gives none'):
    run_tokenizer(workdir, cfg.data)  # synthetic data names no tokenizer
  imported = tmp_path / 'imported'
  (imported / 'tokenizer').mkdir(parents=True)

  train_tokenizer(['def f():\n  return 1\n'] * 20, 300).save(
      str(imported / 'tokenizer' / 'tokenizer.json'))
  tok, path = run_tokenizer(str(imported), cfg.data)
  assert path == str(imported / 'tokenizer' / 'tokenizer.json') and tok.vocab_size > 256
  shutil.copy(path, os.path.join(workdir, 'tokenizer.json'))
  assert run_tokenizer(workdir, cfg.data)[1] == os.path.join(workdir, 'tokenizer.json')
