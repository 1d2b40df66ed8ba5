"""Held-out evaluation never drops expert assignments, whatever `model.moe_backend` trains with."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from deepseek41.config import ConfigError, resolve
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.evaluation import Evaluator
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import make_eval_step
from deepseek41.train.trainer import train
from tests.helpers import small_config


@pytest.mark.parametrize('backend, train_moe, want', [
    ('cpu', 'capacity_einsum', 'reference'), ('gpu', 'capacity_einsum', 'grouped'),
    ('tpu', 'capacity_einsum', 'ragged_dot'), ('gpu', 'auto', 'grouped'),
    ('cpu', 'ragged_dot', 'ragged_dot')])
def test_auto_eval_backend_is_dropless(backend, train_moe, want):
  """auto keeps a dropless training backend and replaces the capacity einsum."""
  cfg = resolve(small_config(**{'model.moe_backend': train_moe}), num_devices=1, backend=backend)
  assert cfg.model.eval_moe_backend == want


def test_capacity_einsum_is_refused_for_evaluation():
  with pytest.raises(ConfigError, match=r'^model\.eval_moe_backend: .*drops'):
    resolve(small_config(**{'model.eval_moe_backend': 'capacity_einsum'}), num_devices=1,
            backend='cpu')


def test_eval_loss_is_dropless_while_training_drops(tmp_path):
  """Training with a capacity far too small drops most assignments, yet the trainer's eval loss
  is the one every expert computes (the reference backend); through the capacity path it would
  differ by far more than the tolerance."""
  config = small_config(**{
      'data.synthetic': False, 'data.cache_dir': str(tmp_path / 'cache'),
      'data.default_corpus_vocab_size': 300, 'data.default_corpus_max_files': 5,
      'model.vocab_size': 320, 'mesh.data': -1,
      'model.moe_backend': 'capacity_einsum', 'model.capacity_factor': 0.1, 'model.init_std': 0.1,
      'train.steps': 1, 'train.eval_every_steps': 1, 'train.eval_batches': 1})
  workdir = str(tmp_path / 'run')
  result = train(config, workdir)
  records = [json.loads(line) for line in open(f'{workdir}/metrics.jsonl')]
  dropped = [r['dropped_frac'] for r in records if 'dropped_frac' in r]
  assert dropped and min(dropped) > 0.3  # 2 slots per expert and sequence for 12 assignments

  cfg = resolve(config)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh)
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, cfg.mesh.rules)
  ckpt = Checkpointer(workdir, cfg.checkpoint)
  state = ckpt.restore(1, state_lib.with_shardings(abstract, shardings), None)
  ckpt.close()

  def eval_loss(moe_backend):
    model_cfg = dataclasses.replace(cfg.model, moe_backend=moe_backend)
    md = state_lib.model_def(dataclasses.replace(cfg, model=model_cfg), tx)
    evaluate = Evaluator(cfg, jax.jit(make_eval_step(md)), mesh,
                         batch_sharding(mesh, cfg.mesh.rules), None, cfg.train.batch_size)
    return evaluate(state)['eval_loss']

  reference, dropping = eval_loss('reference'), eval_loss('capacity_einsum')
  assert abs(dropping - reference) > 1e-2  # the check below can tell the two paths apart
  np.testing.assert_allclose(result.last_eval_loss, reference, rtol=1e-7)
