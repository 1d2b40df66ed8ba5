"""RoPE (docs/architecture.md section 3.4): rotation properties and the YaRN frequencies.

Expected frequencies are recomputed here from the section's formulas, not from rope.py helpers.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.config import base_config, resolve
from deepseek41.model.rope import apply_rope, rope_for_role, rope_inv_freq

RNG = np.random.default_rng(0)


def _doc_lo_hi(d, theta, l0, beta_fast, beta_slow):
  """lo/hi exactly as section 3.4 writes them (no clamping)."""
  lo = math.floor(d * math.log(l0 / (beta_fast * 2 * math.pi)) / (2 * math.log(theta)))
  hi = math.ceil(d * math.log(l0 / (beta_slow * 2 * math.pi)) / (2 * math.log(theta)))
  return lo, hi


def _plain(d, theta):
  return theta ** (-2.0 * np.arange(d // 2) / d)


def _pair_norms(x, rope_dim):
  r = np.asarray(x, np.float64)[..., -rope_dim:]
  return np.hypot(r[..., 0::2], r[..., 1::2])


@pytest.mark.parametrize('shape', [(2, 7, 3, 24), (2, 7, 24)])
def test_inverse_undoes_rotation_and_norms_are_kept(shape):
  x = RNG.standard_normal(shape).astype(np.float32)
  pos = RNG.integers(0, 70000, size=shape[:2])
  inv_freq = rope_inv_freq(16, 160000.0, 16.0, 65536)
  y = apply_rope(x, pos, inv_freq)
  back = apply_rope(y, pos, inv_freq, inverse=True)
  np.testing.assert_allclose(back, x, atol=2e-5, rtol=0)
  np.testing.assert_allclose(_pair_norms(y, 16), _pair_norms(x, 16), rtol=1e-5, atol=1e-6)
  # Only the last 16 channels are rotated; the rest pass through bit for bit.
  np.testing.assert_array_equal(np.asarray(y)[..., :-16], x[..., :-16])
  assert not np.allclose(np.asarray(y)[..., -16:], x[..., -16:])


def test_dtype_is_kept():
  x = jnp.asarray(RNG.standard_normal((1, 5, 2, 8)), jnp.bfloat16)
  y = apply_rope(x, np.arange(5)[None], rope_inv_freq(8, 10000.0))
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape


def test_score_depends_only_on_relative_position():
  d = 32
  inv_freq = rope_inv_freq(d, 10000.0)
  q, k = RNG.standard_normal((2, d)).astype(np.float32)

  def score(m, n):
    rq = apply_rope(q[None, None], np.array([[m]]), inv_freq)[0, 0]
    rk = apply_rope(k[None, None], np.array([[n]]), inv_freq)[0, 0]
    return float(jnp.dot(rq, rk))

  for m, n in [(5, 2), (40, 40), (3, 100), (700, 650)]:
    base = score(m, n)
    for shift in (1, 17, 300):
      assert score(m + shift, n + shift) == pytest.approx(base, abs=2e-4)
  assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # but it does depend on m - n


def test_adjacent_pair_convention_by_hand():
  w, p = 0.3, 7
  angle = p * w
  # C=4, rope on the last 2 channels with one frequency: [a, b, 1, 0] -> [a, b, cos, sin].
  x = np.array([[[0.5, -2.0, 1.0, 0.0]]], np.float32)
  y = np.asarray(apply_rope(x, np.array([[p]]), np.array([w], np.float32)))
  np.testing.assert_allclose(y[0, 0], [0.5, -2.0, math.cos(angle), math.sin(angle)], atol=1e-6)
  # Two frequencies: channel 0 pairs with channel 1 (adjacent), not with channel 2 (NeoX halves).
  x = np.array([[[1.0, 0.0, 0.0, 0.0]]], np.float32)
  y = np.asarray(apply_rope(x, np.array([[p]]), np.array([w, 0.01], np.float32)))
  np.testing.assert_allclose(y[0, 0], [math.cos(angle), math.sin(angle), 0, 0], atol=1e-6)
  y_inv = np.asarray(apply_rope(x, np.array([[p]]), np.array([w, 0.01], np.float32),
                                inverse=True))
  np.testing.assert_allclose(y_inv[0, 0], [math.cos(angle), -math.sin(angle), 0, 0], atol=1e-6)


def test_released_lo_hi_and_yarn_ramp():
  d, theta, l0, factor = 64, 160000.0, 65536, 16.0
  lo, hi = _doc_lo_hi(d, theta, l0, 32, 1)
  assert (lo, hi) == (15, 25)
  got = rope_inv_freq(d, theta, factor, l0, 32, 1).astype(np.float64)
  plain = _plain(d, theta)
  i = np.arange(d // 2)
  # Pairs turning > beta_fast times over L0 keep their frequency; < beta_slow times: / factor.
  np.testing.assert_allclose(got[i <= lo], plain[i <= lo], rtol=1e-6)
  np.testing.assert_allclose(got[i >= hi], plain[i >= hi] / factor, rtol=1e-6)
  mid = (i > lo) & (i < hi)
  assert np.all(got[mid] < plain[mid]) and np.all(got[mid] > plain[mid] / factor)
  ramp = (i - lo) / (hi - lo)
  np.testing.assert_allclose(got, plain / factor * np.clip(ramp, 0, 1) +
                             plain * (1 - np.clip(ramp, 0, 1)), rtol=1e-6)


def test_yarn_factor_one_is_plain():
  for d, theta in [(64, 10000.0), (64, 160000.0), (16, 160000.0)]:
    np.testing.assert_allclose(rope_inv_freq(d, theta, 1.0, 65536), _plain(d, theta), rtol=1e-6)


def test_negative_lo_is_clamped_to_zero():
  # Toy config: d=16, L0=128 gives lo=-1 by the formula; like the references we clamp to 0, so
  # pair 0 keeps its frequency and the ramp runs from pair 0 to hi.
  d, theta, l0, factor = 16, 160000.0, 128, 4.0
  lo, hi = _doc_lo_hi(d, theta, l0, 32, 1)
  assert (lo, hi) == (-1, 3)
  got = rope_inv_freq(d, theta, factor, l0, 32, 1)
  plain = _plain(d, theta)
  ramp = np.clip(np.arange(d // 2) / hi, 0, 1)
  np.testing.assert_allclose(got, plain / factor * ramp + plain * (1 - ramp), rtol=1e-6)
  assert got[0] == pytest.approx(plain[0], rel=1e-7)


def test_rope_for_role_reads_the_model_config():
  m = resolve(base_config(), backend='cpu', num_devices=1).model
  np.testing.assert_allclose(rope_for_role(m, 'main'), _plain(m.rope_head_dim, m.rope_theta),
                             rtol=1e-6)
  compress = rope_for_role(m, 'compress')
  assert compress.shape == (m.rope_head_dim // 2,)
  assert compress[-1] == pytest.approx(_plain(m.rope_head_dim, m.compress_rope_theta)[-1] /
                                       m.yarn_factor, rel=1e-6)
  with pytest.raises(ValueError):
    rope_for_role(m, 'other')
