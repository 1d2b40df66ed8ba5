"""Fake quantization (docs/architecture.md sections 3.5, 3.6, 3.7, 3.16).

Hand-computed blocks from the spec, bit-exact agreement of the arithmetic rounding with ml_dtypes'
casts (random values across magnitudes, every grid point, every tie and its float32 neighbours),
the block formats against the numpy reference, and the straight-through gradient.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepseek41 import quant
from deepseek41.quant import (fake_quant, fq_fp4_e4m3_scale, fq_fp4_ue8m0_scale,
                              fq_fp8_ue8m0_scale, qdq_reference, round_e2m1, round_e4m3)

FORMATS = ('fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32')
FQ = {'fp4_e4m3_16': fq_fp4_e4m3_scale, 'fp4_ue8m0_32': fq_fp4_ue8m0_scale,
      'fp8_ue8m0_32': fq_fp8_ue8m0_scale}
BLOCK = {'fp4_e4m3_16': 16, 'fp4_ue8m0_32': 32, 'fp8_ue8m0_32': 32}


# Non-negative values of the element formats, ascending.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E4M3 = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                        .astype(np.float32)))
E4M3 = E4M3[np.isfinite(E4M3)]


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def _ties_and_neighbours(grid):
  """Grid points, midpoints and the float32 neighbours of both, both signs."""
  pts = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2]).astype(np.float32)
  pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                        np.nextafter(pts, np.float32(0))])
  return np.concatenate([pts, -pts])


def _random_magnitudes(rng, n, lo_exp, hi, max_abs):
  x = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(lo_exp, np.log2(hi), n))
  return np.clip(x, -max_abs, max_abs).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Element rounding against ml_dtypes, bit for bit


def test_round_e2m1_matches_cast():
  rng = np.random.default_rng(0)
  x = np.concatenate([
      _random_magnitudes(rng, 100_000, -30, 6.0, 6.0),
      rng.uniform(-6, 6, 20_000).astype(np.float32),
      rng.uniform(-100, 100, 2_000).astype(np.float32),       # saturation: the cast gives +-6
      _ties_and_neighbours(E2M1),
      np.array([0.0, -0.0, 1e-42, -1e-42, 6.5, 7.0, -7.0, 1e30], np.float32)])
  ref = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  got = np.asarray(jax.jit(round_e2m1)(x))
  np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_round_e4m3_matches_cast():
  rng = np.random.default_rng(1)
  x = np.concatenate([
      _random_magnitudes(rng, 100_000, -16, 448.0, 448.0),
      rng.uniform(-448, 448, 20_000).astype(np.float32),
      _ties_and_neighbours(E4M3),
      np.array([0.0, -0.0, 1e-42, -1e-42, 2.0**-10, -(2.0**-10), 448.0, -448.0], np.float32)])
  x = np.clip(x, -448, 448)  # the cast gives NaN beyond; ours saturates (tested below)
  ref = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(jax.jit(round_e4m3)(x))
  np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_round_e4m3_saturates():
  got = np.asarray(round_e4m3(np.array([460.0, 464.0, 500.0, 1e9, -1e9, np.inf], np.float32)))
  np.testing.assert_array_equal(got, [448, 448, 448, 448, -448, 448])


@pytest.mark.parametrize('fmt,dtype,grid', [(quant._E2M1, ml_dtypes.float4_e2m1fn, E2M1),
                                            (quant._E4M3, ml_dtypes.float8_e4m3fn, E4M3)])
def test_round_quotient_matches_cast_of_float32_quotient(fmt, dtype, grid):
  """The division-free rounding of x / s, with s broadcast (the case XLA rewrites to x * (1/s))."""
  rng = np.random.default_rng(2)
  s = rng.choice(E4M3[E4M3 >= 2.0**-9], 64).astype(np.float32)[:, None]
  if fmt is quant._E4M3:
    s = np.array([6.0, 448.0], np.float32)[rng.integers(0, 2, 64)][:, None]
  ties = _ties_and_neighbours(grid)
  x = np.concatenate([
      (ties[None, :] * s),                                    # exact ties of x / s and neighbours
      np.nextafter(ties[None, :] * s, np.float32(np.inf)),
      np.nextafter(ties[None, :] * s, np.float32(0)),
      _random_magnitudes(rng, 64 * 2000, -20, float(grid[-1]), float(grid[-1])).reshape(64, -1)
      * s], axis=1).astype(np.float32)
  ref = np.clip(x / s, -grid[-1], grid[-1]).astype(dtype).astype(np.float32)
  got = np.asarray(jax.jit(functools.partial(quant._round_quotient, fmt=fmt))(x, s))
  np.testing.assert_array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize('qmax', [6.0, 448.0])
def test_ceil_pow2_quotient_is_the_smallest_sufficient_power_of_two(qmax):
  rng = np.random.default_rng(3)
  k = rng.integers(-120, 100, 20_000)
  edges = (qmax * np.exp2(k)).astype(np.float32)
  amax = np.concatenate([edges, np.nextafter(edges, np.float32(np.inf)),
                         np.nextafter(edges, np.float32(0)),
                         np.exp2(rng.uniform(-120, 100, 20_000)).astype(np.float32)])
  amax = np.maximum(amax, np.float32(qmax * 2.0**-126))
  got = np.asarray(jax.jit(functools.partial(quant._ceil_pow2_quotient, qmax=qmax))(amax))
  ref = np.ceil(np.log2(amax.astype(np.float64) / qmax)).astype(np.int64)
  np.testing.assert_array_equal(got, ref)
  # and the spec's float32 formula, evaluated on the host
  ref32 = np.ceil(np.log2((amax / np.float32(qmax)).astype(np.float64))).astype(np.int64)
  np.testing.assert_array_equal(got, ref32)


# ---------------------------------------------------------------------------------------------
# Hand-computed blocks (numbers from the spec, section 3.6 / 3.7 / 3.5)


def _block(values, n):
  x = np.zeros(n, np.float32)
  x[:len(values)] = values
  return x


def test_fp4_e4m3_hand_computed():
  # amax 3 -> scale e4m3(3/6) = 0.5; x/0.5 rounds on the e2m1 grid, ties to even.
  x = _block([3.0, 1.3, -0.2, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, -2.5], 16)
  # x/s:     6    2.6   -0.4  0.25   0.75   1.25   1.75   2.5   3.5   5    -5
  # q:       6    3     -0.5  0      1      1      2      2     4     4    -4
  want = _block([3.0, 1.5, -0.25, 0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, -2.0], 16)
  np.testing.assert_array_equal(np.asarray(fq_fp4_e4m3_scale(x)), want)

  rows = [
      # amax 3.3: 0.55 -> e4m3 step 1/16 in [0.5, 1): 8.8 steps -> 9 -> scale 0.5625
      ([3.3, 1.0], [6 * 0.5625, 2 * 0.5625]),
      # amax 5.625: scale 0.9375 exactly; 1.171875 / 0.9375 = 1.25 and 2.34375 / 0.9375 = 2.5 are
      # ties -> 1 and 2. (x * float32(1 / 0.9375), XLA's rewrite of the division that quant.py
      # avoids, gives 1.2500001 and 2.5000002 -> 1.5 and 3.)
      ([5.625, 1.171875, 2.34375], [5.625, 0.9375, 2 * 0.9375]),
      # amax 3.1: 0.5167 -> 8.27 steps -> 8 -> scale 0.5: 3.1/0.5 = 6.2 clips to 6
      ([3.1, -3.1], [3.0, -3.0]),
      # amax 3.1875: 0.53125 = 8.5 steps, a tie -> 8 (even) -> scale 0.5; 6.375 -> 6
      ([3.1875], [3.0]),
      # amax 3.5625: 0.59375 = 9.5 steps, a tie -> 10 -> scale 0.625; 5.7 -> 6
      ([3.5625], [3.75]),
      # amax below the floor 6*2^-9: scale 2^-9; 1e-4 -> 0.05 -> 0; 0.0015 -> 0.768 -> 1
      ([1e-4, 0.0015], [0.0, 2.0**-9]),
      # amax 6000: 1000 saturates the scale at 448; 13.4 -> 6
      ([6000.0, 448.0], [6 * 448.0, 448.0]),
      ([], []),  # all zero -> zero, no NaN
  ]
  for xs, ws in rows:
    got = np.asarray(fq_fp4_e4m3_scale(_block(xs, 16)))
    np.testing.assert_allclose(got, _block(ws, 16), rtol=0, atol=0, err_msg=str(xs))


def test_fp4_ue8m0_hand_computed():
  # amax 5: scale 2^ceil(log2(5/6)) = 1
  x = _block([5.0, -0.25, 0.75, 2.5, 3.5, 1.2, -1.3, 0.3], 32)
  want = _block([4.0, -0.0, 1.0, 2.0, 4.0, 1.0, -1.5, 0.5], 32)
  got = np.asarray(fq_fp4_ue8m0_scale(x))
  np.testing.assert_array_equal(_bits(got), _bits(want))  # -0.25 -> -0, sign kept

  rows = [
      # amax 7: 7/6 -> 2^1 = 2; 3.5 -> 4, 3.25 -> 3, 0.5 -> 0.5, 0.25 -> 0 (tie, even)
      ([7.0, 6.5, 1.0, 0.5], [8.0, 6.0, 1.0, 0.0]),
      # amax exactly 6 * 2^k keeps scale 2^k, not 2^(k+1)
      ([6.0, 0.75], [6.0, 1.0]),
      ([12.0, 1.0], [12.0, 1.0]),   # scale 2: 1.0 / 2 = 0.5 is on the grid
      ([6 * 2.0**-100], [6 * 2.0**-100]),
      ([1e-40], [0.0]),  # below the floor: scale 2^-126, 1e-40 / 2^-126 ~ 0.0085 -> 0
      ([], []),
  ]
  for xs, ws in rows:
    got = np.asarray(fq_fp4_ue8m0_scale(_block(xs, 32)))
    np.testing.assert_array_equal(got, _block(ws, 32), err_msg=str(xs))
  # one float32 ulp above 12 needs scale 4: 12.000001 / 4 = 3.0000002 -> 3 -> 12
  # and 1.0 / 4 = 0.25 is a tie -> 0
  over = np.nextafter(np.float32(12.0), np.float32(13.0))
  got = np.asarray(fq_fp4_ue8m0_scale(_block([over, 1.0], 32)))
  np.testing.assert_array_equal(got, _block([12.0, 0.0], 32))


def test_fp8_ue8m0_hand_computed():
  rows = [
      # amax 448: scale 1. 300 in [256, 512) step 32: 9.375 -> 9 -> 288; 17: step 2, 8.5 tie -> 16;
      # 19 -> 9.5 tie -> 20; 1.5 * 2^-9 subnormal step 2^-9: tie -> 2^-8; 2^-10 tie -> 0
      ([448.0, 300.0, 17.0, 19.0, 1.5 * 2.0**-9, 2.0**-10, -300.0],
       [448.0, 288.0, 16.0, 20.0, 2.0**-8, 0.0, -288.0]),
      # amax 449: scale 2; 224.5 -> step 16: 14.03 -> 224 -> 448; 150 -> 9.375 -> 144 -> 288
      ([449.0, 300.0], [448.0, 288.0]),
      # amax 1000: 2.23 -> scale 4; 250 -> 15.6 steps of 16 -> 256 -> 1024
      ([1000.0], [1024.0]),
      # amax below the 1e-4 floor: scale 2^ceil(log2(1e-4 / 448)) = 2^-22;
      # 1e-6 * 2^22 = 4.19 -> step 0.5: 8.39 -> 8 -> 4 -> 4 * 2^-22
      ([1e-6], [4.0 * 2.0**-22]),
      ([], []),
  ]
  for xs, ws in rows:
    got = np.asarray(fq_fp8_ue8m0_scale(_block(xs, 32)))
    np.testing.assert_array_equal(got, np.asarray(_block(ws, 32), np.float32), err_msg=str(xs))


# ---------------------------------------------------------------------------------------------
# Block formats: reference, grid, dtypes, shapes


def _inputs(seed, shape, dtype=np.float32):
  """Normal values with a per-row magnitude from 2^-30 to 2^12, some zero rows."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 12, shape[:-1] + (1,)))
  x[..., :1, :] = 0.0
  return x.astype(np.float32).astype(dtype)


