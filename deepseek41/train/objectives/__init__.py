"""What a run trains: one `Objective` per training stage (docs/design.md, "Objectives").

    objective = objective_for(cfg)
    model = objective.build_model(rngs); graphdef, params, frozen, biases = objective.split(model)
    step_fn = objective.make_train_step(md); eval_fn = objective.make_eval_step(eval_md)

`objective_for` is the one place that reads which stage a config trains (tests/unit/test_objectives.py
holds every other module to that): adding a stage is one module here and its config section.
"""

from __future__ import annotations

from deepseek41.config import RunConfig
from deepseek41.train.objectives.base import BACKBONE, MODEL, Objective, Split, WarmStart
from deepseek41.train.objectives.dspark import DSparkStage
from deepseek41.train.objectives.language_model import LanguageModelling

__all__ = ['BACKBONE', 'MODEL', 'DSparkStage', 'LanguageModelling', 'Objective', 'Split',
           'WarmStart', 'objective_for']


def objective_for(cfg: RunConfig) -> Objective:
  """The objective `cfg` trains: language modelling (pretraining), or the DSpark stage on a
  frozen backbone or with it (post-training)."""
  stage = cfg.dspark.stage
  if stage == 'off':
    return LanguageModelling(cfg)
  if stage in ('frozen', 'post_training'):
    return DSparkStage(cfg, frozen=stage == 'frozen')
  raise ValueError(f'dspark.stage={stage!r}: no objective trains it')
