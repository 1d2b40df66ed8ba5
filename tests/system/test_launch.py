"""The cluster launchers, as far as a CPU host without SLURM, gcloud or Kubernetes can check them.

- launch/slurm.sbatch under a faked SLURM job: a stand-in `srun` starts SLURM_NTASKS local tasks
  with the step's variables (SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST, ...); the real
  trainer's `--distributed` then joins 2 processes through jax's SLURM auto-detection (gloo on
  the CPU) and prints its --dry_run banner. With a stand-in trainer: the time-limit signal to the
  batch script reaches every task as one SIGTERM, status 75 requeues the job (`scontrol requeue`, also a stand-in), the
  per-task GPU choice (JAX_LOCAL_DEVICE_IDS).
- launch/tpu_pod.sh with DRY=1: the gcloud commands; the command it sends the workers is run
  here (one worker, explicit coordinator flags) and starts the trainer. Its preflight (TOPOLOGY):
  the plan command, and that a failing plan stops the launch before gcloud.
- launch/k8s/jobset.yaml: the manifest's structure; its container command, with the variables
  expanded as Kubernetes would for pods 0 and 1, starts a 2-process run here (--dry_run).
Not checked here: real srun/sbatch/scontrol, gcloud, a JobSet controller, GPUs or TPUs.
(2 processes x 2 devices through launch/local.sh --dry_run: tests/system/test_multiprocess.py.)
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
SBATCH = os.path.join(ROOT, 'launch', 'slurm.sbatch')
TPU_POD = os.path.join(ROOT, 'launch', 'tpu_pod.sh')
JOBSET = os.path.join(ROOT, 'launch', 'k8s', 'jobset.yaml')

# srun on one host: SLURM_NTASKS tasks of the command, each with the variables of a job step
# (those jax's SlurmCluster reads among them); --output's %x %j %t and --chdir honoured; SIGTERM
# forwarded to every task, as srun does; the status is the highest of the tasks'.
FAKE_SRUN = r'''#!/usr/bin/env bash
set -u
printf '%s\n' "$@" >"$FAKE_SRUN_ARGS"
out=/dev/stdout
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --output=*) out=${1#--output=} ;;
    --chdir=*) cd "${1#--chdir=}" ;;
  esac
  shift
done
pids=()
trap 'kill -s TERM "${pids[@]}" 2>/dev/null' TERM
for ((t = 0; t < SLURM_NTASKS; t++)); do
  log=${out//%x/$SLURM_JOB_NAME}; log=${log//%j/$SLURM_JOB_ID}; log=${log//%t/$t}
  SLURM_PROCID=$t SLURM_LOCALID=$t SLURM_NODEID=0 SLURM_STEP_ID=0 \
    SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST SLURM_STEP_NUM_NODES=1 "$@" >>"$log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do
  while kill -0 "$p" 2>/dev/null; do wait "$p" || true; done
  rc=0; wait "$p" || rc=$?
  if ((rc > status)); then status=$rc; fi
done
exit "$status"
'''
FAKE_SCONTROL = '#!/usr/bin/env bash\necho "$@" >>"$FAKE_SCONTROL_LOG"\n'
# A trainer that reports what it was given, then runs until SIGTERM, counts the SIGTERMs of the
# next half second and exits 75 (FAKE_STATUS: exit with that status at once instead).
FAKE_TRAINER = r'''#!/usr/bin/env bash
echo "argv: $*"
echo "task ${SLURM_PROCID:-?} local_device_ids=${JAX_LOCAL_DEVICE_IDS-unset} cwd=$PWD"
if [[ -n ${FAKE_STATUS:-} ]]; then exit "$FAKE_STATUS"; fi
n=0
trap 'n=$((n + 1)); echo "got SIGTERM $n"' TERM
echo ready
while ((n == 0)); do sleep 0.05; done
sleep 0.5
exit 75
'''


def _env(**extra) -> dict:
  """The environment of a launched trainer: CPU, one device per process (the suite's 8 fake
  devices dropped)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = ' '.join(f for f in env.get('XLA_FLAGS', '').split()
                              if not f.startswith('--xla_force_host_platform_device_count'))
  env.pop('JAX_LOCAL_DEVICE_IDS', None)
  env.pop('CUDA_VISIBLE_DEVICES', None)
  for k in [k for k in env if k.startswith('SLURM_')]:
    del env[k]
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _executable(path, text):
  path.write_text(text)
  path.chmod(0o755)
  return str(path)