@pytest.mark.parametrize('name', FORMATS)
@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_matches_numpy_reference(name, dtype):
  x = _inputs(4, (3, 128, 256), dtype)
  got = np.asarray(jax.jit(functools.partial(fake_quant, name))(x))
  assert got.dtype == x.dtype and got.shape == x.shape
  ref = qdq_reference(name, x)
  np.testing.assert_array_equal(got.astype(np.float32), ref.astype(np.float32))


@pytest.mark.parametrize('name', FORMATS)
def test_edges_match_numpy_reference(name):
  """Blocks whose amax sits on a scale boundary or tie (6 or 448 times a power of two or an e4m3
  value or midpoint, and their float32 neighbours), filled with exact element ties at that scale."""
  qmax = 448.0 if name == 'fp8_ue8m0_32' else 6.0
  grid = E4M3 if name == 'fp8_ue8m0_32' else E2M1
  b = BLOCK[name]
  amax = np.concatenate([qmax * np.exp2(np.arange(-60.0, 40.0)),
                         6.0 * E4M3[1:], 6.0 * (E4M3[1:-1] + E4M3[2:]) / 2]).astype(np.float32)
  amax = np.concatenate([amax, np.nextafter(amax, np.float32(np.inf)),
                         np.nextafter(amax, np.float32(0))])
  scale = _scales(name, np.repeat(amax[:, None], b, axis=1))[:, :1].astype(np.float32)
  ties = _ties_and_neighbours(grid)
  rng = np.random.default_rng(9)
  fill = ties[rng.integers(0, len(ties), (len(amax), b - 1))] * scale
  x = np.concatenate([amax[:, None], np.clip(fill, -amax[:, None], amax[:, None])], axis=1)
  x = x.astype(np.float32)
  got = np.asarray(fake_quant(name, x))
  np.testing.assert_array_equal(_bits(got), _bits(qdq_reference(name, x)))


