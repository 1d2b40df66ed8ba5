"""`deepseek41.generate` on a work directory: restore, tokenize, generate; bad input named."""

import collections
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from deepseek41.generate.programs import compiler_options
from deepseek41.generate.prompts import with_images
from deepseek41.generate.generator import (GenerateError, Generator, execution_overrides,
                                           generation_config)
from tests.helpers import CORPUS_STEPS

@pytest.fixture
def workdir(pretrained_run):
  """The session's trained run: its checkpoints and the tokenizer.json the trainer copied."""
  return pretrained_run


def test_generates_from_a_work_directory(workdir):
  gen = Generator(workdir)
  assert gen.step == CORPUS_STEPS
  out = gen.generate(['def main', 'import os\nprint('], max_new_tokens=5)
  assert all(len(r.tokens) <= 5 and r.prompt_tokens for r in out)  # (eos may end a row early)
  assert all(isinstance(r.text, str) for r in out)
  again = gen.generate(['def main'], max_new_tokens=5)  # greedy: the same tokens alone
  assert again[0].tokens == out[0].tokens
  pieces = collections.defaultdict(list)
  streamed = gen.generate(['def main', 'import os\nprint('], max_new_tokens=5,
                          tokens_per_dispatch=2, stream=lambda row, text: pieces[row].append(text))
  assert [r.tokens for r in streamed] == [r.tokens for r in out]
  for row, r in enumerate(streamed):
    assert ''.join(pieces[row]) == r.text
    assert len(pieces[row]) >= min(len(r.tokens), 4)  # a piece per dispatch: 1 + 1 + 2 + 1


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
  with pytest.raises(GenerateError, match=rf'--step=7: no checkpoint .*\(there are: '
                                          rf'{CORPUS_STEPS // 2}, {CORPUS_STEPS}\)'):
    Generator(workdir, step=7)
  with pytest.raises(GenerateError, match='has no checkpoints/ directory'):
    Generator(str(tmp_path))
  # Without the run's copy of its tokenizer, the one its data section names serves; with
  # neither, the error names the work directory (tests/unit/test_reading.py).
  bare = str(tmp_path / 'bare')
  shutil.copytree(workdir, bare)
  os.remove(os.path.join(bare, 'tokenizer.json'))
  assert Generator(bare).tokenizer.source.endswith('tokenizer.json')


def test_execution_overrides(workdir):
  # Execution-only model keys set at generation: they reach the model's config; anything else,
  # or a value of the wrong type or range, is refused naming the key.
  base = Generator(workdir)
  gen = Generator(workdir, execution={'model.mhc_decode_block_d': '256',
                                      'moe_gather_small_calls': 'false',
                                      'model.mhc_decode_splits': '4'})
  assert gen.cfg.model.mhc_decode_block_d == 256 and not gen.cfg.model.moe_gather_small_calls
  assert gen.cfg.model.mhc_decode_splits == 4 and base.cfg.model.mhc_decode_splits == 16
  assert base.cfg.model.mhc_decode_block_d == 0 and base.cfg.model.moe_gather_small_calls
  assert gen.generate(['def main'], max_new_tokens=4)[0].tokens == \
      base.generate(['def main'], max_new_tokens=4)[0].tokens
  with pytest.raises(GenerateError, match=r"'model.d_model': not an execution-only model key"):
    Generator(workdir, execution={'model.d_model': '64'})
  with pytest.raises(GenerateError, match=r"model.mhc_decode_block_d='many': expected a int"):
    Generator(workdir, execution={'model.mhc_decode_block_d': 'many'})
  with pytest.raises(GenerateError, match=r'model.mhc_decode_block_d: must be 0 .* power of two'):
    Generator(workdir, execution={'model.mhc_decode_block_d': '48'})
  with pytest.raises(GenerateError, match=r'model.mhc_decode_splits: must be 0 .* power of two'):
    Generator(workdir, execution={'model.mhc_decode_splits': '3'})
  with pytest.raises(GenerateError, match=r"model.moe_gather_small_calls='maybe': expected a bool"):
    Generator(workdir, execution={'model.moe_gather_small_calls': 'maybe'})
  with pytest.raises(GenerateError, match=r"--execution: 'model.hc_eps' is not KEY=VALUE"):
    execution_overrides(['model.hc_eps'])
  assert execution_overrides(['a=1', ' b = x ']) == {'a': '1', 'b': 'x'}


def test_decode_keys_are_todays_defaults_whatever_the_run_saved(workdir):
  # A run trained before a decode path became the default saved the old value; generation takes
  # the default, and --execution still sets it.
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = json.load(f)
  saved['model'].update(mhc_decode_splits=0, mhc_decode_block_d=64, moe_gather_small_calls=False,
                        decode_vector_dots='reduce')
  model = generation_config(saved).model
  assert (model.mhc_decode_splits, model.mhc_decode_block_d, model.moe_gather_small_calls,
          model.decode_vector_dots) == (16, 0, True, 'gemm')
  # generation's programs compile without XLA's rewrite of one-row products into reductions
  assert compiler_options(model) == {'xla_disable_hlo_passes': 'dot-strength-reduction'}
  model = generation_config(saved, execution={'model.mhc_decode_splits': '2',
                                              'model.decode_vector_dots': 'reduce'}).model
  assert model.mhc_decode_splits == 2
  assert compiler_options(model) is None


def test_cli(workdir, tmp_path):
  prompts = tmp_path / 'p.jsonl'
  prompts.write_text('{"prompt": "def main"}\n{"prompt": "import"}\n')
  run = subprocess.run([sys.executable, '-m', 'deepseek41.generate', f'--workdir={workdir}',
                        f'--prompts={prompts}', '--max_new_tokens=3', '--json', '--stream'],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = [json.loads(l) for l in run.stdout.splitlines() if l.startswith('{')]
  rows = [l for l in lines if 'prompt' in l]
  assert [r['prompt'] for r in rows] == ['def main', 'import'] and all(rows[0]['tokens'])
  for i, r in enumerate(rows):  # the streamed pieces come first and add up to the text
    assert ''.join(l['text'] for l in lines if l.get('row') == i) == r['text']
  assert lines.index(rows[0]) == len(lines) - 2
  # One --prompt streams by default, and prints what it would print at the end.
  text = Generator(workdir).generate(['def main'], max_new_tokens=4)[0].text
  run = subprocess.run([sys.executable, '-m', 'deepseek41.generate', f'--workdir={workdir}',
                        '--prompt=def main', '--max_new_tokens=4', '--tokens_per_dispatch=2'],
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.startswith(f'def main{text}\n--- ')
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "x"}\n')
  run = subprocess.run([sys.executable, '-m', 'deepseek41.generate', f'--workdir={workdir}',
                        f'--prompts={bad}'], capture_output=True, text=True, timeout=600)
  assert run.returncode == 2 and 'line 1: expected {"prompt": "..."}' in run.stderr
