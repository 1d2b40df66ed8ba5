"""train/warm_start.py: one step-directory check, one model rule and one restore path for
`checkpoint.init_from` and the DSpark backbone; resume shares the rule and reads its own
checkpoint whole. The HF-import case (init_from of an import): tests/system/test_convert.py."""

import os

import numpy as np
import pytest

from deepseek41.config import resolve
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train import warm_start
from deepseek41.train.checkpoint import CheckpointError, Checkpointer
from deepseek41.train.optimizer import make_optimizer
from tests.helpers import small_config

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

DRAFTER = {'dspark.num_blocks': 1, 'dspark.block_size': 3, 'dspark.n_routed_experts': 4,
           'dspark.num_experts_per_tok': 2, 'dspark.markov_rank': 8}


def _cfg(**overrides):
  return resolve(small_config(**overrides), backend='cpu')


def _fresh(cfg):
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh)
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  return state, mesh


def _save(cfg, state, workdir, step=0) -> str:
  ckpt = Checkpointer(str(workdir), cfg.checkpoint)
  abstract = state_lib.abstract_state(cfg, make_optimizer(cfg.train))
  ckpt.save(step, state, None, cfg.to_dict(), state_lib.state_layout(abstract))
  ckpt.close()
  return os.path.join(str(workdir), 'checkpoints', str(step))


def _same(a, b):
  a, b = state_lib.named_leaves(a), state_lib.named_leaves(b)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """A pretraining state (seed 7) saved as WORKDIR/checkpoints/0."""
  cfg = _cfg(**{'train.seed': 7})
  state, _ = _fresh(cfg)
  return state, _save(cfg, state, tmp_path_factory.mktemp('pre'))


@pytest.fixture
def calls(monkeypatch):
  """The keys restore_weights was called with, and how often the model rule ran."""
  seen = {'restore': [], 'rule': 0}
  restore, rule = warm_start.restore_weights, warm_start.model_differences

  def spy_restore(key, *args, **kwargs):
    seen['restore'].append(key)
    return restore(key, *args, **kwargs)

  def spy_rule(*args):
    seen['rule'] += 1
    return rule(*args)
  monkeypatch.setattr(warm_start, 'restore_weights', spy_restore)
  monkeypatch.setattr(warm_start, 'model_differences', spy_rule)
  return seen


def test_step_directory_names_the_key(tmp_path):
  (tmp_path / 'checkpoints' / '12').mkdir(parents=True)
  assert warm_start.step_directory('k', str(tmp_path / 'checkpoints' / '12')) == \
      (str(tmp_path), 12)
  for bad in ('', str(tmp_path), str(tmp_path / 'checkpoints' / '13')):
    with pytest.raises(CheckpointError, match=r'^some\.key=.* is not a checkpoint step '
                                               r'directory \(WORKDIR/checkpoints/<step>\)'):
      warm_start.step_directory('some.key', bad)


def test_only_execution_choices_may_differ():
  cfg = _cfg().to_dict()['model']
  gpu = {**cfg, 'index_impl': 'fused', 'compute_dtype': 'bfloat16', 'd_model': 48}
  another, execution = warm_start.model_differences(gpu, cfg)
  assert another == ['model.d_model: checkpoint 48 != now 32']
  assert sorted(d.split(':')[0] for d in execution) == ['model.compute_dtype', 'model.index_impl']
  missing = dict(cfg)
  del missing['hc_mult']
  assert warm_start.model_differences(missing, cfg)[0] == \
      ['model.hc_mult: absent in checkpoint, present now']


def test_init_from_takes_the_weights_and_nothing_else(pretrained, calls):
  saved, path = pretrained
  cfg = _cfg(**{'checkpoint.init_from': path, 'train.lr': 1e-2})
  fresh, mesh = _fresh(cfg)
  started = warm_start.load_warm_starts(cfg, fresh, mesh)
  for entry in ('params', 'router_bias'):
    _same(started[entry], saved[entry])
  assert started['opt'] is fresh['opt'] and int(started['step']) == 0
  assert calls['restore'] == ['checkpoint.init_from'] and calls['rule'] == 1
  other = _cfg(**{'checkpoint.init_from': path, 'model.moe_intermediate_size': 24})
  with pytest.raises(CheckpointError, match=r'^checkpoint\.init_from: .* holds another model: '
                                             r'model\.moe_intermediate_size: checkpoint 16'):
    warm_start.load_warm_starts(other, _fresh(other)[0], mesh)


