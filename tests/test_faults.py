"""Fault injection: failed saves, corrupt checkpoints, signals, a locked or unusable work
directory, resumes after a kill, bad command lines. Tiny synthetic runs on the CPU."""

import errno
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

from deepseek41.config import resolve
from deepseek41.train.checkpoint import (MANIFEST, CheckpointError, CheckpointSaveError,
                                         Checkpointer)
from deepseek41.train.trainer import TrainingDiverged, _StopFlag, train
from deepseek41.train.warm_start import check_fits
from deepseek41.train.workdir import WorkdirError, WorkdirLock
from tests.util import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _steps(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line)['step'] for line in f]


def _largest_array_file(step_dir):
  files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(step_dir, 'state')) for n in ns]
  return max(files, key=os.path.getsize)


def _checkpointer(tmp_path, **overrides):
  return Checkpointer(str(tmp_path), resolve(small_config(**overrides),
                                             num_devices=1, backend='cpu').checkpoint)


def test_execution_only_choices_do_not_block_a_resume(tmp_path):
  """A GPU checkpoint (fused index and vision attention, bf16) resumes on the CPU."""
  cfg = resolve(small_config(), num_devices=1, backend='cpu')
  gpu = cfg.to_dict()
  gpu['model'].update(index_impl='fused', vision_attention_impl='fused',
                      compute_dtype='bfloat16', attention_impl='chunked')
  ck = Checkpointer(str(tmp_path), cfg.checkpoint)
  ck.save(1, {'x': jax.numpy.ones(3)}, None, gpu, {})
  warnings = check_fits(ck, 1, {}, cfg.to_dict())
  ck.close()
  assert any('model.index_impl' in w for w in warnings)
  assert any('model.vision_attention_impl' in w for w in warnings)


