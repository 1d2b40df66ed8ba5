"""Fault injection: failed, stuck and cut-short saves, an unwritable metrics.jsonl, corrupt
checkpoints, signals at start-up and in the loop, a locked or unusable work directory, resumes
after a kill, bad command lines. Tiny synthetic runs on the CPU."""

import errno
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from orbax.checkpoint._src.multihost import multihost

from deepseek41.config import resolve
from deepseek41.train import metrics as metrics_lib
from deepseek41.train import trainer as trainer_lib
from deepseek41.train.checkpoint import (MANIFEST, CheckpointError, CheckpointSaveError,
                                         Checkpointer)
from deepseek41.train.metrics import MetricsWriteError
from deepseek41.train.stop import STOP
from deepseek41.train.trainer import TrainingDiverged, train
from deepseek41.train.warm_start import check_fits
from deepseek41.train.workdir import WorkdirError, WorkdirLock
from tests.helpers import REPO_ROOT, small_config

ROOT = REPO_ROOT


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


def test_second_signal_waits_for_the_save_third_exits_at_once(monkeypatch, caplog):
  """The handler never raises (an exception raised in a signal handler is dropped inside a GC
  callback, or unwinds out of a blocking JAX call under running threads); the third signal ends
  the process with os._exit, naming the checkpoints it leaves."""
  exits = []
  monkeypatch.setattr(os, '_exit', exits.append)
  with STOP as stop, caplog.at_level(logging.WARNING):
    stop.describe_checkpoints = lambda: 'complete checkpoints in /w/checkpoints: [2, 4]'
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # a second Ctrl-C: logged, the save goes on
    assert stop.signal == signal.SIGINT and not exits
    try:
      stop._handle(signal.SIGTERM, None)
    except BaseException as e:  # a KeyboardInterrupt here would also end the test session
      pytest.fail(f'the third signal raised {e!r} instead of exiting')
  assert exits == [128 + signal.SIGTERM]
  assert ('received SIGTERM three times: exiting now (status 143) without waiting for any save; '
          'complete checkpoints in /w/checkpoints: [2, 4]') in caplog.records[-1].getMessage()


def test_the_trainer_takes_sigterm_back_from_jax_distributed():
  """jax.distributed.initialize(), between the command line's entry and train()'s, gives SIGTERM
  to its preemption notifier (which only logs it): the nested entry installs the handler again,
  keeping a signal already received; the outermost exit restores what was there before."""
  before = signal.getsignal(signal.SIGTERM)
  with STOP as stop:
    stop._handle(signal.SIGINT, None)  # received during the command line's imports
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as the preemption notifier takes it
    with STOP:
      assert signal.getsignal(signal.SIGTERM) == stop._handle
      assert stop.signal == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) == stop._handle
  assert signal.getsignal(signal.SIGTERM) == before


