"""Train-step options: gradient accumulation and block remat leave the update unchanged."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.transformer import Transformer
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import accumulate_gradients, make_train_step
from tests.helpers import jaxpr_eqns, packed_batch, resolved


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
                                       {'train.remat': 'block'},
                                       {'train.remat': 'block', 'train.remat_layers': 1}])
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


def test_block_remat_with_csa2_same_update_without_reselecting():
  """With CSA2 on, block remat gives the same update (the indexer's distillation included) and
  saves each index source's selection: its backward reruns no selection top-k, only the MoE
  routing's (the recomputed layers' own top-k)."""
  grads_none, _, metrics_none = _one_step(**{'model.attention_variant': 'csa2'})
  grads, _, metrics = _one_step(**{'model.attention_variant': 'csa2', 'train.remat': 'block'})
  np.testing.assert_allclose(metrics['loss'], metrics_none['loss'], rtol=1e-6)
  assert float(metrics['indexer_loss']) > 0
  np.testing.assert_allclose(metrics['indexer_loss'], metrics_none['indexer_loss'], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_none)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)

  def top_ks(jaxpr):  # (MoE routing, others) top_k eqns
    stacks = [str(e.source_info.name_stack) for e in jaxpr_eqns(jaxpr)
              if e.primitive.name == 'top_k']
    moe = sum('moe' in st for st in stacks)
    return moe, len(stacks) - moe

  cfg = resolved(**{'model.attention_variant': 'csa2'}).model
  batch = {k: jnp.asarray(v)[:2] for k, v in packed_batch(seed=5).items()}
  counts = {}
  for remat in ('none', 'block'):
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(params=0), remat=remat))

    def loss(params, graphdef=graphdef):
      logits, aux = nnx.merge(graphdef, params)(batch)
      return jnp.mean(logits) + aux['indexer_loss']
    counts[remat] = top_ks(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  (moe_none, sel_none), (moe_block, sel_block) = counts['none'], counts['block']
  assert sel_none > 0 and sel_block == sel_none, counts
  assert moe_block == 2 * moe_none, counts  # the routing is recomputed: the check sees remat


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


def _pallas_calls(jaxpr):
  """{kernel name: pallas_call eqns}."""
  return collections.Counter(e.params['name'] for e in jaxpr_eqns(jaxpr)
                             if e.primitive.name == 'pallas_call')


def test_block_keep_attention_runs_no_forward_kernel_again():
  """With the GPU attention kernels (interpreted on the CPU), remat=block_keep_attention gives
  the update of no remat, and its backward runs none of the forward kernels again (window,
  sparse, selected scores), where plain block remat runs each once more."""
  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.num_heads': 16, 'model.o_groups': 2,
                    'model.index_n_heads': 16, 'model.index_head_dim': 16,
                    'model.sparse_chunk': 16}).model
  # The config takes these kernels on the GPU only; on the CPU they run interpreted.
  cfg = dataclasses.replace(cfg, sparse_impl='fused', attention_impl='fused',
                            selected_scores_impl='fused')
  batch = {k: jnp.asarray(v)[:2] for k, v in packed_batch(seed=5, docs_per_row=2).items()}
  counts, grads = {}, {}
  for remat in ('none', 'block', 'block_keep_attention'):
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(params=0), remat=remat))

    def loss(params, graphdef=graphdef):
      logits, aux = nnx.merge(graphdef, params)(batch)
      return jnp.mean(logits) + aux['indexer_loss']
    counts[remat] = _pallas_calls(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    grads[remat] = jax.jit(jax.grad(loss))(params)
  forward = ('swa_window_fwd', 'csa2_sparse_fwd', 'csa2_selected_scores')
  assert all(counts['none'].get(k, 0) > 0 for k in forward), counts
  for k in forward:
    assert counts['block_keep_attention'][k] == counts['none'][k], (k, counts)
    assert counts['block'][k] == 2 * counts['none'][k], (k, counts)
  for a, b in zip(jax.tree.leaves(grads['block_keep_attention']), jax.tree.leaves(grads['none'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
