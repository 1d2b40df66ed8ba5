"""Train-step options: gradient accumulation and block remat leave the update unchanged (with
CSA2 and the attention kernels: tests/kernels/test_remat.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.transformer import Transformer
from tests.helpers import jaxpr_eqns, one_train_step, packed_batch, resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope='module')
def baseline():
  return one_train_step()


@pytest.mark.parametrize('overrides', [{'train.grad_accum_steps': 2},
                                       {'train.grad_accum_steps': 4},
                                       {'train.remat': 'block'},
                                       {'train.remat': 'block', 'train.remat_layers': 1}])
def test_same_update(baseline, overrides):
  grads, state, metrics = one_train_step(**overrides)
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


def test_remat_layers_recomputes_the_first_layers_only():
  """train.remat_layers=n: layers 0..n-1 run under remat (a checkpoint each, whose backward
  recomputes the MoE routing's top-k), the rest keep their residuals; 0 means every layer."""
  cfg = resolved().model
  batch = {k: jnp.asarray(v)[:2] for k, v in packed_batch(seed=5).items()}

  def checkpoints_and_routing(**kw):
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(params=0), **kw))

    def loss(params):
      return jnp.mean(nnx.merge(graphdef, params)(batch)[0])
    forward = jax.make_jaxpr(loss)(params).jaxpr
    wrapped = [str(e.source_info.name_stack) for e in forward.eqns
               if e.primitive.name == 'remat2']
    routing = sum(e.primitive.name == 'top_k' and 'moe' in str(e.source_info.name_stack)
                  for e in jaxpr_eqns(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
    return wrapped, routing
  wrapped, routing_none = checkpoints_and_routing(remat='none')
  assert wrapped == [] and routing_none == cfg.num_layers
  for n, want in ((1, ['layer0']), (3, ['layer0', 'layer1', 'layer2']),
                  (0, [f'layer{l}' for l in range(cfg.num_layers)])):
    wrapped, routing = checkpoints_and_routing(remat='block', remat_layers=n)
    assert wrapped == want and routing == routing_none + len(want), (n, wrapped, routing)
