"""Long-context evaluation: task accuracy is 1 for a model told the answers and chance for a
constant one; the trainer logs train.eval_tasks; `python -m deepseek41.eval` reports any
checkpoint and names bad input; a CSA2 model's selection against dense attention at the
answers is measured by both (the answers' sources visible, the window's reach exact), a window
model says it has none."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.config import TaskSpec, layer_roles, resolve
from deepseek41.data.tokenizer import load_tokenizer
from deepseek41.eval import report as report_lib
from deepseek41.eval.restore import EvalError, open_checkpoint
from deepseek41.train.reading import run_tokenizer
from deepseek41.eval.run import Options, evaluate
from deepseek41.model.diagnostics import FIELDS
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train.evaluation import (SELECTION_MEASURES, TaskEvaluator, make_task_step,
                                         model_predictor, task_metrics, task_rows)
from deepseek41.train.trainer import train
from tests.helpers import REPO_ROOT, prepare_sentences, small_config

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

VOCAB = 416


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """Plain sentences, and English like the tasks' own, so the small BPE encodes them briefly."""
  return prepare_sentences(
      str(tmp_path_factory.mktemp('corpus')), 400,
      ['What is the secret number? Remember it: the secret number is 12. Keep the secret '
       'number in mind. Note that the code for it is 3. The code for it is 4.'] * 20)


def _config(corpus, **overrides):
  return small_config(**{'data.synthetic': False, 'data.sources': f'mqar:0.5,{corpus}:0.5',
                         'data.seq_len': 64, 'model.vocab_size': VOCAB, 'mesh.data': -1,
                         'tasks.mqar_pairs': 4, 'tasks.mqar_queries': 2,
                         'tasks.mqar_value_digits': 1, **overrides})


# ---------------------------------------------------------------------------------------------
# Scoring: a model told the answer, a constant model.


class _Stub:
  """An objective whose backbone returns fixed logits: the targets' one-hot (told the answer)
  or one token everywhere (constant)."""

  def __init__(self, constant=None):
    self.constant = constant

  def reader_models(self, graphdef, weights):
    del graphdef, weights

    def backbone(batch):
      ids = batch['targets'] if self.constant is None else jnp.full_like(batch['targets'],
                                                                          self.constant)
      return 30.0 * jax.nn.one_hot(ids, VOCAB), {}
    return backbone, None


def _stub_accuracy(cfg, tok, stub, specs):
  mesh = make_mesh(cfg.mesh)
  predict = model_predictor(jax.jit(make_task_step(stub, None)), mesh,
                            batch_sharding(mesh, cfg.mesh.rules), None, False)
  evaluator = TaskEvaluator(cfg, specs, predict, lambda n: task_rows(cfg, n), tokenizer=tok)
  return evaluator, evaluator(None)


def test_a_model_told_the_answer_scores_one_and_a_constant_one_chance(corpus):
  cfg = resolve(_config(corpus, **{'tasks.eval_examples': 40, 'tasks.eval_depths': (0.0, 1.0)}))
  tok = load_tokenizer(f'{corpus}/tokenizer.json')
  specs = (TaskSpec('mqar', 64), TaskSpec('passkey', 128))
  evaluator, told = _stub_accuracy(cfg, tok, _Stub(), specs)
  assert [(s.spec.label, s.depth) for s in told] == [('mqar@64', None), ('passkey@128', 0.0),
                                                     ('passkey@128', 1.0)]
  assert all(s.answers == 80 and s.acc == 1.0 and s.token_acc == 1.0 for s in told[:1])
  assert all(s.answers == 40 and s.acc == 1.0 and s.answer_loss < 1e-3 for s in told[1:])
  # mqar values are one digit, each one token: a model that always says '7' is right exactly
  # where the value is 7, about one time in ten; never on a 5-digit passkey.
  seven = int(tok.hf.encode('7', add_special_tokens=False).ids[0])
  _, constant = _stub_accuracy(cfg, tok, _Stub(seven), specs)
  values = [tok.decode(a) for d in evaluator.documents(specs[0], None)
            for a in d.answer_tokens()]
  assert constant[0].acc == values.count('7') / len(values) and 0 < constant[0].acc < 0.3
  assert all(s.acc == 0.0 for s in constant[1:])
  metrics = task_metrics(constant)
  assert metrics['eval_acc/mqar@64'] == constant[0].acc
  assert metrics['eval_acc/passkey@128'] == 0.0
  assert {'eval_acc/passkey@128/depth0', 'eval_acc/passkey@128/depth1',
          'eval_answer_loss/passkey@128', 'eval_answer_loss/mqar@64'} == set(metrics) - {
              'eval_acc/mqar@64', 'eval_acc/passkey@128'}


