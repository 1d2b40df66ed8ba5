"""Evaluate a restored checkpoint: held-out loss per source, and the long-context tasks' accuracy
per task, length and depth, teacher-forced through the model's forward (and, as an option,
greedily decoded through generation); for a CSA2 model also each CSA2 layer's selection against
dense attention at the answers (model/diagnostics.py), from the same forward."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.config import TASK_NAMES, ConfigError, TaskSpec, max_positions
from deepseek41.config.checks import check_task_length
from deepseek41.data.pipeline import tokenizer_path_of
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import load_tokenizer
from deepseek41.eval.restore import Checkpoint, EvalError
from deepseek41.eval.report import finished_cells
from deepseek41.generate.generator import GenerateError, Generator
from deepseek41.sharding import batch_sharding
from deepseek41.train.evaluation import (Evaluator, TaskEvaluator, TaskScore, batch_shards,
                                         make_task_step, model_predictor, selection_note,
                                         task_rows)
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import ModelDef


@dataclasses.dataclass(frozen=True)
class Options:
  specs: tuple[TaskSpec, ...]
  examples: int | None = None             # per task, length and depth; None: tasks.eval_examples
  depths: tuple[float, ...] | None = None  # None: tasks.eval_depths
  rows: int = 0                           # rows per batch; 0: about the training batch's tokens
  heldout_batches: int | None = None      # per source; None: train.eval_batches; 0: none
  generate: bool = False                  # also greedy decoding of each answer
  selection: bool = True                  # the selection against dense attention (CSA2 only)


def check_options(ck: Checkpoint, opts: Options) -> None:
  """Every task length within the model's positions; rows that split over the devices."""
  cfg = ck.cfg
  try:
    for spec in opts.specs:
      check_task_length(spec.label, spec.length, cfg.model, cfg.data.seq_len, cfg.mesh.context,
                        '--tasks')
  except ConfigError as e:
    raise EvalError(str(e)) from None
  if opts.generate:
    limit = max_positions(cfg.model, cfg.data.seq_len)
    for spec in opts.specs:
      if spec.length + 1 > limit:
        raise EvalError(f'--generate: {spec.label} decodes its answers after prompts of up to '
                        f'{spec.length} tokens, which needs {spec.length + 1} positions; the '
                        f'model has {limit}')
  unit = math.lcm(batch_shards(cfg.mesh), jax.process_count())
  if opts.rows % unit:
    raise EvalError(f'--batch_size={opts.rows}: must be a multiple of the {unit} devices the '
                    'batch is split over')
  if opts.examples is not None and opts.examples < 1:
    raise EvalError(f'--examples must be >= 1, got {opts.examples}')
  if opts.depths is not None and not (opts.depths and all(0 <= d <= 1 for d in opts.depths)):
    raise EvalError(f'--depths must be one or more depths in [0, 1], got {opts.depths}')


def _options_key(ck: Checkpoint, opts: Options, tasks: TaskEvaluator) -> dict:
  """What a report's cells depend on: an interrupted report with the same key resumes."""
  return {'step': ck.step, 'tasks': [s.label for s in opts.specs], 'examples': tasks.examples,
          'depths': list(tasks.depths), 'rows': opts.rows, 'generate': opts.generate,
          'selection': tasks.selection, 'heldout_batches': opts.heldout_batches}


def resumable(report: dict | None, ck: Checkpoint) -> bool:
  """Whether `report` is an interrupted evaluation of this checkpoint (its options are checked
  against the new ones by `evaluate`)."""
  return bool(report) and report.get('complete') is False and report.get('workdir') == \
      ck.workdir and report.get('step') == ck.step and 'options' in report


def evaluate(ck: Checkpoint, opts: Options, progress: Callable[[dict], None] | None = None,
             previous: dict | None = None) -> dict:
  """The report: held-out loss per source, each task's scores (teacher-forced, and decoded with
  --generate; with the selection measured, each teacher-forced row's 'selection': the
  measures averaged over the CSA2 layers and per layer, 'layers'), the checkpoint and its
  config; 'selection_note' says why there is no selection.

  progress: called with the report so far ('complete' False, 'cells' the task cells due)
  after the held-out losses and after each task, length and depth; the returned report is
  'complete'. previous: an interrupted report (`resumable`); where its options are these, its
  held-out losses and finished cells are kept and only the rest is evaluated ('resumed': how
  many cells were kept)."""
  check_options(ck, opts)
  cfg = ck.cfg
  sharding = batch_sharding(ck.mesh, cfg.mesh.rules)
  task_step = jax.jit(make_task_step(ck.objective, ck.graphdef),
                      out_shardings=NamedSharding(ck.mesh, P()))
  predict = model_predictor(task_step, ck.mesh, sharding, ck.engram_map, cfg.model.vision)
  rows = (lambda length: opts.rows) if opts.rows else (lambda length: task_rows(cfg, length))
  tasks = TaskEvaluator(cfg, opts.specs, predict, rows, tokenizer=ck.tokenizer,
                        examples=opts.examples, depths=opts.depths, selection=opts.selection)
  cells = len(tasks.cells())
  key = _options_key(ck, opts, tasks)
  report = {'workdir': ck.workdir, 'step': ck.step,
            'max_positions': max_positions(cfg.model, cfg.data.seq_len),
            'examples': tasks.examples, 'depths': list(tasks.depths), 'complete': False,
            'cells': cells * (2 if opts.generate else 1), 'options': key, 'tasks': []}
  note = selection_note(cfg) or (None if opts.selection else 'not measured (--noselection)')
  if note:
    report['selection_note'] = note
  report['config'] = cfg.to_dict()
  if resumable(previous, ck) and previous['options'] == key:
    for name in ('heldout_loss', 'heldout_note', 'tasks', 'generated'):
      if name in previous:
        report[name] = previous[name]
    report['resumed'] = finished_cells(report)
  else:
    report.update(held_out(ck, opts, tasks, predict, rows))

  def adder(name):
    def add(score: TaskScore):
      report.setdefault(name, []).append(score.to_dict())
      if progress is not None:
        progress(report)
    return add

  def finished(name):
    return {(t['label'], t['depth']) for t in report.get(name, [])}
  if progress is not None:
    progress(report)
  tasks(ck.weights, on_score=adder('tasks'), skip=finished('tasks'))
  if opts.generate:
    generated(ck, tasks, rows, on_score=adder('generated'), skip=finished('generated'))
  report['complete'] = True
  return report


