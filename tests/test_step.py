"""Train-step options: gradient accumulation and block remat leave the update unchanged."""

import jax
import numpy as np
import pytest

from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import accumulate_gradients, make_train_step
from tests.util import packed_batch, resolved


def _one_step(**overrides):
  cfg = resolved(**overrides)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  md = state_lib.model_def(cfg, tx)
  batch = packed_batch(seed=3, image_rows=(0, 7))
  grads = jax.jit(lambda p, b, x: accumulate_gradients(cfg, md, p, b, x)[0])(
      state['params'], state['router_bias'], batch)
  new_state, metrics = jax.jit(make_train_step(cfg, md))(state, batch)
  return grads, new_state, metrics


@pytest.fixture(scope='module')
def baseline():
  return _one_step()


@pytest.mark.parametrize('overrides', [{'train.grad_accum_steps': 2},
                                       {'train.grad_accum_steps': 4},
                                       {'train.remat': 'block'}])
def test_same_update(baseline, overrides):
  grads, state, metrics = _one_step(**overrides)
  base_grads, base_state, base_metrics = baseline
  # f32 sums reassociate across microbatches: agreement to ~1e-6 relative
  np.testing.assert_allclose(metrics['loss'], base_metrics['loss'], rtol=1e-6)
  np.testing.assert_allclose(metrics['grad_norm'], base_metrics['grad_norm'], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(metrics['load_lme']), np.asarray(base_metrics['load_lme']))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
  # The router biases follow the summed loads exactly.
  for a, b in zip(jax.tree.leaves(state['router_bias']), jax.tree.leaves(base_state['router_bias'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
