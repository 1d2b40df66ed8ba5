"""Whole training runs the unit tier leaves out: each attention variant through `train()`,
FP8 training against full precision over 40 steps, a resume with every execution choice
changed."""

import json
import os

import jax
import numpy as np
import pytest

from deepseek41.config import execution_only_keys
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import make_train_step
from deepseek41.train.trainer import train
from tests.helpers import packed_batch, resolved, small_config

EXECUTION_ONLY = sorted(execution_only_keys('model'))


@pytest.mark.parametrize('variant', ['csa2', 'dense', 'window'])
def test_each_variant_trains(variant, tmp_path):
  """In-process `train()`, as the command line runs it; the dense layers beside mHC and
  Engram (MoE is in every config). The window run ends without its final save
  (checkpoint.save_at_end, for benchmarks); the others save at their last step."""
  everything = {'model.residual': 'mhc_single_pass', 'model.engram': True}
  config = small_config(**{'model.attention_variant': variant, 'train.steps': 2,
                           'checkpoint.save_at_end': variant != 'window',
                           **(everything if variant == 'dense' else {})})
  result = train(config, str(tmp_path))
  assert result.step == 2 and np.isfinite(result.last_loss)
  assert os.path.isdir(os.path.join(tmp_path, 'checkpoints', '2')) == (variant != 'window')


STEPS = 40


def loss_curve(fp8):
  cfg = resolved(**{'model.fp8': fp8, 'train.steps': STEPS, 'train.lr': 3e-3,
                    'train.warmup_steps': 5})
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  step = jax.jit(make_train_step(cfg, state_lib.model_def(cfg, tx)))
  batches = [packed_batch(seed=s) for s in range(4)]
  losses = []
  for i in range(STEPS):
    state, metrics = step(state, batches[i % len(batches)])
    losses.append(float(metrics['loss']))
  return np.array(losses)


def test_fp8_training_tracks_full_precision():
  """40 steps of the test model with model.fp8 = 'rowwise' against 'off' (fp32 compute):
  every step's loss within 2% of the fp32 run, the last within 1.5% (observed max 0.5%), the loss
  falls by > 10%, and the runs differ (fp8 is really on)."""
  ref, fp8 = loss_curve('off'), loss_curve('rowwise')
  rel = np.abs(fp8 - ref) / ref
  assert rel.max() <= 0.02, rel
  assert rel[-1] <= 0.015, rel[-1]
  assert fp8[-1] < 0.9 * fp8[0]
  assert rel.max() > 1e-4


def test_a_run_resumes_with_its_execution_choices_changed(tmp_path):
  """A real resume: 2 steps, then 2 more with every execution-only key that has another value
  the CPU runs changed at once (the first start's compiled programs do not serve the second)."""
  workdir = str(tmp_path / 'run')
  first = {'model.attention_variant': 'csa2', 'train.steps': 4}
  assert train(small_config(**first), workdir, stop_at_step=2).step == 2
  changed = {
      'model.attention_impl': 'reference', 'model.sparse_impl': 'reference',
      'model.moe_backend': 'ragged_dot', 'model.sparse_chunk': 16, 'model.span_chunk': 0,
      'model.index_causal_groups': 1, 'model.index_topk_block': 0, 'model.merged_backward': False,
      'model.sparse_group_dkv': False, 'model.capacity_factor': 2.0,
      'model.expert_partials': 'compute', 'model.engram_exchange_capacity': 0.0,
      'model.expert_buffer_factor': 1.0,
  }
  assert {k.split('.')[1] for k in changed} <= set(EXECUTION_ONLY)
  result = train(small_config(**first, **changed), workdir)
  assert result.step == 4
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['model']['attention_impl'] == 'reference'  # the resumed run's own config
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['2', '4']
