"""Fake quantization for quantization-aware training (docs/architecture.md 3.5-3.7, 3.16).

Each format quantizes in blocks along the last axis and dequantizes again (`qdq_*`); the `fq_*`
versions wrap that in a straight-through estimator (identity gradient, section 3.16). Math runs in
float32 and the result comes back in the input dtype.

  name            element  block  scale                                  where
  'fp4_e4m3_16'   e2m1     16     e4m3(max(amax, 6*2^-9) / 6)            compressed main KV (3.6)
  'fp4_ue8m0_32'  e2m1     32     2^ceil(log2(max(amax, 6*2^-126) / 6))  indexer q and k (3.7)
  'fp8_ue8m0_32'  e4m3fn   32     2^ceil(log2(max(amax, 1e-4) / 448))    SWA KV (3.5)

Rounding is arithmetic on float32 (bit extraction, `round` half-to-even, `where`), never a
`astype(float4_e2m1fn).astype(...)` round trip: under jit on the H200, XLA folds such round trips
away (`xla_allow_excess_precision`, docs/performance.md's first trap) and the QAT silently trains in
full precision. Nor is there a division: XLA turns `x / scale` into `x * (1 / scale)`, which puts
exact ties on the wrong side (see `_round_quotient`). `round_e2m1` / `round_e4m3` and the `qdq_*`
functions equal ml_dtypes' casts of the float32 quotients bit for bit (tests/unit/test_quant.py);
`benchmarks/check_fake_quant.py` checks that on a device against `qdq_reference`, the host-side
numpy / ml_dtypes ground truth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# fp4_e4m3: 6 * 2^-9 makes the smallest scale 2^-9, the smallest e4m3 subnormal, never 0 (3.6).
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
# fp4_ue8m0: 6 * 2^-126 makes the smallest scale 2^-126, the smallest normal float32 (3.7).
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
# fp8_ue8m0: DeepSeek's FP8 activation floor (3.16), not 448 * 2^-126. Scales stay >= 2^-22, so
# every nonzero output is >= 2^-31, a normal float32/bf16: a device that flushes denormals (GPUs
# may) cannot disagree with the host. A block with amax < 1e-4 only loses elements < 2^-31.
FP8_UE8M0_AMAX_FLOOR = 1e-4


# ---------------------------------------------------------------------------------------------
# Element rounding
#
# No division anywhere: XLA rewrites `a / broadcast(b)` and `a / constant` into `a * (1 / b)`
# (measured on CPU under jax 0.11.2), which is not correctly rounded, so `x / scale` would land on
# the wrong side of a rounding tie now and then and disagree with the casts. Dividing by a power of
# two is safe (its reciprocal is exact); for other divisors `_round_quotient` decides with exact
# products instead.

# (mantissa bits, lowest normal exponent, largest value) of the element formats.
_E2M1 = (1, 0, 6.0)
_E4M3 = (3, -6, 448.0)


def _pow2(e):
  """2.0**e for int32 e in [-126, 127], built from the exponent bits: exact, no transcendental."""
  return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _exponent(a):
  """floor(log2(a)) for float32 a >= 0, read from the bits (exact; -127 for 0 and subnormals)."""
  return (jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) - 127


def _step_exponent(a, fmt):
  """log2 of the grid step at a >= 0: in the binade [2^e, 2^(e+1)) it is e - mantissa_bits;
  below the lowest normal binade the subnormals keep that binade's step."""
  mantissa_bits, min_exponent, _ = fmt
  # The upper clip keeps inf/NaN's exponent (128) in _pow2's range.
  return jnp.clip(_exponent(a), min_exponent, 127) - mantissa_bits


def _round_minifloat(x, fmt):
  """Round float32 x to the nearest value of a small float format, ties to even, saturating.

  Multiplying by the exact reciprocal of a power-of-two step is exact, and a tie rounded up into
  the next binade lands on its (even) power of two, so one `round` suffices.
  """
  x = jnp.asarray(x, jnp.float32)
  a = jnp.abs(x)
  k = _step_exponent(a, fmt)
  n = jax.lax.round(a * _pow2(-k), jax.lax.RoundingMethod.TO_NEAREST_EVEN)
  r = jnp.minimum(n * _pow2(k), fmt[2])
  # copysign keeps -0 for small negatives, as the casts do.
  return jnp.copysign(r, x)


