"""The cache formats as stored bytes (docs/architecture.md sections 3.5-3.7, 3.9).

`pack(name, x)` keeps what a cache holds for x in format `name` (quant.py): the element codes
(e2m1: two 4-bit codes per byte, the lower nibble first; e4m3fn: one byte each) and one scale
byte per block (e4m3 bits for `fp4_e4m3_16`, the biased exponent 127 + k of 2^k for the ue8m0
formats). `unpack` returns exactly quant.py's quantize-dequantize of x, bit for bit, so a cache in
these bytes and the training path's fake quantization agree. Bytes per value:

  fp4_e4m3_16   0.5 + 1/16     compressed main KV
  fp4_ue8m0_32  0.5 + 1/32     indexer keys
  fp8_ue8m0_32  1 + 1/32       SWA window

`store` / `load` are what a generation cache does with a value in `model.*_quant`'s format
(`'none'`: the compute dtype as is).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepseek41.quant import quantize_blocks

# e2m1 magnitudes by code (bits: exponent 2, mantissa 1); bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FORMATS = {  # name: (block, element bits, scale kind)
    'fp4_e4m3_16': (16, 4, 'e4m3'),
    'fp4_ue8m0_32': (32, 4, 'ue8m0'),
    'fp8_ue8m0_32': (32, 8, 'ue8m0'),
}


class Packed(NamedTuple):
  codes: jax.Array   # uint8 [..., n * bits / 8]
  scales: jax.Array  # uint8 [..., n / block]


def bytes_per_value(name: str) -> float:
  block, bits, _ = _format(name)
  return bits / 8 + 1 / block


def _format(name: str):
  if name not in FORMATS:
    raise ValueError(f'no packed layout for format {name!r}; expected one of {tuple(FORMATS)}')
  return FORMATS[name]


def _e2m1_codes(q):
  """4-bit codes of e2m1 values (exact members of the grid)."""
  table = jnp.asarray(E2M1_MAGNITUDES, jnp.float32)
  magnitude = jnp.argmax(jnp.abs(q)[..., None] == table, axis=-1).astype(jnp.uint8)
  return magnitude | (jnp.signbit(q).astype(jnp.uint8) << 3)


def _e2m1_values(codes):
  table = jnp.asarray(E2M1_MAGNITUDES, jnp.float32)
  value = table[(codes & 7).astype(jnp.int32)]
  return jnp.where((codes & 8) != 0, -value, value)


def _float8_bits(v):
  # v is exactly an e4m3 value, so this cast rounds nothing (no excess-precision folding risk).
  return jax.lax.bitcast_convert_type(v.astype(jnp.float8_e4m3fn), jnp.uint8)


def _float8_values(bits):
  return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)


def pack(name: str, x) -> Packed:
  """x [..., n] (n a multiple of the block) in format `name`'s stored bytes."""
  block, bits, scale_kind = _format(name)
  q_bjk, scale_bj1 = quantize_blocks(name, x)
  lead = x.shape[:-1]
  q = q_bjk.reshape(*lead, x.shape[-1])
  if bits == 4:
    c = _e2m1_codes(q)
    codes = c[..., 0::2] | (c[..., 1::2] << 4)
  else:
    codes = _float8_bits(q)
  scale = scale_bj1[..., 0]
  if scale_kind == 'e4m3':
    scales = _float8_bits(scale)
  else:  # 2^k, k in [-126, 127]: the exponent field is the biased k
    scales = (jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23).astype(jnp.uint8)
  return Packed(codes, scales.reshape(*lead, -1))


def unpack(name: str, packed: Packed, dtype=jnp.float32):
  """The values a packed cache holds: quant.py's quantize-dequantize, bit for bit."""
  block, bits, scale_kind = _format(name)
  codes, scales = packed
  if bits == 4:
    q = jnp.stack([_e2m1_values(codes & 0xF), _e2m1_values(codes >> 4)], axis=-1)
    q = q.reshape(*codes.shape[:-1], codes.shape[-1] * 2)
  else:
    q = _float8_values(codes)
  if scale_kind == 'e4m3':
    scale = _float8_values(scales)
  else:
    scale = jax.lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)
  q_bjk = q.reshape(*q.shape[:-1], q.shape[-1] // block, block)
  return (q_bjk * scale[..., None]).reshape(q.shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# A cache's storage: `model.*_quant = 'none'` keeps the compute dtype as is, a format its bytes.


def store(fmt: str, x):
  """x [..., d] as a cache keeps it in format `fmt` ('none' or a `FORMATS` name)."""
  return x if fmt == 'none' else pack(fmt, x)


def load(fmt: str, stored, dtype):
  """The values `store(fmt, x)` keeps, in `dtype`: the fake quantization of x, bit for bit."""
  return stored.astype(dtype) if fmt == 'none' else unpack(fmt, stored, dtype)


def empty_stored(fmt: str, lead: tuple[int, ...], d: int, dtype):
  """Zeros [*lead, d] as format `fmt` stores them."""
  if fmt == 'none':
    return jnp.zeros((*lead, d), dtype)
  zeros = pack(fmt, jnp.zeros((1, d), jnp.float32))
  return Packed(jnp.zeros((*lead, zeros.codes.shape[-1]), jnp.uint8),
                jnp.zeros((*lead, zeros.scales.shape[-1]), jnp.uint8))
