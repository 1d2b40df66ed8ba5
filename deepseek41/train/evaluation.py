"""Held-out evaluation: the mixture's loss, the objective's own held-out metrics (e.g. DSpark's
acceptance and calibration), with image sources the caption losses, and with train.eval_tasks
the long-context tasks' accuracy (`TaskEvaluator`, which `python -m deepseek41.eval` runs too)
and, for a CSA2 model, each CSA2 layer's selection against dense attention at the answers
(train.eval_selection; model/diagnostics.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.config import MeshConfig, RunConfig, TaskSpec, parse_task_specs
from deepseek41.data.pipeline import (document_answer_rows, document_batch, make_dataset,
                                      open_task)
from deepseek41.data.tasks import TaskDocument, held_out_documents
from deepseek41.data.tokenizer import Tokenizer
from deepseek41.model import diagnostics
from deepseek41.model.shared import Probe
from deepseek41.train.feed import global_batch
from deepseek41.train.objectives import Objective, objective_for


def eval_config(cfg: RunConfig) -> RunConfig:
  """`cfg` with the routed experts computed by `model.eval_moe_backend`, which is dropless: the
  model the evaluation step is built from (same parameters and state layout, so the training
  state merges into it unchanged)."""
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, moe_backend=cfg.model.eval_moe_backend))


class Evaluator:
  """`eval_batches` held-out batches per evaluation, the same batches every time; with a
  `task_step` (make_task_step) also train.eval_tasks, the same documents every time."""

  def __init__(self, cfg, eval_step, mesh, sharding, engram_map, local_batch: int,
               task_step=None):
    self.cfg = cfg
    self.eval_step = eval_step
    self.mesh = mesh
    self.sharding = sharding
    self.engram_map = engram_map
    self.local_batch = local_batch
    self.objective = objective_for(cfg)
    specs = parse_task_specs(cfg.train.eval_tasks, 'train.eval_tasks')
    self.tasks = None
    if specs and task_step is not None:
      predict = model_predictor(task_step, mesh, sharding, engram_map, cfg.model.vision)
      self.tasks = TaskEvaluator(cfg, specs, predict, lambda length: task_rows(cfg, length),
                                 selection=cfg.train.eval_selection)

  def __call__(self, state) -> dict[str, float]:
    """`eval_loss` over the whole mixture and the objective's metrics over the same batches;
    with image sources also the caption loss (the text of the image samples) with the real
    images and with blank ones; with train.eval_tasks each task's accuracy
    (`eval_acc/<task>@<length>`, task_metrics) and the selection's measures
    (`eval_sel/<measure>/<task>@<length>`). {} on synthetic data."""
    if self.cfg.data.synthetic:
      return {}
    outputs: list[dict] = []  # the eval step's outputs, for the objective's metrics
    out = {'eval_loss': self.held_out_losses(state, outputs=outputs)[0]}
    out.update(self.objective.held_out_metrics(outputs))
    if self.cfg.data.image_sources:
      out['eval_caption_loss_image'], out['eval_caption_loss_blank'] = self.held_out_losses(
          state, ('image',), blanks=(False, True))
    if self.tasks is not None:
      out.update(task_metrics(self.tasks(state)))
    return {k: v for k, v in out.items() if v is not None}

  def held_out_losses(self, state, kinds=('text', 'image'), blanks=(False,),
                      outputs: list[dict] | None = None) -> list[float | None]:
    """Mean held-out CE per entry of `blanks` (False: the batch as read, True: black images),
    all over the same batches, which are read and decoded once; the eval step's outputs on the
    batches as read are appended to `outputs`."""
    cfg = self.cfg
    # An endless unshuffled stream: every process gets the same number of batches, and each
    # evaluation sees the same eval_batches batches. In-process: worker start-up would cost
    # more than the few evaluation batches.
    ds = make_dataset(dataclasses.replace(cfg.data, num_workers=0), split='heldout',
                      batch_size=self.local_batch, seed=cfg.train.seed,
                      process_index=jax.process_index(), process_count=jax.process_count(),
                      repeat=True, shuffle=False, kinds=kinds)
    sums_v2 = np.zeros((len(blanks), 2))  # (ce_sum, tokens) per variant
    it = iter(ds)
    try:
      for _, local in zip(range(cfg.train.eval_batches), it):
        for i, blank in enumerate(blanks):
          batch = global_batch(local, self.sharding, self.engram_map, vision=cfg.model.vision,
                               blank_images=blank)
          with jax.set_mesh(self.mesh):
            out = jax.device_get(self.eval_step(state, batch))
          sums_v2[i] += (float(out['ce_sum']), float(out['tokens']))
          if outputs is not None and not blank:
            outputs.append(out)
    finally:
      if hasattr(it, 'close'):
        it.close()
    return [ce / n if n else None for ce, n in sums_v2]


# ---------------------------------------------------------------------------------------------
# Long-context tasks: teacher-forced accuracy of the answers, and why a retrieval failed.


# The selection's measures reported per task (model/diagnostics.py FIELDS; the JSON holds all).
SELECTION_MEASURES = ('dense_recall', 'answer_selected', 'answer_in_dense_topk',
                      'answer_visible', 'answer_in_window', 'neighbour_shared')


def _number(x: float) -> float | None:
  return None if math.isnan(x) else x  # JSON has no NaN


@dataclasses.dataclass
class TaskScore:
  """One task at one length and depth (None: a task without depth): of its asked items, how
  many the model got right (every answer token the argmax of its position), and the answers'
  loss; with the selection measured, each CSA2 layer's `diagnostics.selection_totals` summed
  over the rows that predict an answer token."""
  spec: TaskSpec
  depth: float | None
  answers: int = 0
  correct: int = 0
  answer_tokens: int = 0
  correct_tokens: int = 0
  ce_sum: float = 0.0
  selection: dict[int, np.ndarray] | None = None  # {layer: float64 [len(FIELDS), 2]}

  @property
  def acc(self) -> float:
    return self.correct / self.answers if self.answers else float('nan')

  @property
  def token_acc(self) -> float:
    return self.correct_tokens / self.answer_tokens if self.answer_tokens else float('nan')

  @property
  def answer_loss(self) -> float:
    return self.ce_sum / self.answer_tokens if self.answer_tokens else float('nan')

  def selection_means(self) -> dict[str, float]:
    """`diagnostics.summarize_totals` of the selection: '<measure>' (the mean over the CSA2
    layers) and '<measure>/L<layer>'; {} when not measured."""
    return {} if self.selection is None else diagnostics.summarize_totals(self.selection)

  def add(self, docs: Sequence[TaskDocument], pred_bt: np.ndarray, ce_bt: np.ndarray,
          selection: dict[int, np.ndarray] | None = None) -> None:
    """Score `docs`, one per row of the argmax ids and per-target CE of their batch, and add
    the batch's selection totals."""
    for r, doc in enumerate(docs):
      for start, end in doc.answers:
        right_t = pred_bt[r, start - 1:end - 1] == doc.tokens[start:end]
        self.answers += 1
        self.correct += int(right_t.all())
        self.answer_tokens += end - start
        self.correct_tokens += int(right_t.sum())
        self.ce_sum += float(ce_bt[r, start - 1:end - 1].sum())
    if selection is not None:
      self.selection = _added(self.selection, selection)

  @classmethod
  def merged(cls, scores: Sequence[TaskScore]) -> TaskScore:
    """The scores of one spec over all its depths."""
    total = cls(scores[0].spec, None, *(sum(getattr(s, f) for s in scores) for f in (
        'answers', 'correct', 'answer_tokens', 'correct_tokens', 'ce_sum')))
    for s in scores:
      if s.selection is not None:
        total.selection = _added(total.selection, s.selection)
    return total

  def to_dict(self) -> dict[str, Any]:
    out = {'task': self.spec.name, 'length': self.spec.length, 'label': self.spec.label,
           'depth': self.depth, 'answers': self.answers, 'correct': self.correct,
           'acc': _number(self.acc), 'token_acc': _number(self.token_acc),
           'answer_loss': _number(self.answer_loss)}
    if self.selection is not None:
      means = self.selection_means()
      out['selection'] = {name: _number(means[name]) for name in diagnostics.FIELDS}
      out['selection']['layers'] = {
          f'L{layer}': {name: _number(means[f'{name}/L{layer}']) for name in diagnostics.FIELDS}
          for layer in sorted(self.selection)}
    return out