# ---------------------------------------------------------------------------------------------
# The trainer and the eval command on one run.


@pytest.fixture(scope='module')
def run(corpus, tmp_path_factory):
  """Two steps on mqar + text, evaluating mqar@64 and passkey@128 at steps 0 and 2."""
  workdir = str(tmp_path_factory.mktemp('run') / 'w')
  train(_config(corpus, **{'train.steps': 2, 'train.eval_every_steps': 2,
                           'train.eval_batches': 1, 'train.eval_tasks': 'mqar@64,passkey@128',
                           'tasks.eval_examples': 8, 'tasks.eval_depths': (0.0, 0.5),
                           'checkpoint.every_steps': 2}), workdir)
  return workdir


def test_the_trainer_logs_the_tasks(run):
  records = [json.loads(line) for line in open(f'{run}/metrics.jsonl')]
  evals = [r for r in records if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [0, 2]
  for r in evals:
    for key in ('eval_acc/mqar@64', 'eval_acc/passkey@128', 'eval_acc/passkey@128/depth0.5',
                'eval_answer_loss/mqar@64'):
      assert 0.0 <= r[key] <= (1.0 if 'acc' in key else 50.0), key
    assert not [k for k in r if k.startswith('eval_sel/')]  # a window model selects nothing


def test_eval_reports_a_checkpoint(run, tmp_path):
  ck = open_checkpoint(run)
  assert ck.step == 2
  snapshots = []  # the report as the eval command writes it, after each cell
  report = evaluate(ck, Options(specs=(TaskSpec('mqar', 64), TaskSpec('passkey', 128)),
                                examples=8, depths=(0.0, 0.5), heldout_batches=1,
                                generate=True),
                    progress=lambda r: snapshots.append(json.loads(json.dumps(r))))
  assert report['complete'] and report['cells'] == 6  # (mqar, passkey x 2 depths) x 2 ways
  assert [(len(r['tasks']), len(r.get('generated', []))) for r in snapshots] == [
      (0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (3, 3)]
  assert not any(r['complete'] for r in snapshots) and snapshots[0]['heldout_loss']
  assert snapshots[-1]['tasks'] == report['tasks'] and 'config' in snapshots[0]
  assert set(report['heldout_loss']) == {'mqar', ck.cfg.data.sources[1][0]}
  assert not [t for t in report['tasks'] if 'selection' in t]
  assert "model.attention_variant='window': no layer selects entries" in report['selection_note']
  assert all(np.isfinite(v) and v > 0 for v in report['heldout_loss'].values())
  # the same documents and numbers as the trainer's evaluation of this checkpoint
  logged = [json.loads(line) for line in open(f'{run}/metrics.jsonl')][-1]
  by_label = {}
  for t in report['tasks']:
    by_label.setdefault(t['label'], []).append(t)
  for label, rows in by_label.items():
    acc = sum(t['correct'] for t in rows) / sum(t['answers'] for t in rows)
    assert acc == pytest.approx(logged[f'eval_acc/{label}'], abs=1e-6)
  assert [(g['label'], g['depth']) for g in report['generated']] == [
      (t['label'], t['depth']) for t in report['tasks']]
  assert all(0 <= g['acc'] <= 1 and g['answer_loss'] is None for g in report['generated'])
  text = report_lib.table(report)
  assert 'passkey@128' in text and 'decoded acc' in text
  assert 'selection: none (model.attention_variant=' in text
  report_lib.write_json(report, str(tmp_path / 'r.json'))
  assert json.load(open(tmp_path / 'r.json'))['step'] == 2
  pytest.importorskip('matplotlib')
  report_lib.heat_map(report, str(tmp_path / 'r.png'))
  assert os.path.getsize(tmp_path / 'r.png') > 1000
  # variants side by side, one lacking a task (its panel left blank)
  one_task = {**report, 'tasks': [t for t in report['tasks'] if t['task'] == 'mqar']}
  report_lib.comparison_map([('a', report), ('b', one_task)], str(tmp_path / 'c.png'))
  assert os.path.getsize(tmp_path / 'c.png') > os.path.getsize(tmp_path / 'r.png')


def test_a_dspark_stage_is_scored_by_its_backbone(corpus, run, tmp_path):
  """A frozen DSpark stage on the run's checkpoint scores exactly as that checkpoint does."""
  stage = str(tmp_path / 'stage')
  train(_config(corpus, **{'train.steps': 1, 'dspark.stage': 'frozen',
                           'dspark.backbone_checkpoint': f'{run}/checkpoints/2',
                           'dspark.num_blocks': 1, 'dspark.block_size': 3,
                           'dspark.n_routed_experts': 4, 'dspark.num_experts_per_tok': 2,
                           'dspark.markov_rank': 8}), stage)
  options = Options(specs=(TaskSpec('mqar', 64),), examples=4, heldout_batches=0)
  drafting, plain = (evaluate(open_checkpoint(w), options)['tasks'] for w in (stage, run))
  assert drafting == plain


def test_an_imports_tokenizer_is_found(run, tmp_path):
  """`tools.convert import` keeps the tokenizer in OUT/tokenizer/: the tasks encode with it."""
  (tmp_path / 'tokenizer').mkdir()
  shutil.copy(f'{run}/tokenizer.json', tmp_path / 'tokenizer' / 'tokenizer.json')
  tok, path = run_tokenizer(str(tmp_path), None)
  assert path == str(tmp_path / 'tokenizer' / 'tokenizer.json') and tok.vocab_size > 256


# `python -m deepseek41.eval` as a program (its flags are global: imported here they would clash
# with other commands' in the same test process), with the report's writes counted on stderr
# and, given N, a SIGTERM to itself once a write holds N task cells.
_EVAL_PROGRAM = """
import os, signal, sys
from deepseek41.eval import report
write_json, signal_at = report.write_json, int(sys.argv.pop(1))
def counted(r, path):
  write_json(r, path)
  print('write', len(r['tasks']), file=sys.stderr, flush=True)
  if len(r['tasks']) == signal_at:
    os.kill(os.getpid(), signal.SIGTERM)
report.write_json = counted
from deepseek41.eval.__main__ import run
run()
"""


def _eval_cli(args, signal_at=-1):
  """(exit status, stdout, stderr, the task cells of each report write)."""
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, '-c', _EVAL_PROGRAM, str(signal_at), *args],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  writes = [int(line.split()[1]) for line in done.stderr.splitlines()
            if line.startswith('write ')]
  return done.returncode, done.stdout, done.stderr, writes


def test_a_terminated_eval_keeps_its_cells_and_resumes(run, tmp_path):
  """SIGTERM (a preemption, a job's limit) once the first cell is written: exit 143, and the
  JSON holds the held-out losses and that cell, marked incomplete; the table says so. The same
  command again evaluates only the other cells, to the report an uninterrupted run writes;
  other options start over."""
  prefix = str(tmp_path / 'cut')
  args = [f'--workdir={run}', '--tasks=mqar@64,passkey@128', '--examples=8', '--depths=0,0.5',
          '--heldout_batches=1', f'--out={prefix}', '--noplot']
  status, out, err, writes = _eval_cli(args, signal_at=1)
  assert status == 128 + signal.SIGTERM and writes == [0, 1], err[-2000:]
  cut = json.load(open(prefix + '.json'))
  assert cut['complete'] is False and cut['cells'] == 3 and cut['heldout_loss']
  assert [t['label'] for t in cut['tasks']] == ['mqar@64']
  assert 'INTERRUPTED: 1 of 3 task cells finished' in out
  assert f'interrupted (SIGTERM): {prefix}.json holds the 1 of 3 task cells' in err

  status, out, err, writes = _eval_cli(args)
  assert status == 0 and writes == [1, 2, 3, 3], err[-2000:]  # from 1; the last: complete
  assert 'resumed: 1 of the 3 task cells were kept' in out
  resumed = json.load(open(prefix + '.json'))
  # progress on stderr: the cells still due, then a line per cell as it finishes
  assert f'2 of 3 task cells to evaluate ({prefix}.json after each)' in err
  for i, t in enumerate(resumed['tasks'][1:], start=2):
    assert f'[{i}/3] passkey@128 depth {t["depth"]:g}: acc {t["acc"]:.3f} ' \
        f'({t["correct"]} of {t["answers"]})' in err, err[-2000:]
  whole = evaluate(open_checkpoint(run), Options(
      specs=(TaskSpec('mqar', 64), TaskSpec('passkey', 128)), examples=8, depths=(0.0, 0.5),
      heldout_batches=1))
  assert resumed['complete']
  for got, want in zip(resumed['tasks'], whole['tasks'], strict=True):
    assert {k: got[k] for k in ('label', 'depth', 'answers', 'correct', 'token_acc')} == \
        {k: want[k] for k in ('label', 'depth', 'answers', 'correct', 'token_acc')}
    assert got['answer_loss'] == pytest.approx(want['answer_loss'], rel=1e-4)
  assert resumed['heldout_loss'] == pytest.approx(whole['heldout_loss'], rel=1e-4)

  cut['complete'] = False  # an interrupted report, but of other options: evaluated anew
  report_lib.write_json(cut, prefix + '.json')
  status, out, err, writes = _eval_cli([*args[:2], '--examples=4', *args[3:]])
  assert status == 0 and writes == [0, 1, 2, 3, 3] and 'resumed' not in out, err[-2000:]


def test_bad_input_is_named(run, tmp_path):
  ck = open_checkpoint(run)
  with pytest.raises(EvalError, match=r'--tasks: passkey@1k: 1024 tokens exceed the model.s '
                                      r'512 positions'):
    evaluate(ck, Options(specs=(TaskSpec('passkey', 1024),)))
  with pytest.raises(EvalError, match=r'--generate: passkey@512 .* needs 513 positions'):
    evaluate(ck, Options(specs=(TaskSpec('passkey', 512),), generate=True))
  with pytest.raises(EvalError, match=r'--batch_size=3: must be a multiple of the 8 devices'):
    evaluate(ck, Options(specs=(TaskSpec('mqar', 64),), rows=3))
  with pytest.raises(EvalError, match=r'--step=7: no checkpoint .*\(there are: 2\)'):
    open_checkpoint(run, step=7)
  with pytest.raises(EvalError, match='has no checkpoints/ directory'):
    open_checkpoint(str(tmp_path))
  empty = tmp_path / 'empty'
  (empty / 'checkpoints').mkdir(parents=True)
  with pytest.raises(EvalError, match='holds no complete checkpoint'):
    open_checkpoint(str(empty))


# ---------------------------------------------------------------------------------------------
# A CSA2 model: the selection against dense attention at the answers.

# (a window of 16 reaches some mqar values from their query, none of the passkeys)
CSA2 = {'model.attention_variant': 'csa2', 'model.candidate_source_layer_id': -1,
        'model.index_n_heads': 2, 'model.index_head_dim': 8, 'model.sliding_window': 16}
SPECS = (TaskSpec('mqar', 64), TaskSpec('passkey', 128))


@pytest.fixture(scope='module')
def csa2_run(corpus, tmp_path_factory):
  """The run fixture's training and evaluation with a CSA2 model, without the step-0 one."""
  workdir = str(tmp_path_factory.mktemp('csa2') / 'w')
  train(_config(corpus, **CSA2, **{'train.steps': 2, 'train.eval_every_steps': 2,
                                   'train.eval_at_start': False,
                                   'train.eval_batches': 1,
                                   'train.eval_tasks': 'mqar@64,passkey@128',
                                   'tasks.eval_examples': 8, 'tasks.eval_depths': (0.0, 0.5),
                                   'checkpoint.every_steps': 2}), workdir)
  return workdir


def _expected(cfg, docs):
  """From the documents alone: per CSA2 layer, the share of the answers' query rows whose
  source's entry is complete (visible), and the share whose source the window reads."""
  rows = [(q, int(doc.answer_rows()[q])) for doc in docs
          for q in np.flatnonzero(doc.answer_rows() >= 0)]
  ratios = {r.layer: cfg.model.compress_ratios[r.kv_source] for r in layer_roles(cfg.model)
            if r.ratio}
  visible = {f'L{layer}': np.mean([a // k * k + k - 1 <= q for q, a in rows])
             for layer, k in ratios.items()}
  in_window = np.mean([0 <= q - a < cfg.model.sliding_window for q, a in rows])
  return visible, in_window


def test_the_trainer_logs_the_selection(csa2_run):
  evals = [r for r in map(json.loads, open(f'{csa2_run}/metrics.jsonl')) if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [2]  # train.eval_at_start=False
  for r in evals:
    for name in SELECTION_MEASURES:
      for label in ('mqar@64', 'passkey@128', 'passkey@128/depth0', 'passkey@128/depth0.5'):
        assert 0.0 <= r[f'eval_sel/{name}/{label}'] <= 1.0, (name, label)
    # every answer's hidden item lies in complete entries before its question
    assert r['eval_sel/answer_visible/passkey@128'] == r['eval_sel/answer_visible/mqar@64'] == 1


def test_eval_reports_the_selection_per_task_depth_and_layer(csa2_run, tmp_path):
  ck = open_checkpoint(csa2_run)
  report = evaluate(ck, Options(specs=SPECS, examples=8, depths=(0.0, 0.5), heldout_batches=0))
  assert 'selection_note' not in report
  tasks = TaskEvaluator(ck.cfg, SPECS, None, None, tokenizer=ck.tokenizer, examples=8,
                        depths=(0.0, 0.5))
  logged = [json.loads(line) for line in open(f'{csa2_run}/metrics.jsonl')][-1]
  for t in report['tasks']:
    sel = t['selection']
    assert set(sel) == set(FIELDS) | {'layers'} and set(sel['layers']) == {'L1', 'L2', 'L3'}
    visible, in_window = _expected(ck.cfg, tasks.documents(TaskSpec(t['task'], t['length']),
                                                           t['depth']))
    for layer, values in sel['layers'].items():
      assert all(0.0 <= v <= 1.0 for v in values.values()), values
      assert values['answer_visible'] == pytest.approx(visible[layer])
      assert values['answer_in_window'] == pytest.approx(in_window)
      assert values['answer_selected'] <= values['answer_visible']
      assert values['answer_in_dense_topk'] <= values['answer_visible']
    assert sel['answer_visible'] == 1.0  # what is hidden is inside the visible entries
    assert (in_window > 0) == (t['task'] == 'mqar')
    key = t['label'] + ('' if t['depth'] is None else f'/depth{t["depth"]:g}')
    for name in SELECTION_MEASURES:
      assert sel[name] == pytest.approx(np.mean([v[name] for v in sel['layers'].values()]))
      # the trainer's numbers for this checkpoint
      assert sel[name] == pytest.approx(logged[f'eval_sel/{name}/{key}'], abs=1e-6)
  text = report_lib.table(report)
  assert 'dense recall' in text and 'in dense top-k' in text and 'selection: none' not in text
  report_lib.write_json(report, str(tmp_path / 'r.json'))
  again = json.load(open(tmp_path / 'r.json'))
  assert again['tasks'][0]['selection']['layers']['L1'] == report['tasks'][0]['selection'][
      'layers']['L1']
  off = evaluate(ck, Options(specs=SPECS[:1], examples=2, heldout_batches=0, selection=False))
  assert 'selection' not in off['tasks'][0]
  assert off['selection_note'] == 'not measured (--noselection)'
  assert 'selection: none (not measured (--noselection))' in report_lib.table(off)
