"""The merged-softmax backward (ops/softmax_merge.py) equals autodiff through the merge.

The fused window and sparse kernels joined as `Branch`es, alone and next to plain partials,
against the jnp reference partials merged by `combine_with_sink`: output, and the gradients of
queries, keys/values and the sink, with and without the inverse RoPE folded into the merge.
Kernels interpreted on the CPU, f32.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.model.rope import apply_rope, rope_inv_freq
from deepseek41.ops.gpu.window_kernel import window_backward_fused, window_partial_fused
from deepseek41.ops.softmax_merge import merge
from deepseek41.ops.sparse_attention import compressed_branch, compressed_partial
from deepseek41.ops.swa_attention import combine_with_sink, swa_partial, window_branch

B, T, H, D, N, K, WINDOW = 2, 64, 16, 32, 16, 8, 8


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (B, T, H, D))
  kv = jax.random.normal(ks[1], (B, T, D))
  comp = jax.random.normal(ks[2], (B, N, D))
  idx = jnp.argsort(jax.random.uniform(ks[3], (B, T, N)), axis=-1)[..., :K].astype(jnp.int32)
  valid = jax.random.uniform(ks[4], (B, T, K)) > 0.3
  valid = valid.at[:, :3].set(False)  # the first queries see no entry
  seg = jnp.concatenate([jnp.ones((B, 40), jnp.int32), jnp.full((B, 20), 2, jnp.int32),
                         jnp.zeros((B, 4), jnp.int32)], 1)  # two documents and padding
  sink = jax.random.normal(ks[5], (H,))
  return q, kv, comp, idx, valid, seg, sink


def _loss(o_bthd):
  # A cotangent that differs per element, so no gradient term can cancel by symmetry.
  w = jnp.sin(jnp.arange(o_bthd.size, dtype=jnp.float32)).reshape(o_bthd.shape)
  return jnp.sum(w * o_bthd)


ROPE = functools.partial(apply_rope, inv_freq=rope_inv_freq(8, 10000.0))
POSITIONS = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) * 37, (B, T))  # angles of all sizes


@pytest.mark.parametrize('kinds,rotated', [
    (('window', 'sparse'), True), (('window', 'sparse'), False),
    (('window', 'plain_sparse'), True), (('plain_window', 'sparse'), False), (('window',), True)])
def test_branches_equal_autodiff_through_the_merge(kinds, rotated):
  q, kv, comp, idx, valid, seg, sink = _inputs()
  rope = ROPE if rotated else None

  def reference(q, kv, comp, sink):
    parts = [swa_partial(q, kv, seg, window=WINDOW, impl='reference')]
    if len(kinds) > 1:
      parts.append(compressed_partial(q, comp, idx, valid, impl='reference'))
    o_bthd = combine_with_sink(parts, sink)
    return _loss(ROPE(o_bthd, POSITIONS, inverse=True) if rotated else o_bthd)

  def merged(q, kv, comp, sink):
    parts = [window_branch(q, kv, seg, window=WINDOW) if kinds[0] == 'window' else
             swa_partial(q, kv, seg, window=WINDOW, impl='reference')]
    if kinds[1:] == ('sparse',):
      parts.append(compressed_branch(q, comp, idx, valid)[0])
    elif kinds[1:] == ('plain_sparse',):
      parts.append(compressed_partial(q, comp, idx, valid, impl='reference'))
    o_bthd, handoffs = merge(parts, sink, dtype=jnp.float32, rope=rope, positions_bt=POSITIONS)
    assert handoffs == [{} for k in kinds if k in ('window', 'sparse')]
    return _loss(o_bthd)

  args = (q, kv, comp, sink)
  l_ref, g_ref = jax.value_and_grad(reference, argnums=range(4))(*args)
  l_m, g_m = jax.jit(jax.value_and_grad(merged, argnums=range(4)))(*args)
  np.testing.assert_allclose(l_m, l_ref, rtol=1e-5)
  for name, a, b in zip(('q', 'kv', 'compressed kv', 'sink'), g_m, g_ref):
    assert np.abs(np.asarray(b)).max() > 0 or name == 'compressed kv'
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_window_backward_alone_equals_the_kernels_vjp_of_its_output():
  # Given the branch's own (D, lse) and dlse = 0, the backward is the partial's VJP in o.
  q, kv, _, _, _, seg, _ = _inputs(1)
  fused = lambda q, kv: window_partial_fused(q, kv, seg, window=WINDOW, interpret=True)
  (o, lse), vjp = jax.vjp(fused, q, kv)
  do = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
  dq_ref, dkv_ref = vjp((do, jnp.zeros_like(lse)))
  delta = jnp.sum(do * o, axis=-1)
  dq, dkv = window_backward_fused(q, kv, seg, delta, lse, do, window=WINDOW, interpret=True)
  np.testing.assert_allclose(dq, dq_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dkv, dkv_ref, rtol=1e-4, atol=1e-5)


def _forward_kernels(jaxpr):
  """The window forward kernels a program launches, by their kernel names."""
  return set(re.findall(r'name=(swa_window_fwd\w*)', str(jaxpr)))


def test_the_mosaic_window_forward_joins_the_merge_as_the_triton_one_does():
  # model.window_forward=mosaic: the branch's forward from the Mosaic GPU kernel (interpreted),
  # its backward from the merged softmax as before. bf16 (the Mosaic kernel's dtypes), d = 128
  # (its smallest); against the same branch on the Triton forward.
  q, kv, _, _, _, seg, sink = _inputs(2)
  q = jnp.concatenate([q] * 4, -1).astype(jnp.bfloat16)  # D 32 -> 128
  kv = jnp.concatenate([kv] * 4, -1).astype(jnp.bfloat16)

  def merged(q, kv, sink, fused_forward):
    branch = window_branch(q, kv, seg, window=WINDOW, fused_forward=fused_forward)
    o_bthd, _ = merge([branch], sink, dtype=jnp.float32)
    return _loss(o_bthd)

  grads = {}
  for kernel in ('triton', 'mosaic'):
    fn = jax.jit(jax.value_and_grad(functools.partial(merged, fused_forward=kernel),
                                    argnums=range(3)))
    forwards = _forward_kernels(jax.make_jaxpr(fn)(q, kv, sink))
    assert forwards == {'triton': {'swa_window_fwd'}, 'mosaic': {'swa_window_fwd_mgpu'}}[kernel]
    grads[kernel] = fn(q, kv, sink)
  (l_t, g_t), (l_m, g_m) = grads['triton'], grads['mosaic']
  np.testing.assert_allclose(l_m, l_t, rtol=2e-2)
  for name, a, b in zip(('q', 'kv', 'sink'), g_m, g_t):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(b).max() > 0
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), name


def test_the_mosaic_window_forward_leaves_image_spans_and_fp32_to_triton():
  q, kv, _, _, _, seg, _ = _inputs(3)
  spans = jnp.zeros_like(seg).at[:, 8:16].set(1)
  for args, kw in (((q, kv), {}),  # fp32: the Mosaic kernel takes 16-bit latents only
                   ((q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)), {'span_ids_bt': spans})):
    jaxpr = jax.make_jaxpr(lambda q, kv: window_branch(
        q, kv, seg, window=WINDOW, fused_forward='mosaic', **kw).o_bthd)(*args)
    assert _forward_kernels(jaxpr) == {'swa_window_fwd'}
