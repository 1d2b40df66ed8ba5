"""Router and correction-bias behaviour (docs/architecture.md section 3.11)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepseek41.model.moe import (MoE, expert_load, route, router_scores,
                                  sequence_balance_loss, update_router_bias)
from deepseek41.model.params import RouterBias
from deepseek41.ops.expert_gemm import expert_ffn
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import make_train_step
from tests.helpers import packed_batch, resolved


def test_selection_uses_bias_but_weights_do_not():
  scores = jnp.array([[[0.9, 0.5, 0.4, 0.1]]], jnp.float32)
  bias = jnp.array([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
  idx, w = route(scores, bias, jnp.zeros((1, 1), jnp.int32), k=2, route_scale=1.5)
  assert set(np.asarray(idx)[0, 0]) == {0, 3}           # expert 3 selected through its bias
  np.testing.assert_allclose(np.asarray(w)[0, 0].sum(), 1.5, rtol=1e-6)
  order = list(np.asarray(idx)[0, 0])
  expected = np.array([0.9, 0.1]) / 1.0 * 1.5
  np.testing.assert_allclose(np.asarray(w)[0, 0][[order.index(0), order.index(3)]], expected,
                             rtol=1e-6)
  # the image row of the bias applies to modality-1 tokens only
  idx_img, _ = route(scores, bias, jnp.ones((1, 1), jnp.int32), k=2, route_scale=1.5)
  assert set(np.asarray(idx_img)[0, 0]) == {0, 1}


def test_router_scores_are_sqrt_softplus_in_fp32():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (8, 4), jnp.float32)
  s = router_scores(x, w)
  assert s.dtype == jnp.float32
  expected = np.sqrt(np.log1p(np.exp(np.asarray(x, np.float32) @ np.asarray(w))))
  np.testing.assert_allclose(s, expected, rtol=1e-5)


def test_sign_rule_moves_only_the_imbalanced_modality_toward_balance():
  load = jnp.array([[5.0, 5.0, 5.0, 5.0],      # text: balanced
                    [17.0, 1.0, 1.0, 1.0]])    # image: expert 0 overloaded
  bias = jnp.zeros((2, 4))
  new = np.asarray(update_router_bias(bias, load, 0.01))
  np.testing.assert_array_equal(new[0], 0.0)
  assert new[1, 0] < 0 and (new[1, 1:] > 0).all()


def test_expert_load_counts_real_tokens_by_modality():
  idx = jnp.array([[[0, 1], [1, 2], [3, 0]]])
  modality = jnp.array([[0, 1, 1]])
  valid = jnp.array([[1, 1, 0]])
  load = np.asarray(expert_load(idx, modality, valid, 4))
  np.testing.assert_array_equal(load, [[1, 1, 0, 0], [0, 1, 1, 0]])


def test_balance_loss_is_one_when_uniform():
  e, k = 4, 2
  scores = jnp.ones((1, 4, e))
  idx = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  loss = sequence_balance_loss(scores, idx, jnp.ones((1, 4)), k)
  np.testing.assert_allclose(loss, 1.0, rtol=1e-6)  # sum_e f_e P_e = sum 1 * 1/E * ... = 1


def _bias_after_steps(batch, steps, **overrides):
  cfg = resolved(**{'train.lr': 1e-9, **overrides})
  tx = make_optimizer(cfg.train)
  md = state_lib.model_def(cfg, tx)
  from deepseek41.sharding import make_mesh
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  step = jax.jit(make_train_step(cfg, md))
  biases, metrics = [], []
  for _ in range(steps):
    biases.append(jax.tree.leaves(state['router_bias']))
    state, m = step(state, batch)
    metrics.append(m)
  biases.append(jax.tree.leaves(state['router_bias']))
  return state, biases, metrics


def test_biases_follow_their_modality_and_the_optimizer_ignores_them():
  batch = packed_batch(seed=0, image_rows=(2, 5))
  # image tokens all the same id: every image token picks the same experts (worst imbalance)
  batch['tokens'][batch['modality'] == 1] = 11
  state, biases, metrics = _bias_after_steps(batch, 12)
  # the router bias is state, not a parameter: the optimizer state has no copy of it
  assert not any(isinstance(v, RouterBias) for v in jax.tree.leaves(
      state['opt'], is_leaf=lambda x: isinstance(x, nnx.Variable)))
  first, last = biases[0], biases[-1]
  for layer, (b0, b1) in enumerate(zip(first, last)):
    moved = np.abs(np.asarray(b1) - np.asarray(b0))
    assert moved[0].max() > 0 and moved[1].max() > 0
  # the image imbalance (max/mean load) falls as its bias steers selection
  def imbalance(m):
    load = np.asarray(m['load_lme'])[:, 1]
    return (load.max(-1) / load.mean(-1)).mean()
  assert imbalance(metrics[-1]) < imbalance(metrics[0])


def test_absent_modality_bias_stays_put_and_rate_zero_freezes_biases():
  batch = packed_batch(seed=1)  # text only
  _, biases, _ = _bias_after_steps(batch, 2)
  for b0, b1 in zip(biases[0], biases[-1]):
    np.testing.assert_array_equal(np.asarray(b1)[1], np.asarray(b0)[1])
    assert np.abs(np.asarray(b1)[0] - np.asarray(b0)[0]).max() > 0
  state, biases, _ = _bias_after_steps(batch, 2, **{'model.router_bias_rate': 0.0,
                                                     'train.lr': 1e-2})
  for b0, b1 in zip(biases[0], biases[-1]):
    np.testing.assert_array_equal(np.asarray(b1), np.asarray(b0))


def test_shared_experts_compute_what_a_routed_expert_computes_in_bf16():
  """One clipped SwiGLU for every expert: the shared expert equals a routed expert (reference
  backend, weight 1) holding the same weights, bit for bit in bf16 (the activation in fp32)."""
  cfg = resolved(**{'model.compute_dtype': 'bfloat16', 'model.swiglu_limit': 0.5}).model
  moe = MoE(cfg, nnx.Rngs(0))
  for w in (moe.shared_gate, moe.shared_up, moe.shared_down):
    w[...] = w[...] * 40.0   # pre-activations well past the clamp and in silu's curved part
  x = jax.random.normal(jax.random.key(1), (2, 24, cfg.d_model), jnp.bfloat16)
  got = moe.shared_experts(x)
  n = x.shape[0] * x.shape[1]
  want, _ = expert_ffn(x.reshape(n, -1), jnp.zeros((n, 1), jnp.int32), jnp.ones((n, 1)),
                       jnp.ones(n, bool), moe.shared_gate[...][None], moe.shared_up[...][None],
                       moe.shared_down[...][None], swiglu_limit=cfg.swiglu_limit,
                       backend='reference')
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want.reshape(got.shape), np.float32))


def test_decode_sized_grouped_calls_lay_out_small_tiles():
  """model.moe_small_call_block_m: a grouped-backend call of fewer than 128 tokens lays each
  expert's rows out in tiles of that many rows (fewer padded rows in every kernel), with the
  same output as the training's tiles; larger calls and 0 keep those."""
  from deepseek41.model.moe import SMALL_CALL_TOKENS
  from deepseek41.ops.gpu.grouped_gemm import default_tiles
  from deepseek41.ops.grouped_gemm import padded_rows
  from tests.helpers import jaxpr_eqns

  def moe_for(block_m):
    cfg = resolved(**{'model.moe_backend': 'grouped', 'model.moe_small_call_block_m': block_m,
                      'model.moe_gather_small_calls': False}).model
    return MoE(cfg, nnx.Rngs(0))
  small, off = moe_for(16), moe_for(0)
  base = default_tiles(small.cfg.grouped_wgrad)
  assert base.block_m > 16
  assert small.grouped_tiles(SMALL_CALL_TOKENS - 1).block_m == 16
  assert small.grouped_tiles(SMALL_CALL_TOKENS) == base
  assert off.grouped_tiles(1) == base
  x = jax.random.normal(jax.random.key(3), (2, 5, small.cfg.d_model), jnp.float32)
  modality, valid = jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), bool).at[1, 4].set(False)
  y_small, y_off = small(x, modality, valid)[0], off(x, modality, valid)[0]
  np.testing.assert_allclose(np.asarray(y_small), np.asarray(y_off), rtol=1e-5, atol=1e-6)

  def layout_rows(moe, tiles):  # the call's expert-sorted layout: 20 assignments, 8 experts
    block_m = tiles.block_m
    rows = padded_rows(10 * moe.cfg.num_experts_per_tok, moe.cfg.n_routed_experts, block_m)
    jaxpr = jax.make_jaxpr(lambda x: moe(x, modality, valid)[0])(x)
    return rows, {v.aval.shape[0] for e in jaxpr_eqns(jaxpr.jaxpr) for v in e.outvars
                  if getattr(v.aval, 'shape', ())}
  rows_small, shapes_small = layout_rows(small, small.grouped_tiles(10))
  rows_base, shapes_off = layout_rows(off, base)
  assert rows_small < rows_base
  assert rows_small in shapes_small and rows_base not in shapes_small
  assert rows_base in shapes_off
