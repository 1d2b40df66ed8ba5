"""The fused sparse attention kernel (Pallas interpreter on the CPU) equals the jnp reference."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.transformer import Transformer
from deepseek41.ops.gpu import sparse_kernel
from deepseek41.ops.gpu.sparse_kernel import sparse_partial_fused
from deepseek41.ops.sparse_attention import compressed_partial
from tests.helpers import (GROUPED, packed_batch, random_selection, resolved, token_ce,
                           triton_lowering_for_h200)

H, D = 16, 32


def _both(q, kv, idx, valid, block_k, dkv_chunk=sparse_kernel.FULL_WIDTH, fwd_head_group=0):
  """(value, aux, grads) of a loss with nonzero cotangents on o AND lse, for both paths."""
  scale = q.shape[-1] ** -0.5

  def run(fused):
    def loss(q, kv):
      if fused:
        o, lse, mass = sparse_partial_fused(q, kv, idx, valid, scale=scale, with_mass=True,
                                            fwd_tiles=(block_k, 4, 1, fwd_head_group),
                                            bwd_tiles=(block_k, 4, 8, dkv_chunk),
                                            interpret=True)
      else:
        o, lse, mass = compressed_partial(q, kv, idx, valid, impl='reference', scale=scale,
                                          with_mass=True)
      o = o.astype(jnp.float32)
      lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(o * jnp.cos(3 * o)) + jnp.sum(lse_safe * jnp.sin(lse_safe)), (o, lse, mass)
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(q, kv)
  return run(False), run(True)


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize('prefix,mass_on_chip,dkv_chunk',
                         [(True, True, D), (False, True, 16), (False, False, D)])
def test_fused_equals_reference_in_outputs_mass_and_gradients(dtype, tol, prefix, mass_on_chip,
                                                              dkv_chunk, monkeypatch):
  # dkv_chunk < D: the backward adds the key/value gradient 16 columns at a time.
  # mass_on_chip False: too many scores to keep in registers, the mass takes a second walk.
  if not mass_on_chip:
    monkeypatch.setattr(sparse_kernel, 'MASS_SCORES_PER_WARP', 0)
  b, t, n, k = 2, 20, 10, 20  # k > n: unused slots; 20 slots = two 16-slot blocks, padded
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, t, H, D)).astype(dtype)
  kv = jax.random.normal(ks[1], (b, n, D)).astype(dtype)
  idx, valid = random_selection(ks[2], b, t, n, k, prefix=prefix)
  assert not valid.any(-1).all() and valid.any()  # some queries see nothing, some see entries
  ((_, (o_r, lse_r, m_r)), g_r), ((_, (o_f, lse_f, m_f)), g_f) = _both(q, kv, idx, valid, 16,
                                                                      dkv_chunk)
  np.testing.assert_array_equal(np.isfinite(lse_r), np.isfinite(lse_f))
  fin = np.isfinite(lse_r)
  np.testing.assert_allclose(np.asarray(lse_f)[fin], np.asarray(lse_r)[fin], atol=tol, rtol=tol)
  np.testing.assert_allclose(o_f, o_r, atol=tol, rtol=tol)
  np.testing.assert_allclose(m_f, m_r, atol=tol, rtol=tol)
  for a_f, a_r in zip(g_f, g_r):
    a_f, a_r = np.asarray(a_f, np.float32), np.asarray(a_r, np.float32)
    scale = np.abs(a_r).max()
    assert scale > 0
    np.testing.assert_allclose(a_f / scale, a_r / scale, atol=tol)


def test_fused_without_mass_and_through_compressed_partial():
  b, t, n, k = 1, 16, 8, 16
  ks = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(ks[0], (b, t, H, D))
  kv = jax.random.normal(ks[1], (b, n, D))
  idx, valid = random_selection(ks[2], b, t, n, k)
  o_f, lse_f = compressed_partial(q, kv, idx, valid, impl='fused')  # CPU: interpreted
  o_r, lse_r = compressed_partial(q, kv, idx, valid, impl='reference')
  np.testing.assert_allclose(o_f, o_r, atol=2e-5)
  fin = np.isfinite(np.asarray(lse_r))
  np.testing.assert_allclose(np.asarray(lse_f)[fin], np.asarray(lse_r)[fin], atol=2e-5)


def test_fused_pads_any_heads_and_width_to_what_triton_multiplies():
  b, t, n, k, h, d = 1, 16, 8, 6, 3, 24  # padded to 16 heads x 32 inside
  ks = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(ks[0], (b, t, h, d))
  kv = jax.random.normal(ks[1], (b, n, d))
  idx, valid = random_selection(ks[2], b, t, n, k)
  ((_, (o_r, lse_r, m_r)), g_r), ((_, (o_f, lse_f, m_f)), g_f) = _both(q, kv, idx, valid, 16)
  assert o_f.shape == o_r.shape and lse_f.shape == lse_r.shape
  fin = np.isfinite(np.asarray(lse_r))
  np.testing.assert_allclose(np.asarray(lse_f)[fin], np.asarray(lse_r)[fin], atol=2e-5)
  np.testing.assert_allclose(o_f, o_r, atol=2e-5)
  np.testing.assert_allclose(m_f, m_r, atol=2e-5)  # padding heads carry no mass
  for a_f, a_r in zip(g_f, g_r):
    np.testing.assert_allclose(a_f, a_r, atol=2e-5 * np.abs(a_r).max())


@pytest.mark.parametrize('mass_on_chip', [True, False])
def test_forward_head_groups_split_the_heads_and_their_mass(mass_on_chip, monkeypatch):
  """ForwardTiles.head_group: a query's heads over several programs, each adding its share of
  the slot mass (V4.1's 64 heads as two programs of 32, the mass in one pass); 24 heads pad to
  32, so the second group holds 8 padding heads that must carry no mass."""
  if not mass_on_chip:
    monkeypatch.setattr(sparse_kernel, 'MASS_SCORES_PER_WARP', 0)
  b, t, n, k, h = 1, 20, 10, 20, 24
  ks = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(ks[0], (b, t, h, D))
  kv = jax.random.normal(ks[1], (b, n, D))
  idx, valid = random_selection(ks[2], b, t, n, k, prefix=False)
  ((_, (o_r, lse_r, m_r)), g_r), ((_, (o_f, lse_f, m_f)), g_f) = _both(q, kv, idx, valid, 16,
                                                                      fwd_head_group=16)
  fin = np.isfinite(np.asarray(lse_r))
  np.testing.assert_allclose(np.asarray(lse_f)[fin], np.asarray(lse_r)[fin], atol=2e-5)
  np.testing.assert_allclose(o_f, o_r, atol=2e-5)
  np.testing.assert_allclose(m_f, m_r, atol=2e-5)
  for a_f, a_r in zip(g_f, g_r):
    np.testing.assert_allclose(a_f, a_r, atol=2e-5 * np.abs(a_r).max())
  with pytest.raises(ValueError, match='head_group 12 does not divide'):
    sparse_partial_fused(q, kv, idx, valid, scale=1.0, fwd_tiles=(16, 4, 1, 12), interpret=True)


@pytest.mark.parametrize('kv_quant', ['none', 'fp4_e4m3_16'])
def test_model_with_the_fused_kernel_equals_the_gathered_path(kv_quant):
  """Loss and every parameter gradient, documents packed, released KV fake quantization on/off."""
  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.index_n_heads': 2,
                    'model.index_head_dim': 8,
                    'model.sparse_chunk': 16, 'model.num_heads': 16, 'model.o_groups': 2,
                    'model.kv_quant': kv_quant}).model
  batch = {k: jnp.asarray(v) for k, v in packed_batch(seed=3, docs_per_row=2, pad=4).items()}
  batch = {k: v[:2] for k, v in batch.items()}

  def loss_and_grads(impl):
    model = Transformer(dataclasses.replace(cfg, sparse_impl=impl), nnx.Rngs(params=0))

    def loss(m):
      return jnp.sum(token_ce(m, batch)) / batch['loss_mask'].sum()
    return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)
  l_ref, g_ref = loss_and_grads('gathered')
  l_f, g_f = loss_and_grads('fused')
  np.testing.assert_allclose(l_f, l_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_grouped_key_value_gradient_equals_the_gathered_path():
  """Layers sharing a selection add their kv gradient once (the index source's backward): the
  same loss and gradients as the gathered path, with one key/value kernel per group."""
  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.index_n_heads': 2,
                    'model.index_head_dim': 8,
                    'model.sparse_chunk': 16, 'model.num_heads': 16, 'model.o_groups': 2,
                    **GROUPED}).model
  batch = {k: jnp.asarray(v)[:2] for k, v in packed_batch(seed=3, docs_per_row=2, pad=4).items()}

  def loss_and_grads(impl, group=True, dkv_tile=0):
    model = Transformer(dataclasses.replace(cfg, sparse_impl=impl, sparse_group_dkv=group,
                                            sparse_dkv_tile=dkv_tile),
                        nnx.Rngs(params=0), remat='block')

    def loss(m):
      return jnp.sum(token_ce(m, batch)) / batch['loss_mask'].sum()
    graph, weights = nnx.split(model)
    # Traced once: its jaxpr read for the kernels, then compiled and run.
    traced = jax.jit(lambda w: nnx.value_and_grad(loss)(nnx.merge(graph, w))).trace(weights)
    return traced.lower().compile()(weights), str(traced.jaxpr)
  (l_ref, g_ref), _ = loss_and_grads('gathered')
  (l_f, g_f), jaxpr = loss_and_grads('fused')
  assert jaxpr.count('name=csa2_sparse_dkv') == 2
  assert not re.search(r'name=csa2_sparse_bwd\b', jaxpr)  # no layer adds its own
  np.testing.assert_allclose(l_f, l_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  (l_own, g_own), jaxpr = loss_and_grads('fused', group=False)  # each layer adds its own
  assert 'csa2_sparse_dkv' not in jaxpr and re.search(r'name=csa2_sparse_bwd\b', jaxpr)
  np.testing.assert_allclose(l_own, l_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_own), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # model.sparse_dkv_tile: each group's adds merged per tile of 4 queries (ops/gpu/merged_dkv.py)
  (l_m, g_m), jaxpr = loss_and_grads('fused', dkv_tile=4)
  assert jaxpr.count('name=csa2_sparse_dkv_merged') == 2
  np.testing.assert_allclose(l_m, l_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# BackwardTiles: (block_k, warps, head_group, dkv_chunk, stages, dq_block_k, dq_warps, dq_stages,
# dkv_tile)
@pytest.mark.parametrize('bwd_tiles', [(16, 4, 8, 16, 1, 32, 4, 1), (32, 4, 8, 16, 1, 16, 4, 1)],
                         ids=['dq_wider', 'dkv_wider'])
def test_grouped_calls_hand_off_and_add_once(bwd_tiles):
  """The kernel API: a first call and two later calls over one kv and selection, against three
  plain calls: the same outputs and gradients (interpreter). The dq kernel and the key/value
  kernel walk the slots in blocks of different sizes: where the key/value kernel's blocks are
  the wider, it reads slots past a query's last valid one that the dq kernel never wrote."""
  b, t, n, k = 2, 24, 12, 24  # valid slots scattered over 32 padded ones: 1 or 2 blocks
  ks = jax.random.split(jax.random.key(5), 3)
  kv = jax.random.normal(ks[0], (b, n, D))
  idx, valid = random_selection(ks[1], b, t, n, k, prefix=False)
  qs = jax.random.normal(ks[2], (3, b, t, H, D))
  kw = dict(scale=D ** -0.5, fwd_tiles=(16, 4), bwd_tiles=bwd_tiles, interpret=True)

  def score(o, lse):
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(o * jnp.cos(3 * o)) + jnp.sum(lse * jnp.sin(lse))

  def plain(qs, kv):
    return sum(score(*sparse_partial_fused(qs[u], kv, idx, valid, **kw)[:2]) * (u + 1)
               for u in range(3))

  def grouped(qs, kv):
    o, lse, _, sinks = sparse_partial_fused(qs[0], kv, idx, valid, later=2, **kw)
    total = score(o, lse)
    for u in (1, 2):
      o, lse, _ = sparse_partial_fused(qs[u], kv, idx, valid, sink=sinks[u - 1], **kw)
      total = total + score(o, lse) * (u + 1)
    return total
  np.testing.assert_allclose(grouped(qs, kv), plain(qs, kv), rtol=1e-6)
  for a, want in zip(jax.grad(grouped, argnums=(0, 1))(qs, kv),
                     jax.grad(plain, argnums=(0, 1))(qs, kv)):
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_kernels_lower_for_triton():
  """The forward, the fused backward and the deferred pair (dq + coefficients, the shared
  key/value kernel) lower to Triton IR for an H200 on the CPU: the interpreter cannot see what
  the Triton lowering refuses (the coefficients' transposed stores, say)."""
  b, t, n, k, h, d = 1, 64, 32, 64, 16, 512
  qs = jax.ShapeDtypeStruct((2, b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, n, d), jnp.bfloat16)
  idx = jnp.zeros((b, t, k), jnp.int32)
  valid = jnp.ones((b, t, k), bool)

  def loss(qs, kv, grouped):
    # Compiled, as on the GPU (the launch rule would interpret on this CPU).
    kw = dict(scale=0.04, interpret=False)
    if grouped:
      o, lse, _, sinks = sparse_partial_fused(qs[0], kv, idx, valid, later=1, **kw)
      o2, lse2, _ = sparse_partial_fused(qs[1], kv, idx, valid, sink=sinks[0], **kw)
    else:
      o, lse, _ = sparse_partial_fused(qs[0], kv, idx, valid, **kw)
      o2, lse2 = o, lse
    return sum(jnp.sum(x.astype(jnp.float32)) for x in (o, o2, lse, lse2))
  with triton_lowering_for_h200():
    # Pipeline depths of the 16-head defaults: forward 3, fused backward 2; grouped: the
    # forward (both calls are one launch, lowered once: ops/launch.py), two dq kernels at 3,
    # the key/value kernel unpipelined.
    for grouped, names, stages in ((False, ('csa2_sparse_fwd', 'csa2_sparse_bwd'), [2, 3]),
                                   (True, ('csa2_sparse_bwd_dq', 'csa2_sparse_dkv'),
                                    [1, 3, 3, 3])):
      text = jax.jit(jax.grad(functools.partial(loss, grouped=grouped), argnums=(0, 1))).trace(
          qs, kv).lower(lowering_platforms=('cuda',)).as_text()
      assert 'triton' in text and all(name in text for name in names)
      assert sorted(int(v) for v in re.findall(r'num_stages = (\d+) : i32', text)) == stages


def test_head_grouped_forward_with_its_mass_lowers_for_triton():
  """V4.1's 64 heads as two programs of 32 (8 warps each), the slot mass kept on chip."""
  b, t, n, k, h, d = 1, 64, 32, 64, 64, 512
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, n, d), jnp.bfloat16)
  idx, valid = jnp.zeros((b, t, k), jnp.int32), jnp.ones((b, t, k), bool)

  def forward(q, kv):
    return sparse_partial_fused(q, kv, idx, valid, scale=0.04, with_mass=True,
                                fwd_tiles=(64, 8, 2, 32), interpret=False)
  with triton_lowering_for_h200():
    text = jax.jit(forward).trace(q, kv).lower(lowering_platforms=('cuda',)).as_text()
  assert 'csa2_sparse_fwd' in text and 'num_warps = 8' in text


def test_too_many_tile_fields_are_refused():
  kv = jnp.zeros((1, 4, D))
  idx, valid = jnp.zeros((1, 8, 4), jnp.int32), jnp.ones((1, 8, 4), bool)
  with pytest.raises(ValueError, match='bwd_tiles has 10 fields'):
    sparse_partial_fused(jnp.zeros((1, 8, H, D)), kv, idx, valid, scale=1.0,
                         bwd_tiles=(16,) * 10, interpret=True)
