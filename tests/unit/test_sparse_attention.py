"""The compressed (selected-entry) branch: gathered equals the dense-masked reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops.sparse_attention import compressed_partial, gather_rows, selection_mask
from deepseek41.ops.swa_attention import combine_with_sink

B, T, H, D, N, K = 2, 37, 3, 16, 20, 6


def _inputs(seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, H, D))
  kv = jax.random.normal(ks[1], (B, N, D))
  idx = jax.random.randint(ks[2], (B, T, K), 0, N)
  # distinct indices per query: take a random permutation prefix
  idx = jnp.argsort(jax.random.uniform(ks[2], (B, T, N)), axis=-1)[..., :K].astype(jnp.int32)
  valid = jax.random.uniform(ks[3], (B, T, K)) > 0.3
  valid = valid.at[:, :3].set(False)  # the first queries see nothing
  return q, kv, idx, valid


@pytest.mark.parametrize('chunk', [None, 8, 37, 64])
def test_gathered_equals_reference(chunk):
  q, kv, idx, valid = _inputs(0)
  o_ref, lse_ref = compressed_partial(q, kv, idx, valid, impl='reference')
  o, lse = jax.jit(lambda *a: compressed_partial(*a, impl='gathered', chunk=chunk))(
      q, kv, idx, valid)
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
  fin = np.isfinite(lse_ref)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_ref)[fin], rtol=1e-5)
  assert (np.asarray(o)[:, :3] == 0).all()

  def loss(impl):
    def f(q, kv):
      o, _ = compressed_partial(q, kv, idx, valid, impl=impl, chunk=chunk)
      return jnp.sum(combine_with_sink([(o, _)], jnp.zeros(H)) ** 2)
    return jax.grad(f, argnums=(0, 1))(q, kv)
  for a, b in zip(loss('gathered'), loss('reference')):
    # fp32 sums in another order: their error scales with the largest terms (gradients up to
    # ~20 here), not with each element (a CPU with other vector widths moved an element of
    # -7.7e-4 by 1.3e-6).
    atol = 1e-6 * max(1.0, float(np.abs(np.asarray(b)).max()))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    assert np.isfinite(np.asarray(a)).all()


def test_matches_numpy_softmax_over_the_selection_with_sink():
  q, kv, idx, valid = _inputs(1)
  sink = jnp.array([0.5, -1.0, 2.0])
  o = combine_with_sink([compressed_partial(q, kv, idx, valid)], sink)
  mask = np.asarray(selection_mask(idx, valid, N))
  qn, kvn = np.asarray(q, np.float64), np.asarray(kv, np.float64)
  for b in range(B):
    for t in range(T):
      for h in range(H):
        s = kvn[b] @ qn[b, t, h] / np.sqrt(D)
        e = np.where(mask[b, t], np.exp(s - s.max()), 0.0)
        z = e.sum() + np.exp(float(sink[h]) - s.max())
        np.testing.assert_allclose(np.asarray(o)[b, t, h], e @ kvn[b] / z, rtol=1e-4, atol=1e-6)


def test_gather_rows_gradient_skips_invalid_slots():
  """The custom backward equals autodiff of the gather with invalid slots' cotangents zeroed.

  Invalid slots all name entry 0; their cotangent is dropped, not added (even when non-zero).
  """
  _, kv, idx, valid = _inputs(2)
  idx = jnp.where(valid, idx, 0)
  ct = jax.random.normal(jax.random.key(3), idx.shape + (D,))
  got = jax.vjp(lambda x: gather_rows(x, idx, valid), kv)[1](ct)[0]
  plain = jax.vjp(lambda x: jax.vmap(lambda x_nd, i: x_nd[i])(x, idx), kv)[1](
      ct * valid[..., None])[0]
  np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)
  with_invalid = jax.vjp(lambda x: jax.vmap(lambda x_nd, i: x_nd[i])(x, idx), kv)[1](ct)[0]
  assert not np.allclose(with_invalid[:, 0], got[:, 0])
  np.testing.assert_array_equal(gather_rows(kv, idx, valid),
                                jax.vmap(lambda x_nd, i: x_nd[i])(kv, idx))
