"""Several trainer processes on one host (launch/local.sh): 2 processes x 2 fake CPU devices train
the losses of 1 process x 4 devices, and a run resumes across that change; SIGTERM to the
launcher; --dry_run; a failing process ends the launch.

The runs are subprocesses with their own XLA_FLAGS (the suite's 8 devices do not apply), on the
suite's persistent compilation cache. Tolerance: rtol 1e-5 on the losses. The global batches and
the program are the same; only the collectives differ (gloo across processes, in-process within
one), whose summation order can move the last bit or two of a float32 loss (seen: 3e-8).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from deepseek41.train.checkpoint import CheckpointError
from deepseek41.train.trainer import _stream_count
from deepseek41.train.workdir import WorkdirLock
from tests.helpers import REPO_ROOT

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = REPO_ROOT
LAUNCH = os.path.join(ROOT, 'launch', 'local.sh')
STEPS = 4  # compared; every run has the schedule of 1000 steps and stops early
RTOL = 1e-5
# configs/tiny.py cut down to compile in seconds: 4 layers at width 32, sliding-window attention
# only, plain residual, no Engram; synthetic data; a checkpoint every 2 steps, all kept; mesh
# data=2 x fsdp=2, so the batch and the parameters are both split across the two processes.
# Process 1 of a run compiles on its own (JAX's persistent cache is written by process 0 only,
# and process 1 never finds its programs there): the 2 x 2 runs are the slow part.
FLAGS = [
    '--config=configs/tiny.py',
    '--config.train.steps=1000', '--config.train.batch_size=8',
    '--config.train.eval_every_steps=0',
    f'--config.train.compilation_cache_dir={jax.config.jax_compilation_cache_dir or ""}',
    '--config.data.synthetic=True', '--config.data.seq_len=32',
    '--config.model.vocab_size=96', '--config.model.d_model=32', '--config.model.num_layers=4',
    '--config.model.num_encoder_layers=2', '--config.model.head_dim=32',
    '--config.model.rope_head_dim=8', '--config.model.q_lora_rank=16',
    '--config.model.o_lora_rank=16', '--config.model.sliding_window=8',
    '--config.model.compress_ratios=(0,2,1,1)', '--config.model.kv_source_layer_ids=(1,2)',
    '--config.model.index_source_layer_ids=(1,2,3)',
    '--config.model.candidate_source_layer_id=2', '--config.model.engram_layer_ids=(1,)',
    '--config.model.moe_intermediate_size=16', '--config.model.residual=plain',
    '--config.model.engram=False', '--config.model.attention_variant=window',
    '--config.checkpoint.every_steps=2', '--config.checkpoint.keep_period=2',
    '--config.checkpoint.async_save=False',
    '--config.log.every_steps=1', '--config.log.progress_bar=False',
    '--config.log.tensorboard=False',
    '--config.mesh.data=2', '--config.mesh.fsdp=2',
]


def _env(devices: int | None = None) -> dict:
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHON=sys.executable)
  env['XLA_FLAGS'] = ' '.join(f for f in env.get('XLA_FLAGS', '').split()
                              if not f.startswith('--xla_force_host_platform_device_count'))
  if devices is not None:
    env['XLA_FLAGS'] += f' --xla_force_host_platform_device_count={devices}'
  return env


def _one_process(workdir, *extra, timeout=240):
  """1 process x 4 devices."""
  return subprocess.run([sys.executable, '-m', 'deepseek41.train', *FLAGS,
                         f'--workdir={workdir}', *extra], cwd=ROOT, env=_env(4),
                        capture_output=True, text=True, timeout=timeout)


def _two_processes(workdir, *extra, timeout=240):
  """2 processes x 2 devices through launch/local.sh."""
  return subprocess.run(['timeout', str(timeout), LAUNCH, '2', *FLAGS, f'--workdir={workdir}',
                         *extra], cwd=ROOT, env={**_env(), 'DEVICES_PER_PROC': '2'},
                        capture_output=True, text=True)


def _two_processes_until_sigterm(workdir, after_step: int, timeout=240):
  """2 x 2 through launch/local.sh, sent SIGTERM once process 0 logged `after_step`."""
  launcher = subprocess.Popen([LAUNCH, '2', *FLAGS, f'--workdir={workdir}'], cwd=ROOT,
                              env={**_env(), 'DEVICES_PER_PROC': '2'}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
  log0 = os.path.join(workdir, 'logs', 'process_0.log')
  try:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
      if os.path.exists(log0):
        with open(log0) as f:
          if f'step {after_step}:' in f.read():
            break
      time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  return subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err)


def _check(result, workdir=None, status=0):
  logs = ''
  if workdir is not None and os.path.isdir(os.path.join(workdir, 'logs')):
    for name in sorted(os.listdir(os.path.join(workdir, 'logs'))):
      with open(os.path.join(workdir, 'logs', name)) as f:
        logs += f'\n== {name}\n' + f.read()[-3000:]
  assert result.returncode == status, result.stderr[-3000:] + logs


def _losses(workdir) -> dict[int, float]:
  out = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      d = json.loads(line)
      if 'loss' in d:
        assert d['step'] not in out, f'step {d["step"]} logged twice'
        out[d['step']] = d['loss']
  return out


def _data_files(workdir, step) -> dict[str, dict]:
  d = os.path.join(workdir, 'checkpoints', str(step), 'data')
  out = {}
  for name in sorted(os.listdir(d)):
    if name.endswith('.json'):
      with open(os.path.join(d, name)) as f:
        out[name] = json.load(f)
  return out


def _assert_losses_match(got: dict, want: dict, steps):
  got = {s: got[s] for s in steps}
  want = {s: want[s] for s in steps}
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                             rtol=RTOL)


def _resume_copy(src, dst, step):
  """A work directory holding only checkpoint `step` of `src`."""
  os.makedirs(os.path.join(dst, 'checkpoints'))
  shutil.copytree(os.path.join(src, 'checkpoints', str(step)),
                  os.path.join(dst, 'checkpoints', str(step)))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The straight runs: 1 process x 4 devices in 2 data streams to step 4, and 2 processes x 2
  devices until SIGTERM to the launcher after step 4."""
  one = str(tmp_path_factory.mktemp('one'))
  _check(_one_process(one, '--config.data.streams=2', f'--stop_at_step={STEPS}'))
  two = str(tmp_path_factory.mktemp('two'))
  _check(_two_processes_until_sigterm(two, STEPS), two, status=75)
  return one, two


