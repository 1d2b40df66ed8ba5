"""CSA2 (selection, shared KV, gathered branch) on a mesh of 8 fake devices equals one device."""

import jax
import numpy as np

from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import forward_loss
from tests.helpers import CSA2_SMALL, aligned_batch, resolved


def test_sharded_matches_single_device():
  """CSA2 (selection, shared KV, gathered branch) on a 2x2x2 mesh of 8 fake devices."""
  batch = aligned_batch(8)
  out = []
  for n, mesh_overrides in ((1, {'mesh.data': 1}),
                            (8, {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.expert': 2})):
    cfg = resolved(num_devices=n, **{**CSA2_SMALL, **mesh_overrides})
    tx = make_optimizer(cfg.train)
    mesh = make_mesh(cfg.mesh, jax.devices()[:n])
    state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
    md = state_lib.model_def(cfg, tx)
    gbatch = {k: jax.device_put(v, batch_sharding(mesh, cfg.mesh.rules)) for k, v in batch.items()}

    def loss(params, biases, b):
      ce, cnt, aux = forward_loss(md, params, biases, b)
      return ce / cnt + aux['indexer_loss']
    with jax.set_mesh(mesh):
      out.append(jax.jit(jax.value_and_grad(loss))(state['params'], state['router_bias'], gbatch))
  (l1, g1), (l8, g8) = out
  np.testing.assert_allclose(l8, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
