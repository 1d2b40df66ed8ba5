"""FP8 training GEMMs with row-wise power-of-two scales (`model.fp8 = 'rowwise'`).

All three GEMMs of a projection y = x W run with e4m3 operands and float32 accumulation:

  forward  y_mn  = q(x_mk over k) q(w_kn over k)      scales: sx_m * sw_n
  dgrad    dx_mk = q(dy_mn over n) q(w_kn over n)^T   scales: sdy_m * sw_k
  wgrad    dw_kn = q(x_mk over m)^T q(dy_mn over m)   scales: sx_k * sdy_n

Each operand is scaled per row *along the contraction axis*, so the scales factor out of the sum
and apply in the epilogue: acc_mn * s_m1 * s_1n. That is the only scaling cuBLASLt's FP8 GEMM
takes, hence what XLA can lower (dot_general on e4m3 operands -> a cuBLASLt FP8 GEMM on the H200).
DeepSeek-V3's 1x128 activation / 128x128 weight tiles would need the scales inside the
contraction loop, i.e. a custom kernel: out of scope here. Like DeepSeek-V3 (and unlike the
common e4m3 forward / e5m2 backward recipe), the gradients are e4m3 too.

Scales are powers of two rounded up (ue8m0, as DeepSeek-V4): amax / 448 <= scale, so nothing
clips, and multiplying by a scale is exact. Master weights and the optimizer stay float32; the
caller casts the weight to the compute dtype first, so dw flows back to float32 through that cast.
On the CPU, XLA upcasts e4m3 dots internally; the numbers are the same (products of two e4m3
values are exact in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepseek41.quant import E4M3_MAX, _ceil_pow2_quotient, _pow2, round_e4m3

E4M3 = jnp.float8_e4m3fn
FP8_CHOICES = ('off', 'rowwise')
# The smallest amax with a normal float32 scale (2^-126). Lower than quant.py's 1e-4 activation
# floor on purpose: gradient rows of a mean loss over many tokens are routinely below 1e-6, and a
# floor there would push them into e4m3's subnormals. An all-zero row quantizes to zeros.
AMAX_FLOOR = E4M3_MAX * 2.0**-126


def _scale_exponent(x32, axis):
  amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
  return _ceil_pow2_quotient(jnp.maximum(amax, AMAX_FLOOR), E4M3_MAX)


def quantize_rowwise(x, axis: int):
  """(x_e4m3, scale_f32) with x ~= x_e4m3 * scale; one power-of-two scale per row along `axis`.

  Plain elementwise math and one max-reduction, so XLA fuses it into the producer of x.
  """
  x32 = x.astype(jnp.float32)
  k = _scale_exponent(x32, axis)
  # Dividing by a power of two is exact; the clip only guards rounding at the top binade.
  q = jnp.clip(x32 * _pow2(-k), -E4M3_MAX, E4M3_MAX).astype(E4M3)
  return q, _pow2(k)


def qdq_rowwise(x, axis: int):
  """quantize_rowwise then back, in float32 arithmetic (no e4m3 dtype): the reference numerics."""
  x32 = x.astype(jnp.float32)
  k = _scale_exponent(x32, axis)
  return round_e4m3(jnp.clip(x32 * _pow2(-k), -E4M3_MAX, E4M3_MAX)) * _pow2(k)


def scaled_dot_nt(a_mk, b_nk, out_dtype):
  """a_mk @ b_nk^T in e4m3 with row-wise scales over k, float32 accumulation, out_dtype result.

  The "NT" layout (both operands contract their last axis) is the one cuBLASLt's FP8 GEMM takes;
  the transposes the callers pass in fuse into the quantization. The GEMM writes out_dtype
  directly (half the bytes of float32 for bf16) and the scales apply afterwards: they are powers
  of two, so scaling after the rounding equals rounding after the scaling.
  """
  aq_mk, sa_m1 = quantize_rowwise(a_mk, axis=1)
  bq_nk, sb_n1 = quantize_rowwise(b_nk, axis=1)
  y_mn = jax.lax.dot_general(aq_mk, bq_nk, (((1,), (1,)), ((), ())),
                             preferred_element_type=out_dtype)
  return y_mn * sa_m1.astype(out_dtype) * sb_n1.T.astype(out_dtype)


@jax.custom_vjp
def _fp8_matmul_2d(x_mk, w_kn):
  return scaled_dot_nt(x_mk, w_kn.T, x_mk.dtype)


def _fp8_matmul_fwd(x_mk, w_kn):
  # The unquantized operands are kept: the backward quantizes them along other axes.
  return _fp8_matmul_2d(x_mk, w_kn), (x_mk, w_kn)


def _fp8_matmul_bwd(res, dy_mn):
  x_mk, w_kn = res
  dx_mk = scaled_dot_nt(dy_mn, w_kn, x_mk.dtype)
  dw_kn = scaled_dot_nt(x_mk.T, dy_mn.T, w_kn.dtype)
  return dx_mk, dw_kn


_fp8_matmul_2d.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def fp8_matmul(x_mk, w_kn):
  """x @ w with all three GEMMs in e4m3 (module docstring); [..., K] @ [K, N] -> [..., N].

  Output in x's dtype, dx in x's dtype, dw in w's dtype.
  """
  lead = x_mk.shape[:-1]
  y_mn = _fp8_matmul_2d(x_mk.reshape(-1, x_mk.shape[-1]), w_kn)
  return y_mn.reshape(*lead, w_kn.shape[1])


def _ref_dot_nt(a_mk, b_nk):
  return jnp.matmul(qdq_rowwise(a_mk, 1), qdq_rowwise(b_nk, 1).T,
                    precision=jax.lax.Precision.HIGHEST)


def fp8_matmul_reference(x_mk, w_kn):
  """Plain jnp forward of fp8_matmul: float32 quantize-dequantize, float32 matmul ([..., K])."""
  lead = x_mk.shape[:-1]
  y_mn = _ref_dot_nt(x_mk.reshape(-1, x_mk.shape[-1]), w_kn.T)
  return y_mn.reshape(*lead, w_kn.shape[1]).astype(x_mk.dtype)


def fp8_matmul_reference_vjp(x_mk, w_kn, dy_mn):
  """Plain jnp (dx, dw) of fp8_matmul: the same quantization applied to each backward GEMM."""
  x2_mk = x_mk.reshape(-1, x_mk.shape[-1])
  dy2_mn = dy_mn.reshape(-1, dy_mn.shape[-1])
  dx_mk = _ref_dot_nt(dy2_mn, w_kn).reshape(x_mk.shape).astype(x_mk.dtype)
  dw_kn = _ref_dot_nt(x2_mk.T, dy2_mn.T).astype(w_kn.dtype)
  return dx_mk, dw_kn


def check_fp8(fp8: str):
  if fp8 not in FP8_CHOICES:
    raise ValueError(f'unknown fp8 mode {fp8!r}; expected one of {FP8_CHOICES}')


def dense(x, w, fp8: str = 'off'):
  """x @ w with w cast to x's dtype: the plain matmul when fp8 is 'off', else fp8_matmul."""
  check_fp8(fp8)
  if fp8 == 'off':
    return x @ w.astype(x.dtype)
  return fp8_matmul(x, w.astype(x.dtype))


def batched_fp8_matmul(x_emk, w_ekn):
  """fp8_matmul per leading index e (experts, output groups): [E, M, K] @ [E, K, N] -> [E, M, N].

  A vmap of the custom VJP: each e has its own row scales, the same numerics as e separate calls.
  """
  return jax.vmap(fp8_matmul)(x_emk, w_ekn)