def round_e2m1(x):
  """Nearest float4 e2m1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even, |x| > 6 -> 6. float32."""
  return _round_minifloat(x, _E2M1)


def round_e4m3(x):
  """Nearest float8 e4m3fn value, ties to even, |x| > 448 -> 448 (the cast gives NaN). float32."""
  return _round_minifloat(x, _E4M3)


def _round_quotient(x, s, fmt):
  """The format's rounding of the exact quotient x / s (s > 0, broadcastable), without dividing.

  Estimate with the inexact `x * (1 / s)`, which is off by at most one grid point, then settle it
  against the midpoints to the neighbours times s: those products have at most 9 significant bits
  (a midpoint at most 5, s an e4m3 value or the constant 6: at most 4), so they and the comparisons
  are exact.
  Equals the cast of the float32 quotient `x / s`: that quotient is rounded monotonically and never
  lands on a midpoint it does not equal.
  """
  x = jnp.asarray(x, jnp.float32)
  a = jnp.abs(x)
  c = jnp.abs(_round_minifloat(a * (1.0 / s), fmt))
  k = _step_exponent(c, fmt)
  step_up = _pow2(k)
  # Just below a power of two above the subnormals the step halves (e2m1: 1.5 -> 2, then 2 -> 3).
  mantissa_zero = (jax.lax.bitcast_convert_type(c, jnp.int32) & 0x7FFFFF) == 0
  halves = mantissa_zero & (_exponent(c) > fmt[1])
  step_down = jnp.where(halves, _pow2(k - 1), step_up)
  # The code's last mantissa bit is the parity of c / step; at a tie the even neighbour wins.
  odd = ((c * _pow2(-k)).astype(jnp.int32) & 1) == 1
  mid_up = (c + 0.5 * step_up) * s
  mid_down = (c - 0.5 * step_down) * s
  up = (c < fmt[2]) & ((a > mid_up) | ((a == mid_up) & odd))
  down = (c > 0) & ((a < mid_down) | ((a == mid_down) & odd))
  r = jnp.where(up, c + step_up, jnp.where(down, c - step_down, c))
  return jnp.copysign(r, x)


def _ceil_pow2_quotient(amax, qmax: float):
  """k = ceil(log2(amax / qmax)) (int32), the exponent of the ue8m0 scale rounded up (3.16): the
  smallest k with 2^k * qmax >= amax, for amax >= qmax * 2^-126.

  Estimated from the bits of the inexact `amax * (1 / qmax)`, then fixed by exact comparisons:
  jnp.log2 is not exact at powers of two either, and one exponent too many halves a block's
  precision.
  """
  y = amax * (1.0 / qmax)
  bits = jax.lax.bitcast_convert_type(y, jnp.int32)
  k = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
  k = jnp.clip(k, -126, 127)
  k = k + ((_pow2(k) * qmax < amax) & (k < 127)).astype(jnp.int32)
  k = k - ((k > -126) & (_pow2(jnp.maximum(k - 1, -126)) * qmax >= amax)).astype(jnp.int32)
  return k


# ---------------------------------------------------------------------------------------------
# Block quantize -> dequantize (no custom gradient)


def _blocks(x, block: int):
  """x as float32 [..., n / block, block]; a clear error when the last axis does not split."""
  if not isinstance(block, int) or block <= 0:
    raise ValueError(f'fake quant block must be a positive int, got {block!r}')
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f'fake quant needs a floating-point input, got dtype {x.dtype}')
  if x.ndim == 0 or x.shape[-1] % block:
    raise ValueError(f'fake quant quantizes blocks of {block} along the last axis, but the input '
                     f'shape {x.shape} has a last axis not divisible by {block}')
  return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax(xb, floor: float):
  return jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), floor)


