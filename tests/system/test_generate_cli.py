"""`deepseek41.generate` on a work directory: restore, tokenize, generate; bad input named."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from deepseek41.data.tokenizer import train_tokenizer
from deepseek41.generate.prompts import with_images
from deepseek41.generate.generator import GenerateError, Generator
from deepseek41.train.trainer import train
from tests.helpers import small_config

VOCAB = 300  # the smallest byte-level BPE: 256 bytes + specials + merges


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """A 2-step pretraining run (synthetic data) with a tokenizer.json beside its checkpoint."""
  path = str(tmp_path_factory.mktemp('gen') / 'run')
  cfg = small_config(**{'model.vocab_size': VOCAB, 'train.steps': 2,
                        'checkpoint.every_steps': 2})
  train(cfg, path)
  texts = ['def main():\n    return 0\n', 'import os\nprint(os.getcwd())\n'] * 20
  train_tokenizer(texts, VOCAB).save(os.path.join(path, 'tokenizer.json'))
  return path


def test_generates_from_a_work_directory(workdir):
  gen = Generator(workdir)
  assert gen.step == 2
  out = gen.generate(['def main', 'import os\nprint('], max_new_tokens=5)
  assert all(len(r.tokens) <= 5 and r.prompt_tokens for r in out)  # (eos may end a row early)
  assert all(isinstance(r.text, str) for r in out)
  again = gen.generate(['def main'], max_new_tokens=5)  # greedy: the same tokens alone
  assert again[0].tokens == out[0].tokens


def test_bad_input_is_named(workdir, tmp_path):
  gen = Generator(workdir)
  with pytest.raises(GenerateError, match=r'prompt 0: .* exceed the model\'s'):
    gen.generate_tokens([np.ones(gen.cfg.model.yarn_original_max_position * 4, np.int32)],
                        max_new_tokens=4)
  with pytest.raises(GenerateError, match='prompt 1 is empty'):
    gen.generate(['x', ''])
  with pytest.raises(GenerateError, match='prompt 0 has an image but the model has no vision'):
    gen.generate([[{'text': 'x'}, {'image': np.zeros((4, 4, 3), np.uint8)}]])
  with pytest.raises(GenerateError, match='--prompt: 2 <image> markers for 1 images'):
    with_images('a <image> b <image>', ['x.png'], '--prompt')
  assert with_images('a <image> b', ['x.png'], '--prompt') == [
      {'text': 'a '}, {'image': 'x.png'}, {'text': ' b'}]
  with pytest.raises(GenerateError, match='--speculative needs a DSpark-stage checkpoint'):
    gen.generate(['x'], speculative=True)
  with pytest.raises(GenerateError, match=r'--step=7: no checkpoint .*\(there are: 2\)'):
    Generator(workdir, step=7)
  with pytest.raises(GenerateError, match='has no checkpoints/ directory'):
    Generator(str(tmp_path))
  bare = str(tmp_path / 'bare')
  shutil.copytree(workdir, bare)
  os.remove(os.path.join(bare, 'tokenizer.json'))
  with pytest.raises(GenerateError, match='has no tokenizer.json'):
    Generator(bare)


def test_cli(workdir, tmp_path):
  prompts = tmp_path / 'p.jsonl'
  prompts.write_text('{"prompt": "def main"}\n{"prompt": "import"}\n')
  run = subprocess.run([sys.executable, '-m', 'deepseek41.generate', f'--workdir={workdir}',
                        f'--prompts={prompts}', '--max_new_tokens=3', '--json'],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  rows = [json.loads(l) for l in run.stdout.splitlines() if l.startswith('{')]
  assert [r['prompt'] for r in rows] == ['def main', 'import'] and all(rows[0]['tokens'])
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "x"}\n')
  run = subprocess.run([sys.executable, '-m', 'deepseek41.generate', f'--workdir={workdir}',
                        f'--prompts={bad}'], capture_output=True, text=True, timeout=600)
  assert run.returncode == 2 and 'line 1: expected {"prompt": "..."}' in run.stderr
