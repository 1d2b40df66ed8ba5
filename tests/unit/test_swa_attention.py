"""Sliding-window attention branch (docs/architecture.md 3.3, 3.5): masks, sink, merge, impls.

Masks are checked by perturbation (change inputs, compare outputs bit for bit), the sink and the
merge against a plain numpy softmax written here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops.swa_attention import combine_with_sink, swa_attention, swa_partial

B, H, D, WINDOW = 2, 3, 16, 8
# Row 0: documents of 20, 25, 10 tokens then padding; row 1: 30, 27 then padding.
DOC_LENGTHS = ((20, 25, 10), (30, 27))


def segment_ids(t, doc_lengths=DOC_LENGTHS):
  rows = []
  for lengths in doc_lengths:
    row = np.concatenate([np.full(n, k + 1) for k, n in enumerate(lengths)])[:t]
    rows.append(np.pad(row, (0, t - len(row))))
  return np.stack(rows).astype(np.int32)


def inputs(t, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, t, H, D)).astype(dtype)
  kv = rng.standard_normal((B, t, D)).astype(dtype)
  sink = rng.standard_normal(H).astype(np.float32)
  return q, kv, segment_ids(t), sink


@functools.partial(jax.jit, static_argnames=('window', 'impl', 'chunk'))
def attend(q, kv, seg, sink, *, window=WINDOW, impl='chunked', chunk=None):
  return swa_attention(q, kv, seg, sink, window=window, impl=impl, chunk=chunk)


def np_visible(seg, window):
  """[B, T, T] visibility written out directly from the definition."""
  b, t = seg.shape
  vis = np.zeros((b, t, t), bool)
  for bi in range(b):
    for ti in range(t):
      for u in range(max(0, ti - window + 1), ti + 1):
        vis[bi, ti, u] = seg[bi, ti] != 0 and seg[bi, u] == seg[bi, ti]
  return vis


def np_partial(q, kv, vis):
  """Per-branch (o normalised over the branch's keys, lse); zeros / -inf where nothing is seen."""
  q, kv = q.astype(np.float64), kv.astype(np.float64)
  s = np.einsum('bthd,bud->bthu', q, kv) / np.sqrt(q.shape[-1])
  o = np.zeros(q.shape)
  lse = np.full(q.shape[:3], -np.inf)
  for bi, ti in zip(*np.nonzero(vis.any(-1))):
    keys = np.nonzero(vis[bi, ti])[0]
    sk = s[bi, ti][:, keys]                       # [H, keys]
    m = sk.max(-1, keepdims=True)
    e = np.exp(sk - m)
    o[bi, ti] = (e / e.sum(-1, keepdims=True)) @ kv[bi, keys]
    lse[bi, ti] = (m + np.log(e.sum(-1, keepdims=True)))[:, 0]
  return o, lse


def np_attention_with_sink(q, kv, vis, sink):
  """softmax over [visible scores, sink]; the sink column carries no value."""
  q, kv = q.astype(np.float64), kv.astype(np.float64)
  s = np.einsum('bthd,bud->bthu', q, kv) / np.sqrt(q.shape[-1])
  o = np.zeros(q.shape)
  for bi, ti in zip(*np.nonzero(vis.any(-1))):
    keys = np.nonzero(vis[bi, ti])[0]
    logits = np.concatenate([s[bi, ti][:, keys], np.asarray(sink, np.float64)[:, None]], -1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o[bi, ti] = p[:, :-1] @ kv[bi, keys]
  return o


# ---------------------------------------------------------------------------------------------
# Both implementations against numpy, and against each other including gradients.


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_matches_numpy_softmax_with_sink(impl):
  q, kv, seg, sink = inputs(61)
  o, lse = attend(q, kv, seg, sink, impl=impl)
  vis = np_visible(seg, WINDOW)
  np.testing.assert_allclose(o, np_attention_with_sink(q, kv, vis, sink), atol=2e-6)
  np.testing.assert_allclose(lse, np_partial(q, kv, vis)[1], atol=2e-6)
  assert o.dtype == jnp.float32 and lse.dtype == jnp.float32


@functools.partial(jax.jit, static_argnames=('window', 'impl', 'chunk'))
def attend_with_grads(q, kv, seg, sink, *, window=WINDOW, impl='chunked', chunk=None):
  """((o, lse), (dq, dkv, dsink)) of a fixed random linear function of o and the finite lse."""
  rng = np.random.default_rng(1)
  co_o = rng.standard_normal(q.shape).astype(np.float32)
  co_lse = rng.standard_normal(q.shape[:3]).astype(np.float32)

  def loss(q, kv, sink):
    o, lse = swa_attention(q, kv, seg, sink, window=window, impl=impl, chunk=chunk)
    return (jnp.sum(o * co_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * co_lse, 0.0)),
            (o, lse))

  (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, kv, sink)
  return outputs, grads


@pytest.mark.parametrize('t,window,chunk', [
    (61, 8, None),    # T not a multiple of the window
    (64, 8, None),    # T a multiple
    (50, 100, None),  # window longer than the sequence
    (61, 1, None),    # only the token itself
    (61, 8, 3),       # chunk < window: three look-back blocks
    (61, 8, 16),      # chunk > window
])
def test_chunked_equals_reference(t, window, chunk):
  q, kv, seg, sink = inputs(t, seed=t + window)
  (o_ref, lse_ref), g_ref = attend_with_grads(q, kv, seg, sink, window=window, impl='reference')
  (o_chk, lse_chk), g_chk = attend_with_grads(q, kv, seg, sink, window=window, impl='chunked',
                                              chunk=chunk)
  np.testing.assert_allclose(o_chk, o_ref, atol=1e-6)
  np.testing.assert_allclose(lse_chk, lse_ref, atol=1e-5)   # -inf at the same places
  for name, a, b in zip(('dq', 'dkv', 'dsink'), g_chk, g_ref):
    assert np.all(np.isfinite(a)), name
    np.testing.assert_allclose(a, b, atol=2e-5, err_msg=name)
  assert np.abs(g_ref[2]).max() > 0  # the sink does get a gradient


def test_bfloat16_inputs():
  q, kv, seg, sink = inputs(61)
  o32, _ = attend(q, kv, seg, sink)
  o16, lse16 = attend(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), seg, sink)
  assert o16.dtype == jnp.bfloat16 and lse16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o16, np.float32), o32, atol=5e-2)


