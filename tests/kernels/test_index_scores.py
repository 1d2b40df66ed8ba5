"""The fused indexer-score kernel (run in the Pallas interpreter) against the jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.config import ConfigError
from deepseek41.ops.gpu.index_scores import index_scores_fused
from deepseek41.ops.index_scores import index_scores_reference as index_scores
from tests.helpers import resolved


@pytest.mark.parametrize('ratio,t,n,heads,dim', [(2, 80, 40, 4, 16), (1, 48, 48, 2, 32),
                                                 (2, 33, 17, 8, 16)])
def test_fused_scores_equal_reference_where_visible(ratio, t, n, heads, dim):
  kq, kw, kk = jax.random.split(jax.random.key(ratio + t), 3)
  q = jax.random.normal(kq, (2, t, heads, dim))
  w = jax.random.normal(kw, (2, t, heads))
  k = jax.random.normal(kk, (2, n, dim))
  limit = jnp.broadcast_to((jnp.arange(t) + 1) // ratio, (2, t))
  got = np.asarray(index_scores_fused(q, w, k, limit, block_q=16, block_n=16, interpret=True))
  want = np.asarray(index_scores(q, w, k))
  visible = np.arange(n)[None, None, :] < np.asarray(limit)[..., None]
  assert got.shape == want.shape
  np.testing.assert_allclose(got[visible], want[visible], rtol=1e-5, atol=1e-5)
  # Key tiles wholly past the causal limit of a query tile are skipped (written as 0).
  rows = np.arange(t)
  for qt in range(0, t, 16):
    last_visible = (min(qt + 16, t)) // ratio
    skipped = slice(-(-last_visible // 16) * 16, None)
    assert np.all(got[:, qt:qt + 16, skipped] == 0)
  assert np.any(got[:, rows[-1], : (t // ratio)] != 0)


def test_fused_scores_are_a_gpu_choice():
  with pytest.raises(ConfigError, match='model.index_impl'):
    resolved(**{'model.attention_variant': 'csa2', 'model.index_impl': 'fused'})       # CPU
  with pytest.raises(ConfigError, match='model.index_impl'):
    resolved(**{'model.index_impl': 'triton'})
  with pytest.raises(ConfigError, match='model.selected_scores_impl'):
    resolved(**{'model.attention_variant': 'csa2',
                'model.selected_scores_impl': 'fused'})  # CPU
  # auto on the CPU
  assert resolved(**{'model.attention_variant': 'csa2'}).model.index_impl == 'reference'


@pytest.mark.parametrize('ratio', [1, 2])
def test_selection_with_the_kernel_equals_reference(ratio, monkeypatch):
  """select_chunked (chunks, two-stage top-k, candidate pool) is the same with either scorer,
  on documents at offsets that are not multiples of the candidate block, and with the jnp
  scorer's [rows, H, N] products bounded (scored a block of entries at a time, as a long
  prefill chunk's are)."""
  import functools

  from flax import nnx

  from deepseek41.model import csa2
  from deepseek41.model.compressor import Compressor
  from deepseek41.model.csa2 import select_chunked
  from deepseek41.model.indexer import IndexKeys, IndexQuery
  from tests.helpers import packed_layout

  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.index_n_heads': 2,
                    'model.index_head_dim': 16}).model
  b, t = 2, 48
  seg, pos = packed_layout([[20, 28], [10, 14, 24]], t)
  rng = np.random.default_rng(ratio)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), jnp.float32)
  q_r = jnp.asarray(rng.standard_normal((b, t, cfg.q_lora_rank)), jnp.float32)
  comp = Compressor(cfg, ratio, nnx.Rngs(0))(x, seg, pos)
  k = IndexKeys(cfg, 16, nnx.Rngs(1))(comp.latent_bnd, comp.pos_bn)
  q, w = IndexQuery(cfg, 2, 16, nnx.Rngs(2))(q_r, x, pos)
  kernel = functools.partial(index_scores_fused, interpret=True)
  kw = dict(topk=4, chunk=16, block_size=4, topk_block=2)
  want = select_chunked(q, w, k, seg, comp, publish_blocks=3, **kw)
  got = select_chunked(q, w, k, seg, comp, publish_blocks=3, scores_fn=kernel, **kw)
  for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
  # A Reindex layer selecting inside that pool.
  want_r = select_chunked(q, w, k, seg, comp, pool=want[2], **kw)
  got_r = select_chunked(q, w, k, seg, comp, pool=want[2], scores_fn=kernel, **kw)
  for a, b_ in zip(jax.tree.leaves(got_r), jax.tree.leaves(want_r)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
  # Entries 7 at a time (a last block past N): the same choices as the whole products.
  monkeypatch.setattr(csa2, 'REFERENCE_PRODUCTS_BYTES', 0)
  monkeypatch.setattr(csa2, 'STORED_KEYS_BLOCK', 7)
  monkeypatch.setattr(csa2, 'STORED_KEYS_BYTES', 0)
  for pool, publish, ref in ((None, 3, want), (want[2], 0, want_r)):
    got_b = select_chunked(q, w, k, seg, comp, pool=pool, publish_blocks=publish, **kw)
    for a, b_ in zip(jax.tree.leaves(got_b), jax.tree.leaves(ref)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def test_causal_groups_cover_what_each_run_can_see():
  from deepseek41.model.csa2 import causal_groups

  # 65,536 rows at ratio 1 in 64 chunks: 4 runs of 16 chunks, each over its own prefix.
  assert causal_groups(65536, 1024, 4, 0, 1, 65536) == [
      (0, 16384, 16384), (16384, 32768, 32768), (32768, 49152, 49152), (49152, 65536, 65536)]
  # Ratio 2, a tail of rows (CED prefill) and a short last chunk: the runs end at chunk
  # boundaries, and each scores the entries complete by its last row, rounded up to 16.
  runs = causal_groups(2500, 1000, 2, 300, 2, 1400)
  assert runs == [(0, 1000, 656), (1000, 2500, 1400)]
  assert causal_groups(4096, 1024, 8, 0, 2, 2048) == [
      (0, 1024, 512), (1024, 2048, 1024), (2048, 3072, 1536), (3072, 4096, 2048)]
  # One run: one group, one chunk, or an offset per batch row (decoding).
  assert causal_groups(4096, 1024, 1, 0, 1, 4096) == [(0, 4096, 4096)]
  assert causal_groups(1000, 1024, 4, 0, 1, 1000) == [(0, 1000, 1000)]
  assert causal_groups(4096, 1024, 4, jnp.zeros((2, 1), jnp.int32), 1, 4096) == [(0, 4096, 4096)]


@pytest.mark.parametrize('ratio,impl', [(1, 'top_k'), (2, 'threshold')])
def test_selection_is_the_same_in_causal_runs(ratio, impl):
  """select_chunked in runs over their own prefixes of the entries picks what one run over all
  of them picks: the selection, the published candidate blocks and a Reindex inside them, also
  for a tail of rows."""
  from flax import nnx

  from deepseek41.model.compressor import Compressor
  from deepseek41.model.csa2 import causal_groups, select_chunked
  from deepseek41.model.indexer import IndexKeys, IndexQuery
  from tests.helpers import packed_layout

  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.index_n_heads': 2,
                    'model.index_head_dim': 16}).model
  b, t = 2, 96
  seg, pos = packed_layout([[40, 56], [10, 14, 24, 48]], t)
  rng = np.random.default_rng(7 + ratio)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), jnp.float32)
  q_r = jnp.asarray(rng.standard_normal((b, t, cfg.q_lora_rank)), jnp.float32)
  comp = Compressor(cfg, ratio, nnx.Rngs(0))(x, seg, pos)
  k = IndexKeys(cfg, 16, nnx.Rngs(1))(comp.latent_bnd, comp.pos_bn)
  q, w = IndexQuery(cfg, 2, 16, nnx.Rngs(2))(q_r, x, pos)
  n = k.shape[1]
  kw = dict(topk=6, chunk=16, block_size=4, topk_block=2, select_impl=impl)
  assert len({r[2] for r in causal_groups(t, 16, 3, 0, ratio, n)}) == 3  # three prefixes
  want = select_chunked(q, w, k, seg, comp, publish_blocks=3, **kw)
  assert bool(jnp.any(want[1][:, -1]))
  for groups in (2, 3, 6):
    got = select_chunked(q, w, k, seg, comp, publish_blocks=3, groups=groups, **kw)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
    got_r = select_chunked(q, w, k, seg, comp, pool=want[2], groups=groups, **kw)
    want_r = select_chunked(q, w, k, seg, comp, pool=want[2], **kw)
    for a, b_ in zip(jax.tree.leaves(got_r), jax.tree.leaves(want_r)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
  # The last 40 rows alone (row_offset 56), in runs and in one.
  tail = dict(row_offset=56, **kw)
  want_t = select_chunked(q[:, 56:], w[:, 56:], k, seg[:, 56:], comp, **tail)
  got_t = select_chunked(q[:, 56:], w[:, 56:], k, seg[:, 56:], comp, groups=3, **tail)
  for a, b_ in zip(jax.tree.leaves(got_t), jax.tree.leaves(want_t)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
  np.testing.assert_array_equal(np.asarray(want_t[0]), np.asarray(want[0][:, 56:]))
