"""The train step with the fused LM head + loss (`model.head_chunk`) equals the step without it."""

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import forward_loss, make_train_step
from tests.helpers import packed_batch, resolved


def _assert_trees_close(got, want, tol):
  """Every leaf equal to `tol` of its largest magnitude (fp32 rounding, reassociated, moves
  the smallest entries of a leaf by more than `tol` of themselves)."""
  leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(leaves) == len(want_leaves)
  for a, b in zip(leaves, want_leaves):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(float(np.abs(b).max()), 1e-30))


def _one_step(**overrides):
  """(initial parameters, gradients of the CE sum, state after one train step, its metrics)."""
  cfg = resolved(**overrides)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  md = state_lib.model_def(cfg, tx)
  batch = packed_batch(seed=3)
  grads = jax.jit(jax.grad(lambda p: forward_loss(md, p, state['router_bias'], batch)[0]))(
      state['params'])
  new_state, metrics = jax.jit(make_train_step(cfg, md))(state, batch)
  return state['params'], grads, new_state, metrics


def test_the_train_step_is_the_same_with_the_fused_head():
  """The train step with model.head_chunk on (5: T = 48 is padded to 50) equals the step with it
  off: loss, gradients and the updated parameters."""
  params0, grads, state, metrics = _one_step(**{'model.head_chunk': 5})
  _, grads_ref, state_ref, metrics_ref = _one_step(**{'model.head_chunk': 0})
  np.testing.assert_allclose(metrics['loss'], metrics_ref['loss'], rtol=1e-6)
  np.testing.assert_allclose(metrics['grad_norm'], metrics_ref['grad_norm'], rtol=1e-5)
  _assert_trees_close(grads, grads_ref, 1e-5)
  assert float(jnp.abs(grads['head'][...]).max()) > 0  # the head's gradient is among them
  # AdamW's first update is about lr x sign(g): where a gradient entry is near zero its rounding
  # moves the update by up to 2 lr, so the parameters are held to a small part of one step.
  lr = float(metrics['lr'])
  leaves, leaves_ref = jax.tree.leaves(state['params']), jax.tree.leaves(state_ref['params'])
  for a, b in zip(leaves, leaves_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0.02 * lr)
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(leaves_ref, jax.tree.leaves(params0)))
  assert moved > 0.5 * lr  # the step did move them