# The qdq functions are jitted so that eager calls (tests, tools) compile one program instead of
# dispatching dozens of small ops; inside a jitted model they simply inline.

def _quantize_e4m3_scale(x, block: int):
  """(element values q [..., n/block, block], scales [..., n/block, 1]), float32: e2m1 values,
  one e4m3 scale per block. The clip to +-6 is the rounding's saturation; a scale that rounds down
  clips the block's amax."""
  xb = _blocks(x, block)
  scale = _round_quotient(_amax(xb, FP4_E4M3_AMAX_FLOOR), E2M1_MAX, _E4M3)
  return _round_quotient(xb, scale, _E2M1), scale


def _quantize_pow2_scale(x, block: int, amax_floor: float, qmax: float, round_fn):
  """(q, scale) with a power-of-two scale rounded up (ue8m0): an exact reciprocal."""
  xb = _blocks(x, block)
  k = _ceil_pow2_quotient(_amax(xb, amax_floor), qmax)
  return round_fn(jnp.clip(xb * _pow2(-k), -qmax, qmax)), _pow2(k)


def quantize_blocks(name: str, x):
  """The format `name`'s (element values [..., n/block, block], scales [..., n/block, 1]) of x,
  float32; q * scale is its qdq. What the packed caches store (packing.py)."""
  if name == 'fp4_e4m3_16':
    return _quantize_e4m3_scale(x, 16)
  if name == 'fp4_ue8m0_32':
    return _quantize_pow2_scale(x, 32, FP4_UE8M0_AMAX_FLOOR, E2M1_MAX, round_e2m1)
  if name == 'fp8_ue8m0_32':
    return _quantize_pow2_scale(x, 32, FP8_UE8M0_AMAX_FLOOR, E4M3_MAX, round_e4m3)
  raise ValueError(f'unknown quantization format {name!r}; expected one of {QUANT_NAMES}')


@functools.partial(jax.jit, static_argnames='block')
def qdq_fp4_e4m3_scale(x, block: int = 16):
  """Compressed main-KV format (3.6): e2m1 values, one e4m3 scale per `block`. No STE."""
  q, scale = _quantize_e4m3_scale(x, block)
  return (q * scale).reshape(x.shape).astype(x.dtype)


def _qdq_pow2_scale(x, block: int, amax_floor: float, qmax: float, round_fn):
  """Block quantize-dequantize with a power-of-two scale rounded up (ue8m0): exact reciprocal."""
  q, scale = _quantize_pow2_scale(x, block, amax_floor, qmax, round_fn)
  return (q * scale).reshape(x.shape).astype(x.dtype)


@functools.partial(jax.jit, static_argnames='block')
def qdq_fp4_ue8m0_scale(x, block: int = 32):
  """Indexer q/k format (3.7): e2m1 values, a power-of-two scale (rounded up) per block. No STE."""
  return _qdq_pow2_scale(x, block, FP4_UE8M0_AMAX_FLOOR, E2M1_MAX, round_e2m1)


@functools.partial(jax.jit, static_argnames='block')
def qdq_fp8_ue8m0_scale(x, block: int = 32):
  """SWA KV format (3.5): e4m3fn values, a power-of-two scale (rounded up) per block. No STE."""
  return _qdq_pow2_scale(x, block, FP8_UE8M0_AMAX_FLOOR, E4M3_MAX, round_e4m3)


# ---------------------------------------------------------------------------------------------
# Straight-through versions (what the model uses)


