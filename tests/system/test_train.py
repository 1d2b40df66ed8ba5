"""End-to-end trainer behaviour on 8 fake CPU devices: resume exactness, signals, failures."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from deepseek41.config import ConfigError
from deepseek41.train.checkpoint import CheckpointError, Checkpointer
from deepseek41.train.trainer import TrainingDiverged, train
from deepseek41.config import resolve
from tests.helpers import (CORPUS_STEPS, REPO_ROOT, corpus_config, final_state, logged_losses,
                           small_config)

ROOT = REPO_ROOT
STEPS = CORPUS_STEPS
_config = corpus_config


def _data_state(workdir, step):
  with open(os.path.join(workdir, 'checkpoints', str(step), 'data', 'process_0-of-1.json')) as f:
    return json.load(f)


def _assert_states_equal(a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.fixture
def straight(pretrained_run):
  return pretrained_run


def test_resume_is_bit_exact(corpus, straight, tmp_path):
  workdir = str(tmp_path)
  first = train(_config(corpus), workdir, stop_at_step=STEPS // 2)
  assert first.step == STEPS // 2
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(STEPS // 2)))
  second = train(_config(corpus), workdir)
  assert second.step == STEPS
  step_a, state_a = final_state(straight, _config(corpus))
  step_b, state_b = final_state(workdir, _config(corpus))
  assert step_a == step_b == STEPS
  _assert_states_equal(state_a, state_b)   # params, optimizer, step, router biases, rng
  assert logged_losses(straight) == logged_losses(workdir)  # same data order -> same per-step losses
  assert _data_state(straight, STEPS) == _data_state(workdir, STEPS)


def test_sigterm_saves_and_resumes_exactly(corpus, tmp_path):
  steps = 60
  # The suite's compile cache passed on: the subprocess does not run conftest.py.
  overrides = {**corpus, 'train.steps': steps,
               'train.compilation_cache_dir': jax.config.jax_compilation_cache_dir}
  cfg_file = tmp_path / 'cfg.py'
  cfg_file.write_text('from tests.helpers import small_config\n'
                      f'def get_config():\n  return small_config(**{overrides!r})\n')
  workdir = tmp_path / 'killed'
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=8')
  proc = subprocess.Popen([sys.executable, '-m', 'deepseek41.train', f'--config={cfg_file}',
                           f'--workdir={workdir}'], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  metrics = workdir / 'metrics.jsonl'
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and len(logged_losses(str(workdir))) >= 2:
      break
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 75, out  # EX_TEMPFAIL: stopped by a signal, resumable
  saved = Checkpointer(str(workdir), resolve(small_config(**overrides)).checkpoint)
  stop = saved.latest_step()
  saved.close()
  assert stop is not None and 2 <= stop < steps - 3, out
  assert 'SIGTERM' in out

  target = stop + 3
  train(small_config(**overrides), str(workdir), stop_at_step=target)
  fresh = str(tmp_path / 'fresh')
  train(small_config(**overrides), fresh, stop_at_step=target)
  _assert_states_equal(final_state(str(workdir), small_config(**overrides))[1],
                       final_state(fresh, small_config(**overrides))[1])


@pytest.mark.parametrize('residual', ['mhc_single_pass', 'plain'])
def test_loss_falls(corpus, tmp_path, residual):
  """The released residual with Engram on, and the plain residual, both learn."""
  config = _config(corpus, **{'train.steps': 40, 'train.lr': 1e-2, 'train.warmup_steps': 5,
                              'train.eval_every_steps': 40, 'train.eval_batches': 2,
                              'model.residual': residual,
                              'model.engram': residual != 'plain'})
  result = train(config, str(tmp_path))
  losses = logged_losses(str(tmp_path))
  evals = {}
  for line in open(tmp_path / 'metrics.jsonl'):
    d = json.loads(line)
    if 'eval_loss' in d:
      evals[d['step']] = d['eval_loss']
  assert np.mean([losses[s] for s in range(36, 41)]) < losses[1] - 1.0
  assert evals[40] < evals[0] - 1.0
  assert result.last_eval_loss == evals[40]
  records = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert all({'step', 'loss', 'tokens_per_s'} <= set(r) for r in records)
  assert [r['step'] for r in records] == list(range(0, 41))  # eval steps share their step's line
  assert records[40]['eval_loss'] == evals[40] and records[40]['loss'] is not None
  # the evaluation's own time, and how long the host waited for the step before it
  assert records[0]['eval_s'] > 0 and records[40]['eval_s'] > 0
  assert records[40]['eval_step_wait_s'] >= 0 and 'eval_step_wait_s' not in records[39]
  assert json.load(open(tmp_path / 'config.json'))['train']['steps'] == 40


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path):
  config = _config(corpus, **{'train.lr': 1e30, 'train.grad_clip_norm': 0.0,
                              'train.warmup_steps': 0, 'checkpoint.every_steps': 1,
                              'train.steps': 6})
  with pytest.raises(TrainingDiverged, match=r'at step (\d+)') as err:
    train(config, str(tmp_path))
  bad_step = int(err.value.args[0].split('at step ')[1].split(';')[0])
  step, state = final_state(str(tmp_path), config)
  assert step < bad_step
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state['params']))


def test_corrupt_and_mismatched_checkpoints_are_named(corpus, straight, tmp_path, caplog):
  import shutil
  workdir = tmp_path / 'w'
  shutil.copytree(straight, workdir)
  ck_dir = workdir / 'checkpoints' / str(STEPS)

  # a model that does not fit: every differing tensor and key is listed
  with pytest.raises(CheckpointError) as err:
    train(_config(corpus, **{'model.d_model': 48}), str(workdir))
  msg = str(err.value)
  assert str(ck_dir) in msg and 'model.d_model' in msg and "['embed']" in msg

  # an unfinished save is skipped with a warning, the complete one is used
  (workdir / 'checkpoints' / f'{STEPS + 4}.orbax-checkpoint-tmp-1234').mkdir()
  with caplog.at_level(logging.WARNING):
    result = train(_config(corpus), str(workdir))
  assert result.step == STEPS
  assert any('unfinished checkpoint' in r.getMessage() for r in caplog.records)

  # a corrupt checkpoint names its directory; nothing is deleted
  for name in os.listdir(ck_dir / 'meta'):
    (ck_dir / 'meta' / name).write_text('{not json')
  before = sorted(os.listdir(workdir / 'checkpoints'))
  with pytest.raises(CheckpointError, match=str(ck_dir)):
    train(_config(corpus), str(workdir))
  assert sorted(os.listdir(workdir / 'checkpoints')) == before


def test_missing_data_path_is_named(tmp_path):
  config = small_config(**{'data.synthetic': False, 'data.sources': str(tmp_path / 'nope'),
                           'mesh.data': -1})
  with pytest.raises(Exception, match='nope'):
    train(config, str(tmp_path / 'w'))


def test_vocab_too_small_for_data_is_a_config_error(corpus, tmp_path):
  with pytest.raises(ConfigError, match='model.vocab_size'):
    train(_config(corpus, **{'model.vocab_size': 64, 'data.default_corpus_vocab_size': 300}),
          str(tmp_path))


def test_retention_and_writers(corpus, tmp_path):
  config = _config(corpus, **{'train.steps': 10, 'checkpoint.every_steps': 1,
                              'checkpoint.max_to_keep': 2, 'checkpoint.keep_period': 4,
                              'log.tensorboard': True, 'log.progress_bar': True})
  train(config, str(tmp_path))
  kept = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  assert kept == [4, 8, 9, 10]  # the newest two plus every 4th
  events = [f for f in os.listdir(tmp_path / 'tensorboard') if 'tfevents' in f]
  assert events and os.path.getsize(tmp_path / 'tensorboard' / events[0]) > 0


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_stop_flag_catches_signals(sig):
  from deepseek41.train.stop import STOP
  with STOP as stop:
    os.kill(os.getpid(), sig)
    deadline = time.time() + 5
    while stop.signal is None and time.time() < deadline:
      time.sleep(0.01)
    assert stop.signal == sig
  assert signal.getsignal(sig) is not stop._handle  # handlers restored


def test_engram_hashes_tokenizer_compressed_ids(corpus, tmp_path):
  """engram_compressed_vocab_size must match the data's tokenizer; then training uses the map."""
  import re

  from deepseek41.config import ConfigError
  engram = {'model.engram': True, 'train.steps': 2}
  with pytest.raises(ConfigError, match='model.engram_compressed_vocab_size') as err:
    train(_config(corpus, **engram, **{'model.engram_compressed_vocab_size': 5}),
          str(tmp_path / 'wrong'))
  assert not (tmp_path / 'wrong' / 'checkpoints').exists() or \
      not any((tmp_path / 'wrong' / 'checkpoints').iterdir())
  count = int(re.search(r'compresses to (\d+) ids', str(err.value)).group(1))
  assert 3 < count < 300  # case and whitespace variants of BPE tokens merge
  result = train(_config(corpus, **engram, **{'model.engram_compressed_vocab_size': count}),
                 str(tmp_path / 'ok'))
  assert result.step == 2
  assert len(logged_losses(str(tmp_path / 'ok'))) == 2