def _scales(name, x32):
  """Each element's block scale, from the spec on the host (independent of quant.py)."""
  b = BLOCK[name]
  amax = np.abs(x32.reshape(*x32.shape[:-1], -1, b)).max(-1, keepdims=True).astype(np.float64)
  if name == 'fp4_e4m3_16':
    s = np.minimum(np.maximum(amax, 6 * 2.0**-9) / 6, 448).astype(np.float32).astype(
        ml_dtypes.float8_e4m3fn)
  elif name == 'fp4_ue8m0_32':
    s = np.exp2(np.ceil(np.log2(np.maximum(amax, 6 * 2.0**-126) / 6)))
  else:
    s = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-4) / 448)))
  return np.broadcast_to(s.astype(np.float64), amax.shape[:-1] + (b,)).reshape(x32.shape)


@pytest.mark.parametrize('name', FORMATS)
def test_outputs_lie_on_the_grid(name):
  x = _inputs(5, (64, 512))
  out = np.asarray(fake_quant(name, x)).astype(np.float64)
  q = np.abs(out / _scales(name, x))
  grid = E4M3 if name == 'fp8_ue8m0_32' else E2M1
  assert np.isin(q, grid.astype(np.float64)).all()
  # and the quantizer is not a no-op
  assert np.abs(out - x).max() > 0