def test_two_processes_match_one(runs):
  one, two = runs
  _assert_losses_match(_losses(two), _losses(one), range(1, STEPS + 1))
  last = max(_losses(two))  # process 0 alone writes metrics: every step once
  assert sorted(_losses(two)) == list(range(1, last + 1))
  for step in (2, STEPS):  # every stream's position saved, the same on both layouts
    files = _data_files(two, step)
    assert sorted(files) == ['process_0-of-2.json', 'process_1-of-2.json']
    assert files == _data_files(one, step)
  assert sorted(os.listdir(os.path.join(two, 'logs'))) == ['process_0.log', 'process_1.log']
  with open(os.path.join(two, 'logs', 'process_1.log')) as f:
    assert 'process 1 of 2 with 2' in f.read()
  with open(os.path.join(two, 'config.json')) as f:
    assert json.load(f)['mesh']['fsdp'] == 2


def test_resume_two_processes_on_one(runs, tmp_path):
  """2 x 2 to step 2, then 1 x 4 to the end: the straight run's losses (the data streams go on
  where they were)."""
  one, two = runs
  work = str(tmp_path / 'resumed')
  _resume_copy(two, work, 2)
  result = _one_process(work, f'--stop_at_step={STEPS}')  # no data.streams: the checkpoint's
  _check(result)
  assert 'resumed from' in result.stderr
  assert sorted(_losses(work)) == [3, 4]
  _assert_losses_match(_losses(work), _losses(one), [3, 4])
  assert _data_files(work, STEPS) == _data_files(one, STEPS)


def test_resume_one_process_on_two(runs, tmp_path):
  one, _ = runs
  work = str(tmp_path / 'resumed')
  _resume_copy(one, work, 2)
  _check(_two_processes(work, f'--stop_at_step={STEPS}'), work)
  _assert_losses_match(_losses(work), _losses(one), [3, 4])
  assert _data_files(work, STEPS) == _data_files(one, STEPS)


def test_stream_count_rule(tmp_path):
  """A resumed run keeps the checkpoint's stream count; a process count that does not divide
  it, or a different data.streams, is refused with the counts that fit."""
  data = tmp_path / 'checkpoints' / '6' / 'data'
  data.mkdir(parents=True)
  for k in range(4):
    (data / f'process_{k}-of-4.json').write_text('{}')

  class Ckpt:
    def latest_step(self):
      return 6

    def step_dir(self, step):
      return str(tmp_path / 'checkpoints' / str(step))

  assert _stream_count(Ckpt(), 0, 2) == 4
  assert _stream_count(Ckpt(), 4, 1) == 4
  with pytest.raises(CheckpointError, match='resume on 1, 2, 4 process'):
    _stream_count(Ckpt(), 0, 3)
  with pytest.raises(CheckpointError, match='data.streams=2, but checkpoint'):
    _stream_count(Ckpt(), 2, 1)
  (data / 'process_3-of-4.json').unlink()
  with pytest.raises(CheckpointError, match=r'stream\(s\) \[3\] of 4'):
    _stream_count(Ckpt(), 0, 2)

  class Fresh(Ckpt):
    def latest_step(self):
      return None

  assert _stream_count(Fresh(), 0, 2) == 2
  with pytest.raises(CheckpointError, match='data.streams=3 cannot be split evenly over 2'):
    _stream_count(Fresh(), 3, 2)


