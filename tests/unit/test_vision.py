"""Vision encoder (docs/architecture.md 3.15): 2D RoPE, per-image attention, merge, placement."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.batch import (NUM_DELIMITERS, ROLE_ALIGN, ROLE_END, ROLE_NEWLINE, ROLE_PATCH,
                              ROLE_START, ROLE_TEXT)
from deepseek41.model.vision import (VisionEncoder, merge_patches, patch_rows_cols,
                                     place_image_embeddings, rope_2d, vit_attention_fused,
                                     vit_attention_reference)
from tests.helpers import first_update_ratios, resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)


def np_rope_2d(x, rows, cols, theta):
  """float64 transcription of section 3.15: angle = [row*f, col*f], pairs (c, c + hd/2)."""
  x = np.asarray(x, np.float64)
  hd = x.shape[-1]
  f = theta ** (-2.0 * np.arange(hd // 4) / (hd // 2))
  out = np.empty_like(x)
  for idx in np.ndindex(*rows.shape):
    angle = np.concatenate([rows[idx] * f, cols[idx] * f])
    v = x[idx]                                   # [..., hd] (heads broadcast)
    for c in range(hd // 2):
      a, b = v[..., c], v[..., c + hd // 2]
      out[idx][..., c] = a * np.cos(angle[c]) - b * np.sin(angle[c])
      out[idx][..., c + hd // 2] = b * np.cos(angle[c]) + a * np.sin(angle[c])
  return out


def np_unshuffle(feats_pc, h, w, merge):
  """Explicit pixel-unshuffle of one image: [h*w, C] -> [hm*wm, C*merge^2], channel-major."""
  c = feats_pc.shape[-1]
  hm, wm = -(-h // merge), -(-w // merge)
  grid = np.zeros((hm * merge, wm * merge, c), feats_pc.dtype)
  grid[:h, :w] = feats_pc[:h * w].reshape(h, w, c)
  out = np.zeros((hm * wm, c * merge * merge), feats_pc.dtype)
  for i in range(hm):
    for j in range(wm):
      for ch in range(c):
        for dy in range(merge):
          for dx in range(merge):
            out[i * wm + j, ch * merge * merge + dy * merge + dx] = grid[i * merge + dy,
                                                                         j * merge + dx, ch]
  return out


# ---------------------------------------------------------------------------------------------
# 2D RoPE


def test_rope_2d_matches_a_direct_transcription():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 3, 16)).astype(np.float32)          # [S, P, H, hd]
  rows = rng.integers(0, 40, (2, 5))
  cols = rng.integers(0, 40, (2, 5))
  got = rope_2d(jnp.asarray(x), rows, cols, 100.0)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np_rope_2d(x, rows, cols, 100.0), atol=2e-5)
  # bf16 in, bf16 out; (0, 0) is the identity.
  xb = jnp.asarray(x, jnp.bfloat16)
  assert rope_2d(xb, rows, cols, 100.0).dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(rope_2d(xb, 0 * rows, 0 * cols, 1e4)), np.asarray(xb))


def test_rope_2d_rows_turn_the_first_quarter_pairs_and_cols_the_second():
  hd = 16
  x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1, hd)), jnp.float32)
  base = np.asarray(rope_2d(x, np.array([[3]]), np.array([[5]]), 1e4))
  row_moved = np.asarray(rope_2d(x, np.array([[4]]), np.array([[5]]), 1e4))
  col_moved = np.asarray(rope_2d(x, np.array([[3]]), np.array([[6]]), 1e4))
  q = hd // 4
  row_pairs = np.r_[0:q, 2 * q:3 * q]          # channels c, c + hd/2 with angle[c] = row * f_c
  col_pairs = np.r_[q:2 * q, 3 * q:4 * q]
  np.testing.assert_array_equal(row_moved[..., col_pairs], base[..., col_pairs])
  assert np.abs(row_moved[..., row_pairs] - base[..., row_pairs]).max() > 1e-3
  np.testing.assert_array_equal(col_moved[..., row_pairs], base[..., row_pairs])
  assert np.abs(col_moved[..., col_pairs] - base[..., col_pairs]).max() > 1e-3
  # Rotations keep each pair's norm.
  np.testing.assert_allclose(np.linalg.norm(row_moved), np.linalg.norm(np.asarray(x)), rtol=1e-6)


def test_rope_2d_scores_depend_only_on_the_relative_offset():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(1, 1, 32)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 32)), jnp.float32)

  def score(rq, cq, rk, ck):
    a = rope_2d(q, np.array([[rq]]), np.array([[cq]]), 1e4)
    b = rope_2d(k, np.array([[rk]]), np.array([[ck]]), 1e4)
    return float(jnp.sum(a * b))
  s = score(2, 7, 5, 1)
  for dr, dc in ((1, 0), (0, 3), (11, 4), (30, 30)):
    assert abs(score(2 + dr, 7 + dc, 5 + dr, 1 + dc) - s) < 1e-4
  assert abs(score(2, 7, 6, 1) - s) > 1e-3       # a different offset is a different score
  assert abs(score(2, 7, 5, 2) - s) > 1e-3


def test_patch_rows_cols_follow_the_raster_order_of_each_slot():
  rows, cols = patch_rows_cols(8, jnp.array([[2, 3], [4, 1], [0, 0]], jnp.int32))
  np.testing.assert_array_equal(rows[0], [0, 0, 0, 1, 1, 1, 2, 2])
  np.testing.assert_array_equal(cols[0], [0, 1, 2, 0, 1, 2, 0, 1])
  np.testing.assert_array_equal(rows[1], np.arange(8))
  np.testing.assert_array_equal(cols[1], np.zeros(8))
  np.testing.assert_array_equal(rows[2], np.arange(8))  # empty slot: finite, unused


# ---------------------------------------------------------------------------------------------
# Merge aligner input


def test_merge_makes_one_token_per_3x3_channel_major():
  merge, m_max, c = 3, 8, 5
  p = merge * merge * m_max
  rng = np.random.default_rng(3)
  feats = rng.normal(size=(1, 3, p, c)).astype(np.float32)
  grid = np.array([[[6, 6], [7, 5], [0, 0]]], np.int32)
  for n, (h, w) in enumerate(grid[0]):
    feats[0, n, h * w:] = 0                                    # padding patches are zero
  out = np.asarray(merge_patches(jnp.asarray(feats), jnp.asarray(grid), merge, m_max))
  assert out.shape == (1, 3, m_max, c * merge * merge)
  # 6x6 -> 2x2 = 4 tokens; 7x5 -> 3x2 = 6 tokens; the rest (and the empty slot) are zero.
  for n, tokens in ((0, 4), (1, 6)):
    h, w = grid[0, n]
    np.testing.assert_array_equal(out[0, n, :tokens], np_unshuffle(feats[0, n], h, w, merge))
    assert np.all(np.abs(out[0, n, :tokens]).sum(-1) > 0)
    np.testing.assert_array_equal(out[0, n, tokens:], 0)
  np.testing.assert_array_equal(out[0, 2], 0)
  # 7x5: token (2, 1) holds only patch (6, 3) and (6, 4): rows 7, 8 and col 5 are padding cells.
  token = out[0, 1, 5].reshape(c, merge, merge)
  np.testing.assert_array_equal(token[:, 0, :2], feats[0, 1, [6 * 5 + 3, 6 * 5 + 4]].T)
  np.testing.assert_array_equal(token[:, 1:], 0)
  np.testing.assert_array_equal(token[:, :, 2], 0)


# ---------------------------------------------------------------------------------------------
# Attention


def test_fused_attention_equals_reference_with_padding():
  rng = np.random.default_rng(4)
  s, p, h, d = 3, 18, 2, 8
  q, k, v = (jnp.asarray(rng.normal(size=(s, p, h, d)), jnp.float32) for _ in range(3))
  lengths = jnp.array([18, 7, 1], jnp.int32)
  ref = np.asarray(vit_attention_reference(q, k, v, lengths))
  fused = np.asarray(vit_attention_fused(q, k, v, lengths))
  for i, n in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(fused[i, :n], ref[i, :n], atol=1e-5, rtol=1e-5)
  # Keys past the length are invisible: changing them changes no real query.
  k2 = k.at[1, 7:].set(100.0)
  v2 = v.at[1, 7:].set(-100.0)
  for fn in (vit_attention_reference, vit_attention_fused):
    np.testing.assert_allclose(np.asarray(fn(q, k2, v2, lengths))[1, :7], ref[1, :7], atol=1e-5)
  # A slot with nothing visible is finite in both.
  for fn in (vit_attention_reference, vit_attention_fused):
    assert np.all(np.isfinite(np.asarray(fn(q, k, v, jnp.array([0, 0, 0], jnp.int32)))))


def test_plan_stand_in_keeps_a_flash_kernels_buffers():
  """tools.plan's stand-in for the fused vision attention (launch.shapes_only): forward +
  backward compile without any [P, P] buffer, far under the dense path's temporaries, with the
  gradients' shapes and dtypes; a program traced within refuses to run."""
  from deepseek41.model.vision import vit_attention
  from deepseek41.ops import launch
  s, p, h, d = 2, 512, 2, 16
  q, k, v = (jax.ShapeDtypeStruct((s, p, h, d), jnp.bfloat16) for _ in range(3))
  lengths = jax.ShapeDtypeStruct((s,), jnp.int32)

  def grads(impl):
    def loss(q, k, v, n):
      return jnp.sum(vit_attention(q, k, v, n, impl).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  dense = grads('reference').lower(q, k, v, lengths).compile()
  within = grads('fused')
  with launch.shapes_only():
    lowered = within.lower(q, k, v, lengths)
    compiled = lowered.compile()
  assert [(g.shape, g.dtype) for g in lowered.out_info] == [((s, p, h, d), jnp.bfloat16)] * 3
  temp = compiled.memory_analysis().temp_size_in_bytes
  scores = s * h * p * p * 4
  assert temp < scores <= dense.memory_analysis().temp_size_in_bytes, (temp, scores)
  with pytest.raises(Exception, match='compile-only stand-in'):
    ones = jnp.ones((s, p, h, d), jnp.bfloat16)
    jax.block_until_ready(within(ones, ones, ones, jnp.full((s,), p, jnp.int32)))


# ---------------------------------------------------------------------------------------------
# The encoder


@pytest.fixture(scope='module')
def vision_cfg():
  return resolved(**{'model.vision': True}).model


def _build(cfg, impl):
  # One compiled init instead of an eager compile per parameter shape.
  return nnx.jit(lambda: VisionEncoder(dataclasses.replace(cfg, vision_attention_impl=impl),
                                       nnx.Rngs(0)))()


@pytest.fixture(scope='module')
def encoder(vision_cfg):
  return _build(vision_cfg, 'reference')


@pytest.fixture(scope='module')
def fused_encoder(vision_cfg):
  return _build(vision_cfg, 'fused')


@nnx.jit
def _encode(enc, patches, grid):
  return enc(patches, grid, jnp.float32)


def _images(cfg, grids, seed=0):
  """Random uint8 patches [1, N, P, p*p*3], zero past each slot's h*w, and the grid."""
  p = cfg.vision_merge ** 2 * cfg.vision_max_image_tokens
  rng = np.random.default_rng(seed)
  patches = rng.integers(0, 256, (1, len(grids), p, cfg.vision_patch ** 2 * 3)).astype(np.uint8)
  for n, (h, w) in enumerate(grids):
    patches[0, n, h * w:] = 0
  return patches, np.array([grids], np.int32)


def test_encoder_shapes_and_padded_tokens(vision_cfg, encoder):
  cfg = vision_cfg
  patches, grid = _images(cfg, [(5, 7), (4, 4)])
  out = np.asarray(_encode(encoder, patches, grid))
  assert out.shape == (1, 2, cfg.vision_max_image_tokens, cfg.d_model)
  assert out.dtype == np.float32
  # Tokens past hm*wm saw only zeros: they are the aligner's response to a zero input, all equal.
  np.testing.assert_array_equal(out[0, 0, 6:], np.broadcast_to(out[0, 0, 6], out[0, 0, 6:].shape))
  assert np.abs(out[0, 0, 0] - out[0, 0, 6]).max() > 0
  np.testing.assert_array_equal(out[0, 1, 4:], np.broadcast_to(out[0, 0, 6], out[0, 1, 4:].shape))


@pytest.mark.parametrize('impl', ['reference', 'fused'])
def test_attention_is_bidirectional_inside_an_image_and_never_crosses(vision_cfg, encoder,
                                                                      fused_encoder, impl):
  enc = encoder if impl == 'reference' else fused_encoder
  assert enc.cfg.vision_attention_impl == impl
  patches, grid = _images(vision_cfg, [(5, 7), (4, 4)])
  base = np.asarray(_encode(enc, patches, grid))

  def changed(slot, patch):
    moved = patches.copy()
    moved[0, slot, patch] = 255 - moved[0, slot, patch]
    return np.abs(np.asarray(_encode(enc, moved, grid)) - base).max(-1)[0]   # [N, M]

  # Patch 34 = (4, 6) sits in merged token (1, 2) = 5; token 0 (patches of rows 0-2) still moves.
  delta = changed(0, 34)
  assert delta[0, 0] > 1e-4 and delta[0, 5] > 1e-4
  assert delta[1].max() == 0                                 # other slot untouched
  # Padding patches (index >= h*w) reach nothing, in their own slot or the other.
  moved = patches.copy()
  moved[0, 0, 35:] = 200
  moved[0, 1, 16:] = 17
  np.testing.assert_array_equal(np.asarray(_encode(enc, moved, grid)), base)


def test_encoder_reference_equals_fused(vision_cfg, encoder, fused_encoder):
  patches, grid = _images(vision_cfg, [(5, 7), (3, 2), (0, 0)], seed=1)
  ref = np.asarray(_encode(encoder, patches, grid))
  np.testing.assert_allclose(np.asarray(_encode(fused_encoder, patches, grid)), ref, atol=2e-5,
                             rtol=1e-4)


def test_gradient_through_an_empty_slot_is_finite(vision_cfg, encoder):
  patches, grid = _images(vision_cfg, [(0, 0), (2, 3)])

  @nnx.jit
  def grads(enc):
    return nnx.grad(lambda e: jnp.sum(e(patches, grid, jnp.float32) ** 2))(enc)
  g = grads(encoder)
  leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
  assert leaves and all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
  assert all(np.isfinite(np.asarray(_encode(encoder, *_images(vision_cfg, [(0, 0)])))).flat)
  # The delimiters are not used by the encoder; the attention weights did get a gradient.
  assert float(jnp.abs(g.blocks[0].attn.w_qkv[...]).max()) > 0


# ---------------------------------------------------------------------------------------------
# Placement into the token stream


def test_place_image_embeddings_by_role():
  b, t, n, m, d = 2, 9, 2, 3, 4
  rng = np.random.default_rng(5)
  x = rng.normal(size=(b, t, d)).astype(np.float32)
  merged = rng.normal(size=(b, n, m, d)).astype(np.float32)
  delims = rng.normal(size=(NUM_DELIMITERS, d)).astype(np.float32)
  role = np.full((b, t), ROLE_TEXT, np.int32)
  index = np.zeros((b, t), np.int32)
  # row 0: text, align, start, patch (slot 0, token 1), newline, patch (slot 1, token 2), end
  role[0, 1:7] = [ROLE_ALIGN, ROLE_START, ROLE_PATCH, ROLE_NEWLINE, ROLE_PATCH, ROLE_END]
  index[0, 3], index[0, 5] = 1, 1 * m + 2
  role[1, 0], index[1, 0] = ROLE_PATCH, 0
  out = np.asarray(place_image_embeddings(jnp.asarray(x), role, index, jnp.asarray(merged),
                                          jnp.asarray(delims)))
  expect = x.copy()
  expect[0, 1], expect[0, 2] = delims[ROLE_ALIGN - ROLE_START], delims[0]   # align is the 4th
  expect[0, 4], expect[0, 6] = delims[1], delims[2]
  expect[0, 3], expect[0, 5] = merged[0, 0, 1], merged[0, 1, 2]
  expect[1, 0] = merged[1, 0, 0]
  np.testing.assert_array_equal(out, expect)


# ---------------------------------------------------------------------------------------------
# Released size


def test_released_parameter_count(vision_cfg):
  cfg = dataclasses.replace(vision_cfg, vision_layers=32, vision_dim=1024, vision_heads=16,
                            vision_mlp=2816, vision_patch=14, vision_merge=3, d_model=5120,
                            vision_max_image_tokens=1024)
  abstract = nnx.eval_shape(lambda: VisionEncoder(cfg, nnx.Rngs(0)))
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  # patch embed        588*1024 + 1024                                   =     603,136
  # 32 blocks x (qkv 1024*3072 + 3072, out 1024*1024 + 1024,
  #              MLP 3*1024*2816, norms 2*1024 = 12,851,200)             = 411,238,400
  # final norm         1024                                              =       1,024
  # aligner            9216*5120 + 5120 + 5120*5120 + 5120               =  73,410,560
  # delimiters         4*5120 (start, newline, end, alignment pad)       =      20,480
  #                                                                 total 485,273,600
  # (= 485,267,456 + 1,024 final norm + 5,120 4th delimiter: the 485,267,456 figure leaves out
  # the final RMSNorm that section 3.15 lists.)
  assert count == 485_273_600


def test_vision_learns_at_its_multiplied_rate():
  scaled = first_update_ratios(
      {'train.engram_table_lr_multiplier': 1.0, 'model.vision': True},
      {'train.vision_lr_multiplier': 0.1}, {'train.vision_lr_multiplier': 1.0},
      lambda name: 0.1 if name.startswith("['vision']") else 1.0)
  assert scaled >= 10  # every ViT and aligner weight, and only those
