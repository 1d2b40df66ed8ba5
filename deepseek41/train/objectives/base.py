"""The objective seam: what a run trains (docs/design.md, "Objectives").

Everything that depends on the training stage is asked of one `Objective`: the model to build
and how it splits into the train state, the train and eval steps, the FLOPs per token behind
MFU, the held-out metrics beyond the loss, what a fresh run loads before step 0, and where a
reader (generation, HF export) finds the backbone and the drafter in restored weights. The
trainer, the state, the evaluation and the readers never branch on the stage themselves;
`objectives.objective_for(cfg)` picks the objective.

Weights: the model's entries of the train state (`model_entries`: 'params', 'router_bias', and
'frozen' where part of the model is held fixed), as the state holds them or as a checkpoint
restores them.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from flax import nnx

from deepseek41.config import RunConfig
from deepseek41.train.flops import FlopsPerToken
from deepseek41.train.step import ModelDef

# What a warm start loads from its checkpoint: every parameter and router bias of the model, or
# those of its backbone only.
MODEL, BACKBONE = 'model', 'backbone'


class Split(NamedTuple):
  """A model split into its graph and the train state's entries."""
  graphdef: Any
  params: Any        # differentiated, and the only parameters the optimizer sees
  frozen: Any        # parameters held fixed (the state's 'frozen' entry); None if none are
  router_bias: Any   # the MoE correction biases: state, updated by the sign rule


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """A checkpoint a fresh run loads before step 0 (train/warm_start.py loads it)."""
  key: str    # the config key that names it: every error and log line names it
  path: str   # a step directory, WORKDIR/checkpoints/<step>
  part: str   # MODEL or BACKBONE


class Objective(abc.ABC):
  """What a run trains. One subclass per training stage."""

  model_entries: tuple[str, ...] = ('params', 'router_bias')
  has_drafter = False

  def __init__(self, cfg: RunConfig):
    self.cfg = cfg

  # ---- the model and the state's split --------------------------------------------------------

  @abc.abstractmethod
  def build_model(self, rngs: nnx.Rngs) -> nnx.Module:
    """The model, its parameters in the dtype they are created with (train/state.py casts)."""

  @abc.abstractmethod
  def split(self, model: nnx.Module) -> Split:
    """The parameters split into trained, frozen and router biases (state_lib's entries)."""

  @abc.abstractmethod
  def merge(self, graphdef, weights: Mapping[str, Any]) -> nnx.Module:
    """The model back from its graph and its weights (`model_entries` of a state)."""

  # ---- training and evaluation ----------------------------------------------------------------

  @abc.abstractmethod
  def make_train_step(self, md: ModelDef) -> Callable:
    """(state, batch[, schedule]) -> (state, metrics): one update; `schedule` the learning-rate
    schedule's numbers as an argument (train/step.py has it and the metric keys)."""

  @abc.abstractmethod
  def make_eval_step(self, md: ModelDef) -> Callable:
    """(state, batch) -> {'ce_sum', 'tokens', ...}: one held-out batch; `md` is the evaluation
    model's (train/evaluation.py `eval_config`)."""

  @abc.abstractmethod
  def flops_per_token(self) -> FlopsPerToken:
    """Model FLOPs per batch token of one training step (MFU's numerator)."""

  def held_out_metrics(self, outputs: list[dict]) -> dict[str, float]:
    """Metrics beyond the held-out loss, from the eval step's outputs over the evaluation's
    batches (host side)."""
    del outputs
    return {}

  # ---- where the weights come from, and where readers find them -------------------------------

  def warm_starts(self) -> tuple[WarmStart, ...]:
    """What a fresh run loads before step 0 beyond `checkpoint.init_from` (never on resume)."""
    return ()

  @abc.abstractmethod
  def backbone_weights(self, weights: Mapping[str, Any]) -> dict[str, Any]:
    """{'params', 'router_bias'} of the backbone, as a pretraining state holds them."""

  @abc.abstractmethod
  def with_backbone(self, state: dict, backbone: Mapping[str, Any]) -> dict:
    """`state` with its backbone's weights replaced by `backbone` (backbone_weights' form)."""

  @abc.abstractmethod
  def reader_models(self, graphdef, weights: Mapping[str, Any]) -> tuple[nnx.Module, Any]:
    """(backbone, drafter or None) for generation."""
