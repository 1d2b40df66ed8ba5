"""ops/union_attention.py: one softmax over a decode chunk's key sets equals the partial per key
set and their merge with the sink (ops/softmax_merge.py), the path it replaces."""

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.ops.softmax_merge import merge_stats
from deepseek41.ops.swa_attention import keyset_partial
from deepseek41.ops.union_attention import max_and_sum_exp, union_attention


def per_query_partial(q_bthd, kv_btkd, sees_btk):
  """keyset_partial with each query's own keys (vmapped over the chunk)."""
  one = lambda q, kv, s: keyset_partial(q[:, None], kv, s[:, None])  # noqa: E731
  o, lse = jax.vmap(one, in_axes=(1, 1, 1), out_axes=(1, 1))(q_bthd, kv_btkd, sees_btk)
  return o[:, :, 0], lse[:, :, 0]


def test_one_softmax_equals_the_merged_partials():
  b, t, h, d, c, k = 2, 3, 4, 16, 7, 5
  ks = jax.random.split(jax.random.key(0), 8)
  q = jax.random.normal(ks[0], (b, t, h, d)) * 2.0
  own, ring = jax.random.normal(ks[1], (b, t, d)), jax.random.normal(ks[2], (b, c, d))
  selected = jax.random.normal(ks[3], (b, t, k, d))
  sees_own = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
  sees_ring = jax.random.bernoulli(ks[4], 0.6, (b, t, c))
  sees_sel = jax.random.bernoulli(ks[5], 0.5, (b, t, k))
  # query (0, 0) sees nothing at all (its mass all on the sink), query (1, 2) only the ring
  sees_own, sees_ring, sees_sel = (sees_own.at[0, 0].set(False), sees_ring.at[0, 0].set(False),
                                   sees_sel.at[0, 0].set(False).at[1, 2].set(False))
  sees_own = sees_own.at[1, 2].set(False)
  sink = jax.random.normal(ks[6], (h,))
  got = union_attention(q, [(own, sees_own), (ring, sees_ring), (selected, sees_sel)], sink)
  partials = [keyset_partial(q, own, sees_own), keyset_partial(q, ring, sees_ring),
              per_query_partial(q, selected, sees_sel)]
  want, _ = merge_stats(partials, sink)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got[0, 0]), 0.0)
  assert np.abs(np.asarray(got[1, 2])).max() > 0.01


def test_bf16_keys_stay_close_to_the_float32_softmax():
  b, t, h, d, c = 1, 1, 8, 64, 40
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
  ring = jax.random.normal(ks[1], (b, c, d), jnp.bfloat16)
  sees = jax.random.bernoulli(ks[2], 0.7, (b, t, c))
  sink = jnp.zeros((h,))
  got = union_attention(q, [(ring, sees)], sink)
  want, _ = merge_stats([keyset_partial(q.astype(jnp.float32), ring.astype(jnp.float32), sees)],
                        sink)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2)


def test_max_and_sum_in_one_reduction():
  """The online softmax's (max, sum exp(s - max)) pair from one reduction equals the two-pass
  values, with rows of -inf entries, an all -inf row (sum 0) and a one-entry row."""
  s = jax.random.normal(jax.random.key(2), (3, 5, 37)) * 10.0
  s = s.at[0, :, 5:].set(-jnp.inf).at[1, 2].set(-jnp.inf).at[2, 3, 1:].set(-jnp.inf)
  m, total = max_and_sum_exp(s)
  want_m = jnp.max(s, axis=-1)
  safe = jnp.where(jnp.isfinite(want_m), want_m, 0.0)
  want_total = jnp.sum(jnp.exp(s - safe[..., None]), axis=-1)
  np.testing.assert_array_equal(np.asarray(m), np.asarray(want_m))
  np.testing.assert_allclose(np.asarray(total), np.asarray(want_total), rtol=1e-6)
  assert float(total[1, 2]) == 0.0 and float(total[2, 3]) == 1.0
