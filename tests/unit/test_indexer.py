"""CSA2 lightning indexer (docs/architecture.md 3.7): scores, top-k, candidate pool, KL, recall.

Expected values come from numpy loops and stable argsorts written here (ties: lowest index).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.compressor import (CompressedKV, Compressor, document_first_entry_bt,
                                         group_layout, visible_btn)
from deepseek41.model import indexer as indexer_lib
from deepseek41.model.indexer import (IndexKeys, IndexQuery, block_scores, candidate_blocks,
                                      indexer_distillation, indexer_kl_per_query,
                                      newest_visible_bt, pool_entry_mask,
                                      select_topk, select_topk_blocked)
from deepseek41.model.rope import rope_for_role
from deepseek41.ops.index_scores import index_scores_reference as index_scores
from deepseek41.ops.sparse_attention import selection_mask
from tests.helpers import DOCS, entry_layout, first_visible, np_rope, packed_layout, resolved

B, T, D, DH, DI, HI, QL = 2, 48, 32, 16, 8, 2, 16
EPS = 1e-6


def model_cfg():
  return resolved(**{'model.rope_head_dim': 4, 'model.rms_norm_eps': EPS}).model


def packed(doc_lengths, t=T):
  return packed_layout(doc_lengths, t)


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
  seg, _, _, vis = entry_layout(ratio)
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
      np.testing.assert_array_equal(np.asarray(selection_mask(idx, valid, n)), vis)


@pytest.mark.parametrize('ratio', [1, 2])
def test_two_stage_topk_equals_one_pass(ratio):
  """Blocked top-k is exact, ties (lowest index first) and the allowed mask included."""
  rng = np.random.default_rng(7)
  seg, _, _, vis = entry_layout(ratio)
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
  seg, _, _, vis = entry_layout(1)
  scores = rng.standard_normal(vis.shape).astype(np.float32)
  allowed = rng.random(vis.shape) < 0.5
  idx, valid = select_topk(scores, vis, 5, allowed_btn=allowed)
  sel = np.asarray(selection_mask(idx, valid, vis.shape[-1]))
  assert not (sel & ~(vis & allowed)).any()
  expected = np_topk(scores, vis & allowed, 5)
  idx, valid = np.asarray(idx).reshape(-1, 5), np.asarray(valid).reshape(-1, 5)
  got = [list(i[v]) for i, v in zip(idx, valid)]
  assert got == expected


# ---------------------------------------------------------------------------------------------
# Candidate pool


def candidate_pool(scores, vis, bs, topk_blocks):
  """(blk_idx, blk_valid, pool mask): the candidate source's pieces, composed as select_chunked
  composes them (on the whole row as one chunk)."""
  first = first_visible(vis)
  blk_idx, blk_valid = candidate_blocks(block_scores(scores, vis, first, bs),
                                        newest_visible_bt(vis), first, bs, topk_blocks)
  pool = pool_entry_mask(blk_idx, blk_valid, first, bs, scores.shape[-1]) & vis
  return blk_idx, blk_valid, pool


def np_candidate_blocks(scores, vis, bs, topk_blocks):
  """Expected kept block sets per query, from the section's description: blocks of `bs` entries
  counted from the query's document's first entry (its first visible one)."""
  out = []
  n = scores.shape[-1]
  m = -(-n // bs)
  for s_row, v_row in zip(scores.reshape(-1, n), vis.reshape(-1, n)):
    if not v_row.any():
      out.append(set())
      continue
    first = np.nonzero(v_row)[0].min()
    bsc = np.full(m, -np.inf)
    for blk in range(m):
      members = [j for j in range(first + blk * bs, min(n, first + blk * bs + bs)) if v_row[j]]
      if members:
        bsc[blk] = max(s_row[j] for j in members)
    finite = np.isfinite(bsc)
    newest_blk = (max(np.nonzero(v_row)[0]) - first) // bs
    bsc[newest_blk] = np.inf
    order = [b for b in np.argsort(-bsc, kind='stable') if bsc[b] > -np.inf]
    out.append(set(order[:min(topk_blocks, int(finite.sum()))]))
  return out


@pytest.mark.parametrize('ratio', [1, 2])
@pytest.mark.parametrize('bs,topk_blocks', [(4, 3), (3, 2), (4, 20)])
def test_candidate_pool(ratio, bs, topk_blocks):
  rng = np.random.default_rng(5)
  seg, _, comp, vis = entry_layout(ratio)
  n = vis.shape[-1]
  scores = rng.standard_normal(vis.shape).astype(np.float32)
  scores[..., 5] = 10.0   # a high score that is invisible to some queries
  blk_idx, blk_valid, pool = (np.asarray(a) for a in candidate_pool(scores, vis, bs, topk_blocks))
  assert pool.shape == vis.shape
  assert not (pool & ~vis).any()                               # never invisible entries
  first = np.asarray(document_first_entry_bt(seg, comp))
  expected = np_candidate_blocks(scores, vis, bs, topk_blocks)
  for q, (p_row, v_row, exp) in enumerate(zip(pool.reshape(-1, n), vis.reshape(-1, n), expected)):
    bi, ti = divmod(q, T)
    assert set(blk_idx[bi, ti][blk_valid[bi, ti]]) == exp
    if not v_row.any():
      assert first[bi, ti] == -1 and not p_row.any()
      continue
    f = np.nonzero(v_row)[0].min()
    assert first[bi, ti] == f
    kept = {(j - f) // bs for j in np.nonzero(p_row)[0]}
    assert kept == exp
    newest_j = np.nonzero(v_row)[0].max()
    assert p_row[newest_j]                                       # the newest entry's block
    n_blocks_visible = len({(j - f) // bs for j in np.nonzero(v_row)[0]})
    assert len(kept) == min(topk_blocks, n_blocks_visible)
    for j in np.nonzero(v_row)[0]:                               # all of a kept block's entries
      assert p_row[j] == ((j - f) // bs in kept)


def test_pool_blocks_follow_the_document_not_the_row():
  """The same document at two offsets (0 and 2, blocks of 4) keeps the same blocks."""
  rng = np.random.default_rng(9)
  seg, pos = packed_layout([[20], [2, 20]], 24)
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, 1)
  comp = CompressedKV(latent_bnd=None, kv_bnd=None, pos_bn=pos_bn, seg_bn=seg_bn,
                      last_bn=last_bn, ratio=1)
  vis = np.asarray(visible_btn(seg, comp))
  doc_scores = rng.standard_normal((20, 20)).astype(np.float32)
  scores = np.zeros((2, 24, 24), np.float32)
  scores[0, :20, :20] = doc_scores
  scores[1, 2:22, 2:22] = doc_scores
  blk_idx, blk_valid, pool = (np.asarray(a) for a in candidate_pool(scores, vis, 4, 2))
  np.testing.assert_array_equal(blk_idx[1, 2:22], blk_idx[0, :20])
  np.testing.assert_array_equal(blk_valid[1, 2:22], blk_valid[0, :20])
  np.testing.assert_array_equal(pool[1, 2:22, 2:22], pool[0, :20, :20])
  assert (vis[0, :20, :20] & ~pool[0, :20, :20]).any()           # the pool binds
  # The entry mask of the published blocks, given the document's first entry, is the pool.
  np.testing.assert_array_equal(
      np.asarray(pool_entry_mask(blk_idx, blk_valid, document_first_entry_bt(seg, comp), 4, 24))
      & vis,
      pool)


@pytest.mark.parametrize('bs', [1, 3, 4, 8])
def test_pool_entry_mask_is_the_kept_blocks_of_each_document(bs):
  rng = np.random.default_rng(bs)
  n, k = 23, 3
  m = -(-n // bs)
  first = rng.integers(-1, n, (B, T)).astype(np.int32)
  idx = rng.integers(0, m, (B, T, k)).astype(np.int32)
  valid = rng.random((B, T, k)) < 0.7
  got = np.asarray(pool_entry_mask(idx, valid, first, bs, n))
  for bi, ti in np.ndindex(B, T):
    f, kept = max(first[bi, ti], 0), set(idx[bi, ti][valid[bi, ti]])
    want = [e >= f and (e - f) // bs in kept for e in range(n)]
    np.testing.assert_array_equal(got[bi, ti], want, err_msg=f'first={f}')


def test_reindex_selection_inside_pool():
  rng = np.random.default_rng(6)
  _, _, _, vis = entry_layout(1)
  s_src = rng.standard_normal(vis.shape).astype(np.float32)
  s_own = rng.standard_normal(vis.shape).astype(np.float32)
  pool = candidate_pool(s_src, vis, 4, 3)[2]
  idx, valid = select_topk(s_own, vis, 8, allowed_btn=pool)
  sel = np.asarray(selection_mask(idx, valid, vis.shape[-1]))
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
  sel = np.asarray(selection_mask(idx, valid, comp.num_entries))
  assert not (sel & ~np.asarray(vis)).any()


@pytest.mark.parametrize('select_impl', ['top_k', 'threshold'])
def test_generation_scores_only_the_pool_and_stored_keys_blockwise(select_impl, monkeypatch):
  """A Reindex chunk whose pools hold fewer entries than the row scores only the pool's
  (gathered) keys: the same selection, slot for slot, as scoring the whole row and masking it;
  stored keys scored a block at a time select as their unpacked values do."""
  from deepseek41.model import csa2
  from deepseek41.packing import load, store
  rng = np.random.default_rng(11)
  cfg = model_cfg()
  seg, pos = packed([[20, 28], [10, 14, 24]])
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  q_r = rng.standard_normal((B, T, QL)).astype(np.float32)
  comp = Compressor(cfg, 1, nnx.Rngs(0))(x, seg, pos)
  k = IndexKeys(cfg, 32, nnx.Rngs(1))(comp.latent_bnd, comp.pos_bn)
  q, w = IndexQuery(cfg, HI, 32, nnx.Rngs(2))(q_r, x, pos)
  kw = dict(topk=4, block_size=4, topk_block=2, select_impl=select_impl)
  pool = csa2.select_chunked(q, w, k, seg, comp, chunk=16, publish_blocks=3, **kw)[2]
  n = k.shape[1]                                   # 48 entries; a pool holds 3 x 4 = 12
  whole = csa2.select_chunked(q, w, k, seg, comp, chunk=16, pool=pool, **kw)   # 16 x 12 >= 48
  pooled = csa2.select_chunked(q, w, k, seg, comp, chunk=2, pool=pool, **kw)   # 2 x 12 < 48
  np.testing.assert_array_equal(np.asarray(pooled[1]), np.asarray(whole[1]))
  np.testing.assert_array_equal(np.asarray(pooled[0]), np.asarray(whole[0]))
  mask = np.asarray(pool_entry_mask(*pool, document_first_entry_bt(seg, comp), 4, n))
  assert np.asarray(whole[1]).any() and (mask.sum(-1) < n).all()  # the pool restricts

  stored = store('fp4_ue8m0_32', k)
  values = load('fp4_ue8m0_32', stored, jnp.float32)
  unpack = functools.partial(load, 'fp4_ue8m0_32', dtype=jnp.float32)
  monkeypatch.setattr(csa2, 'STORED_KEYS_BLOCK', 20)  # blocks that do not divide the row
  monkeypatch.setattr(csa2, 'STORED_KEYS_BYTES', 0)
  for chunk, pool_kw in ((16, {'publish_blocks': 3}), (2, {'pool': pool})):
    want = csa2.select_chunked(q, w, values, seg, comp, chunk=chunk, **pool_kw, **kw)
    got = csa2.select_chunked(q, w, stored, seg, comp, chunk=chunk, load_keys=unpack,
                              **pool_kw, **kw)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stored_keys_blocks_grow_for_few_rows():
  """A decode step scores the stored keys in blocks as large as 32 MiB of dequantized keys
  allow (a few iterations of the scoring loop at 1M tokens of context); many rows (a prefill
  chunk, a large batch) keep blocks of STORED_KEYS_BLOCK."""
  from deepseek41.model import csa2
  q = lambda b, rows: jax.ShapeDtypeStruct((b, rows, 16, 128), jnp.bfloat16)  # noqa: E731
  assert csa2.stored_keys_block(q(1, 1)) == 131072          # 32 MiB / (128 x 2 bytes)
  assert csa2.stored_keys_block(q(1, 64)) == 65536          # 256 MiB of fp32 products
  assert csa2.stored_keys_block(q(1, 1024)) == csa2.STORED_KEYS_BLOCK == 8192
  assert csa2.stored_keys_block(q(32, 1)) == 8192


def test_stored_key_scores_equal_the_unpacked_keys():
  from deepseek41.ops.index_scores import index_scores_stored
  from deepseek41.packing import load, store
  rng = np.random.default_rng(12)
  k = jnp.asarray(rng.standard_normal((B, 37, 32)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((B, 3, HI, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((B, 3, HI)), jnp.float32)
  stored = store('fp4_ue8m0_32', k)
  unpack = functools.partial(load, 'fp4_ue8m0_32', dtype=jnp.float32)
  want = index_scores(q, w, unpack(stored))
  for block in (1, 8, 37, 64):
    np.testing.assert_allclose(index_scores_stored(q, w, stored, unpack, block), want,
                               rtol=1e-6, atol=1e-6)


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


def _kl_loss(scores, teacher, mask):
  kl_sum, counted, _ = indexer_distillation(scores, teacher, mask)
  return kl_sum / jnp.maximum(counted, 1.0)


def test_indexer_kl():
  rng = np.random.default_rng(8)
  _, _, _, vis = entry_layout(2)
  teacher = rng.random(vis.shape).astype(np.float32)
  teacher[rng.random(vis.shape) < 0.2] = 0.0
  scores = rng.standard_normal(vis.shape).astype(np.float32) * 3
  loss = _kl_loss(scores, teacher, vis)
  expected = np_kl(scores.astype(np.float64), teacher.astype(np.float64), vis)
  np.testing.assert_allclose(loss, expected, rtol=1e-4)
  _, counted = indexer_kl_per_query(scores, teacher, vis)
  np.testing.assert_array_equal(counted, vis.any(-1) & ((teacher * vis).sum(-1) > 0))
  # Student == teacher on the mask (scores = log teacher + any per-query constant): zero loss.
  pos_teacher = teacher + 0.05
  student = np.log(pos_teacher) + rng.standard_normal(vis.shape[:2])[..., None]
  student = np.where(vis, student, 123.0).astype(np.float32)   # outside the mask: irrelevant
  np.testing.assert_allclose(_kl_loss(student, pos_teacher, vis), 0.0, atol=1e-6)

  # Gradient flows to the scores only, is finite, and is zero outside the mask.
  g_s, g_t = jax.grad(_kl_loss, argnums=(0, 1))(jnp.asarray(scores), jnp.asarray(teacher),
                                                jnp.asarray(vis))
  assert np.all(np.asarray(g_t) == 0)
  g_s = np.asarray(g_s)
  assert np.all(np.isfinite(g_s)) and np.any(g_s != 0)
  assert np.all(g_s[~vis] == 0)
  # Queries with an empty mask (padding, first tokens) contribute nothing, even with huge scores.
  big = np.where(vis, scores, 1e30).astype(np.float32)
  np.testing.assert_allclose(_kl_loss(big, teacher, vis), loss, rtol=1e-6)
  assert float(_kl_loss(scores, teacher, np.zeros_like(vis))) == 0.0


@pytest.mark.parametrize('impl', ['top_k', 'threshold'])
def test_recall(impl):
  recall_per_query = functools.partial(indexer_lib.recall_per_query, select_impl=impl)
  indexer_distillation = functools.partial(indexer_lib.indexer_distillation, select_impl=impl)
  n = 12
  teacher = np.zeros((1, 3, n), np.float32)
  teacher[0, 0, [1, 4, 7, 9]] = [0.4, 0.3, 0.2, 0.1]
  teacher[0, 1, [0, 2]] = [0.5, 0.5]
  # row 2 has no teacher mass: recall 0, and it is not counted
  student = np.zeros((1, 3, n), np.float32)
  student[0, 0, [1, 4, 7, 11]] = [4, 3, 2, 1]    # its top-3 is the teacher's top-3
  student[0, 1, [0, 2, 3]] = [1, 2, 3]           # its top-2 is {3, 2}: one of the teacher's two
  mask = np.ones((1, 3, n), bool)
  np.testing.assert_allclose(recall_per_query(student, teacher, mask, 3), [[1.0, 1.0, 0.0]])
  np.testing.assert_allclose(recall_per_query(student, teacher, mask, 2), [[1.0, 0.5, 0.0]])
  np.testing.assert_allclose(recall_per_query(student, teacher, mask, 4), [[0.75, 1.0, 0.0]])
  mask[0, 0, 1] = False                           # outside the mask for both
  np.testing.assert_allclose(recall_per_query(student, teacher, mask, 2), [[1.0, 0.5, 0.0]])
  # The model's statistic: the top quarter of the slots, summed over counted queries.
  _, counted, recall_sum = indexer_distillation(student[:, :, :8], teacher[:, :, :8],
                                                np.ones((1, 3, 8), bool))
  assert float(counted) == 2.0                    # top 2 of 8: {1, 4} / {0, 2} vs {3, 2}
  assert float(recall_sum) == pytest.approx(1.0 + 0.5)
