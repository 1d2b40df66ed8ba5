"""Held-out evaluation: the mixture's loss, the objective's own held-out metrics (e.g. DSpark's
acceptance and calibration), with image sources the caption losses, and with train.eval_tasks
the long-context tasks' accuracy (`TaskEvaluator`, which `python -m deepseek41.eval` runs too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.config import MeshConfig, RunConfig, TaskSpec, parse_task_specs
from deepseek41.data.pipeline import document_batch, make_dataset, open_task
from deepseek41.data.tasks import TaskDocument, held_out_documents
from deepseek41.data.tokenizer import Tokenizer
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
      self.tasks = TaskEvaluator(cfg, specs, predict, lambda length: task_rows(cfg, length))

  def __call__(self, state) -> dict[str, float]:
    """`eval_loss` over the whole mixture and the objective's metrics over the same batches;
    with image sources also the caption loss (the text of the image samples) with the real
    images and with blank ones; with train.eval_tasks each task's accuracy
    (`eval_acc/<task>@<length>`, task_metrics). {} on synthetic data."""
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
# Long-context tasks: teacher-forced accuracy of the answers.


@dataclasses.dataclass
class TaskScore:
  """One task at one length and depth (None: a task without depth): of its asked items, how
  many the model got right (every answer token the argmax of its position), and the answers'
  loss."""
  spec: TaskSpec
  depth: float | None
  answers: int = 0
  correct: int = 0
  answer_tokens: int = 0
  correct_tokens: int = 0
  ce_sum: float = 0.0

  @property
  def acc(self) -> float:
    return self.correct / self.answers if self.answers else float('nan')

  @property
  def token_acc(self) -> float:
    return self.correct_tokens / self.answer_tokens if self.answer_tokens else float('nan')

  @property
  def answer_loss(self) -> float:
    return self.ce_sum / self.answer_tokens if self.answer_tokens else float('nan')

  def add(self, docs: Sequence[TaskDocument], pred_bt: np.ndarray, ce_bt: np.ndarray) -> None:
    """Score `docs`, one per row of the argmax ids and per-target CE of their batch."""
    for r, doc in enumerate(docs):
      for start, end in doc.answers:
        right_t = pred_bt[r, start - 1:end - 1] == doc.tokens[start:end]
        self.answers += 1
        self.correct += int(right_t.all())
        self.answer_tokens += end - start
        self.correct_tokens += int(right_t.sum())
        self.ce_sum += float(ce_bt[r, start - 1:end - 1].sum())

  @classmethod
  def merged(cls, scores: Sequence[TaskScore]) -> TaskScore:
    """The scores of one spec over all its depths."""
    return cls(scores[0].spec, None, *(sum(getattr(s, f) for s in scores) for f in (
        'answers', 'correct', 'answer_tokens', 'correct_tokens', 'ce_sum')))

  def to_dict(self) -> dict[str, Any]:
    def number(x):  # JSON has no NaN (an answer loss of generation, which has none)
      return None if math.isnan(x) else x
    return {'task': self.spec.name, 'length': self.spec.length, 'label': self.spec.label,
            'depth': self.depth, 'answers': self.answers, 'correct': self.correct,
            'acc': number(self.acc), 'token_acc': number(self.token_acc),
            'answer_loss': number(self.answer_loss)}


# (weights, host batch of the global rows) -> (argmax ids [B, T], CE [B, T]) on the host
Predict = Callable[[Any, dict[str, np.ndarray]], tuple[np.ndarray, np.ndarray]]


class TaskEvaluator:
  """The tasks of `specs` at their lengths, at each of tasks.eval_depths (the tasks that have a
  depth), tasks.eval_examples documents each, through `predict` in batches of rows(length)
  rows; the documents are the held-out ones (data/tasks/ `held_out_documents`), the same for
  every call, run and checkpoint."""

  def __init__(self, cfg: RunConfig, specs: Sequence[TaskSpec], predict: Predict,
               rows: Callable[[int], int], tokenizer: Tokenizer | None = None,
               examples: int | None = None, depths: Sequence[float] | None = None):
    self.cfg, self.specs, self.predict, self.rows = cfg, tuple(specs), predict, rows
    self.examples = examples or cfg.tasks.eval_examples
    self.depths = tuple(cfg.tasks.eval_depths if depths is None else depths)
    self.tasks = {name: open_task(cfg.data, name, 'heldout', tokenizer)
                  for name in dict.fromkeys(s.name for s in self.specs)}
    self._documents: dict[tuple, list[TaskDocument]] = {}

  def documents(self, spec: TaskSpec, depth: float | None) -> list[TaskDocument]:
    key = (spec, depth)
    if key not in self._documents:  # generated once: evaluation repeats through training
      self._documents[key] = held_out_documents(self.tasks[spec.name], spec.length, depth,
                                                self.examples)
    return self._documents[key]

  def __call__(self, weights) -> list[TaskScore]:
    scores = []
    for spec in self.specs:
      rows = self.rows(spec.length)
      for depth in self.depths if spec.has_depth else (None,):
        score = TaskScore(spec, depth)
        docs = self.documents(spec, depth)
        for i in range(0, len(docs), rows):
          chunk = docs[i:i + rows]
          batch = document_batch(chunk, rows, spec.length, self.cfg.data.images)
          pred_bt, ce_bt = self.predict(weights, batch)
          score.add(chunk, pred_bt, ce_bt)
        scores.append(score)
    return scores


def task_metrics(scores: Sequence[TaskScore]) -> dict[str, float]:
  """`eval_acc/<task>@<length>` and `eval_answer_loss/...` over every depth, and per depth
  `eval_acc/<task>@<length>/depth<d>`."""
  out = {}
  for label in dict.fromkeys(s.spec.label for s in scores):
    group = [s for s in scores if s.spec.label == label]
    total = TaskScore.merged(group)
    out[f'eval_acc/{label}'] = total.acc
    out[f'eval_answer_loss/{label}'] = total.answer_loss
    if group[0].spec.has_depth:
      out.update({f'eval_acc/{label}/depth{s.depth:g}': s.acc for s in group})
  return out


def make_task_step(objective: Objective, graphdef):
  """(weights, batch) -> {'pred': argmax ids, 'ce': per-target CE (0 off the loss mask)}: the
  backbone's forward at the batch's shape (`objective.reader_models`: any stage's backbone);
  `weights` holds the objective's model entries (a train state, or a checkpoint's weights)."""
  def task_step(weights, batch):
    backbone, _ = objective.reader_models(graphdef, weights)
    logits_btv, _ = backbone(batch)
    logits_btv = logits_btv.astype(jnp.float32)
    target_bt = jnp.take_along_axis(logits_btv, batch['targets'][..., None], axis=-1)[..., 0]
    ce_bt = (jax.nn.logsumexp(logits_btv, axis=-1) - target_bt) * batch['loss_mask']
    return {'pred': jnp.argmax(logits_btv, axis=-1).astype(jnp.int32), 'ce': ce_bt}
  return task_step


def model_predictor(task_step, mesh, sharding, engram_map, vision: bool) -> Predict:
  """`predict` through a jitted task_step (its outputs replicated): each process feeds its own
  rows of the global batch, and every process gets the whole result."""
  def predict(weights, batch):
    n, i = jax.process_count(), jax.process_index()
    rows = len(batch['tokens']) // n
    local = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}
    with jax.set_mesh(mesh):
      out = jax.device_get(task_step(weights, global_batch(local, sharding, engram_map,
                                                           vision=vision)))
    return np.asarray(out['pred']), np.asarray(out['ce'])
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