# ---------------------------------------------------------------------------------------------
# Masks, by perturbation: outputs that must not depend on a change stay bit-identical.


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_causality(impl):
  q, kv, seg, sink = inputs(61)
  o, _ = attend(q, kv, seg, sink, impl=impl)
  for t_changed in (5, 24, 40):
    kv2, q2 = kv.copy(), q.copy()
    kv2[:, t_changed] += 3.0
    q2[:, t_changed] -= 2.0
    o2, _ = attend(q2, kv2, seg, sink, impl=impl)
    np.testing.assert_array_equal(o2[:, :t_changed], o[:, :t_changed])
    assert not np.allclose(o2[:, t_changed], o[:, t_changed])


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_document_isolation(impl):
  q, kv, seg, sink = inputs(61)
  o, _ = attend(q, kv, seg, sink, impl=impl)
  in_doc2 = seg == 2
  q2, kv2 = q.copy(), kv.copy()
  q2[in_doc2] = np.random.default_rng(5).standard_normal(q2[in_doc2].shape)
  kv2[in_doc2] = np.random.default_rng(6).standard_normal(kv2[in_doc2].shape)
  o2, _ = attend(q2, kv2, seg, sink, impl=impl)
  np.testing.assert_array_equal(np.asarray(o2)[~in_doc2], np.asarray(o)[~in_doc2])
  # The first token of row 0's third document is right after document 2 but sees none of it.
  assert seg[0, 45] == 3 and seg[0, 44] == 2
  assert not np.allclose(np.asarray(o2)[in_doc2], np.asarray(o)[in_doc2])


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_window_edge(impl):
  q, kv, seg, sink = inputs(61)
  o, _ = attend(q, kv, seg, sink, impl=impl)
  t_changed = 32   # inside row 0's second document and row 1's first
  kv2 = kv.copy()
  kv2[:, t_changed] += 3.0
  o2, _ = attend(q, kv2, seg, sink, impl=impl)
  o, o2 = np.asarray(o), np.asarray(o2)
  # Queries t_changed .. t_changed+WINDOW-1 see it, the next one no longer does.
  last_seeing = t_changed + WINDOW - 1
  assert not np.allclose(o2[:, last_seeing], o[:, last_seeing])
  np.testing.assert_array_equal(o2[:, last_seeing + 1:], o[:, last_seeing + 1:])


# ---------------------------------------------------------------------------------------------
# Sink and merge.


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_sink_limits(impl):
  q, kv, seg, _ = inputs(61)
  vis = np_visible(seg, WINDOW)
  no_sink, _ = attend(q, kv, seg, np.full(H, -1e9, np.float32), impl=impl)
  np.testing.assert_allclose(no_sink, np_partial(q, kv, vis)[0], atol=2e-6)
  small, _ = attend(q, kv, seg, np.zeros(H, np.float32), impl=impl)
  big, _ = attend(q, kv, seg, np.full(H, 30.0, np.float32), impl=impl)
  assert np.abs(big).max() < 1e-6 * np.abs(small).max()


def test_combine_two_branches_equals_one_over_all_keys():
  q, kv, seg, sink = inputs(61)
  vis = np_visible(seg, WINDOW)
  pos = np.arange(61)
  recent = vis & (pos[None, None, :] > pos[None, :, None] - 3)   # the newest 3 keys
  older = vis & ~recent
  partials = [tuple(jnp.asarray(a, jnp.float32) for a in np_partial(q, kv, m))
              for m in (recent, older)]
  merged = combine_with_sink(partials, sink)
  o, _ = attend(q, kv, seg, sink, impl='chunked')
  np.testing.assert_allclose(merged, o, atol=2e-6)
  # A branch that sees nothing (lse -inf everywhere) changes nothing.
  empty = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf))
  np.testing.assert_allclose(combine_with_sink(partials + [empty], sink), merged, atol=0)
  # swa_attention is the one-branch case of swa_partial + combine_with_sink.
  part = jax.jit(swa_partial, static_argnames=('window', 'impl'))(q, kv, seg, window=WINDOW,
                                                                 impl='chunked')
  np.testing.assert_allclose(combine_with_sink([part], sink), o, atol=1e-6)  # eager vs jit


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_queries_that_see_nothing(impl):
  t = 61
  q, kv, seg, sink = inputs(t)
  seg[1] = 0            # a row of padding only
  padding = seg == 0
  o, lse = attend(q, kv, seg, sink, impl=impl)
  assert np.all(np.asarray(o)[padding] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[padding]))
  assert np.all(np.isfinite(np.asarray(lse)[~padding]))
  for sink_value in (sink, np.full(H, -1e9, np.float32)):
    _, (dq, dkv, dsink) = attend_with_grads(q, kv, seg, sink_value, impl=impl)
    for g in (dq, dkv, dsink):
      assert np.all(np.isfinite(g))
    assert np.all(np.asarray(dq)[padding] == 0) and np.all(np.asarray(dkv)[padding] == 0)
