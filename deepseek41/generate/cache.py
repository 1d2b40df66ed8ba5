"""Generation caches in the released storage formats (docs/architecture.md sections 3.5-3.9).

Per batch row the cache holds positions 0..length-1 of one sequence (prompts are right-padded,
so row index = position = RoPE position, and compressed groups align as at inference):

  every layer        `ring`      the SWA window: the latents of the last C positions, slot
                                 pos % C, in `model.swa_quant` (FP8 e4m3 + ue8m0 scales per 32),
                     `ring_pos`  int32 [B, C] the position in each slot, -1 = empty
  KV-source layers   `kv`        compressed entries [B, N, d] in `model.kv_quant` (FP4 e2m1 +
                                 e4m3 scales per 16), entry j = tokens j*r .. j*r + r-1
                     `keys`      indexer keys [B, N, d_I] in `model.index_quant` (FP4 + ue8m0/32)
                     `written`   bool [B, N]
                     ratio > 1:  `raw_kv`, `raw_gate` fp32 [B, R, d], `raw_pos` [B, R]: the
                                 projected rows of the last R positions, from which an entry
                                 that a chunk completes is pooled
  Reuse / Reindex layers hold nothing of their own (their KV source's entries serve them).

C = sliding_window + max_chunk - 1 and R = ratio - 1 + max_chunk: a verification chunk of
`max_chunk` tokens whose tail is rejected overwrites only slots that no later query needs, so a
rollback is just a shorter `length` (stale slots are masked by position).

Stored formats are `packing.Packed` (codes + scale bytes); `model.*_quant = 'none'` stores the
compute dtype as is. `load` returns exactly what the training path's fake quantization gives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.config import ModelConfig, layer_roles
from deepseek41.model.params import dtype_of
from deepseek41.packing import Packed, pack, unpack


def store(fmt: str, x):
  """x [..., d] as the cache keeps it."""
  return x if fmt == 'none' else pack(fmt, x)


def load(fmt: str, stored, dtype):
  return stored.astype(dtype) if fmt == 'none' else unpack(fmt, stored, dtype)


def empty_stored(fmt: str, lead: tuple[int, ...], d: int, dtype):
  if fmt == 'none':
    return jnp.zeros((*lead, d), dtype)
  zeros = pack(fmt, jnp.zeros((1, d), jnp.float32))
  return Packed(jnp.zeros((*lead, zeros.codes.shape[-1]), jnp.uint8),
                jnp.zeros((*lead, zeros.scales.shape[-1]), jnp.uint8))


def scatter_rows(dest, b_idx, slot_bq, new):
  """dest[b, slot] = new[b, q] for every (b, q) whose slot is in range (others dropped)."""
  return jax.tree.map(lambda d, n: d.at[b_idx, slot_bq].set(n.astype(d.dtype), mode='drop'),
                      dest, new)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Static sizes of one cache: rows, the longest sequence, the longest chunk after prefill."""
  batch: int
  max_len: int
  max_chunk: int

  def ring(self, cfg: ModelConfig) -> int:
    return cfg.sliding_window + self.max_chunk - 1

  def entries(self, ratio: int) -> int:
    return -(-self.max_len // ratio)

  def raw(self, ratio: int) -> int:
    return ratio - 1 + self.max_chunk


def empty_cache(cfg: ModelConfig, spec: CacheSpec, feature_dim: int = 0) -> dict:
  """A cache with nothing in it. feature_dim > 0 adds DSpark's context ring (`feat`, [B, C, D]
  of m_t, with `feat_pos`)."""
  b, dt = spec.batch, dtype_of(cfg.compute_dtype)
  c = spec.ring(cfg)
  layers = {}
  for role in layer_roles(cfg):
    lc = {'ring': empty_stored(cfg.swa_quant, (b, c), cfg.head_dim, dt),
          'ring_pos': jnp.full((b, c), -1, jnp.int32)}
    if cfg.csa2 and role.ratio > 0 and role.kv_source == role.layer:
      n = spec.entries(role.ratio)
      lc['kv'] = empty_stored(cfg.kv_quant, (b, n), cfg.head_dim, dt)
      lc['keys'] = empty_stored(cfg.index_quant, (b, n), cfg.index_head_dim, dt)
      lc['written'] = jnp.zeros((b, n), bool)
      if role.ratio > 1:
        r = spec.raw(role.ratio)
        lc['raw_kv'] = jnp.zeros((b, r, cfg.head_dim), jnp.float32)
        lc['raw_gate'] = jnp.zeros((b, r, cfg.head_dim), jnp.float32)
        lc['raw_pos'] = jnp.full((b, r), -1, jnp.int32)
    layers[str(role.layer)] = lc
  cache = {'length': jnp.zeros((b,), jnp.int32),
           'tokens': jnp.zeros((b, spec.max_len), jnp.int32),
           'layers': layers}
  if feature_dim:
    cache['feat'] = jnp.zeros((b, c, feature_dim), dt)
    cache['feat_pos'] = jnp.full((b, c), -1, jnp.int32)
  return cache


def drop_windows(cache: dict) -> dict:
  """The cache without its SWA windows (bounded replay rebuilds them)."""
  layers = {k: {**lc, 'ring_pos': jnp.full_like(lc['ring_pos'], -1)}
            for k, lc in cache['layers'].items()}
  return {**cache, 'layers': layers}


def _nbytes(tree) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def global_bytes_per_token(cache: dict, cfg: ModelConfig, spec: CacheSpec) -> float:
  """Bytes of the compressed KV and indexer keys (codes + scales) per cached token of one row:
  what `tools.info` calls kv_cache.global_bytes_per_token."""
  total = sum(_nbytes(lc['kv']) + _nbytes(lc['keys']) for lc in cache['layers'].values()
              if 'kv' in lc)
  return total / (spec.batch * spec.max_len)


def window_bytes_per_request(cache: dict, spec: CacheSpec, cfg: ModelConfig) -> float:
  """Bytes of the SWA windows of one row, counted at `sliding_window` slots per layer."""
  ring = sum(_nbytes(lc['ring']) for lc in cache['layers'].values())
  return ring / spec.batch * cfg.sliding_window / spec.ring(cfg)
