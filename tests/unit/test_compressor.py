"""CSA2 KV compressor (docs/architecture.md section 3.6): math, group layout, visibility, causality.

Expected values are recomputed here in numpy (projection, gate softmax, RMSNorm, adjacent-pair
RoPE) from the section's formulas; visibility is recomputed from its definition on tokens.
"""

import numpy as np
import pytest
from flax import nnx

from deepseek41.model.compressor import (CompressedKV, Compressor, document_first_entry_bt,
                                         group_layout, visible_btn)
from deepseek41.model.rope import rope_for_role
from tests.helpers import np_rope, packed_layout, resolved

B, T, D, DH = 2, 40, 32, 16
EPS = 1e-6


def model_cfg():
  # rope_head_dim 4 < head_dim 16: the pass-through channels are exercised too.
  return resolved(**{'model.rope_head_dim': 4, 'model.rms_norm_eps': EPS}).model


def packed(doc_lengths, t=T):
  return packed_layout(doc_lengths, t)


# Aligned: every document starts at an even row offset and has even length.
ALIGNED = ((10, 16, 8), (24, 12))
# Misaligned: odd-length documents make straddling groups; both rows end in padding.
MISALIGNED = ((7, 12, 9, 5), (13, 1, 20))


def make(ratio, seed=0):
  comp = Compressor(model_cfg(), ratio, nnx.Rngs(seed))
  rng = np.random.default_rng(seed + 100)
  # Non-trivial weights: larger gates (so the softmax is far from uniform) and a norm scale.
  comp.wkv[...] = rng.standard_normal((D, DH)).astype(np.float32) * 0.3
  if ratio == 2:
    comp.wgate[...] = rng.standard_normal((D, DH)).astype(np.float32) * 0.5
  comp.kv_norm.scale[...] = rng.uniform(0.5, 1.5, DH).astype(np.float32)
  return comp


def np_rms(x, scale):
  x = x.astype(np.float64)
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * scale


