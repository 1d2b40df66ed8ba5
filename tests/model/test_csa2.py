"""CSA2 in the model: roles, selection invariants, causality, reference vs scalable paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.config import FULL, REINDEX, REUSE, layer_roles
from deepseek41.model.compressor import document_first_entry_bt, visible_btn
from deepseek41.model.indexer import pool_entry_mask
from deepseek41.model.shared import Shared
from deepseek41.ops.sparse_attention import selection_mask
from deepseek41.model.transformer import Transformer
from tests.helpers import CSA2_SMALL as CSA2
from tests.helpers import aligned_batch, resolved, token_ce

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)


def _model(**overrides):
  cfg = resolved(**{**CSA2, **overrides})
  return Transformer(cfg.model, nnx.Rngs(params=0)), cfg


def _walk(model, batch):
  """Run the blocks as Transformer does, recording `shared` after each layer."""
  x, pre = model.residual_input(batch)
  batch = model.with_engram_rows(batch)
  shared, trail = Shared(), []
  for block in model.blocks:
    x, pre, _, shared = block(x, pre, batch, shared)
    trail.append(shared)
  return trail


def _published(shared: Shared) -> set[str]:
  """What `shared` holds, by kind and layer: {'kv1', 'sel1', 'pool2', ...}."""
  return ({f'kv{l}' for l in shared.kv} | {f'sel{l}' for l in shared.selections} |
          {f'pool{l}' for l in shared.pools} | {f'sinks{l}' for l in shared.sinks})


_token_ce = nnx.jit(token_ce)


def test_roles_publish_and_reuse_exactly_what_they_should():
  model, cfg = _model()
  batch = {k: jnp.asarray(v) for k, v in aligned_batch(0).items()}
  trail = _walk(model, batch)
  roles = layer_roles(cfg.model)
  assert [r.mode for r in roles] == ['SWA', FULL, FULL, REINDEX]
  for role, shared in zip(roles, trail):
    new = _published(shared) - (_published(trail[role.layer - 1]) if role.layer else set())
    # accumulated from the first source
    assert (shared.indexer_totals is not None) == (role.layer >= 1)
    expected = set()
    if role.mode == FULL:
      expected |= {f'kv{role.layer}', f'sel{role.layer}'}
    if role.mode == REINDEX:
      expected |= {f'sel{role.layer}'}
    if role.publishes_candidates:
      expected |= {f'pool{role.layer}'}
    assert new == expected, (role, new)
    assert not (role.mode == REUSE and new)

  # selections are visible entries; top-k and the candidate restriction are active at T=48
  final = trail[-1]
  comp, _ = final.kv[2]
  vis = np.asarray(visible_btn(batch['segment_ids'], comp))
  for layer in (2, 3):
    idx, valid = final.selections[layer]
    sel = np.asarray(selection_mask(idx, valid, comp.num_entries))
    assert not (sel & ~vis).any()
    assert (sel.sum(-1) == np.minimum(vis.sum(-1), cfg.model.index_topk)).all()
    assert (vis.sum(-1) > cfg.model.index_topk).any()
  blk_idx, blk_valid = final.pools[2]
  first = document_first_entry_bt(batch['segment_ids'], comp)
  pool = np.asarray(pool_entry_mask(blk_idx, blk_valid, first, cfg.model.candidate_block_size,
                                    comp.num_entries))
  idx3, valid3 = final.selections[3]
  sel3 = np.asarray(selection_mask(idx3, valid3, comp.num_entries))
  assert not (sel3 & ~pool).any()                       # Reindex stays inside the pool
  assert ((vis & ~pool).sum(-1) > 0).any()              # and the pool really restricts
  newest = np.where(vis.any(-1), vis.shape[-1] - 1 - np.argmax(vis[..., ::-1], -1), -1)
  b_idx, t_idx = np.nonzero(newest >= 0)
  assert pool[b_idx, t_idx, newest[b_idx, t_idx]].all()  # the newest entry's block is kept


def test_top_k_covering_everything_selects_exactly_the_visible_entries():
  model, cfg = _model(**{'model.index_topk': 64, 'model.candidate_topk_blocks': 16})
  batch = {k: jnp.asarray(v) for k, v in aligned_batch(1).items()}
  final = _walk(model, batch)[-1]
  for layer, src in ((1, 1), (2, 2), (3, 2)):
    comp, _ = final.kv[src]
    vis = np.asarray(visible_btn(batch['segment_ids'], comp))
    idx, valid = final.selections[layer]
    np.testing.assert_array_equal(np.asarray(selection_mask(idx, valid, comp.num_entries)), vis)


@pytest.fixture(scope='module')
def csa2_model():
  return _model()[0]


def test_causality_and_document_isolation(csa2_model):
  batch = aligned_batch(2)
  base = np.asarray(_token_ce(csa2_model, batch))
  rng = np.random.default_rng(3)
  for t_change in (9, 30):
    pert = {k: v.copy() for k, v in batch.items()}
    pert['tokens'][:, t_change:] = rng.integers(3, 96, pert['tokens'][:, t_change:].shape)
    out = np.asarray(_token_ce(csa2_model, pert))
    np.testing.assert_array_equal(out[:, :t_change], base[:, :t_change])
  seg = batch['segment_ids']
  pert = {k: v.copy() for k, v in batch.items()}
  pert['tokens'][seg == 1] = rng.integers(3, 96, (seg == 1).sum())
  out = np.asarray(_token_ce(csa2_model, pert))
  np.testing.assert_array_equal(out[seg == 2], base[seg == 2])


def test_the_compressed_branch_changes_the_model(csa2_model):
  batch = aligned_batch(4)
  off, _ = _model(**{'model.attention_variant': 'window'})
  assert np.abs(np.asarray(_token_ce(csa2_model, batch)) -
                np.asarray(_token_ce(off, batch))).max() > 1e-4


@pytest.mark.parametrize('overrides', [{'model.sparse_impl': 'reference',
                                        'model.index_topk_block': 0},
                                       {'model.sparse_chunk': 5},
                                       {'model.index_causal_groups': 1}])
def test_scalable_path_equals_reference(csa2_model, overrides):
  batch = aligned_batch(5)

  def loss_and_grads(model):
    def loss(m):
      return jnp.sum(token_ce(m, batch)) / batch['loss_mask'].sum()
    return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)
  l_ref, g_ref = loss_and_grads(_model(**overrides)[0])
  l, g = loss_and_grads(csa2_model)
  np.testing.assert_allclose(l, l_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _split_grads(overrides, term):
  """Gradients of one objective term, split into indexer weights and everything else."""
  model, cfg = _model(**overrides)
  batch = aligned_batch(6)

  def loss(m):
    logits, aux = m(batch)
    if term == 'indexer':
      return aux['indexer_loss']
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch['targets'][..., None], -1)
    return jnp.sum(ce[..., 0] * batch['loss_mask'])
  grads = nnx.jit(lambda m: nnx.grad(loss)(m))(model)
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(grads, nnx.Param))[0]
  indexer, rest = {}, {}
  for path, g in flat:
    name = jax.tree_util.keystr(path)
    (indexer if ('index_query' in name or 'index_keys' in name) else rest)[name] = np.asarray(g)
  return indexer, rest


def test_indexer_and_backbone_gradients_are_isolated():
  indexer, rest = _split_grads({}, 'indexer')
  assert indexer and all(np.isfinite(g).all() for g in indexer.values())
  assert any(np.abs(g).max() > 0 for g in indexer.values())
  assert all(np.abs(g).max() == 0 for g in rest.values())      # nothing reaches the backbone
  indexer, rest = _split_grads({}, 'lm')
  assert all(np.abs(g).max() == 0 for g in indexer.values())   # top-k stops the LM loss
  assert any(np.abs(g).max() > 0 for g in rest.values())


