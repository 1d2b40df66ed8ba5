"""The dense baseline's attention op (ops/dense_attention.py): every earlier key of the document.

A plain numpy softmax is the ground truth for the reference; the chunked path and the fused
kernel (Pallas interpreter) equal the reference in outputs and gradients, with packed
documents, a padding tail, image spans and T not a multiple of the chunk.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops.dense_attention import causal_runs, dense_branch, dense_partial
from deepseek41.ops.gpu.window_kernel import window_partial_fused
from deepseek41.ops.softmax_merge import merge
from tests.helpers import documents, triton_lowering_for_h200

B, T, H, D = 2, 23, 2, 8


SEG = documents(T, [(9, 14), (5, 7, 6)])  # row 1 ends in 5 padding positions


def inputs(seed=0, t=T):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, t, H, D)).astype(np.float32)
  kv = rng.standard_normal((B, t, D)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(kv)


def numpy_dense(q, kv, seg):
  """Softmax over u <= t of the same document, one query and head at a time."""
  q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
  o = np.zeros(q.shape)
  lse = np.full(q.shape[:3], -np.inf)
  for b in range(q.shape[0]):
    for t in range(q.shape[1]):
      keys = [u for u in range(t + 1) if seg[b, u] == seg[b, t] != 0]
      if not keys:
        continue
      s = q[b, t] @ kv[b, keys].T / np.sqrt(q.shape[-1])   # [H, U]
      m = s.max(-1, keepdims=True)
      p = np.exp(s - m)
      o[b, t] = (p / p.sum(-1, keepdims=True)) @ kv[b, keys]
      lse[b, t] = (m + np.log(p.sum(-1, keepdims=True)))[:, 0]
  return o, lse


def test_reference_is_causal_attention_within_documents():
  q, kv = inputs()
  o, lse = dense_partial(q, kv, jnp.asarray(SEG), impl='reference')
  o_np, lse_np = numpy_dense(q, kv, SEG)
  np.testing.assert_allclose(np.asarray(o), o_np, atol=1e-5)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(lse_np))
  np.testing.assert_allclose(np.asarray(lse), lse_np, atol=1e-5)
  assert np.isneginf(np.asarray(lse)[1, -5:]).all()  # padding sees nothing


@functools.partial(jax.jit, static_argnames=('fn',))
def with_grads(fn, q, kv, co_o, co_lse):
  def loss(q, kv):
    o, lse = fn(q, kv)
    return (jnp.sum(o.astype(jnp.float32) * co_o) +
            jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * co_lse), (o, lse))
  (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(q, kv)
  return outs, grads


def compare(impl, span=None, chunk=None, atol=1e-5):
  q, kv = inputs(seed=1)
  rng = np.random.default_rng(2)
  co_o = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  co_lse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
  seg = jnp.asarray(SEG)
  span = None if span is None else jnp.asarray(span)
  ref = functools.partial(dense_partial, segment_ids_bt=seg, impl='reference', span_ids_bt=span)
  got = functools.partial(dense_partial, segment_ids_bt=seg, impl=impl, chunk=chunk,
                          span_ids_bt=span)
  (o_ref, lse_ref), g_ref = with_grads(ref, q, kv, co_o, co_lse)
  (o, lse), g = with_grads(got, q, kv, co_o, co_lse)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref), atol=atol)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(lse_ref)))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=atol)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol * 10)


@pytest.mark.parametrize('chunk', [4, 5, None])
def test_chunked_equals_the_reference(chunk):
  compare('chunked', chunk=chunk)


def test_chunked_leaves_image_spans_to_the_span_branch():
  span = np.zeros((B, T), np.int32)
  span[0, 3:7] = 1     # inside document 1 of row 0
  span[1, 13:16] = 2   # inside document 3 of row 1
  compare('chunked', span=span, chunk=4)


def test_fused_kernel_equals_the_reference():
  compare('fused', atol=2e-5)


def test_causal_runs_cover_the_rows_in_whole_chunks():
  assert causal_runs(23, 4, 4) == [(0, 4), (4, 12), (12, 16), (16, 23)]
  assert causal_runs(8, 8, 4) == [(0, 8)]
  for t, c, r in ((100, 7, 3), (16, 16, 1), (33, 2, 8)):
    runs = causal_runs(t, c, r)
    assert runs[0][0] == 0 and runs[-1][1] == t
    assert all(a[1] == b[0] and a[0] % c == 0 for a, b in zip(runs, runs[1:]))


def test_no_query_sees_a_later_key_or_another_document():
  """Perturb one key: only its own document's queries at or after it move."""
  q, kv = inputs(seed=3)
  seg = jnp.asarray(SEG)
  base, _ = dense_partial(q, kv, seg, impl='chunked', chunk=4)
  u = 4   # row 0, document 1 (positions 0..8)
  moved, _ = dense_partial(q, kv.at[0, u].add(1.0), seg, impl='chunked', chunk=4)
  changed = np.abs(np.asarray(moved - base)).max(axis=(2, 3)) > 0
  expected = np.zeros((B, T), bool)
  expected[0, u:9] = True
  np.testing.assert_array_equal(changed, expected)


def test_the_branch_merges_like_the_partial():
  """The fused Branch in the merged softmax (model.merged_backward): the output and gradients
  of a plain partial merged with the sink."""
  q, kv = inputs(seed=4)
  seg, sink = jnp.asarray(SEG), jnp.asarray([0.3, -0.2], jnp.float32)
  co = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32)

  def loss(q, kv, sink, branch):
    part = dense_branch(q, kv, seg) if branch else dense_partial(q, kv, seg, impl='reference')
    return jnp.sum(merge([part], sink, dtype=jnp.float32)[0] * co)
  want = jax.grad(functools.partial(loss, branch=False), argnums=(0, 1, 2))(q, kv, sink)
  got = jax.grad(functools.partial(loss, branch=True), argnums=(0, 1, 2))(q, kv, sink)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)


def test_fused_dense_lowers_for_the_h200_at_the_shipped_shapes():
  """The window kernel with the row as its window, forward and backward, at
  configs/ablation_1b.py's heads and width, lowers to Triton for an H200 (on this CPU: the
  lowering only, no GPU and no Triton compile)."""
  t = 1024
  q = jnp.zeros((1, t, 16, 512), jnp.bfloat16)
  kv = jnp.zeros((1, t, 512), jnp.bfloat16)
  seg = jnp.ones((1, t), jnp.int32)

  def loss(q, kv):  # compiled, as on the GPU (the launch rule would interpret on this CPU)
    o, _ = window_partial_fused(q, kv, seg, window=t, interpret=False)
    return jnp.sum(o.astype(jnp.float32))
  with triton_lowering_for_h200():
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(q, kv).lower(
        lowering_platforms=('cuda',)).as_text()
  assert text.count('swa_window_') >= 3   # the forward, dq and dkv kernels
