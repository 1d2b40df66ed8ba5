"""Generation caches in the released storage formats (docs/architecture.md sections 3.5-3.9).

Per batch row the cache holds positions 0..length-1 of one sequence (prompts are right-padded,
so row index = position = RoPE position, and compressed groups align as at inference):

  `length`    int32 [B]: the positions cached
  `tokens`    int32 [B, max_len]: the token history (Engram hashes the ids before a chunk)
  `layers`    {layer: its cache}, built and updated by the layer itself (`Transformer.init_cache`;
              docs/design.md, "Layer caches"):
                every layer    its window ring, the last C latents in `model.swa_quant`
                               (FP8 e4m3 + ue8m0 scales per 32), C = sliding_window + max_chunk - 1
                KV sources     their compressed entries in `model.kv_quant` (FP4 e2m1 + e4m3
                               scales per 16), indexer keys in `model.index_quant` (FP4 +
                               ue8m0/32), which are written, and for ratio > 1 the projected
                               rows of the newest ratio - 1 + max_chunk positions
                Reuse / Reindex layers hold nothing of their own (their KV source's entries
                serve them)
  `feat`      DSpark's context ring (speculative decoding): m_t of the newest C positions, with
              `feat_pos`

A verification chunk whose tail is rejected overwrites only slots that no later query needs, so
a rollback is just a shorter `length` (stale slots are masked by position). A compressed group
that a rejected token completes is written to its entry too: no query sees an entry before its
group's last position, and the chunk that next holds that position rewrites the entry before it
attends. So a verification of all drafted positions rolls back to any accepted length exactly.

Stored formats are `packing.Packed` (codes + scale bytes); `load` gives exactly the training
path's fake quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.config import ModelConfig
from deepseek41.model.layer_cache import CacheSpec
from deepseek41.model.params import dtype_of


def empty_cache(model, spec: CacheSpec, feature_dim: int = 0) -> dict:
  """A cache with nothing in it for `model` (a `Transformer`, concrete or abstract).
  feature_dim > 0 adds DSpark's context ring (`feat`, [B, C, D] of m_t, with `feat_pos`)."""
  cfg, b = model.cfg, spec.batch
  cache = {'length': jnp.zeros((b,), jnp.int32),
           'tokens': jnp.zeros((b, spec.max_len), jnp.int32),
           'layers': model.init_cache(spec)}
  if feature_dim:
    c = spec.ring(cfg)
    cache['feat'] = jnp.zeros((b, c, feature_dim), dtype_of(cfg.compute_dtype))
    cache['feat_pos'] = jnp.full((b, c), -1, jnp.int32)
  return cache


def drop_windows(cache: dict) -> dict:
  """The cache without its SWA windows (bounded replay rebuilds them)."""
  return {**cache, 'layers': {l: lc.without_window() for l, lc in cache['layers'].items()}}


def _nbytes(tree) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def global_bytes_per_token(cache: dict, spec: CacheSpec) -> float:
  """Bytes of the compressed KV and indexer keys (codes + scales) per cached token of one row:
  what `tools.info` calls kv_cache.global_bytes_per_token."""
  total = sum(_nbytes(lc.entries.kv_bnd) + _nbytes(lc.entries.keys_bnc)
              for lc in cache['layers'].values() if lc.entries is not None)
  return total / (spec.batch * spec.max_len)


def window_bytes_per_request(cache: dict, spec: CacheSpec, cfg: ModelConfig) -> float:
  """Bytes of the SWA windows of one row, counted at `sliding_window` slots per layer."""
  ring = sum(_nbytes(lc.ring) for lc in cache['layers'].values())
  return ring / spec.batch * cfg.sliding_window / spec.ring(cfg)