def _added(a: dict[int, np.ndarray] | None, b: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
  b = {layer: np.asarray(t, np.float64) for layer, t in b.items()}
  return b if a is None else {layer: a[layer] + b[layer] for layer in a}


# (weights, host batch of the global rows) -> the task step's outputs on the host: 'pred' argmax
# ids [B, T], 'ce' CE [B, T] and, where the batch holds 'answer_rows', 'selection'
Predict = Callable[[Any, dict[str, np.ndarray]], dict[str, Any]]


def selection_note(cfg: RunConfig) -> str | None:
  """Why the model has no selection to measure (None: it has, a CSA2 model)."""
  m = cfg.model
  if m.csa2:
    return None
  reads = 'every visible entry' if m.dense else 'their sliding window only'
  return (f'model.attention_variant={m.attention_variant!r}: no layer selects entries (the '
          f'compressed layers attend to {reads}), so there is no selection to measure')


class TaskEvaluator:
  """The tasks of `specs` at their lengths, at each of tasks.eval_depths (the tasks that have a
  depth), tasks.eval_examples documents each, through `predict` in batches of rows(length)
  rows; the documents are the held-out ones (data/tasks/ `held_out_documents`), the same for
  every call, run and checkpoint. With `selection` on a CSA2 model, each batch also carries
  the answers' source rows ('answer_rows', pipeline.document_answer_rows) and the scores the
  selection's totals."""

  def __init__(self, cfg: RunConfig, specs: Sequence[TaskSpec], predict: Predict,
               rows: Callable[[int], int], tokenizer: Tokenizer | None = None,
               examples: int | None = None, depths: Sequence[float] | None = None,
               selection: bool = False):
    self.cfg, self.specs, self.predict, self.rows = cfg, tuple(specs), predict, rows
    self.examples = examples or cfg.tasks.eval_examples
    self.depths = tuple(cfg.tasks.eval_depths if depths is None else depths)
    self.selection = selection and selection_note(cfg) is None
    self.tasks = {name: open_task(cfg.data, name, 'heldout', tokenizer)
                  for name in dict.fromkeys(s.name for s in self.specs)}
    self._documents: dict[tuple, list[TaskDocument]] = {}

  def documents(self, spec: TaskSpec, depth: float | None) -> list[TaskDocument]:
    key = (spec, depth)
    if key not in self._documents:  # generated once: evaluation repeats through training
      self._documents[key] = held_out_documents(self.tasks[spec.name], spec.length, depth,
                                                self.examples)
    return self._documents[key]

  def cells(self, skip: Collection[tuple[str, float | None]] = ()
            ) -> list[tuple[TaskSpec, float | None]]:
    """(spec, depth) of every task, length and depth in order (depth None for a task without
    one), but those whose (label, depth) is in `skip`."""
    return [(spec, depth) for spec in self.specs
            for depth in (self.depths if spec.has_depth else (None,))
            if (spec.label, depth) not in skip]

  def __call__(self, weights, on_score: Callable[[TaskScore], None] | None = None,
               skip: Collection[tuple[str, float | None]] = ()) -> list[TaskScore]:
    """The score of each of `cells(skip)`; `on_score` gets each as it is finished (the eval
    command writes its report as it goes, so an interrupted evaluation keeps them and a rerun
    skips them)."""
    scores = []
    for spec, depth in self.cells(skip):
      rows = self.rows(spec.length)
      score = TaskScore(spec, depth)
      docs = self.documents(spec, depth)
      for i in range(0, len(docs), rows):
        chunk = docs[i:i + rows]
        batch = document_batch(chunk, rows, spec.length, self.cfg.data.images)
        if self.selection:
          batch['answer_rows'] = document_answer_rows(chunk, rows, spec.length)
          batch['probe_rows'] = diagnostics.probe_rows(batch['answer_rows'])
        out = self.predict(weights, batch)
        score.add(chunk, out['pred'], out['ce'], out.get('selection'))
      scores.append(score)
      if on_score is not None:
        on_score(score)
    return scores


def task_metrics(scores: Sequence[TaskScore]) -> dict[str, float]:
  """`eval_acc/<task>@<length>` and `eval_answer_loss/...` over every depth, and per depth
  `eval_acc/<task>@<length>/depth<d>`; with the selection measured, likewise
  `eval_sel/<measure>/<task>@<length>[/depth<d>]` for each of SELECTION_MEASURES (the mean
  over the CSA2 layers; none where no row counted)."""
  out = {}
  for label in dict.fromkeys(s.spec.label for s in scores):
    group = [s for s in scores if s.spec.label == label]
    total = TaskScore.merged(group)
    out[f'eval_acc/{label}'] = total.acc
    out[f'eval_answer_loss/{label}'] = total.answer_loss
    if group[0].spec.has_depth:
      out.update({f'eval_acc/{label}/depth{s.depth:g}': s.acc for s in group})
    by_depth = [(f'/depth{s.depth:g}', s) for s in group] if group[0].spec.has_depth else []
    for suffix, score in [('', total)] + by_depth:
      means = score.selection_means()
      out.update({f'eval_sel/{name}/{label}{suffix}': means[name] for name in SELECTION_MEASURES
                  if name in means and not math.isnan(means[name])})
  return out


def make_task_step(objective: Objective, graphdef):
  """(weights, batch) -> {'pred': argmax ids, 'ce': per-target CE (0 off the loss mask)}: the
  backbone's forward at the batch's shape (`objective.reader_models`: any stage's backbone);
  `weights` holds the objective's model entries (a train state, or a checkpoint's weights).
  A batch holding 'answer_rows' (int [B, T], TaskEvaluator) is also probed in the same forward:
  'selection' = {layer: diagnostics.selection_totals over the rows that predict an answer},
  measured at those rows only when the batch also holds them as 'probe_rows' (int [B, M],
  diagnostics.probe_rows)."""
  def task_step(weights, batch):
    backbone, _ = objective.reader_models(graphdef, weights)
    batch = dict(batch)
    answer_rows_bt = batch.pop('answer_rows', None)
    rows_bm = batch.pop('probe_rows', None)
    if answer_rows_bt is None:
      logits_btv, _ = backbone(batch)
    else:
      logits_btv, aux = backbone(batch, probe=Probe(answer_rows_bt=answer_rows_bt,
                                                    rows_bm=rows_bm))
    logits_btv = logits_btv.astype(jnp.float32)
    target_bt = jnp.take_along_axis(logits_btv, batch['targets'][..., None], axis=-1)[..., 0]
    ce_bt = (jax.nn.logsumexp(logits_btv, axis=-1) - target_bt) * batch['loss_mask']
    out = {'pred': jnp.argmax(logits_btv, axis=-1).astype(jnp.int32), 'ce': ce_bt}
    if answer_rows_bt is not None:
      measured = answer_rows_bt >= 0 if rows_bm is None else rows_bm >= 0
      out['selection'] = diagnostics.selection_totals(aux['selection'], measured)
    return out
  return task_step


def model_predictor(task_step, mesh, sharding, engram_map, vision: bool) -> Predict:
  """`predict` through a jitted task_step (its outputs replicated): each process feeds its own
  rows of the global batch, and every process gets the whole result."""
  def predict(weights, batch):
    n, i = jax.process_count(), jax.process_index()
    rows = len(batch['tokens']) // n
    local = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}
    inputs = global_batch(local, sharding, engram_map, vision=vision)
    for name in ('answer_rows', 'probe_rows'):
      if name in local:
        inputs[name] = jax.make_array_from_process_local_data(sharding, local[name])
    with jax.set_mesh(mesh):
      out = jax.device_get(task_step(weights, inputs))
    return out
  return predict


def batch_shards(mesh: MeshConfig) -> int:
  """Devices the batch dimension is split over (the mesh rules for "batch")."""
  return math.prod(getattr(mesh, a) for name, axes in mesh.rules if name == 'batch'
                   for a in axes)


def task_rows(cfg: RunConfig, length: int) -> int:
  """Rows of a task batch at `length`: about the training microbatch's tokens, at least one
  row per batch shard and process, a multiple of both."""
  unit = math.lcm(batch_shards(cfg.mesh), jax.process_count())
  rows = cfg.train.batch_size // cfg.train.grad_accum_steps * cfg.data.seq_len // length
  return max(unit, rows // unit * unit)
