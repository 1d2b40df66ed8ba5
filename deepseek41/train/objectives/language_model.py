"""Language modelling: pretraining's objective (`dspark.stage = 'off'`).

The model is the Transformer; every parameter trains. The loss and the steps are train/step.py's
(next-token cross-entropy + the balance and indexer terms, gradient accumulation, the router-bias
sign rule); the FLOPs per token are train/flops.py's count of the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from deepseek41.model.params import RouterBias
from deepseek41.model.transformer import Transformer
from deepseek41.train import step
from deepseek41.train.flops import FlopsPerToken, flops_per_token
from deepseek41.train.objectives.base import Objective, Split
from deepseek41.train.step import ModelDef


class LanguageModelling(Objective):
  """Next-token prediction over the whole model."""

  def build_model(self, rngs: nnx.Rngs) -> Transformer:
    cfg = self.cfg
    return Transformer(cfg.model, rngs, remat=cfg.train.remat,
                       sequence_parallel=cfg.mesh.sequence_parallel,
                       remat_layers=cfg.train.remat_layers)

  def split(self, model: Transformer) -> Split:
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    return Split(graphdef, params, None, biases)

  def merge(self, graphdef, weights: Mapping[str, Any]) -> Transformer:
    return step.merge_model(graphdef, weights['params'], weights['router_bias'])

  def make_train_step(self, md: ModelDef):
    return step.make_train_step(self.cfg, md)

  def make_eval_step(self, md: ModelDef):
    return step.make_eval_step(md)

  def flops_per_token(self) -> FlopsPerToken:
    return flops_per_token(self.cfg.model, self.cfg.data.seq_len)

  def backbone_weights(self, weights: Mapping[str, Any]) -> dict[str, Any]:
    return {'params': weights['params'], 'router_bias': weights['router_bias']}

  def with_backbone(self, state: dict, backbone: Mapping[str, Any]) -> dict:
    return {**state, 'params': backbone['params'], 'router_bias': backbone['router_bias']}

  def reader_models(self, graphdef, weights: Mapping[str, Any]):
    return self.merge(graphdef, weights), None