def test_signal_after_save_then_corrupt_checkpoint_then_resume(tmp_path, monkeypatch, caplog):
  """SIGTERM right after a periodic save stops cleanly (no second save of that step); every
  save carries checksums; a corrupt newest checkpoint is refused by name; one without checksums
  resumes with a note; metrics.jsonl holds each step once; a rejected start keeps config.json."""
  workdir = str(tmp_path / 'w')
  config = small_config(**{'train.steps': 8, 'checkpoint.every_steps': 2})
  real_save = Checkpointer.save
  signalled = []

  def save_then_sigterm(self, step, *args, **kwargs):
    saved = real_save(self, step, *args, **kwargs)
    if step == 4 and not signalled:
      signalled.append(step)
      os.kill(os.getpid(), signal.SIGTERM)  # arrives before the loop checks its stop flag
    return saved

  monkeypatch.setattr(Checkpointer, 'save', save_then_sigterm)
  result = train(config, workdir)
  monkeypatch.undo()
  assert result.stopped_by_signal and result.step == 4
  ck_dir = os.path.join(workdir, 'checkpoints')
  assert sorted(os.listdir(ck_dir)) == ['2', '4']
  assert all(os.path.exists(os.path.join(ck_dir, s, MANIFEST)) for s in ('2', '4'))

  # a start rejected by the checkpoint leaves config.json as it was
  before = open(os.path.join(workdir, 'config.json')).read()
  with pytest.raises(CheckpointError, match='model.d_model'):
    train(small_config(**{'train.steps': 8, 'model.d_model': 48}), workdir)
  assert open(os.path.join(workdir, 'config.json')).read() == before

  # flipped bytes in an array file of the newest checkpoint: refused, naming it
  victim = _largest_array_file(os.path.join(ck_dir, '4'))
  original = open(victim, 'rb').read()
  flipped = bytearray(original)
  for i in range(len(flipped) // 2, min(len(flipped), len(flipped) // 2 + 4096)):
    flipped[i] ^= 0xFF
  open(victim, 'wb').write(bytes(flipped))
  with pytest.raises(CheckpointError, match=r'checkpoints/4 is corrupt'):
    train(config, workdir)
  ck = _checkpointer(workdir)
  assert 'corrupt' in ck.describe_newest() and 'intact' not in ck.describe_newest()
  assert ck.verify(2)
  ck.close()

  # without checksums (an older checkpoint) it restores, with a note; steps after the
  # checkpoint that a killed run had logged are dropped from metrics.jsonl
  open(victim, 'wb').write(original)
  os.remove(os.path.join(ck_dir, '4', MANIFEST))
  with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
    f.write(json.dumps({'step': 5, 'loss': 1.0}) + '\n' + '{"step": 6, "lo')
  with caplog.at_level(logging.INFO):
    result = train(small_config(**{'train.steps': 4, 'checkpoint.every_steps': 2}), workdir)
  assert result.step == 4  # restored (nothing left to train)
  assert any('has no checksums' in r.getMessage() for r in caplog.records)
  assert _steps(workdir) == [1, 2, 3, 4]


def test_failed_background_save_is_raised_promptly_and_cleaned_up(tmp_path, monkeypatch):
  """A full disk under Orbax's background thread: the next poll between steps raises, naming
  the directory; the partial directory is removed and the earlier checkpoint kept."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler
  real = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def full_disk_at_step_4(self, x, directory):
    if f'{os.sep}4.orbax-checkpoint-tmp' in str(directory):
      raise OSError(errno.ENOSPC, 'No space left on device')
    return await real(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, '_save_fn',
                      full_disk_at_step_4)
  ck = _checkpointer(tmp_path, **{'checkpoint.async_save': True})
  state = {'x': jax.numpy.ones(3)}
  ck.save(2, state, None, {'model': {}}, {})
  ck.save(4, state, None, {'model': {}}, {})
  deadline = time.time() + 60
  with pytest.raises(CheckpointSaveError) as err:
    while time.time() < deadline:  # the training loop polls once per step
      ck.poll()
      time.sleep(0.05)
  ck.close()
  msg = str(err.value)
  assert f'saving checkpoint 4 to {tmp_path / "checkpoints"}' in msg and 'No space left' in msg
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2']  # no tmp left, 2 kept
  ck = _checkpointer(tmp_path)
  assert ck.verify(2) and 'intact (checksums verified)' in ck.describe_newest()
  ck.close()


def test_failed_save_in_the_foreground_is_named_and_cleaned_up(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp
  ck = _checkpointer(tmp_path)
  ck.save(1, {'x': jax.numpy.ones(3)}, None, {'model': {}}, {})

  def unwritable(self, step, *args, **kwargs):
    os.makedirs(os.path.join(self.directory, f'{step}.orbax-checkpoint-tmp-99'))
    raise PermissionError(errno.EACCES, 'Permission denied')

  monkeypatch.setattr(ocp.CheckpointManager, 'save', unwritable)
  with pytest.raises(CheckpointSaveError, match=f'saving checkpoint 2 to {tmp_path}'):
    ck.save(2, {'x': jax.numpy.ones(3)}, None, {'model': {}}, {})
  monkeypatch.undo()
  ck.close()
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1']


def test_unwritable_checkpoints_directory_fails_before_orbax(tmp_path, monkeypatch):
  """Orbax would wait minutes on a step directory it cannot create; the probe fails at once."""
  ck = _checkpointer(tmp_path)
  real_open = open

  def read_only(path, *args, **kwargs):
    if '.write-probe-' in str(path):
      raise OSError(errno.EROFS, 'Read-only file system')
    return real_open(path, *args, **kwargs)

  monkeypatch.setattr('builtins.open', read_only)
  with pytest.raises(CheckpointSaveError, match='Read-only file system'):
    ck.save(1, {'x': jax.numpy.ones(3)}, None, {'model': {}}, {})
  monkeypatch.undo()
  ck.close()


def test_divergence_message_calls_only_a_verified_checkpoint_intact(tmp_path):
  from deepseek41.train.step_log import StepLog

  def diverge(describe):
    log = StepLog(resolve(small_config(), num_devices=1, backend='cpu'), writer=None,
                  throughput=None, describe_checkpoint=describe)
    log.push(3, {'loss': np.float32('nan'), 'grad_norm': np.float32(1.0)}, 0.0)
    with pytest.raises(TrainingDiverged, match='at step 3') as err:
      log.drain(keep_last=False)
    return str(err.value)

  ck = _checkpointer(tmp_path)
  msg = diverge(ck.describe_newest)
  assert 'No checkpoint was saved' in msg and 'None' not in msg and 'intact' not in msg
  ck.save(2, {'x': jax.numpy.ones(3)}, None, {'model': {}}, {})
  assert 'checkpoints/2, is intact (checksums verified)' in diverge(ck.describe_newest)
  os.remove(tmp_path / 'checkpoints' / '2' / MANIFEST)
  msg = diverge(ck.describe_newest)
  assert 'not verified' in msg and 'intact' not in msg
  ck.close()


def test_second_signal_waits_for_the_save_third_aborts():
  with _StopFlag() as stop:
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # a second Ctrl-C: logged, the save goes on
    assert stop.signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
      stop._handle(signal.SIGTERM, None)


def test_workdir_lock_names_the_holder_and_is_released(tmp_path):
  first = WorkdirLock(str(tmp_path))
  first.acquire()
  with pytest.raises(WorkdirError, match=rf'pid {os.getpid()} on host .* started 20'):
    WorkdirLock(str(tmp_path)).acquire()
  with pytest.raises(WorkdirError, match='in use by another trainer'):
    train(small_config(), str(tmp_path))  # refused before anything is compiled or written
  assert not os.path.exists(tmp_path / 'config.json')
  first.release()
  with WorkdirLock(str(tmp_path)):
    pass


def test_lock_of_a_dead_process_does_not_block(tmp_path):
  holder = subprocess.run(
      [sys.executable, '-c', 'import sys; from deepseek41.train.workdir import WorkdirLock; '
       'WorkdirLock(sys.argv[1]).acquire()', str(tmp_path)],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
  assert holder.returncode == 0 and os.path.getsize(tmp_path / '.lock') > 0  # stale text left
  with WorkdirLock(str(tmp_path)):
    pass


def test_unusable_workdir_is_named(tmp_path):
  afile = tmp_path / 'afile'
  afile.write_text('x')
  with pytest.raises(WorkdirError, match=f'{afile} is a file'):
    train(small_config(), str(afile))
  with pytest.raises(WorkdirError, match='cannot be created'):
    train(small_config(), str(afile / 'run'))
  (tmp_path / 'w').mkdir()
  (tmp_path / 'w' / 'checkpoints').write_text('x')
  with pytest.raises(WorkdirError, match='checkpoint directory .*/w/checkpoints is not usable'):
    train(small_config(), str(tmp_path / 'w'))


def test_missing_config_file_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, '-m', 'deepseek41.train',
                         f'--config={tmp_path}/nope.py', f'--workdir={tmp_path}/w',
                         '--config.train.steps=3'], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 2
  assert proc.stderr.strip() == f"error: --config file '{tmp_path}/nope.py' does not exist"
