"""Low-precision weight storage of the released checkpoint format (docs/hf_interop.md,
"Quantized storage"; docs/architecture.md section 3.16): encode for export, decode for import.

    dense FP8     weight e4m3 [out, in], scale ue8m0 per `block` x `block` tile [out/b, in/b]
    expert FP4    weight e2m1 packed two per byte [out, in/2] (low nibble = even column),
                  scale ue8m0 per 32 along `in` [out, in/32]
    Engram FP8    table e4m3 [rows, d], scale ue8m0 per 32 along d [rows, d/32]

A ue8m0 scale is the power of two `2^ceil(log2(amax / qmax))` of its block (qmax 448 for e4m3,
6 for e2m1), so `x / scale` is exact and at most qmax: casting it rounds to nearest, ties to
even, and never overflows. Decoding multiplies back: `value = element * scale`, exact in fp32.
Encoding a decoded tensor again gives the same values (a block's scale can halve when its
largest element rounded down to exactly half the range; its elements then double exactly).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP4_BLOCK = 32
_E8M0_MIN_EXP = -127


def pow2_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
  """fp32 `2^ceil(log2(amax / qmax))`, exactly (frexp, no log), within e8m0's range."""
  ratio = np.maximum(amax.astype(np.float32), np.finfo(np.float32).tiny) / np.float32(qmax)
  mant, exp = np.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
  exp = np.where(mant == 0.5, exp - 1, exp)
  return np.ldexp(np.float32(1), np.maximum(exp, _E8M0_MIN_EXP)).astype(np.float32)


def _tile_amax(w: np.ndarray, block: int) -> np.ndarray:
  out_dim, in_dim = w.shape
  po, pi = -out_dim % block, -in_dim % block
  a = np.pad(np.abs(w.astype(np.float32)), ((0, po), (0, pi)))
  return a.reshape((out_dim + po) // block, block, (in_dim + pi) // block, block).max(axis=(1, 3))


def _expand_tiles(s: np.ndarray, block: int, shape: tuple[int, int]) -> np.ndarray:
  return np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:shape[0], :shape[1]]


def encode_fp8_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(e4m3 [out, in], e8m0 scales [ceil(out/b), ceil(in/b)]) of a 2-D weight."""
  if w.ndim != 2:
    raise ValueError(f'FP8 block storage takes a 2-D weight, got shape {w.shape}')
  scale = pow2_scale(_tile_amax(w, block), 448.0)
  q = (w.astype(np.float32) / _expand_tiles(scale, block, w.shape)).astype(E4M3)
  return q, scale.astype(E8M0)


def decode_fp8_blocks(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
  """fp32 [out, in] from e4m3 elements and per-tile scales (any float dtype)."""
  return q.astype(np.float32) * _expand_tiles(scale.astype(np.float32), block, q.shape)


def encode_rows(x: np.ndarray, elem: np.dtype, qmax: float, block: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """(elements, e8m0 scales [..., n/block]) with one scale per `block` along the last axis."""
  n = x.shape[-1]
  if n % block:
    raise ValueError(f'the last axis ({n}) is not a multiple of the scale block ({block})')
  xb = x.astype(np.float32).reshape(x.shape[:-1] + (n // block, block))
  scale = pow2_scale(np.abs(xb).max(axis=-1), qmax)
  q = (xb / scale[..., None]).astype(elem).reshape(x.shape)
  return q, scale.astype(E8M0)


def decode_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  n = q.shape[-1]
  block = n // scale.shape[-1]
  qb = q.astype(np.float32).reshape(q.shape[:-1] + (n // block, block))
  return (qb * scale.astype(np.float32)[..., None]).reshape(q.shape)


def pack_fp4(q: np.ndarray) -> np.ndarray:
  """e2m1 [..., n] -> uint8 [..., n/2]: element 2i in the low nibble, 2i+1 in the high one."""
  codes = q.view(np.uint8) & 0x0F
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
  lo, hi = packed & 0x0F, packed >> 4
  codes = np.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))
  return codes.astype(np.uint8).view(E2M1)


def encode_fp4_experts(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(packed uint8 [out, in/2], e8m0 [out, in/32]) of an expert weight [out, in]."""
  q, scale = encode_rows(w, E2M1, 6.0, FP4_BLOCK)
  return pack_fp4(q), scale


def decode_fp4_experts(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
  return decode_rows(unpack_fp4(packed), scale)


def encode_fp8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Engram table rows: (e4m3 [rows, d], e8m0 [rows, d/32])."""
  return encode_rows(x, E4M3, 448.0, FP4_BLOCK)
