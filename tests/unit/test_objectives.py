"""The objective seam (train/objectives/): the factory picks one objective per stage, and it is
the only code that reads which stage a config trains."""

import ast
import os

import jax
import pytest

from deepseek41.config import resolve
from deepseek41.model.drafting import DraftingModel
from deepseek41.model.transformer import Transformer
from deepseek41.train import state as state_lib
from deepseek41.train.objectives import DSparkStage, LanguageModelling, objective_for
from deepseek41.train.optimizer import make_optimizer
from tests.helpers import REPO_ROOT, small_config

ROOT = REPO_ROOT
PACKAGE = os.path.join(ROOT, 'deepseek41')

DRAFTER = {'dspark.num_blocks': 1, 'dspark.block_size': 3, 'dspark.n_routed_experts': 4,
           'dspark.num_experts_per_tok': 2, 'dspark.markov_rank': 8}

# Where the stage may be read: the factory, and the config's own validation.
FACTORY = os.path.join('deepseek41', 'train', 'objectives', '__init__.py')
READERS = {FACTORY, os.path.join('deepseek41', 'config.py')}


def _cfg(stage):
  return resolve(small_config(**DRAFTER, **{'dspark.stage': stage}), num_devices=1,
                 backend='cpu')


@pytest.mark.parametrize('stage,kind,entries,model', [
    ('off', LanguageModelling, ('params', 'router_bias'), Transformer),
    ('post_training', DSparkStage, ('params', 'router_bias'), DraftingModel),
    ('frozen', DSparkStage, ('params', 'router_bias', 'frozen'), DraftingModel),
])
def test_each_stage_gets_its_objective(stage, kind, entries, model):
  cfg = _cfg(stage)
  objective = objective_for(cfg)
  assert type(objective) is kind and objective.model_entries == entries
  assert objective.has_drafter == (stage != 'off')
  assert isinstance(state_lib.build_model(cfg), model)
  # The state holds what the objective splits off: the frozen entry in the frozen stage only,
  # the optimizer over the trained parameters alone.
  abstract = state_lib.abstract_state(cfg, make_optimizer(cfg.train))
  assert set(abstract) == set(entries) | {'opt', 'step', 'rng'}
  if stage == 'frozen':
    assert {str(p[0].key) for p, _ in
            jax.tree_util.tree_flatten_with_path(abstract['params'])[0]} == {'dspark'}
    assert {str(p[0].key) for p, _ in
            jax.tree_util.tree_flatten_with_path(abstract['frozen'])[0]} == {'backbone'}
  # Readers find the backbone in any stage's weights, as a pretraining state holds them.
  backbone = objective.backbone_weights(abstract)
  plain = state_lib.abstract_state(_cfg('off'), make_optimizer(cfg.train))
  for group in ('params', 'router_bias'):
    assert state_lib.named_leaves(backbone[group]).keys() == \
        state_lib.named_leaves(plain[group]).keys()


def test_the_stage_decides_the_flops_and_the_warm_start():
  lm, post, frozen = (objective_for(_cfg(s)) for s in ('off', 'post_training', 'frozen'))
  assert lm.flops_per_token().total < post.flops_per_token().total
  assert frozen.flops_per_token().total < post.flops_per_token().total  # no backbone backward
  assert 'DSpark stage' in frozen.flops_per_token().formula
  assert lm.warm_starts() == post.warm_starts() == ()
  with pytest.raises(Exception, match='dspark.backbone_checkpoint'):
    frozen.warm_starts()  # the frozen stage needs a backbone


def _stage_reads(path: str) -> list[str]:
  """Where a module reads a config's stage: `x.stage`, `stage=` (a config built with one),
  getattr(x, 'stage') or x['stage']."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr == 'stage':
      found.append(f'{node.lineno}: .stage')
    elif isinstance(node, ast.keyword) and node.arg == 'stage':
      found.append(f'{node.lineno}: stage=')
    elif isinstance(node, ast.Call) and getattr(node.func, 'id', None) in ('getattr', 'setattr') \
        and len(node.args) > 1 and getattr(node.args[1], 'value', None) == 'stage':
      found.append(f'{node.lineno}: getattr(.., "stage")')
    elif isinstance(node, ast.Subscript) and getattr(node.slice, 'value', None) == 'stage':
      found.append(f'{node.lineno}: ["stage"]')
  return found


def test_nothing_outside_the_factory_reads_the_stage():
  """The seam cannot erode: a stage branch anywhere else (trainer, state, evaluation, readers)
  fails here; ask the objective instead."""
  offenders = {}
  for directory, _, files in os.walk(PACKAGE):
    for name in files:
      path = os.path.join(directory, name)
      rel = os.path.relpath(path, ROOT)
      if not name.endswith('.py') or rel in READERS or \
          rel.startswith(os.path.join('deepseek41', 'config') + os.sep):  # the config package
        continue
      if reads := _stage_reads(path):
        offenders[rel] = reads
  assert not offenders, offenders
  # The check sees what it looks for: the factory does read the stage.
  assert _stage_reads(os.path.join(ROOT, FACTORY))