def test_multimodal_training_writes_caption_and_image_metrics(corpus, tmp_path):
  """A vision run on the shapes task: caption losses (real vs blank images) at evaluation,
  images/s and both modalities' router biases in metrics.jsonl, and a resumable checkpoint."""
  vision = {'model.vision': True, 'model.vision_layers': 1, 'model.vision_dim': 16,
            'model.vision_heads': 2, 'model.vision_mlp': 16, 'model.vision_patch': 4,
            'model.vision_max_image_tokens': 4, 'data.shapes_image_size': 16,
            'data.image_sources': 'shapes:0.8', 'data.sources': 'default:0.2',
            'data.max_images_per_row': 2, 'train.steps': 3, 'train.eval_every_steps': 3,
            'train.eval_batches': 1, 'log.every_steps': 1}
  result = train(_config(corpus, **vision), str(tmp_path))
  assert result.step == 3
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  evals = [r for r in rows if 'eval_caption_loss_image' in r]
  assert [r['step'] for r in evals] == [0, 3]
  for r in evals:
    assert np.isfinite(r['eval_caption_loss_image']) and np.isfinite(r['eval_caption_loss_blank'])
    assert r['eval_caption_loss_image'] != r['eval_caption_loss_blank']  # the image is read
  timed = [r for r in rows if r.get('images_per_s')]
  assert timed and all(r['images_per_s'] > 0 for r in timed)
  assert any(k.endswith('/image') and k.startswith('router_bias_spread') for k in rows[-1])
  assert Checkpointer(str(tmp_path), resolve(_config(corpus, **vision)).checkpoint).latest_step() == 3