def _run_cli(tmp_path, overrides):
  """`python -m deepseek41.train` on small_config(**overrides) in tmp_path/w, output merged."""
  cfg_file = tmp_path / 'cfg.py'
  cfg_file.write_text('from tests.helpers import small_config\n'
                      f'def get_config():\n  return small_config(**{overrides!r})\n')
  return subprocess.Popen([sys.executable, '-m', 'deepseek41.train', f'--config={cfg_file}',
                           f'--workdir={tmp_path / "w"}'], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def test_third_sigint_exits_at_once_cleanly_and_the_checkpoints_resume(tmp_path):
  """Three Ctrl-Cs while steps run and saves are in flight: exit status 130 within seconds, one
  line naming the checkpoints kept, no traceback, no C++ abort ('terminate called without an
  active exception' came from unwinding a KeyboardInterrupt out of a blocking JAX call); every
  complete checkpoint verifies and the newest resumes."""
  overrides = {'train.steps': 100000, 'checkpoint.every_steps': 2, 'checkpoint.async_save': True,
               'train.compilation_cache_dir': jax.config.jax_compilation_cache_dir}
  workdir = tmp_path / 'w'
  proc = _run_cli(tmp_path, overrides)
  seen = []

  def read_until(text):  # each signal is handled before the next is sent: none coalesce
    while line := proc.stdout.readline():
      seen.append(line)
      if text in line:
        return

  try:
    read_until('INFO step 5:')
    for answer in ('received SIGINT:', 'received SIGINT again', None):
      proc.send_signal(signal.SIGINT)
      if answer:
        read_until(answer)
    out = ''.join(seen) + proc.communicate(timeout=60)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
  assert 'received SIGINT three times: exiting now (status 130)' in out
  for crash in ('Traceback', 'terminate called', 'Fatal Python error'):
    assert crash not in out, out[-3000:]
  ck = Checkpointer(str(workdir), resolve(small_config(**overrides)).checkpoint)
  kept = ck.complete_steps()
  listed = re.search(rf'complete checkpoints in {re.escape(ck.directory)}: (\[[\d, ]+\]|none)'
                     r'(; the save of step (\d+) was in flight)?', out)
  assert kept and listed, out[-3000:]
  said = json.loads(listed.group(1)) if listed.group(1) != 'none' else []
  # A save's commit (a rename in Orbax's thread) may land between the listing and the exit:
  # then the line names that step as in flight.
  in_flight = [int(listed.group(3))] if listed.group(3) else []
  assert kept in (said, sorted(said + in_flight)), (kept, listed.group(0))
  for step in kept:
    ck.verify(step)  # raises if corrupt; False (unverified) if cut between commit and checksums
  ck.close()
  result = train(small_config(**overrides), str(workdir), stop_at_step=kept[-1] + 1)
  assert result.step == kept[-1] + 1 and not result.stopped_by_signal


def test_signal_during_start_up_ends_the_run_before_the_first_step(tmp_path, monkeypatch, caplog):
  """A SIGINT during start-up whose handler runs inside a garbage-collection callback (JAX keeps
  one in gc.callbacks): Python's KeyboardInterrupt would be dropped there ('Exception ignored')
  and the run trained to the end. It stops before the first step, saying there is nothing to
  save, with nothing written."""
  real_make_mesh = trainer_lib.make_mesh
  sent = []

  def sigint_inside_gc(phase, info):
    del info
    if phase == 'start' and not sent:
      sent.append(True)
      os.kill(os.getpid(), signal.SIGINT)  # its handler runs here, inside the callback

  def make_mesh_during_a_collection(*args):
    gc.callbacks.append(sigint_inside_gc)
    try:
      gc.collect()
    finally:
      gc.callbacks.remove(sigint_inside_gc)
    return real_make_mesh(*args)

  monkeypatch.setattr(trainer_lib, 'make_mesh', make_mesh_during_a_collection)
  workdir = tmp_path / 'w'
  with caplog.at_level(logging.WARNING):
    result = train(small_config(**{'checkpoint.every_steps': 2}), str(workdir))
  assert sent and result.stopped_by_signal and result.step == 0
  assert any('stopped by SIGINT during start-up, before the first step: nothing to save' in
             r.getMessage() and 'no checkpoint yet' in r.getMessage() for r in caplog.records)
  assert not os.listdir(workdir / 'checkpoints') and not (workdir / 'metrics.jsonl').exists()
  assert not (workdir / 'config.json').exists()


def test_checkpoints_tree_unwritable_during_a_save_fails_at_once(tmp_path, monkeypatch):
  """The tree loses its write permission once `4.orbax-checkpoint-tmp` exists. Created in
  Orbax's background, the item directories failed there and the save of the data item (in the
  main thread) waited 300 s for them, deaf to SIGTERM (here the wait is cut to 5 s: the save
  then failed with a TimeoutError). Now the save fails at once, naming the cause, the directory
  and the complete checkpoints; nothing of the failed save is left."""
  monkeypatch.setattr(multihost, '_DEFAULT_BARRIER_TIMEOUT', 5)
  real_mkdir = os.mkdir

  def unwritable_inside_the_save(path, *args, **kwargs):
    if f'{os.sep}4.orbax-checkpoint-tmp{os.sep}' in os.fspath(path):
      raise PermissionError(errno.EACCES, 'Permission denied', os.fspath(path))
    return real_mkdir(path, *args, **kwargs)

  monkeypatch.setattr(os, 'mkdir', unwritable_inside_the_save)
  workdir = tmp_path / 'w'
  config = small_config(**{'train.steps': 6, 'checkpoint.every_steps': 2,
                           'checkpoint.async_save': True})
  with pytest.raises(CheckpointSaveError) as err:
    train(config, str(workdir))
  monkeypatch.undo()
  msg = str(err.value)
  assert f'saving checkpoint 4 to {workdir / "checkpoints"} failed (PermissionError' in msg, msg
  assert 'Complete checkpoints are kept: [2]' in msg and '\n' not in msg
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2']
  assert _steps(workdir) == [1, 2, 3, 4]  # no step after the failed save
  ck = _checkpointer(workdir)
  assert ck.verify(2)
  ck.close()


def test_a_save_that_does_not_finish_stops_the_run_without_waiting_for_it(tmp_path, monkeypatch):
  """A save stuck in the background (a hung file system): the wait for it ends after
  checkpoint.save_timeout_s with CheckpointSaveError naming the complete checkpoints and the
  unfinished one, and close() does not wait for it again. (The stuck write is released a few seconds later, for
  the test's own threads: without the bound, the wait would simply have lasted until then.)"""
  real = json_checkpoint_handler.JsonCheckpointHandler._save_fn
  disk = threading.Event()

  async def hangs_at_step_4(self, x, directory):
    if f'{os.sep}4.orbax-checkpoint-tmp' in str(directory):
      disk.wait()
    return await real(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, '_save_fn', hangs_at_step_4)
  ck = _checkpointer(tmp_path, **{'checkpoint.async_save': True, 'checkpoint.save_timeout_s': 1})
  state = {'x': jax.numpy.ones(3)}
  ck.save(2, state, None, {'model': {}}, {})
  ck.save(4, state, None, {'model': {}}, {})
  threading.Timer(8, disk.set).start()
  try:
    with pytest.raises(CheckpointSaveError) as err:
      ck.wait()
    msg = str(err.value)
    ck.close()  # returns: the stuck save's threads are not waited for again
    assert f'saving checkpoint 4 to {tmp_path / "checkpoints"} failed (it did not finish' in msg
    assert 'Complete checkpoints are kept: [2]' in msg
    assert 'checkpoints/4.orbax-checkpoint-tmp is left in place; a new start skips it' in msg
  finally:
    disk.set()


def test_unwritable_metrics_file_is_named_at_start_up(tmp_path):
  """Refused before anything is compiled or written (it was a raw traceback after the state's
  initialisation)."""
  (tmp_path / 'metrics.jsonl').mkdir()  # as root, the one file that cannot be opened for writing
  with pytest.raises(WorkdirError, match=rf'{tmp_path}/metrics.jsonl cannot be written \(Is a '
                     'directory\\): the run appends its metrics there'):
    train(small_config(), str(tmp_path))
  assert not (tmp_path / 'config.json').exists() and not (tmp_path / 'checkpoints').exists()


class _FullDiskAtStep:
  """A metrics.jsonl whose disk fills up when the line of `step` is written."""

  def __init__(self, f, step):
    self.f, self.step = f, step

  def write(self, text):
    if text.startswith(f'{{"step": {self.step},'):
      raise OSError(errno.ENOSPC, 'No space left on device')
    return self.f.write(text)

  def __getattr__(self, name):
    return getattr(self.f, name)


def test_metrics_file_failing_mid_run_saves_a_checkpoint_and_stops(tmp_path, monkeypatch):
  """The disk under metrics.jsonl fills up at step 3's line (written once step 4 is dispatched):
  the run saves checkpoint 4 and stops with one message naming the file (it was a raw OSError
  with nothing saved); it resumes from 4."""
  real_open = open
  monkeypatch.setattr(metrics_lib, 'open', lambda path, mode='r', *a, **k: _FullDiskAtStep(
      real_open(path, mode, *a, **k), 3) if mode == 'a' else real_open(path, mode, *a, **k),
      raising=False)
  workdir = str(tmp_path / 'w')
  config = small_config(**{'train.steps': 6})
  with pytest.raises(MetricsWriteError) as err:
    train(config, workdir)
  monkeypatch.undo()
  assert str(err.value).startswith(
      f'cannot write {workdir}/metrics.jsonl at step 3 (No space left on device); saved '
      f'checkpoint 4 ({workdir}/checkpoints/4) and stopped')
  assert _steps(workdir) == [1, 2]
  ck = _checkpointer(workdir)
  assert ck.complete_steps() == [4] and ck.verify(4)
  ck.close()
  assert train(config, workdir).step == 6
  assert _steps(workdir) == [1, 2, 5, 6]  # the lines of steps 3 and 4 are in the log only


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
