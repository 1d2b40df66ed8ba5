"""Rotary position embedding with adjacent-pair rotation and YaRN (docs/architecture.md 3.4).

Pure functions: the inverse frequencies are a static numpy constant computed once per rope role,
and `apply_rope` rotates the last `2 * len(inv_freq)` channels of a tensor in fp32.

Conventions that a checkpoint import depends on:
- pairs are ADJACENT channels (2i, 2i+1) of the rope slice (GPT-J / complex-multiply style), not the
  two halves of the slice (NeoX style);
- the rope slice is the LAST channels of the vector; the channels before it pass through unchanged;
- angle_i = position * inv_freq_i, in fp32; the inverse rotation (for the output of shared K=V
  attention, section 3.3) rotates by -angle;
- YaRN changes the frequencies only: no attention / mscale factor anywhere.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def yarn_correction_range(rope_dim: int, theta: float, original_max_position: int,
                          beta_fast: float, beta_slow: float) -> tuple[int, int]:
  """(lo, hi) frequency-pair indices that bound the YaRN ramp.

  Pair i makes `L0 / (2*pi*theta^(2i/d))` turns over the original context L0; solving for the pair
  that makes exactly `beta` turns gives `d*ln(L0/(beta*2*pi)) / (2*ln(theta))`. Pairs that turn more
  than beta_fast times (i < lo) keep their frequency, pairs that turn less than beta_slow times
  (i > hi) are interpolated by the full factor.

  Clamping: lo is clamped below at 0 and hi above at `rope_dim - 1`, exactly like every public
  reference of this YaRN variant (DeepSeek's `find_correction_range`, HF `rope_utils`, vLLM). The
  lower clamp matters: a negative lo (short L0, e.g. the toy config's L0=128 gives lo=-1) would
  otherwise tilt the ramp so that pair 0 is already partly interpolated, and HF parity would break.
  The upper bound `rope_dim - 1` is looser than the last pair index `rope_dim/2 - 1`; we keep it
  for parity as well. It only matters when L0 > 2*pi*beta_slow*theta (about 1M tokens for
  theta=160000), and then it makes the last pairs slightly less interpolated than a [0, d/2-1]
  clamp would. The released config (d=64, theta=160000, L0=65536, beta 32/1) gives lo=15, hi=25,
  inside both ranges, so neither clamp changes it.
  """
  def pair_index_for_turns(turns):
    return (rope_dim * math.log(original_max_position / (turns * 2 * math.pi)) /
            (2 * math.log(theta)))

  lo = math.floor(pair_index_for_turns(beta_fast))
  hi = math.ceil(pair_index_for_turns(beta_slow))
  return max(lo, 0), min(hi, rope_dim - 1)


def rope_inv_freq(rope_dim: int, theta: float, yarn_factor: float = 1.0,
                  yarn_original_max_position: int = 65536, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
  """Inverse frequencies [rope_dim // 2], float32: `theta^(-2i/d)`, YaRN-ramped if factor > 1.

  Computed in float64 and rounded once to float32 (the references compute the power in float32,
  which can differ by one ulp; well inside any parity tolerance).
  """
  if rope_dim % 2:
    raise ValueError(f'rope_dim must be even, got {rope_dim}')
  i = np.arange(rope_dim // 2, dtype=np.float64)
  inv_freq = theta ** (-2.0 * i / rope_dim)
  if yarn_factor > 1.0:
    lo, hi = yarn_correction_range(rope_dim, theta, yarn_original_max_position, beta_fast,
                                   beta_slow)
    ramp = np.clip((i - lo) / max(hi - lo, 1e-3), 0.0, 1.0)  # 0: keep, 1: interpolate
    inv_freq = inv_freq / yarn_factor * ramp + inv_freq * (1.0 - ramp)
  return inv_freq.astype(np.float32)


def rope_for_role(model_cfg, rope: str) -> np.ndarray:
  """inv_freq of a layer role's rope (LayerRole.rope): 'main' plain, 'compress' theta' + YaRN."""
  d = model_cfg.rope_head_dim
  if rope == 'main':
    return rope_inv_freq(d, model_cfg.rope_theta)
  if rope == 'compress':
    return rope_inv_freq(d, model_cfg.compress_rope_theta, model_cfg.yarn_factor,
                         model_cfg.yarn_original_max_position, model_cfg.yarn_beta_fast,
                         model_cfg.yarn_beta_slow)
  raise ValueError(f"rope must be 'main' or 'compress', got {rope!r}")


def apply_rope(x, positions, inv_freq, inverse: bool = False):
  """Rotate the last `2*len(inv_freq)` channels of x by angle `position * inv_freq`.

  x: [B, T, C] or [B, T, N, C] (any axes between the position axes and C are broadcast over, e.g.
  heads); positions: [B, T] integer, the leading axes of x. Compressed entry j of ratio r
  is passed position j*r by the caller. Returns x's dtype; the rotation runs in fp32.
  """
  inv_freq = jnp.asarray(inv_freq, jnp.float32)
  half = inv_freq.shape[0]
  rope_dim = 2 * half
  if rope_dim > x.shape[-1]:
    raise ValueError(f'rope needs {rope_dim} channels but x has {x.shape[-1]}')
  positions = jnp.asarray(positions)
  if x.shape[:positions.ndim] != positions.shape:
    raise ValueError(f'positions {positions.shape} must match the leading axes of x {x.shape}')

  angle = positions.astype(jnp.float32)[..., None] * inv_freq          # [*pos, half]
  angle = angle.reshape(positions.shape + (1,) * (x.ndim - positions.ndim - 1) + (half,))
  if inverse:
    angle = -angle
  cos, sin = jnp.cos(angle), jnp.sin(angle)

  x_pass, x_rope = x[..., :-rope_dim], x[..., -rope_dim:]
  pairs = x_rope.astype(jnp.float32).reshape(x_rope.shape[:-1] + (half, 2))
  even, odd = pairs[..., 0], pairs[..., 1]
  # (even + i*odd) * e^{i*angle}
  rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
  rotated = rotated.reshape(x_rope.shape).astype(x.dtype)
  return jnp.concatenate([x_pass, rotated], axis=-1)