def test_dry_run_prints_the_banner_without_compiling(tmp_path):
  work = str(tmp_path / 'dry')
  t0 = time.perf_counter()
  result = _two_processes(work, '--dry_run', timeout=120)
  _check(result, work)
  assert time.perf_counter() - t0 < 60
  for i in (0, 1):
    with open(os.path.join(work, 'logs', f'process_{i}.log')) as f:
      text = f.read()
    assert f'dry run: process {i} of 2; 2 local / 4 global device(s) (cpu)' in text
    assert "mesh {'data': 2, 'fsdp': 2" in text and 'GiB optimizer state' in text
    assert 'not compiled' in text and 'first step' not in text
  assert not os.path.exists(os.path.join(work, 'checkpoints'))


def test_a_bad_flag_fails_the_launch(tmp_path):
  work = str(tmp_path / 'bad')
  result = _two_processes(work, '--config.train.no_such_key=1', timeout=120)
  assert result.returncode == 2, result.stderr
  assert 'unknown config key' in result.stderr  # the tail of the failed process's log


def test_a_locked_workdir_stops_every_process(tmp_path):
  """Another trainer holds the directory: process 0 is refused, and the launch ends with its
  status (the other process, which would wait for process 0 forever, is stopped)."""
  work = str(tmp_path / 'locked')
  os.makedirs(work)
  t0 = time.perf_counter()
  with WorkdirLock(work):
    result = _two_processes(work, timeout=120)
  assert result.returncode == 2, result.stderr
  assert 'is in use by another trainer' in result.stderr
  assert time.perf_counter() - t0 < 100



def test_sigterm_to_the_launcher_saves_and_exits_75(runs):
  """The launcher forwarded SIGTERM (the `runs` fixture checked its status 75): both processes
  saved the same step, past the periodic saves, with both streams' positions."""
  _, two = runs
  steps = sorted(int(n) for n in os.listdir(os.path.join(two, 'checkpoints')) if n.isdigit())
  last = max(_losses(two))
  assert steps[-1] == last >= STEPS and steps[:2] == [2, 4]
  assert sorted(_data_files(two, last)) == ['process_0-of-2.json', 'process_1-of-2.json']
  for i in (0, 1):
    with open(os.path.join(two, 'logs', f'process_{i}.log')) as f:
      assert f'saved checkpoint {last} after SIGTERM' in f.read()


def test_a_process_stuck_after_a_failure_is_killed(tmp_path):
  """Process 1 fails; process 0 ignores SIGTERM (as one blocked in a collective may): the launcher
  kills it after KILL_AFTER seconds and exits with process 1's status. (A stand-in trainer.)"""
  fake = tmp_path / 'python'
  fake.write_text('#!/usr/bin/env bash\n'
                  'for a in "$@"; do [[ $a == --process_id=1 ]] && { echo boom; exit 3; }; done\n'
                  "trap '' TERM\nwhile :; do sleep 0.05; done\n")
  fake.chmod(0o755)
  t0 = time.perf_counter()
  result = subprocess.run(['timeout', '60', LAUNCH, '2', f'--workdir={tmp_path / "w"}'],
                          env={**_env(), 'PYTHON': str(fake), 'PORT': '1', 'KILL_AFTER': '1'},
                          capture_output=True, text=True)
  assert result.returncode == 3, result.stderr
  assert 'process 1 failed with status 3' in result.stderr and 'boom' in result.stderr
  assert time.perf_counter() - t0 < 20


def test_experts_split_across_processes(tmp_path):
  """expert=4 over 2 processes x 2 devices: the all-to-all of the expert exchange crosses the
  process boundary (gloo on the CPU) and the losses match 1 process x 4 devices."""
  ep = ['--config.mesh.fsdp=1', '--config.mesh.data=1', '--config.mesh.expert=4',
        '--config.model.moe_backend=reference', f'--stop_at_step={STEPS // 2}',
        '--config.checkpoint.every_steps=0']
  one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
  _check(_one_process(one, *ep, '--config.data.streams=2'))  # the 2-process run's input streams
  _check(_two_processes(two, *ep), two)
  _assert_losses_match(_losses(two), _losses(one), range(1, STEPS // 2 + 1))