def held_out(ck: Checkpoint, opts: Options, tasks: TaskEvaluator, predict, rows) -> dict:
  """{'heldout_loss': {source: loss}} (a task source: its answers' loss at the training length),
  or a note of why there is none."""
  cfg = ck.cfg
  batches = cfg.train.eval_batches if opts.heldout_batches is None else opts.heldout_batches
  if batches == 0:
    return {}
  if cfg.data.synthetic:
    return {'heldout_note': 'the run trained on data.synthetic: no held-out split'}
  try:
    data_tokenizer = load_tokenizer(tokenizer_path_of(cfg.data))
  except DataError as e:
    raise EvalError(f'held-out loss: the run\'s data is not readable here ({e}); give '
                    '--heldout_batches=0 to skip it') from None
  if data_tokenizer.sha256() != ck.tokenizer.sha256():
    return {'heldout_note': f'data.sources were prepared with another tokenizer than the '
                            f"checkpoint's ({ck.tokenizer_path}): no held-out loss"}
  md = ModelDef(ck.graphdef, make_optimizer(cfg.train))
  eval_step = jax.jit(ck.objective.make_eval_step(md),
                      out_shardings=NamedSharding(ck.mesh, P()))
  sharding = batch_sharding(ck.mesh, cfg.mesh.rules)
  train_length = cfg.tasks.length or cfg.data.seq_len
  out = {}
  for name, _ in cfg.data.sources or (('default', 1.0),):
    if name in TASK_NAMES:
      spec = TaskSpec(name, train_length)
      answers = TaskEvaluator(cfg, (spec,), predict, rows, tokenizer=ck.tokenizer,
                              examples=tasks.examples, depths=tasks.depths)(ck.weights)
      out[name] = TaskScore.merged(answers).answer_loss
      continue
    one = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, sources=((name, 1.0),)),
        train=dataclasses.replace(cfg.train, eval_batches=batches, eval_tasks=''))
    evaluator = Evaluator(one, eval_step, ck.mesh, sharding, ck.engram_map,
                          cfg.train.batch_size // jax.process_count())
    out[name] = evaluator.held_out_losses(ck.weights, kinds=('text',))[0]
  return {'heldout_loss': out}


def generated(ck: Checkpoint, tasks: TaskEvaluator, rows,
              on_score: Callable[[TaskScore], None] | None = None,
              skip: Collection[tuple[str, float | None]] = ()) -> list[TaskScore]:
  """Each answer decoded greedily after its prompt (the document up to it), through the
  generator (its prefill and caches): right when the decoded tokens are the answer's."""
  try:
    gen = Generator(ck.workdir, ck.step)
  except GenerateError as e:
    raise EvalError(f'--generate: {e}') from None
  scores = []
  for spec, depth in tasks.cells(skip):
    score = TaskScore(spec, depth)
    asked = [(doc.tokens[:s], doc.tokens[s:e]) for doc in tasks.documents(spec, depth)
             for s, e in doc.answers]
    n = rows(spec.length)
    for i in range(0, len(asked), n):
      chunk = asked[i:i + n]
      try:
        results = gen.generate_tokens([p for p, _ in chunk], temperature=0.0,
                                      max_new_tokens=max(len(a) for _, a in chunk))
      except GenerateError as e:
        raise EvalError(f'--generate: {spec.label}: {e}') from None
      for (_, answer), r in zip(chunk, results):
        got = r.tokens[:len(answer)]  # short where the model ended the document early
        right_t = np.asarray(got + [-1] * (len(answer) - len(got))) == answer
        score.answers += 1
        score.correct += int(right_t.all())
        score.answer_tokens += len(answer)
        score.correct_tokens += int(right_t.sum())
    score.ce_sum = float('nan')  # decoding has no teacher-forced loss
    scores.append(score)
    if on_score is not None:
      on_score(score)
  return scores