def np_compress(x, seg, pos, comp, ratio):
  """latent, kv, pos_bn, seg_bn, last_bn written out per group."""
  wkv = np.asarray(comp.wkv[...], np.float64)
  scale = np.asarray(comp.kv_norm.scale[...], np.float64)
  inv_freq = rope_for_role(model_cfg(), 'compress')
  b, t, _ = x.shape
  n = -(-t // ratio)
  latent = np.zeros((b, n, DH))
  pos_bn = np.zeros((b, n), np.int64)
  seg_bn = np.zeros((b, n), np.int64)
  last_bn = np.zeros((b, n), np.int64)
  kv_t = x.astype(np.float64) @ wkv
  if ratio == 2:
    g_t = x.astype(np.float64) @ np.asarray(comp.wgate[...], np.float64)
  for bi in range(b):
    for j in range(n):
      rows = [j * ratio + i for i in range(ratio)]
      if ratio == 1:
        pooled = kv_t[bi, j]
      else:
        gates = np.stack([g_t[bi, r] if r < t else np.zeros(DH) for r in rows])
        kvs = np.stack([kv_t[bi, r] if r < t else np.zeros(DH) for r in rows])
        w = np.exp(gates - gates.max(0)) / np.exp(gates - gates.max(0)).sum(0)
        pooled = (w * kvs).sum(0)
      latent[bi, j] = np_rms(pooled, scale)
      pos_bn[bi, j] = pos[bi, rows[0]]
      segs = {seg[bi, r] if r < t else 0 for r in rows}
      seg_bn[bi, j] = segs.pop() if len(segs) == 1 else 0
      last_bn[bi, j] = rows[-1]
  kv = np_rope(latent, pos_bn, inv_freq)
  return latent, kv, pos_bn, seg_bn, last_bn


def np_visible(seg, ratio, t):
  """Definition on tokens: all of the group's rows are <= t and in t's (real) document."""
  b = seg.shape[0]
  n = -(-t // ratio)
  vis = np.zeros((b, t, n), bool)
  for bi in range(b):
    for ti in range(t):
      for j in range(n):
        rows = [j * ratio + i for i in range(ratio)]
        vis[bi, ti, j] = (seg[bi, ti] != 0 and all(r <= ti for r in rows) and
                          all(r < t and seg[bi, r] == seg[bi, ti] for r in rows))
  return vis


@pytest.mark.parametrize('ratio', [1, 2])
@pytest.mark.parametrize('docs', [ALIGNED, MISALIGNED], ids=['aligned', 'misaligned'])
def test_matches_numpy(ratio, docs):
  comp = make(ratio)
  seg, pos = packed(docs)
  x = np.random.default_rng(1).standard_normal((B, T, D)).astype(np.float32)
  out = comp(x, seg, pos)
  assert isinstance(out, CompressedKV) and out.ratio == ratio
  n = T // ratio
  assert out.latent_bnd.shape == (B, n, DH) and out.kv_bnd.shape == (B, n, DH)
  latent, kv, pos_bn, seg_bn, last_bn = np_compress(x, seg, pos, comp, ratio)
  np.testing.assert_allclose(out.latent_bnd, latent, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(out.kv_bnd, kv, atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(out.pos_bn, pos_bn)
  np.testing.assert_array_equal(out.seg_bn, seg_bn)
  np.testing.assert_array_equal(out.last_bn, last_bn)
  for a in (out.pos_bn, out.seg_bn, out.last_bn):
    assert a.dtype == np.int32


def test_rope_position_is_the_groups_first_token():
  seg, pos = packed(ALIGNED)
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, 2)
  # Row 0: documents of 10, 16, 8 tokens (entries 5, 8, 4) then 3 padding entries.
  expected = np.concatenate([np.arange(5) * 2, np.arange(8) * 2, np.arange(4) * 2, np.zeros(3)])
  np.testing.assert_array_equal(pos_bn[0], expected)
  np.testing.assert_array_equal(seg_bn[0], [1] * 5 + [2] * 8 + [3] * 4 + [0] * 3)
  np.testing.assert_array_equal(last_bn[0], np.arange(20) * 2 + 1)
  # And the RoPE really uses it: rotating the latent at pos_bn gives kv.
  comp = make(2)
  x = np.random.default_rng(2).standard_normal((B, T, D)).astype(np.float32)
  out = comp(x, seg, pos)
  inv_freq = rope_for_role(model_cfg(), 'compress')
  np.testing.assert_allclose(out.kv_bnd, np_rope(out.latent_bnd, pos[:, 0::2], inv_freq),
                             atol=2e-5)


def test_straddling_and_padding_groups_are_never_visible():
  # Row 0: documents of 7 and 12 tokens: the group {6, 7} straddles them. Row 1: documents of 13
  # and 1 tokens: the group {12, 13} straddles them. Both rows end in padding.
  seg, pos = packed(((7, 12, 9, 5), (13, 1, 20)))
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, 2)
  assert seg_bn[0, 3] == 0 and seg_bn[1, 6] == 0
  # Padding rows 33..39 of row 0 and 34..39 of row 1.
  assert np.all(seg_bn[0, 17:] == 0) and np.all(seg_bn[1, 17:] == 0)
  comp = make(2)
  x = np.random.default_rng(3).standard_normal((B, T, D)).astype(np.float32)
  out = comp(x, seg, pos)
  vis = np.asarray(visible_btn(seg, out))
  invisible = np.asarray(out.seg_bn) == 0
  assert not vis[np.broadcast_to(invisible[:, None, :], vis.shape)].any()
  # Padding queries see nothing.
  assert not vis[seg == 0].any()
  # The second document of row 0 starts at row 7: its entries are {8,9}, {10,11}, ...: its
  # first two tokens see nothing, the third (row 9, pos 2) completes {8, 9} and sees it.
  np.testing.assert_array_equal(vis[0, 7:11].sum(-1), [0, 0, 1, 1])
  np.testing.assert_array_equal(out.pos_bn[0, 4:6], [1, 3])


@pytest.mark.parametrize('ratio', [1, 2])
@pytest.mark.parametrize('docs', [ALIGNED, MISALIGNED], ids=['aligned', 'misaligned'])
def test_visibility_by_definition(ratio, docs):
  seg, pos = packed(docs)
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, ratio)
  comp = CompressedKV(latent_bnd=None, kv_bnd=None, pos_bn=pos_bn, seg_bn=seg_bn,
                      last_bn=last_bn, ratio=ratio)
  vis = np.asarray(visible_btn(seg, comp))
  np.testing.assert_array_equal(vis, np_visible(seg, ratio, T))
  # Query-chunked form: any slice of query rows with its row offset, any slice of entries.
  for t0, t1 in ((0, 8), (8, 24), (24, 40)):
    np.testing.assert_array_equal(visible_btn(seg[:, t0:t1], comp, row_offset=t0), vis[:, t0:t1])
  sub = CompressedKV(latent_bnd=None, kv_bnd=None, pos_bn=pos_bn[:, 4:11], seg_bn=seg_bn[:, 4:11],
                     last_bn=last_bn[:, 4:11], ratio=ratio)
  np.testing.assert_array_equal(visible_btn(seg[:, 16:32], sub, row_offset=16), vis[:, 16:32, 4:11])
  # The document's first entry in O(T) == the smallest visible entry (-1: none).
  first = np.where(vis.any(-1), np.argmax(vis, -1), -1)
  np.testing.assert_array_equal(document_first_entry_bt(seg, comp), first)
  np.testing.assert_array_equal(document_first_entry_bt(seg[:, 10:30], comp, row_offset=10),
                                first[:, 10:30])


@pytest.mark.parametrize('ratio', [1, 2])
def test_aligned_visibility_is_section_3_6_formula(ratio):
  seg, pos = packed(ALIGNED)
  pos_bn, seg_bn, last_bn = group_layout(seg, pos, ratio)
  comp = CompressedKV(latent_bnd=None, kv_bnd=None, pos_bn=pos_bn, seg_bn=seg_bn,
                      last_bn=last_bn, ratio=ratio)
  vis = np.asarray(visible_btn(seg, comp))
  n = T // ratio
  expected = np.zeros((B, T, n), bool)
  for bi, lengths in enumerate(ALIGNED):
    start = 0
    for length in lengths:
      first_entry = start // ratio
      for t_local in range(length):
        for j_local in range(length // ratio):
          expected[bi, start + t_local, first_entry + j_local] = j_local < (t_local + 1) // ratio
      start += length
  np.testing.assert_array_equal(vis, expected)


@pytest.mark.parametrize('ratio', [1, 2])
def test_causal_by_perturbation(ratio):
  comp = make(ratio)
  seg, pos = packed(MISALIGNED)
  x = np.random.default_rng(4).standard_normal((B, T, D)).astype(np.float32)
  base = comp(x, seg, pos)
  for t_changed in (0, 5, 6, 7, 19, 39):
    x2 = x.copy()
    x2[:, t_changed] += 3.0
    out = comp(x2, seg, pos)
    changed = np.any(np.asarray(out.kv_bnd) != np.asarray(base.kv_bnd), axis=-1)   # [B, N]
    changed |= np.any(np.asarray(out.latent_bnd) != np.asarray(base.latent_bnd), axis=-1)
    # Exactly the group holding row t_changed changes; so no entry with last_bn < t_changed does.
    expected = np.zeros_like(changed)
    expected[:, t_changed // ratio] = True
    np.testing.assert_array_equal(changed, expected)
    assert not changed[np.asarray(base.last_bn) < t_changed].any()


def test_odd_length_row_is_padded_and_quantize_hook():
  comp = make(2)
  t = 33
  seg, pos = packed(((20, 13), (33,)), t=t)
  x = np.random.default_rng(5).standard_normal((B, t, D)).astype(np.float32)
  out = comp(x, seg, pos, quantize=lambda v: 2.0 * v)
  assert out.kv_bnd.shape == (B, 17, DH)
  assert np.all(np.asarray(out.seg_bn)[:, -1] == 0)       # half-padding tail group
  assert not np.asarray(visible_btn(seg, out))[..., -1].any()
  ref = comp(x, seg, pos)
  np.testing.assert_allclose(out.kv_bnd, 2.0 * np.asarray(ref.kv_bnd), rtol=1e-6)
  np.testing.assert_array_equal(out.latent_bnd, ref.latent_bnd)   # the hook is post-RoPE only
  latent, kv, *_ = np_compress(x, seg, pos, comp, 2)
  np.testing.assert_allclose(ref.kv_bnd[:, :16], kv[:, :16], atol=2e-5, rtol=1e-5)


def test_jit_and_gradients():
  comp = make(2)
  seg, pos = packed(MISALIGNED)
  x = np.random.default_rng(6).standard_normal((B, T, D)).astype(np.float32)

  @nnx.jit
  def loss(c, x):
    out = c(x, seg, pos)
    return (out.kv_bnd ** 2 * (out.seg_bn > 0)[..., None]).sum(), out

  (value, out), grads = nnx.value_and_grad(loss, has_aux=True)(comp, x)
  assert np.isfinite(value)
  eager = comp(x, seg, pos)
  np.testing.assert_allclose(out.kv_bnd, eager.kv_bnd, atol=1e-5)
  for g in (grads.wkv[...], grads.wgate[...], grads.kv_norm.scale[...]):
    assert np.all(np.isfinite(g)) and np.any(g != 0)
