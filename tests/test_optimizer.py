"""The fused AdamW (one pass per parameter, ops/adamw_kernel.py) equals the optax chain."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from deepseek41.ops.adamw_kernel import Hyper, adamw_leaf, adamw_leaf_reference, block_size, step_scalars
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.config import resolve
from deepseek41.train.optimizer import (FusedAdamW, apply_gradients, fused_optimizer, make_optimizer,
                                        reference_optimizer)
from tests.test_multimodal_model import VISION
from tests.util import h100_class_gpu_for_lowering, resolved, small_config


def _random_like(tree, seed, scale):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([scale * jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])


@pytest.mark.parametrize('clip', [1e-3, 1e3])   # clipping on / off
def test_fused_equals_chain(clip):
  # Engram and vision multipliers, decay on matrices only, clipping: every branch of the chain.
  cfg = resolved(**{'train.grad_clip_norm': clip, 'train.vision_lr_multiplier': 0.3,
                    'train.engram_table_lr_multiplier': 5.0, 'train.warmup_steps': 2,
                    'model.engram': True, **VISION})
  ref = reference_optimizer(cfg.train)
  fused = fused_optimizer(cfg.train)
  state, _ = state_lib.init_state(cfg, ref, make_mesh(cfg.mesh, jax.devices()[:1]),
                                  cfg.mesh.rules)
  params = state['params']
  big = [x.size for x in jax.tree.leaves(params) if block_size(x.size)]
  assert big and len(big) < len(jax.tree.leaves(params))   # both the kernel and the jnp leaves
  p_ref, s_ref = params, ref.init(params)
  p_fus, s_fus = params, fused.init(params)
  step_ref = jax.jit(lambda g, s, p: apply_gradients(ref, g, s, p))
  step_fus = jax.jit(lambda g, s, p: apply_gradients(fused, g, s, p))
  for i in range(3):
    grads = _random_like(params, i, 0.01)
    p_ref, s_ref = step_ref(grads, s_ref, p_ref)
    p_fus, s_fus = step_fus(grads, s_fus, p_fus)
  assert jax.tree.structure(s_ref) == jax.tree.structure(s_fus)
  for a, b in zip(jax.tree.leaves((p_ref, s_ref)), jax.tree.leaves((p_fus, s_fus))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-9)
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
           for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(params))]
  assert min(moved) > 0


@pytest.mark.parametrize('h', [Hyper(0.9, 0.95, 1e-8, 1.0, 0.1, 5.0),
                               Hyper(0.8, 0.99, 1e-6, 0.0, 0.0, 1.0)])
def test_kernel_equals_reference(h):
  # Several blocks, and a clipped step (norm 3 > 1) when clipping is on.
  shape = (3, 2048)
  g, p, mu, nu = [jax.random.normal(jax.random.key(i), shape) for i in range(4)]
  nu = jnp.abs(nu)
  s = step_scalars(None if h.clip_norm == 0 else jnp.float32(3.0), 0.19, 0.0975, -1e-3)
  want = adamw_leaf_reference(g, p, mu, nu, s, h)
  got = adamw_leaf(g, p, mu, nu, s, h, interpret=True)
  for a, b in zip(want, got):   # inputs of order 1: within an ulp of them where p + u cancels
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=6e-8)


def test_block_size():
  assert block_size(1024) == 1024 and block_size(3 * 8192) == 8192 and block_size(6144) == 2048
  assert block_size(1000) == 0 and block_size(16) == 0
  with pytest.raises(ValueError, match='not a multiple of 1024'):
    adamw_leaf(*[jnp.ones(10)] * 4, step_scalars(None, 1.0, 1.0, -1.0),
               Hyper(0.9, 0.95, 1e-8, 0.0, 0.0, 1.0), interpret=True)


def test_config_choice():
  assert resolved().train.optimizer_impl == 'optax'   # auto: the kernel only on the GPU
  gpu = resolve(small_config(), num_devices=1, backend='gpu').train
  assert gpu.optimizer_impl == 'fused' and isinstance(make_optimizer(gpu), FusedAdamW)
  assert not isinstance(make_optimizer(resolved().train), FusedAdamW)


def test_kernel_lowers_for_triton():
  with h100_class_gpu_for_lowering():
    x = jax.ShapeDtypeStruct((64, 1024, 384), jnp.float32)
    s = jax.ShapeDtypeStruct((8,), jnp.float32)
    h = Hyper(0.9, 0.95, 1e-8, 1.0, 0.1, 1.0)
    text = jax.jit(lambda *a: adamw_leaf(*a, h=h)).trace(x, x, x, x, s).lower(
        lowering_platforms=('cuda',)).as_text()
    assert 'triton' in text and 'adamw_step' in text
