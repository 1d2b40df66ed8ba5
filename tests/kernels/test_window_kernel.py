"""Fused window kernel (ops/gpu/window_kernel.py) against `_swa_partial_reference`, in interpret
mode.

Outputs and gradients of q and kv under nonzero cotangents on both o and lse, with several
documents per row, a padding tail, image spans, T not a multiple of the blocks, and a window
longer than a document.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops.gpu.window_kernel import window_partial_fused
from deepseek41.ops.swa_attention import _swa_partial_reference, swa_partial
from tests.helpers import triton_lowering_for_h200

# Small blocks so that every query block spans several key blocks and vice versa, and the
# d chunking (block_d < d) is exercised; the forward and dq kernels step over keys in blocks of
# their own (here dq's wider, in test_window_longer_than_documents narrower).
SMALL = dict(block_q=2, block_k=4, block_k_dq=8, block_q_dkv=4, block_k_dkv=8, block_d=16)


def ids(t, runs_per_row):
  """[B, T] int32 from per-row lists of (start, length, id); 0 elsewhere."""
  out = np.zeros((len(runs_per_row), t), np.int32)
  for row, runs in enumerate(runs_per_row):
    for start, length, value in runs:
      out[row, start:start + length] = value
  return out


def documents(t, lengths_per_row):
  runs = []
  for lengths in lengths_per_row:
    starts = np.cumsum((0,) + tuple(lengths))[:-1]
    runs.append([(s, n, k + 1) for k, (s, n) in enumerate(zip(starts, lengths))])
  return ids(t, runs)


def inputs(t, h, d, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((2, t, h, d)).astype(np.float32)
  kv = rng.standard_normal((2, t, d)).astype(np.float32)
  co_o = rng.standard_normal((2, t, h, d)).astype(np.float32)
  co_lse = rng.standard_normal((2, t, h)).astype(np.float32)
  return q, kv, co_o, co_lse


@functools.partial(jax.jit, static_argnames=('fn',))
def with_grads(fn, q, kv, co_o, co_lse):
  """((o, lse), (dq, dkv)) of a fixed linear function of o and of the finite lse."""
  def loss(q, kv):
    o, lse = fn(q, kv)
    finite = jnp.isfinite(lse)
    return (jnp.sum(o.astype(jnp.float32) * co_o) +
            jnp.sum(jnp.where(finite, lse, 0.0) * co_lse), (o, lse))
  (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(q, kv)
  return outs, grads


def compare(t, h, d, window, seg, span, dtype, blocks, atol, rtol_grad):
  q, kv, co_o, co_lse = inputs(t, h, d, seed=t + window)
  q, kv = jnp.asarray(q, dtype), jnp.asarray(kv, dtype)
  scale = d ** -0.5
  ref = functools.partial(_swa_partial_reference, segment_ids_bt=seg, window=window,
                          scale=scale, span_ids_bt=span)
  fused = functools.partial(window_partial_fused, segment_ids_bt=seg, window=window,
                            span_ids_bt=span, interpret=True, **blocks)
  (o_ref, lse_ref), g_ref = with_grads(ref, q, kv, co_o, co_lse)
  (o, lse), g = with_grads(fused, q, kv, co_o, co_lse)
  assert o.dtype == dtype and lse.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=atol)
  lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  np.testing.assert_allclose(lse, lse_ref, atol=atol)   # -inf == -inf passes
  for name, a, b in zip(('dq', 'dkv'), g, g_ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a)), name
    np.testing.assert_allclose(a, b, atol=rtol_grad * np.abs(b).max(), err_msg=name)
  return np.asarray(o, np.float32), lse


# Row 0: documents of 10, 15, 9 then padding; row 1: 20, 14 then padding. T = 37: not a
# multiple of any block. Spans: one inside row 0's second document, and in row 1 one longer
# than the window (its later queries see no window key at all) plus one at a document start.
T, DOCS = 37, ((10, 15, 9), (20, 14))
SPANS = [[(13, 4, 1)], [(3, 11, 1), (20, 3, 2)]]


@pytest.mark.parametrize('dtype,atol,rtol_grad', [(jnp.float32, 2e-5, 2e-5),
                                                  (jnp.bfloat16, 3e-2, 1.5e-2)])
def test_spans_documents_padding(dtype, atol, rtol_grad):
  seg, span = documents(T, DOCS), ids(T, SPANS)
  window = 6
  o, lse = compare(T, 2, 32, window, seg, span, dtype, SMALL, atol, rtol_grad)
  # The test covers what it says: padding, and real queries that see nothing (deep in a span).
  padding = seg == 0
  assert padding.any() and np.all(o[padding] == 0) and np.all(np.isneginf(lse[padding]))
  blind = np.isneginf(lse).any(-1) & ~padding
  assert blind[1, 3 + window:14].all() and np.all(o[blind] == 0)


def test_window_longer_than_documents():
  # window 20 > every document (and > a key block); other block shapes, H = 4, one d chunk.
  t = 48
  seg = documents(t, ((10, 13, 12), (7, 30)))
  compare(t, 4, 16, 20, seg, None, jnp.float32,
          dict(block_q=1, block_k=8, block_k_dq=4, block_q_dkv=2, block_k_dkv=4), 2e-5, 2e-5)


def test_window_longer_than_sequence_and_one():
  t = 24
  seg = documents(t, ((24,), (5, 12)))
  for window in (100, 1):
    compare(t, 2, 16, window, seg, ids(t, [[(4, 6, 3)], []]), jnp.float32, SMALL, 2e-5, 2e-5)


def test_swa_partial_fused_runs_interpreted_on_cpu():
  # Through the public dispatch with the default (GPU) blocks: the CPU runs the interpreter.
  assert jax.default_backend() == 'cpu'
  t, h, d, window = 40, 4, 16, 8
  seg, span = documents(t, ((16, 20), (30,))), ids(t, [[(20, 5, 1)], [(2, 3, 1)]])
  q, kv, co_o, co_lse = inputs(t, h, d, seed=3)

  def fn(impl):
    return functools.partial(swa_partial, segment_ids_bt=seg, window=window, impl=impl,
                             span_ids_bt=span)
  (o_ref, lse_ref), g_ref = with_grads(fn('reference'), q, kv, co_o, co_lse)
  (o, lse), g = with_grads(fn('fused'), q, kv, co_o, co_lse)
  np.testing.assert_allclose(o, o_ref, atol=2e-5)
  np.testing.assert_allclose(lse, lse_ref, atol=2e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize('num_stages,want', [(None, [2, 2, 2]), (3, [3, 3, 3]),
                                             ((3, 3, 1), [3, 3, 1])])
def test_pipeline_depth_reaches_each_kernel(num_stages, want):
  """`num_stages` (one for all, or forward / dq / dkv) is what each kernel lowers with for an
  H200 (no GPU needed: the lowering is asked for Triton on the CPU); the default fits each."""
  q = jax.ShapeDtypeStruct((1, 64, 16, 512), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 64, 512), jnp.bfloat16)
  seg = jnp.ones((1, 64), jnp.int32)

  def loss(q, kv):  # compiled, as on the GPU (the launch rule would interpret on this CPU)
    o, _ = window_partial_fused(q, kv, seg, window=16, num_stages=num_stages, interpret=False)
    return jnp.sum(o.astype(jnp.float32))
  with triton_lowering_for_h200():
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(q, kv).lower(
        lowering_platforms=('cuda',)).as_text()
  assert [int(v) for v in re.findall(r'num_stages = (\d+) : i32', text)] == want


def test_pipeline_depth_of_the_wrong_length_is_refused():
  q, kv, seg = jnp.zeros((1, 8, 16, 16)), jnp.zeros((1, 8, 16)), jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match='num_stages'):
    window_partial_fused(q, kv, seg, window=4, num_stages=(2, 2), interpret=True)


def test_key_block_of_the_dq_kernel_is_validated_by_name():
  q, kv, seg = jnp.zeros((1, 8, 16, 16)), jnp.zeros((1, 8, 16)), jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match='block_k_dq'):
    window_partial_fused(q, kv, seg, window=4, block_k_dq=3, interpret=True)


def test_forward_and_dq_walk_their_own_key_blocks(monkeypatch):
  """Outputs cannot tell which key block a kernel steps over, so this records the block each
  kernel's walk is built with: the forward's `block_k`, the dq kernel's `block_k_dq`, and the
  defaults at 16 heads (64 and 32) and 64 heads (32 and 32)."""
  from deepseek41.ops.gpu import window_kernel as W  # noqa: PLC0415
  seen = []
  real = W._key_blocks
  monkeypatch.setattr(W, '_key_blocks', lambda t0, bk, st: (seen.append(bk), real(t0, bk, st))[1])

  def walks(h, **blocks):
    seen.clear()
    q, kv = jnp.ones((1, 8, h, 16)), jnp.ones((1, 8, 16))
    seg = jnp.ones((1, 8), jnp.int32)
    jax.grad(lambda q: jnp.sum(W.window_partial_fused(q, kv, seg, window=4, interpret=True,
                                                      **blocks)[0]))(q)
    return sorted(set(seen))

  assert walks(2, block_k=8, block_k_dq=2) == [2, 8]
  assert walks(16) == [32, 64]
  assert walks(64) == [32]