def _straight_through(qdq):
  """qdq in the forward, identity in the backward (3.16): the rounding has zero gradient almost
  everywhere, so without the STE nothing upstream of a quantized cache would learn."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
  def fq(x, block):
    return qdq(x, block)

  def fwd(x, block):
    return qdq(x, block), None

  def bwd(block, _, g):
    del block
    return (g,)

  fq.defvjp(fwd, bwd)
  return fq


_fq_fp4_e4m3 = _straight_through(qdq_fp4_e4m3_scale)
_fq_fp4_ue8m0 = _straight_through(qdq_fp4_ue8m0_scale)
_fq_fp8_ue8m0 = _straight_through(qdq_fp8_ue8m0_scale)


def fq_fp4_e4m3_scale(x, block: int = 16):
  """Fake quant of the compressed main KV (3.6), straight-through gradient."""
  _blocks(x, block)  # validate here: errors inside custom_vjp tracing read worse
  return _fq_fp4_e4m3(x, block)


def fq_fp4_ue8m0_scale(x, block: int = 32):
  """Fake quant of the indexer q and k (3.7), straight-through gradient."""
  _blocks(x, block)
  return _fq_fp4_ue8m0(x, block)


def fq_fp8_ue8m0_scale(x, block: int = 32):
  """Fake quant of the SWA KV (3.5), straight-through gradient."""
  _blocks(x, block)
  return _fq_fp8_ue8m0(x, block)


# ---------------------------------------------------------------------------------------------
# Registry: config strings (`model.kv_quant`, `model.index_quant`, `model.swa_quant`) -> functions

FAKE_QUANTS = {
    'none': lambda x: x,
    'fp4_e4m3_16': functools.partial(fq_fp4_e4m3_scale, block=16),
    'fp4_ue8m0_32': functools.partial(fq_fp4_ue8m0_scale, block=32),
    'fp8_ue8m0_32': functools.partial(fq_fp8_ue8m0_scale, block=32),
}
QDQS = {
    'none': lambda x: x,
    'fp4_e4m3_16': functools.partial(qdq_fp4_e4m3_scale, block=16),
    'fp4_ue8m0_32': functools.partial(qdq_fp4_ue8m0_scale, block=32),
    'fp8_ue8m0_32': functools.partial(qdq_fp8_ue8m0_scale, block=32),
}
QUANT_NAMES = tuple(FAKE_QUANTS)


def get_fake_quant(name: str):
  """The straight-through fake quant called `name` ('none' is the identity)."""
  if name not in FAKE_QUANTS:
    raise ValueError(f'unknown fake quant format {name!r}; choose one of {QUANT_NAMES}')
  return FAKE_QUANTS[name]


def fake_quant(name: str, x):
  """Apply the straight-through fake quant `name` to x (blocks along the last axis)."""
  return get_fake_quant(name)(x)


# ---------------------------------------------------------------------------------------------
# Host reference (numpy + ml_dtypes casts): ground truth for the tests and the device check

_REFERENCE_SPECS = {  # name: (block, amax floor, qmax, element dtype, scale kind)
    'fp4_e4m3_16': (16, FP4_E4M3_AMAX_FLOOR, E2M1_MAX, ml_dtypes.float4_e2m1fn, 'e4m3'),
    'fp4_ue8m0_32': (32, FP4_UE8M0_AMAX_FLOOR, E2M1_MAX, ml_dtypes.float4_e2m1fn, 'ue8m0'),
    'fp8_ue8m0_32': (32, FP8_UE8M0_AMAX_FLOOR, E4M3_MAX, ml_dtypes.float8_e4m3fn, 'ue8m0'),
}


def qdq_reference(name: str, x) -> np.ndarray:
  """The format `name` on the host, with ml_dtypes casts and float64 log2, in x's dtype.

  Independent of the arithmetic rounding above, so agreement is evidence, not tautology.
  """
  x = np.asarray(x)
  if name == 'none':
    return x
  block, floor, qmax, elem, scale_kind = _REFERENCE_SPECS[name]
  xb = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
  y = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), np.float32(floor)) / np.float32(qmax)
  if scale_kind == 'e4m3':
    scale = np.minimum(y, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  else:
    scale = np.exp2(np.ceil(np.log2(y.astype(np.float64)))).astype(np.float32)
  q = np.clip(xb / scale, -qmax, qmax).astype(elem).astype(np.float32)
  return (q * scale).reshape(x.shape).astype(x.dtype)
