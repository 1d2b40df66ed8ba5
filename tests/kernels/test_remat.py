"""Block remat over the whole model with CSA2 and the attention kernels (interpreted on the
CPU): the update of no remat, the selection saved rather than recomputed, and with
`block_keep_attention` no forward kernel run again in the backward."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepseek41.model.transformer import Transformer
from tests.helpers import jaxpr_eqns, one_train_step, packed_batch, resolved


def test_block_remat_with_csa2_same_update_without_reselecting():
  """With CSA2 on, block remat gives the same update (the indexer's distillation included) and
  saves each index source's selection: its backward reruns no selection top-k, only the MoE
  routing's (the recomputed layers' own top-k)."""
  grads_none, _, metrics_none = one_train_step(**{'model.attention_variant': 'csa2'})
  grads, _, metrics = one_train_step(**{'model.attention_variant': 'csa2', 'train.remat': 'block'})
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
    traced = jax.jit(jax.grad(loss)).trace(params)  # traced once: counted, then run
    counts[remat] = _pallas_calls(traced.jaxpr.jaxpr)
    if remat != 'block':  # plain block remat is only counted
      grads[remat] = traced.lower().compile()(params)
  forward = ('swa_window_fwd', 'csa2_sparse_fwd', 'csa2_selected_scores')
  assert all(counts['none'].get(k, 0) > 0 for k in forward), counts
  for k in forward:
    assert counts['block_keep_attention'][k] == counts['none'][k], (k, counts)
    assert counts['block'][k] == 2 * counts['none'][k], (k, counts)
  for a, b in zip(jax.tree.leaves(grads['block_keep_attention']), jax.tree.leaves(grads['none'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