@pytest.mark.parametrize('name', FORMATS)
def test_all_zero_and_tiny_blocks_are_finite(name):
  x = np.zeros((4, 64), np.float32)
  x[1] = 1e-38
  x[2] = -1e-45
  out = np.asarray(fake_quant(name, x))
  assert np.isfinite(out).all()
  np.testing.assert_array_equal(out[0], 0.0)


@pytest.mark.parametrize('name', FORMATS)
def test_dtype_and_leading_axes(name):
  x = jnp.asarray(_inputs(6, (2, 3, 5, 64)), jnp.bfloat16)
  out = jax.jit(FQ[name])(x)
  assert out.dtype == jnp.bfloat16 and out.shape == x.shape
  flat = FQ[name](x.reshape(-1, 64))
  np.testing.assert_array_equal(np.asarray(out).reshape(-1, 64), np.asarray(flat))


@pytest.mark.parametrize('name', FORMATS)
def test_bad_last_axis_raises(name):
  with pytest.raises(ValueError, match='divisible'):
    FQ[name](jnp.zeros((4, 24)))
  with pytest.raises(ValueError, match='divisible'):
    fake_quant(name, jnp.zeros((8,)))
  with pytest.raises(ValueError, match='floating'):
    FQ[name](jnp.zeros((4, 64), jnp.int32))


def test_registry():
  assert quant.QUANT_NAMES == ('none', 'fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32')
  x = jnp.arange(32.0)
  assert fake_quant('none', x) is x
  with pytest.raises(ValueError, match='fp4_e4m3_16'):
    fake_quant('fp4', x)
  assert quant.get_fake_quant('fp4_e4m3_16')(x).shape == x.shape


# ---------------------------------------------------------------------------------------------
# Straight-through gradient


@pytest.mark.parametrize('name', FORMATS)
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_straight_through_gradient(name, dtype):
  x = jnp.asarray(_inputs(7, (2, 8, 64)), dtype)
  w = jnp.asarray(np.random.default_rng(8).standard_normal(x.shape), dtype)
  loss = lambda v: jnp.sum(fake_quant(name, v) * w)
  g = jax.jit(jax.grad(loss))(x)
  assert g.dtype == dtype
  np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # the forward under jit really quantizes (on the GPU, benchmarks/check_fake_quant.py checks it)
  out = jax.jit(functools.partial(fake_quant, name))(x)
  assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - x.astype(jnp.float32)))) > 0