def test_init_from_may_change_how_many_entries_are_selected(pretrained, calls):
  """The selection's size is no weight: a warm start may narrow it (a wide selection in a short
  stage, then the model's own); the resume rule still counts it as another model."""
  saved, path = pretrained
  base = _cfg().model
  narrower = {'model.index_topk': base.index_topk // 2,
              'model.candidate_topk_blocks': base.candidate_topk_blocks // 2}
  cfg = _cfg(**{'checkpoint.init_from': path, **narrower})
  fresh, mesh = _fresh(cfg)
  started = warm_start.load_warm_starts(cfg, fresh, mesh)
  _same(started['params'], saved['params'])
  another, _ = warm_start.model_differences(_cfg().to_dict()['model'], cfg.to_dict()['model'])
  assert sorted(d.split(':')[0] for d in another) == ['model.candidate_topk_blocks',
                                                        'model.index_topk']


@pytest.mark.parametrize('stage', ['frozen', 'post_training'])
def test_the_backbone_goes_under_the_drafter(pretrained, calls, stage):
  saved, path = pretrained
  cfg = _cfg(**DRAFTER, **{'dspark.stage': stage, 'dspark.backbone_checkpoint': path})
  fresh, mesh = _fresh(cfg)
  started = warm_start.load_warm_starts(cfg, fresh, mesh)
  held = 'frozen' if stage == 'frozen' else 'params'
  _same(started[held]['backbone'], saved['params'])
  _same(started['router_bias']['backbone'], saved['router_bias'])
  _same(started['router_bias']['dspark'], fresh['router_bias']['dspark'])
  _same(started['params']['dspark'], fresh['params']['dspark'])
  assert calls['restore'] == ['dspark.backbone_checkpoint']


def test_resume_reads_its_own_checkpoint_under_the_same_rule(pretrained, calls, tmp_path):
  """A resumed DSpark run restores its own state whole (the backbone key is not read again);
  a model that differs is refused by the rule the warm starts use."""
  _, path = pretrained
  overrides = {**DRAFTER, 'dspark.stage': 'frozen', 'dspark.backbone_checkpoint': path}
  cfg = _cfg(**overrides)
  state, mesh = _fresh(cfg)
  state = warm_start.load_warm_starts(cfg, state, mesh)
  _save(cfg, state, tmp_path, step=0)
  calls['restore'].clear()
  calls['rule'] = 0
  resumed_cfg = _cfg(**{**overrides, 'dspark.backbone_checkpoint': str(tmp_path / 'nowhere')})
  tx = make_optimizer(resumed_cfg.train)
  abstract = state_lib.abstract_state(resumed_cfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, resumed_cfg.mesh.rules)
  ckpt = Checkpointer(str(tmp_path), resumed_cfg.checkpoint, primary=False)
  restored, start = warm_start.initial_state(resumed_cfg, ckpt, tx, mesh, abstract, shardings,
                                             state_lib.state_layout(abstract), None)
  ckpt.close()
  assert start == 0 and calls['restore'] == [] and calls['rule'] == 1
  for entry in state:
    _same(restored[entry], state[entry])
  other = _cfg(**{**overrides, 'model.moe_intermediate_size': 24})
  ckpt = Checkpointer(str(tmp_path), other.checkpoint, primary=False)
  other_abstract = state_lib.abstract_state(other, tx)
  with pytest.raises(CheckpointError, match='does not fit the configured model:(.|\n)*'
                                            'model.moe_intermediate_size'):
    warm_start.check_fits(ckpt, 0, state_lib.state_layout(other_abstract), other.to_dict())
  ckpt.close()


def test_the_trainer_refuses_a_bad_warm_start_before_compiling(pretrained, tmp_path, monkeypatch):
  """A fresh run whose warm start names no checkpoint, or another model's, fails with the key
  named before anything traces or compiles; a resumed run does not read its warm starts."""
  from deepseek41.train import trainer

  def no_compiling(*args, **kwargs):
    raise AssertionError('compiled before the warm starts were checked')
  monkeypatch.setattr(trainer, 'CompiledStep', no_compiling)
  _, path = pretrained
  cases = [({'checkpoint.init_from': str(tmp_path / 'nowhere')},
            r'^checkpoint\.init_from=.* is not a checkpoint step directory'),
           ({'checkpoint.init_from': path, 'model.moe_intermediate_size': 24},
            r'^checkpoint\.init_from: .* holds another model: model\.moe_intermediate_size'),
           ({**DRAFTER, 'dspark.stage': 'frozen'}, r'^dspark\.backbone_checkpoint: the frozen'),
           ({**DRAFTER, 'dspark.stage': 'frozen', 'dspark.backbone_checkpoint': path,
             'dspark.markov_rank': 4}, None)]  # a drafter key differs: the backbone fits
  for i, (overrides, message) in enumerate(cases):
    workdir = str(tmp_path / f'run{i}')
    if message is None:
      with pytest.raises(AssertionError, match='compiled before'):
        trainer.train(small_config(**overrides), workdir)
    else:
      with pytest.raises(CheckpointError, match=message):
        trainer.train(small_config(**overrides), workdir)
  # A run that resumes (its own step 0 here) never looks at its warm starts.
  resumed = str(tmp_path / 'resumed')
  _save(_cfg(), pretrained[0], resumed)
  with pytest.raises(AssertionError, match='compiled before'):
    trainer.train(small_config(**{'checkpoint.init_from': str(tmp_path / 'nowhere')}), resumed)
