"""The threshold top-k kernel (Pallas interpreter on the CPU) picks exactly `jax.lax.top_k`'s set.

Expected sets come from numpy stable argsorts (ties: lowest index; -0.0 < +0.0 as top_k orders
floats) and from `jax.lax.top_k` itself; the indexer's selection functions give the same sets
with select_impl 'threshold' as with 'top_k'.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.model.indexer import (block_scores, candidate_blocks, newest_visible_bt,
                                      select_topk, select_topk_blocked)
from deepseek41.ops.gpu.topk_select import topk_threshold
from deepseek41.ops.sparse_attention import selection_mask
from deepseek41.ops.topk_select import topk_threshold_reference
from tests.helpers import entry_layout, first_visible

SPECIALS = np.array([-np.inf, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 1.5, 3e38, np.inf],
                    np.float32)


def np_top_sets(key_rl, k):
  """Per row: the sorted indices of the k best keys > -inf (total float order, lowest index)."""
  out = []
  for row in key_rl:
    # total order: -0.0 below +0.0 (the int image of the bits, as top_k compares them)
    bits = row.view(np.int32).astype(np.int64)
    image = np.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)
    order = np.argsort(-image, kind='stable')
    out.append(sorted(int(j) for j in [j for j in order if row[j] > -np.inf][:k]))
  return out


def check_slots(idx, valid, want_sets, k):
  """Ascending valid slots first, exactly the expected set; invalid slots idx 0."""
  idx, valid = np.asarray(idx), np.asarray(valid)
  assert idx.dtype == np.int32 and valid.dtype == bool and idx.shape[-1] == k
  for i_row, v_row, want in zip(idx.reshape(-1, k), valid.reshape(-1, k), want_sets):
    np.testing.assert_array_equal(v_row, np.arange(k) < len(want))
    assert list(i_row[v_row]) == want
    assert not i_row[~v_row].any()


def keys(kind, r, l, seed):
  rng = np.random.default_rng(seed)
  if kind == 'normal':
    x = rng.standard_normal((r, l)).astype(np.float32)
  elif kind == 'ties':  # few distinct values: long runs of equal keys straddle the threshold
    x = rng.integers(-2, 3, (r, l)).astype(np.float32)
    x[rng.random((r, l)) < 0.3] = -0.0
  else:  # 'specials': both zeros, denormals, extremes, infinities (the sign-flip mapping)
    x = SPECIALS[rng.integers(0, len(SPECIALS), (r, l))]
  x[0] = -np.inf                                    # a row with nothing eligible
  x[1, rng.random(l) < 0.95] = -np.inf              # a row with (mostly) fewer than k eligible
  return x


@pytest.mark.parametrize('kind', ['normal', 'ties', 'specials'])
@pytest.mark.parametrize('l,k,block_rows', [(512, 32, None), (300, 17, None), (100, 7, 4),
                                            (20, 32, None), (64, 1, 2)])
def test_kernel_equals_top_k(kind, l, k, block_rows):
  x = keys(kind, 6, l, seed=l + k)
  want = np_top_sets(x, k)
  ref = topk_threshold_reference(jnp.asarray(x), k)
  got = topk_threshold(jnp.asarray(x), k, block_rows=block_rows, interpret=True)
  check_slots(*ref, want, k)
  check_slots(*got, want, k)
  for g, r in zip(got, ref):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  # and top_k's own set, row by row (k <= l)
  if k <= l:
    vals, idx = jax.lax.top_k(jnp.asarray(x), k)
    for row_v, row_i, want_row in zip(np.asarray(vals), np.asarray(idx), want):
      assert sorted(row_i[row_v > -np.inf].tolist()) == want_row


def test_kernel_ties_straddling_the_threshold():
  """The k-th key has equal copies before and after the cut: the lowest indices win."""
  x = np.full((3, 16), -np.inf, np.float32)
  x[0] = [1, 5, 3, 3, 5, 3, 0, 3, 3, -0.0, 3, 5, 2, 3, 0, 3]
  x[1] = [0.0, -0.0] * 8              # 8 of +0.0 above 8 of -0.0
  x[2, :5] = [2, -1, 2, -1, 2]
  got = topk_threshold(jnp.asarray(x), 6, interpret=True)
  check_slots(*got, [[1, 2, 3, 4, 5, 11], [0, 2, 4, 6, 8, 10], [0, 1, 2, 3, 4]], 6)
  got = topk_threshold(jnp.asarray(x), 9, interpret=True)
  check_slots(*got, [[1, 2, 3, 4, 5, 7, 8, 10, 11], [0, 1, 2, 4, 6, 8, 10, 12, 14],
                     [0, 1, 2, 3, 4]], 9)


def test_kernel_leading_dims_and_jit():
  x = keys('ties', 6, 40, seed=9).reshape(2, 3, 40)
  got = jax.jit(lambda a: topk_threshold(a, 5, interpret=True))(jnp.asarray(x))
  assert got[0].shape == (2, 3, 5)
  check_slots(*got, np_top_sets(x.reshape(6, 40), 5), 5)


# ---------------------------------------------------------------------------------------------
# The indexer's selection functions: the same sets with either select_impl


def same_selection(a, b, n):
  """Same valid count per row and the same selected set; 'threshold' slots ascending."""
  (ia, va), (ib, vb) = a, b
  np.testing.assert_array_equal(np.asarray(va).sum(-1), np.asarray(vb).sum(-1))
  np.testing.assert_array_equal(np.asarray(selection_mask(ia, va, n)),
                                np.asarray(selection_mask(ib, vb, n)))
  ib, vb = np.asarray(ib), np.asarray(vb)
  assert np.all(np.diff(ib, axis=-1)[vb[..., 1:]] > 0)   # valid slots (all first) ascending
  assert not ib[~vb].any()


def tie_scores(vis, rng, trial):
  if trial % 2:
    return rng.standard_normal(vis.shape).astype(np.float32)
  scores = rng.integers(-2, 3, vis.shape).astype(np.float32)  # heavy ties
  scores[rng.random(vis.shape) < 0.3] = -0.0                    # both zeros (ranked equal)
  return scores


@pytest.mark.parametrize('ratio', [1, 2])
def test_indexer_selection_threshold_equals_top_k(ratio):
  rng = np.random.default_rng(11)
  _, _, _, vis = entry_layout(ratio)
  n = vis.shape[-1]
  for trial in range(2):
    scores = jnp.asarray(tie_scores(vis, rng, trial))
    allowed = jnp.asarray(rng.random(vis.shape) < 0.6)
    for k in (4, n + 3):
      for al in (None, allowed):
        same_selection(select_topk(scores, vis, k, al),
                       select_topk(scores, vis, k, al, select_impl='threshold'), n)
    for k, block in ((2, 2), (3, 4), (5, 3), (1, 7)):
      assert k * block < n  # the two-stage path, not the one-pass fallback
      want = select_topk_blocked(scores, vis, k, block, allowed)
      got = select_topk_blocked(scores, vis, k, block, allowed, select_impl='threshold')
      same_selection(want, got, n)
      same_selection(select_topk(scores, vis, k, allowed), got, n)


@pytest.mark.parametrize('bs,topk_blocks', [(4, 3), (3, 20)])
def test_candidate_blocks_threshold_equals_top_k(bs, topk_blocks):
  rng = np.random.default_rng(12)
  _, _, _, vis = entry_layout(2)
  m = -(-vis.shape[-1] // bs)
  for trial in range(2):
    scores = tie_scores(vis, rng, trial)
    scores[..., 5] = 10.0  # beats every block, invisible to the early queries
    first = first_visible(vis)
    blocks = block_scores(jnp.asarray(scores), jnp.asarray(vis), first, bs)
    newest = newest_visible_bt(jnp.asarray(vis))
    want = candidate_blocks(blocks, newest, first, bs, topk_blocks)
    got = candidate_blocks(blocks, newest, first, bs, topk_blocks, select_impl='threshold')
    same_selection(want, got, m)
    # the forced block (the newest visible entry's) is in, also when it scores lowest
    newest, first = np.asarray(newest), np.asarray(first)
    kept = np.asarray(selection_mask(*got, m))
    has = newest >= 0
    forced = np.where(has, (newest - first) // bs, 0)
    assert np.take_along_axis(kept, forced[..., None], -1)[..., 0][has].all()


def test_select_chunked_threshold_equals_top_k():
  """csa2.select_chunked threads select_impl through both stages and the candidate pool."""
  from flax import nnx

  from deepseek41.model.compressor import Compressor
  from deepseek41.model.csa2 import select_chunked
  from deepseek41.model.indexer import IndexKeys, IndexQuery
  from tests.helpers import packed_layout, resolved

  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.index_n_heads': 2,
                    'model.index_head_dim': 16}).model
  b, t = 2, 48
  seg, pos = packed_layout([[20, 28], [10, 14, 24]], t)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), jnp.float32)
  q_r = jnp.asarray(rng.standard_normal((b, t, cfg.q_lora_rank)), jnp.float32)
  comp = Compressor(cfg, 2, nnx.Rngs(0))(x, seg, pos)
  k = IndexKeys(cfg, 16, nnx.Rngs(1))(comp.latent_bnd, comp.pos_bn)
  q, w = IndexQuery(cfg, 2, 16, nnx.Rngs(2))(q_r, x, pos)
  n, kw = k.shape[1], dict(topk=4, chunk=16, block_size=4, topk_block=2)
  want = select_chunked(q, w, k, seg, comp, publish_blocks=3, **kw)
  got = select_chunked(q, w, k, seg, comp, publish_blocks=3, select_impl='threshold', **kw)
  same_selection(want[:2], got[:2], n)
  same_selection(want[2], got[2], -(-n // 4))
  want_r = select_chunked(q, w, k, seg, comp, pool=want[2], **kw)
  got_r = select_chunked(q, w, k, seg, comp, pool=got[2], select_impl='threshold', **kw)
  same_selection(want_r[:2], got_r[:2], n)


def test_gradient_through_the_selection_is_the_same():
  """No gradient flows through the choice; the gathered scores' gradient matches top_k's."""
  rng = np.random.default_rng(5)
  _, _, _, vis = entry_layout(1)
  scores = jnp.asarray(rng.standard_normal(vis.shape), jnp.float32)

  def loss(s, impl):
    idx, valid = select_topk(s, vis, 6, select_impl=impl)
    picked = jnp.take_along_axis(s, idx, axis=-1)
    return jnp.sum(jnp.where(valid, picked ** 2, 0.0))
  g_top = jax.grad(loss)(scores, 'top_k')
  g_thr = jax.grad(loss)(scores, 'threshold')
  np.testing.assert_allclose(np.asarray(g_thr), np.asarray(g_top), rtol=1e-6)
  assert np.count_nonzero(np.asarray(g_thr)) > 0


def test_rows_too_long_for_the_kernel():
  """Past MAX_L the kernel refuses and the indexer's 'threshold' path uses the reference."""
  from deepseek41.ops.gpu.topk_select import MAX_L
  x = keys('ties', 2, MAX_L + 5, seed=2)
  with pytest.raises(ValueError, match='on chip'):
    topk_threshold(jnp.asarray(x), 8, interpret=True)
  vis = np.ones((1,) + x.shape, bool)
  same_selection(select_topk(jnp.asarray(x[None]), vis, 8),
                 select_topk(jnp.asarray(x[None]), vis, 8, select_impl='threshold'), x.shape[-1])
