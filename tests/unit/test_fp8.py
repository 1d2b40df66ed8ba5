"""FP8 training GEMMs (`model.fp8 = 'rowwise'`, ops/fp8_matmul.py) on the CPU.

Tolerances:
  * fp8_matmul against its plain-jnp reference (same quantization, float32 math): 1e-6 of
    max|ref| (products of e4m3 values are exact in float32; only the summation order differs).
  * fp8_matmul against the exact float32 matmul: normwise relative error <= 6% (e4m3 keeps 3
    mantissa bits: relative rounding <= 2^-4, RMS ~2.6% per operand; observed ~4% on Gaussian
    data). Routed experts (two quantized GEMMs deep, the SwiGLU between): output <= 10%,
    gradients <= 20% (observed 7% and up to 13%).
  * Training (40 steps of the test model, fp32 compute, capacity_einsum experts): every step's
    loss within 2% of the fp32 run and the last within 1.5%; observed at most 0.5%.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepseek41.config import ConfigError
from deepseek41.ops import grouped_gemm
from deepseek41.ops.expert_gemm import expert_ffn
from deepseek41.ops.fp8_matmul import (dense, fp8_matmul, fp8_matmul_reference,
                                       fp8_matmul_reference_vjp, qdq_rowwise, quantize_rowwise)
from deepseek41.ops.gpu import grouped_gemm as gg
from tests.helpers import resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

TIGHT = 1e-6
LOOSE = 0.06  # normwise, against the exact product


def rel_max(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def rel_norm(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def rows(seed, shape, scale_range=6.0):
  """Gaussian rows with row magnitudes spread over 2^+-scale_range (scales must follow them)."""
  ks = jax.random.split(jax.random.key(seed))
  mag = 2.0 ** jax.random.uniform(ks[0], shape[:-1] + (1,), minval=-scale_range,
                                  maxval=scale_range)
  return jax.random.normal(ks[1], shape) * mag


# ---- quantization ------------------------------------------------------------------------------


@pytest.mark.parametrize('axis', [0, 1])
def test_quantize_scales_are_the_smallest_powers_of_two_that_fit(axis):
  x = rows(0, (40, 72)) if axis == 1 else rows(0, (72, 40)).T
  q, s = quantize_rowwise(x, axis)
  q32, s = np.asarray(q, np.float32), np.asarray(s)
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == np.float32
  assert s.shape == tuple(1 if i == axis else n for i, n in enumerate(x.shape))
  mant, _ = np.frexp(s)
  assert np.all(mant == 0.5), 'scales are powers of two'
  amax = np.abs(np.asarray(x)).max(axis=axis, keepdims=True)
  assert np.all(amax <= 448 * s) and np.all(amax > 448 * s / 2), 'smallest fitting power of two'
  assert np.all(np.isfinite(q32)) and np.abs(q32).max() <= 448


def test_quantize_matches_the_ml_dtypes_cast_and_bounds_the_error():
  x = np.asarray(rows(1, (32, 96)))
  q, s = quantize_rowwise(jnp.asarray(x), 1)
  s = np.asarray(s)
  want = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # exact: s is 2^k
  np.testing.assert_array_equal(np.asarray(q, np.float32), want)
  deq = np.asarray(q, np.float32) * s
  np.testing.assert_array_equal(np.asarray(qdq_rowwise(jnp.asarray(x), 1)), deq)
  # Normal e4m3: relative error <= 2^-4; subnormal range: half a step, 2^-10 * scale.
  assert np.all(np.abs(deq - x) <= np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * s))


def test_quantize_zero_and_tiny_rows():
  x = jnp.zeros((3, 16)).at[1].set(1e-30).at[2, 5].set(-3.0)
  q, s = quantize_rowwise(x, 1)
  q32 = np.asarray(q, np.float32)
  assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
  np.testing.assert_array_equal(q32[0], 0.0)
  np.testing.assert_allclose(q32[1] * np.asarray(s)[1], 1e-30, rtol=2.0**-4)  # no floor at 1e-4
  assert q32[2, 5] * np.asarray(s)[2, 0] == -3.0


# ---- fp8_matmul --------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def operands():
  x = rows(2, (3, 20, 64), scale_range=3.0)  # [B, T, K]: leading dims flatten
  w = 0.05 * jax.random.normal(jax.random.key(3), (64, 48))
  dy = rows(4, (3, 20, 48), scale_range=3.0) * 1e-6  # gradient-sized: below quant.py's floor
  return x, w, dy


def test_forward_and_grads_equal_the_reference(operands):
  x, w, dy = operands
  y, vjp = jax.vjp(jax.jit(fp8_matmul), x, w)
  dx, dw = vjp(dy)
  assert y.shape == (3, 20, 48) and dx.shape == x.shape and dw.shape == w.shape
  assert rel_max(y, fp8_matmul_reference(x, w)) <= TIGHT
  ref_dx, ref_dw = fp8_matmul_reference_vjp(x, w, dy)
  assert rel_max(dx, ref_dx) <= TIGHT
  assert rel_max(dw, ref_dw) <= TIGHT


def test_close_to_the_exact_product_but_not_equal(operands):
  x, w, dy = operands
  y, vjp = jax.vjp(fp8_matmul, x, w)
  dx, dw = vjp(dy)
  hi = jax.lax.Precision.HIGHEST
  exact = (jnp.matmul(x, w, precision=hi), jnp.matmul(dy, w.T, precision=hi),
           jnp.einsum('btk,btn->kn', x, dy, precision=hi))
  for got, want in zip((y, dx, dw), exact):
    err = rel_norm(got, want)
    assert 1e-3 < err <= LOOSE, err  # quantized (not silently full precision), and accurate


def test_bf16_in_bf16_out_and_float32_weight_gradient(operands):
  x, w, dy = operands
  y, vjp = jax.vjp(lambda x, w: fp8_matmul(x, w.astype(jnp.bfloat16)),
                   x.astype(jnp.bfloat16), w)
  dx, dw = vjp(dy.astype(jnp.bfloat16))
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  x16, w16 = (a.astype(jnp.bfloat16).astype(jnp.float32) for a in (x, w))
  assert rel_max(y, fp8_matmul_reference(x16, w16)) <= 2.0**-8  # the bf16 rounding of y


def test_dense_off_is_the_plain_matmul(operands):
  x, w, _ = operands
  np.testing.assert_array_equal(np.asarray(dense(x, w, 'off')), np.asarray(x @ w))
  with pytest.raises(ValueError, match='fp8'):
    dense(x, w, 'e5m2')


# ---- routed experts ----------------------------------------------------------------------------

N, D, F, E, K = 48, 32, 24, 4, 2


def expert_inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 7)
  x = jax.random.normal(ks[0], (N, D))
  idx = jax.lax.top_k(jax.random.uniform(ks[1], (N, E)), K)[1].astype(jnp.int32)
  weight = jax.random.uniform(ks[2], (N, K), minval=0.1, maxval=1.0)
  valid = jax.random.uniform(ks[3], (N,)) >= 0.15
  wg = jax.random.normal(ks[4], (E, D, F)) / np.sqrt(D)
  wu = jax.random.normal(ks[5], (E, D, F)) / np.sqrt(D)
  wd = jax.random.normal(ks[6], (E, F, D)) / np.sqrt(F)
  return x, idx, weight, valid, wg, wu, wd


@functools.partial(jax.jit, static_argnames=('backend', 'fp8'))
def expert_value_and_grads(x, idx, weight, valid, wg, wu, wd, *, backend, fp8):
  def loss(x, wg, wu, wd):
    y, _ = expert_ffn(x, idx, weight, valid, wg, wu, wd, swiglu_limit=1.0, backend=backend,
                      capacity_factor=E / K, fp8=fp8)
    return jnp.sum(y * jnp.cos(jnp.arange(D))), y
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wg, wu, wd)


@pytest.fixture(scope='module')
def expert_runs():
  args = expert_inputs()
  return {(b, f): expert_value_and_grads(*args, backend=b, fp8=f)
          for b in ('reference', 'capacity_einsum', 'ragged_dot', 'grouped')
          for f in ('off', 'rowwise')}


@pytest.mark.parametrize('backend, twin', [('capacity_einsum', 'reference'),
                                           ('grouped', 'ragged_dot')])
def test_expert_backends_agree_in_fp8(expert_runs, backend, twin):
  """capacity_einsum = reference (all GEMMs fp8); grouped kernels = ragged_dot's
  quantize-dequantize (forward and dgrad fp8, wgrad unquantized)."""
  (_, y), g = expert_runs[backend, 'rowwise']
  (_, y_twin), g_twin = expert_runs[twin, 'rowwise']
  assert rel_max(y, y_twin) <= 1e-5
  for a, b in zip(g, g_twin):
    assert rel_max(a, b) <= 1e-5


@pytest.mark.parametrize('backend', ['reference', 'capacity_einsum', 'ragged_dot', 'grouped'])
def test_expert_fp8_is_close_to_off(expert_runs, backend):
  (_, y8), g8 = expert_runs[backend, 'rowwise']
  (_, y), g = expert_runs[backend, 'off']
  assert 1e-3 < rel_norm(y8, y) <= 0.1
  for a, b in zip(g8, g):
    assert rel_norm(a, b) <= 0.2


def test_grouped_fp8_kernel_equals_its_reference():
  tiles = gg.INTERPRET_TILES
  _, idx, _, valid, *_ = expert_inputs(1)
  lay = grouped_gemm.make_layout(idx, valid, E, tiles.block_m)
  m = lay.used_m.shape[0]
  x = rows(5, (m, D), 3.0) * lay.used_m[:, None]
  dy = rows(6, (m, F), 3.0) * lay.used_m[:, None]
  w = jax.random.normal(jax.random.key(7), (E, D, F)) / np.sqrt(D)
  fwd = functools.partial(gg.grouped_matmul_fp8, tile_expert_t=lay.tile_expert_t,
                          group_tiles_e1=lay.group_tiles_e1, tiles=tiles, interpret=True)
  y, vjp = jax.vjp(lambda x, w: fwd(x, w), x, w)
  dx, dw = vjp(dy)
  assert rel_max(y, grouped_gemm.grouped_matmul_fp8_reference(x, w, lay.tile_expert_t)) <= TIGHT
  ref_dx = grouped_gemm.grouped_matmul_fp8_reference(dy, w, lay.tile_expert_t, transpose_rhs=True)
  assert rel_max(dx, ref_dx) <= TIGHT
  _, ref_vjp = jax.vjp(lambda w: grouped_gemm.grouped_matmul_reference(x, w, lay.tile_expert_t), w)
  assert rel_max(dw, ref_vjp(dy)[0]) <= 1e-5  # the weight gradient is not quantized
  assert rel_norm(y, grouped_gemm.grouped_matmul_reference(x, w, lay.tile_expert_t)) > 1e-3


# ---- model and config --------------------------------------------------------------------------


def test_config_refuses_a_bad_fp8_value():
  with pytest.raises(ConfigError, match='model.fp8'):
    resolved(**{'model.fp8': 'e5m2'})
  assert resolved().model.fp8 == 'off'


