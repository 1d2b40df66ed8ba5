"""The fused indexer-score kernel (run in the Pallas interpreter) against the jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.config import ConfigError
from deepseek41.ops.index_scores import index_scores_fused
from deepseek41.ops.index_scores import index_scores_reference as index_scores
from tests.util import resolved


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
    resolved(**{'model.csa2': True, 'model.index_impl': 'fused'})       # CPU
  with pytest.raises(ConfigError, match='model.index_impl'):
    resolved(**{'model.index_impl': 'triton'})
  with pytest.raises(ConfigError, match='model.selected_scores_impl'):
    resolved(**{'model.csa2': True, 'model.selected_scores_impl': 'fused'})  # CPU
  assert resolved(**{'model.csa2': True}).model.index_impl == 'reference'  # auto on the CPU


@pytest.mark.parametrize('ratio', [1, 2])
def test_selection_with_the_kernel_equals_reference(ratio):
  """select_chunked (chunks, two-stage top-k, candidate pool) is the same with either scorer,
  on documents at offsets that are not multiples of the candidate block."""
  import functools

  from flax import nnx

  from deepseek41.model.compressor import Compressor
  from deepseek41.model.csa2 import select_chunked
  from deepseek41.model.indexer import IndexKeys, IndexQuery
  from tests.util import packed_layout

  cfg = resolved(**{'model.csa2': True, 'model.index_n_heads': 2,
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
