"""The merged key/value gradient (ops/gpu/merged_dkv.py, Pallas interpreter on the CPU): its
per-tile union is right, and it equals the plain scatter-add and the per-query atomics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops.gpu import merged_dkv, sparse_kernel
from deepseek41.ops.gpu.sparse_kernel import sparse_backward_fused, sparse_partial_fused
from deepseek41.ops.sparse_attention import compressed_partial
from tests.helpers import random_selection, triton_lowering_for_h200

H, D = 16, 32


@pytest.mark.parametrize('tile', [1, 4, 8])
def test_union_lists_each_tiles_distinct_picks_and_who_picked_them(tile):
  b, t, n, k = 2, 22, 11, 20  # 22 queries: the last tile is part padding
  idx, valid = random_selection(jax.random.key(3), b, t, n, k, prefix=False)
  rows, slots, count = map(np.asarray, merged_dkv.query_tile_union(idx, valid, n, tile))
  idx, valid = np.asarray(idx), np.asarray(valid)
  assert rows.shape == (b, -(-t // tile), tile * k) and slots.shape == rows.shape + (tile,)
  for bi in range(b):
    for g in range(rows.shape[1]):
      queries = range(g * tile, min(t, (g + 1) * tile))
      picked = sorted({int(idx[bi, q, s]) for q in queries for s in range(k) if valid[bi, q, s]})
      c = count[bi, g]
      assert c == len(picked) and list(rows[bi, g, :c]) == picked
      assert (rows[bi, g, c:] == n).all() and (slots[bi, g, c:] == -1).all()
      for i, q in enumerate(queries):  # each valid pick listed once, at its entry's place
        listed = {int(s) for s in slots[bi, g, :c, i] if s >= 0}
        assert listed == {s for s in range(k) if valid[bi, q, s]}
        for u in range(c):
          s = slots[bi, g, u, i]
          assert s < 0 or idx[bi, q, s] == rows[bi, g, u]


def _parts(key, b, t, k_pad, h, d, uses, dtype):
  """Coefficients as the dq kernel leaves them: slots past a query's valid ones unwritten (NaN
  here, which the kernels must select away, not multiply)."""
  ks = jax.random.split(key, 4 * uses)
  parts = []
  for u in range(uses):
    ds = jax.random.normal(ks[4 * u], (b, t, k_pad, h)).astype(dtype)
    p = jax.random.uniform(ks[4 * u + 1], (b, t, k_pad, h)).astype(dtype)
    q = jax.random.normal(ks[4 * u + 2], (b, t, h, d)).astype(dtype)
    do = jax.random.normal(ks[4 * u + 3], (b, t, h, d)).astype(dtype)
    parts.append((ds, p, q, do))
  return parts


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize('tile,uses', [(4, 1), (8, 2)])
def test_merged_equals_the_scatter_add_and_the_atomics_per_query(dtype, tol, tile, uses):
  b, t, n, k, k_pad = 2, 22, 11, 20, 32  # K = 20 slots padded to 32, as the kernels pad
  idx, valid = random_selection(jax.random.key(1), b, t, n, k, prefix=False)
  parts = _parts(jax.random.key(2), b, t, k_pad, H, D, uses, dtype)
  valid_p = jnp.pad(valid, ((0, 0), (0, 0), (0, k_pad - k)))
  parts = [(jnp.where(valid_p[..., None], ds, jnp.nan), jnp.where(valid_p[..., None], p, jnp.nan),
            q, do) for ds, p, q, do in parts]
  kv = jnp.zeros((b, n, D), jnp.float32)  # the gradient comes out in kv's dtype
  want = merged_dkv.dkv_reference(n, idx, valid, parts)
  merged = merged_dkv.merged_dkv(kv, idx, valid, parts, tile=tile, block_u=16, num_warps=4,
                                 dkv_chunk=16, interpret=True)
  per_query = sparse_kernel.dkv_from_coefficients(kv, idx, valid, parts, 16, 4, D, True)
  scale = float(jnp.max(jnp.abs(want)))
  assert bool(jnp.isfinite(merged).all())
  np.testing.assert_allclose(merged, want, atol=tol * scale, rtol=0)
  np.testing.assert_allclose(per_query, want, atol=tol * scale, rtol=0)


def test_bad_tile_is_refused():
  idx, valid = jnp.zeros((1, 8, 4), jnp.int32), jnp.ones((1, 8, 4), bool)
  parts = _parts(jax.random.key(0), 1, 8, 16, H, D, 1, jnp.float32)
  with pytest.raises(ValueError, match='power-of-two query tile, got 3'):
    merged_dkv.merged_dkv(jnp.zeros((1, 4, D)), idx, valid, parts, tile=3, block_u=16,
                          num_warps=4, dkv_chunk=D, interpret=True)


def test_fused_gradients_with_merged_adds_equal_the_reference():
  """Through the kernel's own backward (one call) and through the merged softmax's backward."""
  b, t, n, k = 2, 20, 10, 20
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, t, H, D))
  kv = jax.random.normal(ks[1], (b, n, D))
  idx, valid = random_selection(ks[2], b, t, n, k, prefix=False)
  scale = D ** -0.5

  def loss(q, kv, fused, dkv_tile=0):
    if fused:
      o, lse, _ = sparse_partial_fused(q, kv, idx, valid, scale=scale, interpret=True,
                                       bwd_tiles=(16, 4), dkv_tile=dkv_tile)
    else:
      o, lse = compressed_partial(q, kv, idx, valid, impl='reference', scale=scale)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(o * jnp.cos(3 * o)) + jnp.sum(lse_safe * jnp.sin(lse_safe))
  want = jax.grad(loss, argnums=(0, 1))(q, kv, False)
  got = jax.grad(functools.partial(loss, fused=True, dkv_tile=4), argnums=(0, 1))(q, kv)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=2e-5 * float(jnp.max(jnp.abs(w))), rtol=0)

  o, lse = compressed_partial(q, kv, idx, valid, impl='reference', scale=scale)
  do = jax.random.normal(jax.random.key(5), o.shape)
  delta = jnp.sum(do * o, -1)
  lse_in = jnp.where(jnp.isfinite(lse), lse, 0.0)
  atomics, merged = (sparse_backward_fused(q, kv, idx, valid, delta, lse_in, do, scale=scale,
                                           interpret=True, bwd_tiles=(16, 4), dkv_tile=tile)
                     for tile in (0, 8))
  for a, m in zip(atomics, merged):
    np.testing.assert_allclose(m, a, atol=2e-5 * float(jnp.max(jnp.abs(a))), rtol=0)


def test_merged_kernel_lowers_for_triton():
  b, t, n, k, h, d = 1, 64, 32, 64, 16, 512
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, n, d), jnp.bfloat16)
  idx = jnp.zeros((b, t, k), jnp.int32)
  valid = jnp.ones((b, t, k), bool)

  def loss(q, kv):
    o, lse, _ = sparse_partial_fused(q, kv, idx, valid, scale=0.04, interpret=False,
                                     dkv_tile=8)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)
  with triton_lowering_for_h200():
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(q, kv).lower(
        lowering_platforms=('cuda',)).as_text()
  assert 'csa2_sparse_dkv_merged' in text and 'csa2_sparse_bwd_dq' in text
  assert 'csa2_sparse_bwd"' not in text  # the fused backward with per-query atomics is not used
