"""CSA2 lightning indexer (ARCHITECTURE.md section 3.7): scores, top-k, candidate pool, KL, recall.

Expected values come from numpy loops and stable argsorts written here (ties: lowest index).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.compressor import (CompressedKV, Compressor, group_layout,
                                         newest_visible_entry_bt, visible_btn)
from deepseek41.model.indexer import (IndexKeys, IndexQuery, block_scores, blocks_to_entries,
                                      select_topk_blocked,
                                      candidate_blocks, candidate_pool, index_scores,
                                      indexer_kl_loss, newest_visible_bt, recall_at_k,
                                      select_topk, topk_mask)
from deepseek41.model.rope import rope_for_role
from tests.util import np_rope, packed_layout, resolved

B, T, D, DH, DI, HI, QL = 2, 48, 32, 16, 8, 2, 16
EPS = 1e-6


def model_cfg():
  return resolved(**{'model.rope_head_dim': 4, 'model.rms_norm_eps': EPS}).model


def packed(doc_lengths, t=T):
  return packed_layout(doc_lengths, t)


DOCS = ((20, 7, 16), (30, 13))   # misaligned documents and padding in both rows


def layout(ratio, docs=DOCS, t=T):
  seg, pos = packed(docs, t)
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, ratio)
  comp = CompressedKV(latent_bnd=None, kv_bnd=None, pos_bn=pos_bn, seg_bn=seg_bn,
                      last_bn=last_bn, ratio=ratio)
  return seg, pos, comp, np.asarray(visible_btn(seg, comp))


def np_topk(key, eligible, k):
  """Per query: eligible indices by descending key, ties by lowest index, first k."""
  out = []
  for row_key, row_el in zip(key.reshape(-1, key.shape[-1]), eligible.reshape(-1, key.shape[-1])):
    order = np.argsort(-row_key.astype(np.float64), kind='stable')
    out.append([j for j in order if row_el[j]][:k])
  return out


# ---------------------------------------------------------------------------------------------
# Modules and scores


def test_index_keys_and_query_match_numpy():
  rng = np.random.default_rng(1)
  cfg = model_cfg()
  inv_freq = rope_for_role(cfg, 'compress')
  keys = IndexKeys(cfg, DI, nnx.Rngs(0))
  query = IndexQuery(cfg, HI, DI, nnx.Rngs(1))
  keys.k_norm.scale[...] = rng.uniform(0.5, 1.5, DI).astype(np.float32)
  latent = rng.standard_normal((B, T // 2, DH)).astype(np.float32)
  pos_bn = rng.integers(0, 100, (B, T // 2)).astype(np.int32)
  k = keys(latent, pos_bn)
  wk = np.asarray(keys.wk[...], np.float64)
  kk = latent.astype(np.float64) @ wk
  kk = kk / np.sqrt(np.mean(kk * kk, -1, keepdims=True) + EPS) * np.asarray(keys.k_norm.scale[...])
  np.testing.assert_allclose(k, np_rope(kk, pos_bn, inv_freq), atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(keys(latent, pos_bn, quantize=lambda v: -v), -np.asarray(k), rtol=1e-6)

  q_r = rng.standard_normal((B, T, QL)).astype(np.float32)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  positions = rng.integers(0, 100, (B, T)).astype(np.int32)
  q, w = query(q_r, x, positions)
  assert q.shape == (B, T, HI, DI) and w.shape == (B, T, HI) and w.dtype == jnp.float32
  qq = np.einsum('btr,rhc->bthc', q_r.astype(np.float64), np.asarray(query.wq_b[...], np.float64))
  np.testing.assert_allclose(q, np_rope(qq, positions, inv_freq), atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(w, x.astype(np.float64) @ np.asarray(query.weights_proj[...]),
                             atol=2e-5, rtol=1e-5)
  # Logical axes for the sharding rules.
  assert query.wq_b.get_metadata()['logical_axes'] == ('q_lora', 'index_heads', 'index_dim')
  assert query.weights_proj.get_metadata()['logical_axes'] == ('embed', 'index_heads')
  assert keys.wk.get_metadata()['logical_axes'] == ('kv_latent', 'index_dim')


def test_index_scores_match_numpy_loop():
  rng = np.random.default_rng(2)
  q = rng.standard_normal((B, 6, HI, DI)).astype(np.float32)
  w = rng.standard_normal((B, 6, HI)).astype(np.float32)
  k = rng.standard_normal((B, 9, DI)).astype(np.float32)
  got = index_scores(q, w, k)
  assert got.dtype == jnp.float32
  ref = np.zeros((B, 6, 9))
  for b in range(B):
    for t in range(6):
      for j in range(9):
        for h in range(HI):
          dot = float(np.dot(q[b, t, h].astype(np.float64), k[b, j]))
          ref[b, t, j] += w[b, t, h] * HI ** -0.5 * max(dot, 0.0) * DI ** -0.5
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  # bf16 inputs still score in fp32.
  assert index_scores(q.astype(jnp.bfloat16), w, k.astype(jnp.bfloat16)).dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# Top-k selection


@pytest.mark.parametrize('ratio', [1, 2])
def test_select_topk_against_numpy(ratio):
  rng = np.random.default_rng(3)
  seg, _, _, vis = layout(ratio)
  n = vis.shape[-1]
  # Integer-valued scores: many exact ties, including +0.0 / -0.0.
  scores = rng.integers(-3, 4, vis.shape).astype(np.float32)
  scores[rng.random(vis.shape) < 0.3] = -0.0
  counts = vis.sum(-1)
  for k in (4, 8, n + 3):
    idx, valid = select_topk(jnp.asarray(scores), jnp.asarray(vis), k)
    idx, valid = np.asarray(idx), np.asarray(valid)
    assert idx.shape == (B, T, k) and idx.dtype == np.int32
    np.testing.assert_array_equal(valid.sum(-1), np.minimum(k, counts))
    # valid slots first, invalid slots have idx 0
    np.testing.assert_array_equal(valid, np.arange(k) < np.minimum(k, counts)[..., None])
    assert np.all(idx[~valid] == 0)
    expected = np_topk(np.where(scores == 0, 0.0, scores), vis, k)
    got = [list(i[v]) for i, v in zip(idx.reshape(-1, k), valid.reshape(-1, k))]
    assert got == expected
    if k >= vis.sum(-1).max():
      np.testing.assert_array_equal(np.asarray(topk_mask(idx, valid, n)), vis)


@pytest.mark.parametrize('ratio', [1, 2])
def test_two_stage_topk_equals_one_pass(ratio):
  """Blocked top-k is exact, ties (lowest index first) and the allowed mask included."""
  rng = np.random.default_rng(7)
  seg, _, _, vis = layout(ratio)
  n = vis.shape[-1]
  for trial in range(4):
    scores = rng.integers(-2, 3, vis.shape).astype(np.float32)  # heavy ties
    scores[rng.random(vis.shape) < 0.2] = -0.0
    if trial % 2:
      scores = rng.normal(size=vis.shape).astype(np.float32)
    allowed = rng.random(vis.shape) < 0.6 if trial >= 2 else None
    for k, block in ((2, 2), (3, 4), (4, 5), (5, 3), (1, 7)):
      assert k * block < n  # the two-stage path, not the one-pass fallback
      args = (jnp.asarray(scores), jnp.asarray(vis), k)
      allowed_j = None if allowed is None else jnp.asarray(allowed)
      want = select_topk(*args, allowed_j)
      got = select_topk_blocked(*args, block, allowed_j)
      for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f'k={k} b={block}')


def test_select_topk_ties_lowest_index_and_allowed():
  vis = np.ones((1, 1, 10), bool)
  scores = np.array([[[1, 5, 5, 0, -0.0, 0, 5, 2, -0.0, 0]]], np.float32)
  idx, valid = select_topk(scores, vis, 7)
  np.testing.assert_array_equal(idx[0, 0], [1, 2, 6, 7, 0, 3, 4])
  idx, valid = jax.jit(select_topk, static_argnums=2)(scores, vis, 7)   # same under jit
  np.testing.assert_array_equal(idx[0, 0], [1, 2, 6, 7, 0, 3, 4])
  allowed = np.zeros((1, 1, 10), bool)
  allowed[..., [2, 4, 8, 9]] = True
  idx, valid = select_topk(scores, vis, 3, allowed_btn=allowed)
  np.testing.assert_array_equal(idx[0, 0], [2, 4, 8])
  idx, valid = select_topk(scores, vis, 6, allowed_btn=allowed)
  np.testing.assert_array_equal(idx[0, 0], [2, 4, 8, 9, 0, 0])
  np.testing.assert_array_equal(valid[0, 0], [1, 1, 1, 1, 0, 0])
  # A -inf score of an eligible entry still ranks above ineligible entries.
  s2 = np.array([[[-np.inf, -np.inf, 3.0]]], np.float32)
  idx, valid = select_topk(s2, np.array([[[False, True, True]]]), 3)
  np.testing.assert_array_equal(idx[0, 0], [2, 1, 0])
  np.testing.assert_array_equal(valid[0, 0], [1, 1, 0])


def test_select_topk_random_with_allowed():
  rng = np.random.default_rng(4)
  seg, _, _, vis = layout(1)
  scores = rng.standard_normal(vis.shape).astype(np.float32)
  allowed = rng.random(vis.shape) < 0.5
  idx, valid = select_topk(scores, vis, 5, allowed_btn=allowed)
  sel = np.asarray(topk_mask(idx, valid, vis.shape[-1]))
  assert not (sel & ~(vis & allowed)).any()
  expected = np_topk(scores, vis & allowed, 5)
  idx, valid = np.asarray(idx).reshape(-1, 5), np.asarray(valid).reshape(-1, 5)
  got = [list(i[v]) for i, v in zip(idx, valid)]
  assert got == expected


# ---------------------------------------------------------------------------------------------
# Candidate pool


def np_candidate_blocks(scores, vis, bs, topk_blocks):
  """Expected kept block sets per query, from the section's description."""
  out = []
  n = scores.shape[-1]
  m = -(-n // bs)
  for s_row, v_row in zip(scores.reshape(-1, n), vis.reshape(-1, n)):
    bsc = np.full(m, -np.inf)
    for blk in range(m):
      members = [j for j in range(blk * bs, min(n, blk * bs + bs)) if v_row[j]]
      if members:
        bsc[blk] = max(s_row[j] for j in members)
    finite = np.isfinite(bsc)
    if not finite.any():
      out.append(set())
      continue
    newest_blk = max(np.nonzero(v_row)[0]) // bs
    bsc[newest_blk] = np.inf
    order = [b for b in np.argsort(-bsc, kind='stable') if bsc[b] > -np.inf]
    out.append(set(order[:min(topk_blocks, int(finite.sum()))]))
  return out


@pytest.mark.parametrize('bs,topk_blocks', [(4, 3), (3, 2), (4, 20)])
def test_candidate_pool(bs, topk_blocks):
  rng = np.random.default_rng(5)
  seg, _, comp, vis = layout(1)
  n = vis.shape[-1]
  scores = rng.standard_normal(vis.shape).astype(np.float32)
  scores[..., 5] = 10.0   # a high score that is invisible to some queries
  pool = np.asarray(candidate_pool(scores, vis, bs, topk_blocks))
  assert pool.shape == vis.shape
  assert not (pool & ~vis).any()                               # never invisible entries
  newest = np.asarray(newest_visible_bt(vis))
  expected = np_candidate_blocks(scores, vis, bs, topk_blocks)
  blk_idx, blk_valid = candidate_blocks(block_scores(scores, vis, bs), newest, bs, topk_blocks)
  blk_idx, blk_valid = np.asarray(blk_idx), np.asarray(blk_valid)
  for q, (p_row, v_row, exp) in enumerate(zip(pool.reshape(-1, n), vis.reshape(-1, n), expected)):
    kept = {j // bs for j in np.nonzero(p_row)[0]}
    assert kept == exp
    if v_row.any():
      newest_j = np.nonzero(v_row)[0].max()
      assert p_row[newest_j]                                     # the newest entry's block
      n_blocks_visible = len({j // bs for j in np.nonzero(v_row)[0]})
      assert len(kept) == min(topk_blocks, n_blocks_visible)
      # every visible entry of a kept block is in the pool
      for j in np.nonzero(v_row)[0]:
        assert p_row[j] == (j // bs in kept)
    bi, ti = divmod(q, T)
    assert set(blk_idx[bi, ti][blk_valid[bi, ti]]) == exp
  # newest visible via the O(T) compressor helper agrees with the dense one
  np.testing.assert_array_equal(newest_visible_entry_bt(seg, comp), newest)
  # blocks_to_entries covers exactly the kept blocks' entries (within N)
  e_idx, e_valid = blocks_to_entries(blk_idx, blk_valid, bs, n)
  entry_mask = np.asarray(topk_mask(e_idx, e_valid, n))
  np.testing.assert_array_equal(entry_mask & vis, pool)


def test_reindex_selection_inside_pool():
  rng = np.random.default_rng(6)
  _, _, _, vis = layout(1)
  s_src = rng.standard_normal(vis.shape).astype(np.float32)
  s_own = rng.standard_normal(vis.shape).astype(np.float32)
  pool = candidate_pool(s_src, vis, 4, 3)
  idx, valid = select_topk(s_own, vis, 8, allowed_btn=pool)
  sel = np.asarray(topk_mask(idx, valid, vis.shape[-1]))
  assert not (sel & ~np.asarray(pool)).any()
  np.testing.assert_array_equal(sel.sum(-1), np.minimum(8, np.asarray(pool).sum(-1)))


# ---------------------------------------------------------------------------------------------
# End to end on a compressor, chunked queries


def test_end_to_end_chunked_equals_full():
  rng = np.random.default_rng(7)
  cfg = model_cfg()
  seg, pos = packed(DOCS)
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  q_r = rng.standard_normal((B, T, QL)).astype(np.float32)
  comp = Compressor(cfg, 2, nnx.Rngs(0))(x, seg, pos)
  k = IndexKeys(cfg, DI, nnx.Rngs(1))(comp.latent_bnd, comp.pos_bn)
  q, w = IndexQuery(cfg, HI, DI, nnx.Rngs(2))(q_r, x, pos)
  scores = index_scores(q, w, k)
  vis = visible_btn(seg, comp)
  idx, valid = select_topk(scores, vis, 4)
  for t0, t1 in ((0, 16), (16, 32), (32, 48)):
    s_c = index_scores(q[:, t0:t1], w[:, t0:t1], k)
    v_c = visible_btn(seg[:, t0:t1], comp, row_offset=t0)
    i_c, ok_c = select_topk(s_c, v_c, 4)
    np.testing.assert_allclose(s_c, scores[:, t0:t1], atol=1e-6)
    np.testing.assert_array_equal(i_c, idx[:, t0:t1])
    np.testing.assert_array_equal(ok_c, valid[:, t0:t1])
  sel = np.asarray(topk_mask(idx, valid, comp.num_entries))
  assert not (sel & ~np.asarray(vis)).any()


# ---------------------------------------------------------------------------------------------
# Indexer training helpers


def np_kl(scores, teacher, mask):
  kls = []
  for s, t, m in zip(scores.reshape(-1, scores.shape[-1]), teacher.reshape(-1, scores.shape[-1]),
                     mask.reshape(-1, scores.shape[-1])):
    if not m.any() or t[m].sum() <= 0:
      continue
    p = t[m] / t[m].sum()
    logq = s[m] - np.log(np.exp(s[m] - s[m].max()).sum()) - s[m].max()
    kls.append(sum(pi * (np.log(pi) - lq) for pi, lq in zip(p, logq) if pi > 0))
  return np.mean(kls)


def test_indexer_kl_loss():
  rng = np.random.default_rng(8)
  _, _, _, vis = layout(2)
  teacher = rng.random(vis.shape).astype(np.float32)
  teacher[rng.random(vis.shape) < 0.2] = 0.0
  scores = rng.standard_normal(vis.shape).astype(np.float32) * 3
  loss = indexer_kl_loss(scores, teacher, vis)
  expected = np_kl(scores.astype(np.float64), teacher.astype(np.float64), vis)
  np.testing.assert_allclose(loss, expected, rtol=1e-4)
  # Student == teacher on the mask (scores = log teacher + any per-query constant): zero loss.
  pos_teacher = teacher + 0.05
  student = np.log(pos_teacher) + rng.standard_normal(vis.shape[:2])[..., None]
  student = np.where(vis, student, 123.0).astype(np.float32)   # outside the mask: irrelevant
  np.testing.assert_allclose(indexer_kl_loss(student, pos_teacher, vis), 0.0, atol=1e-6)

  # Gradient flows to the scores only, is finite, and is zero outside the mask.
  g_s, g_t = jax.grad(indexer_kl_loss, argnums=(0, 1))(jnp.asarray(scores), jnp.asarray(teacher),
                                                       jnp.asarray(vis))
  assert np.all(np.asarray(g_t) == 0)
  g_s = np.asarray(g_s)
  assert np.all(np.isfinite(g_s)) and np.any(g_s != 0)
  assert np.all(g_s[~vis] == 0)
  # Queries with an empty mask (padding, first tokens) contribute nothing, even with huge scores.
  big = np.where(vis, scores, 1e30).astype(np.float32)
  np.testing.assert_allclose(indexer_kl_loss(big, teacher, vis), loss, rtol=1e-6)
  assert float(indexer_kl_loss(scores, teacher, np.zeros_like(vis))) == 0.0


def test_recall_at_k():
  n = 12
  teacher = np.zeros((1, 3, n), np.float32)
  teacher[0, 0, [1, 4, 7, 9]] = [0.4, 0.3, 0.2, 0.1]
  teacher[0, 1, [0, 2]] = [0.5, 0.5]
  # row 2 has no teacher mass: not counted
  selected = np.zeros((1, 3, n), bool)
  selected[0, 0, [1, 4, 7, 11]] = True      # covers the top-3 of query 0
  selected[0, 1, [0, 2, 3]] = True           # covers both positive entries of query 1
  assert float(recall_at_k(selected, teacher, 3)) == 1.0
  assert float(recall_at_k(selected, teacher, 4)) == pytest.approx((3 / 4 + 1.0) / 2)
  selected[0, 1, 2] = False
  assert float(recall_at_k(selected, teacher, 3)) == pytest.approx((1.0 + 0.5) / 2)
  # The (idx, valid) form of a selection gives the same.
  idx, valid = select_topk(teacher, np.ones_like(selected), 3)
  assert float(recall_at_k((idx, valid), teacher, 3)) == 1.0
  assert float(recall_at_k(selected, np.zeros_like(teacher), 3)) == 1.0
