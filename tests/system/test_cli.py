"""One run of each command line as a program (the tests elsewhere call the entry points
in-process): the exit status, what it prints, and a bad input named."""

import json
import os
import shutil
import subprocess
import sys

from tests.helpers import CORPUS_STEPS, REPO_ROOT

ENV = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS='cpu')


def _run(*args, timeout=600):
  return subprocess.run([sys.executable, '-m', *args], cwd=REPO_ROOT, env=ENV,
                        capture_output=True, text=True, timeout=timeout)


def test_train_names_an_unknown_key_and_a_missing_config(tmp_path):
  out = _run('deepseek41.train', '--config=configs/tiny.py', f'--workdir={tmp_path}',
             '--config.model.no_such_key=1', timeout=120)
  assert out.returncode == 2 and "unknown config key 'model.no_such_key'" in out.stderr
  out = _run('deepseek41.train', '--config=configs/nope.py', f'--workdir={tmp_path}',
             timeout=120)
  assert out.returncode == 2 and 'nope.py' in out.stderr


def test_prepare(tmp_path):
  (tmp_path / 'docs').mkdir()
  for i in range(4):
    (tmp_path / 'docs' / f'{i}.txt').write_text(f'document {i}: the quick brown fox\n' * 20)
  out = _run('deepseek41.data.prepare', '--input', str(tmp_path / 'docs'), '--output',
             str(tmp_path / 'out'), '--vocab_size', '300', '--no_progress')
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith(f'wrote {tmp_path / "out"}')
  out = _run('deepseek41.data.prepare', '--input', str(tmp_path / 'missing'), '--output',
             str(tmp_path / 'out2'), '--vocab_size', '300', '--no_progress')
  assert out.returncode == 2 and str(tmp_path / 'missing') in out.stderr


def test_eval(pretrained_run, tmp_path):
  report = str(tmp_path / 'report')
  cmd = ['deepseek41.eval', f'--workdir={pretrained_run}', '--tasks=mqar@256', '--examples=8',
         '--heldout_batches=0', f'--out={report}']
  done = _run(*cmd)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'mqar@256' in done.stdout
  with open(report + '.json') as f:
    result = json.load(f)
  assert [t['label'] for t in result['tasks']] == ['mqar@256'] and 'heldout_loss' not in result
  bad = _run(*cmd[:-1], '--tasks=mqar@256,keys@2k')
  assert bad.returncode == 2 and "--tasks: unknown task 'keys'" in bad.stderr
  bare = str(tmp_path / 'bare')
  shutil.copytree(pretrained_run, bare)
  for step in (CORPUS_STEPS // 2, CORPUS_STEPS):
    shutil.rmtree(os.path.join(bare, 'checkpoints', str(step)))
  bad = _run('deepseek41.eval', f'--workdir={bare}', '--tasks=mqar@256')
  assert bad.returncode == 2 and 'holds no complete checkpoint' in bad.stderr, bad.stderr