def _read(path) -> str:
  with open(path) as f:
    return f.read()


def test_scripts_parse():
  for script in (SBATCH, TPU_POD, os.path.join(ROOT, 'launch', 'local.sh')):
    result = subprocess.run(['bash', '-n', script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(script, os.X_OK), script
  text = _read(SBATCH)
  assert 'set -euo pipefail' in text
  for directive in ('--requeue', '--signal=B:USR1@120', '--gpus-per-task=1'):
    assert f'#SBATCH {directive}' in text
  # sbatch stops reading #SBATCH lines at the first command
  first_command = next(i for i, line in enumerate(text.splitlines())
                       if line.strip() and not line.startswith('#'))
  assert all(i < first_command for i, line in enumerate(text.splitlines())
             if line.startswith('#SBATCH'))


def test_distributed_without_a_cluster_is_refused_clearly(tmp_path):
  result = subprocess.run([sys.executable, '-m', 'deepseek41.train', '--config=configs/tiny.py',
                           f'--workdir={tmp_path}', '--distributed', '--dry_run'],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
  assert result.returncode == 2, result.stderr
  assert 'found no cluster environment' in result.stderr
  assert 'Traceback' not in result.stderr


@pytest.fixture
def slurm(tmp_path):
  """A faked SLURM job: srun and scontrol stand-ins on PATH, the batch job's variables."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  _executable(bin_dir / 'srun', FAKE_SRUN)
  _executable(bin_dir / 'scontrol', FAKE_SCONTROL)
  work = tmp_path / 'work dir'  # a space: the paths are quoted all the way
  env = _env(PATH=f'{bin_dir}:{os.environ["PATH"]}', SLURM_JOB_ID=4242,
             SLURM_JOB_NAME='deepseek41', SLURM_JOB_NODELIST='localhost', SLURM_NTASKS=2,
             SLURM_JOB_NUM_NODES=1, SLURM_SUBMIT_DIR=ROOT, WORKDIR=work,
             JAX_COORDINATOR_PORT=_free_port(), FAKE_SRUN_ARGS=tmp_path / 'srun_args',
             FAKE_SCONTROL_LOG=tmp_path / 'scontrol.log',
             PYTHON=sys.executable)  # the interpreter running the tests, with its packages
  return env, work, tmp_path


def _task_log(work, task):
  return _read(work / 'logs' / f'deepseek41-4242-{task}.log')


def test_slurm_two_tasks_join_through_auto_detection(slurm):
  """The real trainer: 2 tasks, `--distributed` finds the SLURM step, gloo joins them."""
  env, work, tmp = slurm
  result = subprocess.run(['bash', SBATCH, '--dry_run', '--config.train.batch_size=4'],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
  logs = ''.join(f'\n== task {t}\n' + _task_log(work, t) for t in (0, 1)
                 if (work / 'logs' / f'deepseek41-4242-{t}.log').exists())
  assert result.returncode == 0, result.stderr + logs
  for t in (0, 1):
    text = _task_log(work, t)
    assert f'attempt 0 task {t}' in text
    assert f'dry run: process {t} of 2; 1 local / 2 global device(s) (cpu)' in text, text
    assert "mesh {'data': 2" in text and 'not compiled' in text
  srun_args = _read(tmp / 'srun_args').splitlines()
  assert f'--output={work}/logs/%x-%j-%t.log' in srun_args
  assert f'--chdir={ROOT}' in srun_args and '--open-mode=append' in srun_args
  assert srun_args[-5:] == ['--distributed', '--config=configs/tiny.py', f'--workdir={work}',
                            '--dry_run', '--config.train.batch_size=4']
  assert not (tmp / 'scontrol.log').exists()


def test_slurm_time_limit_signal_saves_and_requeues(slurm):
  """SIGUSR1 to the batch script (--signal=B:USR1@120) becomes one SIGTERM to every task through
  srun, however often it comes; their 75 requeues the job. A SIGTERM to the script (SLURM ending
  the job signals the tasks itself) is not passed on. One GPU visible per task
  (--gpus-per-task=1): JAX's device 0."""
  env, work, tmp = slurm
  env.update(PYTHON=_executable(tmp / 'python', FAKE_TRAINER), CUDA_VISIBLE_DEVICES='5',
             CONFIG='configs/ablation_1b.py')
  job = subprocess.Popen(['bash', SBATCH, '--config.train.steps=7'], cwd=tmp, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and job.poll() is None:
      logs = [work / 'logs' / f'deepseek41-4242-{t}.log' for t in (0, 1)]
      if all(p.exists() and 'ready' in _read(p) for p in logs):
        break
      time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert job.poll() is None
    for t in (0, 1):
      assert 'got SIGTERM' not in _task_log(work, t)
    job.send_signal(signal.SIGUSR1)
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=30)
  finally:
    if job.poll() is None:
      job.kill()
  assert job.returncode == 75, err
  assert _read(tmp / 'scontrol.log').split() == ['requeue', '4242']
  assert 'requeued job 4242' in err
  for t in (0, 1):
    text = _task_log(work, t)
    assert 'got SIGTERM 1' in text and 'got SIGTERM 2' not in text
    assert (f'argv: -m deepseek41.train --distributed --config=configs/ablation_1b.py '
            f'--workdir={work} --config.train.steps=7') in text
    assert f'task {t} local_device_ids=0 cwd={ROOT}' in text


@pytest.mark.parametrize('status, restarts, requeued', [(75, 3, False), (3, 0, False),
                                                         (0, 0, False)])
def test_slurm_one_process_per_node_and_no_requeue(slurm, status, restarts, requeued):
  """One task per node seeing 4 GPUs gets all 4; 75 past MAX_REQUEUES, a failure or success is
  not requeued, and the script exits with the trainer's status."""
  env, work, tmp = slurm
  env.update(PYTHON=_executable(tmp / 'python', FAKE_TRAINER), FAKE_STATUS=str(status),
             SLURM_NTASKS='1', SLURM_NTASKS_PER_NODE='1', CUDA_VISIBLE_DEVICES='0,1,2,3',
             SLURM_RESTART_COUNT=str(restarts), MAX_REQUEUES='3')
  result = subprocess.run(['bash', SBATCH], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=30)
  assert result.returncode == status, result.stderr
  assert (tmp / 'scontrol.log').exists() == requeued
  assert 'task 0 local_device_ids=0,1,2,3' in _task_log(work, 0)
  assert f'attempt {restarts} task 0' in _task_log(work, 0)
  if status == 75:
    assert 'MAX_REQUEUES=3' in result.stderr
  elif status:
    assert 'failed with status 3' in result.stderr


def test_slurm_needs_a_job_and_a_workdir(slurm):
  env, _, tmp = slurm
  del env['WORKDIR']
  result = subprocess.run(['bash', SBATCH], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=30)
  assert result.returncode != 0 and 'set WORKDIR' in result.stderr
  result = subprocess.run(['bash', SBATCH], cwd=tmp, env=_env(WORKDIR=tmp), capture_output=True,
                          text=True, timeout=30)
  assert result.returncode != 0 and 'submit this script with sbatch' in result.stderr


def _tpu_dry(*args, **env):
  result = subprocess.run([TPU_POD, *args], env=_env(DRY=1, **env), capture_output=True,
                          text=True, timeout=30)
  assert result.returncode == 0, result.stderr
  return [shlex.split(line) for line in result.stdout.splitlines()]


def _remote_command(argv) -> str:
  """The --command of a `gcloud ... ssh` line: what each worker's login shell runs."""
  assert argv[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'my-tpu'], argv
  assert '--zone=us-east5-a' in argv and '--worker=all' in argv
  [command] = [a[len('--command='):] for a in argv if a.startswith('--command=')]
  return command


def _worker_script(argv) -> str:
  """The script inside the --command's `bash -c`."""
  inner = shlex.split(_remote_command(argv))
  assert inner[:2] == ['bash', '-c'] and len(inner) == 3, inner
  assert inner[2].startswith('set -euo pipefail; ')
  return inner[2]


def test_tpu_pod_dry_run_prints_the_commands(tmp_path):
  train = ['--config=configs/tiny.py', f'--workdir={tmp_path}/w d', "--config.data.path=it's"]
  [ssh] = _tpu_dry('my-tpu', 'us-east5-a', *train, PROJECT='proj')
  assert '--project=proj' in ssh
  script = _worker_script(ssh)
  words = shlex.split(script.split('nohup ', 1)[1].split('>>', 1)[0])
  assert words == ['.venv/bin/python', '-m', 'deepseek41.train', '--distributed', *train]

  sync = _tpu_dry('my-tpu', 'us-east5-a', *train, SYNC=1, REMOTE_REPO='/opt/ds41')
  assert [argv[:3] for argv in sync[:2]] == [['git', '-C', ROOT], ['gcloud', 'compute', 'tpus']]
  assert sync[1][4] == 'scp' and sync[1][-1] == '--worker=all'
  install = _worker_script(sync[2])
  assert 'tar -xzf /tmp/deepseek41.tar.gz -C /opt/ds41' in install
  assert "pip install --quiet -e '.[tpu]'" in install
  assert 'cd /opt/ds41;' in _worker_script(sync[3])

  [stop] = _tpu_dry('my-tpu', 'us-east5-a', f'--workdir={tmp_path}', ACTION='stop')
  assert 'kill -s TERM' in _worker_script(stop)


def test_tpu_pod_refusals(tmp_path):
  run = lambda *a, **e: subprocess.run([TPU_POD, *a], env=_env(**e), capture_output=True,
                                       text=True, timeout=30)
  missing = run('my-tpu', 'z', '--workdir=w', GCLOUD=str(tmp_path / 'no-gcloud'))
  assert missing.returncode == 127
  assert 'not found: install the Google Cloud CLI' in missing.stderr
  assert run('my-tpu').returncode == 2
  assert 'usage' in run('--workdir=w', 'z').stderr
  assert 'is required' in run('my-tpu', 'z', '--config=c', DRY=1).stderr


def test_tpu_pod_worker_command_starts_the_trainer(tmp_path):
  """What every worker runs, run here as worker 3: the trainer starts (explicit coordinator
  flags stand in for the TPU VM's auto-detection) and logs to WORKDIR/logs/worker_3.log."""
  work = tmp_path / 'w d'
  port = _free_port()
  [ssh] = _tpu_dry('my-tpu', 'us-east5-a', '--config=configs/tiny.py', f'--workdir={work}',
                   '--dry_run', f'--coordinator_address=localhost:{port}', '--num_processes=1',
                   '--process_id=0', REMOTE_REPO=ROOT, PYTHON=sys.executable)
  result = subprocess.run(['sh', '-c', _remote_command(ssh)], cwd=tmp_path,
                          env=_env(TPU_WORKER_ID=3), capture_output=True, text=True, timeout=60)
  log = work / 'logs' / 'worker_3.log'
  assert result.returncode == 0, result.stdout + result.stderr + (_read(log) if log.exists()
                                                                   else '')
  assert 'worker 3: trainer exited with status 0' in result.stdout
  text = _read(log)
  assert 'dry run: process 0 of 1; 1 local / 1 global device(s) (cpu)' in text, text
  assert int(_read(work / 'logs' / 'worker_3.pid')) > 0


def _k8s_expand(value: str, env: dict) -> str:
  """Kubernetes' $(NAME) expansion: defined names only; others stay as written."""
  return re.sub(r'\$\(([A-Za-z_][A-Za-z0-9_]*)\)', lambda m: env.get(m.group(1), m.group(0)),
                value)


def _pod_env(container, pod_labels, pod_annotations) -> dict:
  env = {}
  for var in container['env']:
    if 'value' in var:
      env[var['name']] = _k8s_expand(str(var['value']), env)
    else:
      path = var['valueFrom']['fieldRef']['fieldPath']
      m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
      assert m, path
      env[var['name']] = (pod_labels if m.group(1) == 'labels' else pod_annotations)[m.group(2)]
  return env


def test_jobset_manifest_starts_every_process(tmp_path):
  with open(JOBSET) as f:
    [doc] = list(yaml.safe_load_all(f))
  assert doc['apiVersion'] == 'jobset.x-k8s.io/v1alpha2' and doc['kind'] == 'JobSet'
  spec = doc['spec']
  assert spec['network']['enableDNSHostnames'] is True
  [rjob] = spec['replicatedJobs']
  assert rjob['replicas'] == 1
  job = rjob['template']['spec']
  assert job['completionMode'] == 'Indexed' and job['parallelism'] == job['completions']
  pod = job['template']['spec']
  assert pod['restartPolicy'] == 'Never' and pod['terminationGracePeriodSeconds'] >= 120
  [container] = pod['containers']
  assert container['resources']['limits']['nvidia.com/gpu'] == 8
  assert {m['mountPath'] for m in container['volumeMounts']} >= {'/runs', '/dev/shm'}
  # exit 2 fails the run instead of restarting it
  [rule] = job['podFailurePolicy']['rules']
  assert rule['action'] == 'FailJob' and rule['onExitCodes']['values'] == [2]
  assert spec['failurePolicy']['rules'][0]['onJobFailureReasons'] == ['PodFailurePolicy']

  name, n = doc['metadata']['name'], job['parallelism']
  argvs = []
  for i in range(n):
    env = _pod_env(container,
                   {'jobset.sigs.k8s.io/jobset-name': name,
                    'jobset.sigs.k8s.io/replicatedjob-name': rjob['name']},
                   {'batch.kubernetes.io/job-completion-index': str(i)})
    assert env['COORDINATOR'] == f'{name}-{rjob["name"]}-0-0.{name}:8476'
    assert env['NUM_PROCESSES'] == str(n) and env['WORKDIR'].startswith('/runs/')
    argv = [_k8s_expand(a, env) for a in container['command']]
    assert not any('$(' in a for a in argv), argv
    assert f'--process_id={i}' in argv and f'--num_processes={n}' in argv
    argvs.append(argv)

  # Here: the coordinator's pod name -> localhost, python -> this interpreter, a CPU config.
  port = _free_port()
  work = tmp_path / 'run'
  procs = []
  for argv in argvs:
    argv = [sys.executable if a == 'python' else
            f'--coordinator_address=localhost:{port}' if a.startswith('--coordinator_address=')
            else '--config=configs/tiny.py' if a.startswith('--config=')
            else f'--workdir={work}' if a.startswith('--workdir=') else a for a in argv]
    procs.append(subprocess.Popen([*argv, '--dry_run'], cwd=ROOT, env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=90)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out
    assert f'dry run: process {i} of {n}; 1 local / {n} global device(s) (cpu)' in out, out


def _recording_stub(path, record, status=0):
  """An executable that appends its arguments (one a line, then a blank line) to `record`."""
  path.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" "" >>{shlex.quote(str(record))}\n'
                  f'exit {status}\n')
  path.chmod(0o755)
  return str(path)


def test_tpu_pod_preflight_plans_the_slice_first(tmp_path):
  """TOPOLOGY set: the TPU compiler's plan of the run's config (its --config and --config.*
  flags, nothing else) on that slice comes before any worker command."""
  train = ['--config=configs/tiny.py', '--config.train.steps=3', f'--workdir={tmp_path}',
           '--dry_run']
  plan, ssh = _tpu_dry('my-tpu', 'us-east5-a', *train, TOPOLOGY='v5p:2x2x1',
                       PLAN_FLAGS='--per_layer')
  assert plan == [os.path.join(ROOT, '.venv', 'bin', 'python'), '-m', 'deepseek41.tools.plan',
                  '--topology=v5p:2x2x1', '--config=configs/tiny.py', '--config.train.steps=3',
                  '--per_layer']
  assert 'deepseek41.train' in _worker_script(ssh)


def test_tpu_pod_preflight_gates_the_workers(tmp_path):
  """The workers are reached only when the plan passes: a stand-in plan that passes lets the
  gcloud stand-in run; the real plan of a config that cannot take the slice's mesh (8 experts on
  3 expert shards) stops the launch before gcloud."""
  calls = tmp_path / 'calls'
  gcloud = _recording_stub(tmp_path / 'gcloud', calls)
  ok_plan = _recording_stub(tmp_path / 'plan-ok', tmp_path / 'plan-args')
  launch = lambda *a, **e: subprocess.run(  # noqa: E731
      [TPU_POD, 'my-tpu', 'z', *a, f'--workdir={tmp_path}'], cwd=tmp_path,
      env=_env(GCLOUD=gcloud, TOPOLOGY='v5p:2x2x1', **e), capture_output=True, text=True,
      timeout=120)
  passed = launch('--config=configs/tiny.py', PLAN_PYTHON=ok_plan)
  assert passed.returncode == 0, passed.stderr
  assert '--topology=v5p:2x2x1' in _read(tmp_path / 'plan-args')
  assert 'ssh' in _read(calls).split()
  calls.unlink()

  refused = launch('--config=configs/tiny.py', '--config.mesh.expert=3',
                   PLAN_PYTHON=sys.executable)  # the real plan, under the tests' interpreter
  assert refused.returncode == 1
  assert 'preflight: the train step does not fit or does not compile for v5p:2x2x1' in \
      refused.stderr
  assert 'mesh.data: cannot fill: 4 devices' in refused.stderr
  assert not calls.exists()
