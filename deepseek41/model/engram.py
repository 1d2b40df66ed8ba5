"""Engram conditional memory of one layer (docs/architecture.md section 3.12).

    rows  = table[row_ids]            24 rows per token in the release (3 n-gram sizes x 8 heads)
    [k_1..k_n, v] = W_e flat(rows)     one key per residual stream, one shared value
    dot_k = sum_d h_kd (q_w * k_w)_kd key_kd * rstd(h_k) * rstd(key_k) / sqrt(D)
    g_k   = sigmoid(sign(dot_k) sqrt(max(|dot_k|, 1e-6)))      0 on dead tokens (padding, image)
    X[k] += g_k v                      before the layer's mHC site

The row ids depend only on token ids: `row_ids` computes them once per batch for every Engram
layer (`Transformer.with_engram_rows` calls it; engram_hash.py holds the hashing), never inside a
layer. Tables are rows x head_dim `EngramTable` parameters (their own learning rate) with the
logical axis `engram_rows`, so the mesh rules shard their rows; ops/parallel/engram_lookup.py
fetches each device's rows from their owners.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepseek41.config import ModelConfig
from deepseek41.model import engram_hash
from deepseek41.model.norms import rms_normalize
from deepseek41.model.params import EngramTable, const_param, normal_param
from deepseek41.ops.parallel.engram_lookup import lookup_rows


@dataclasses.dataclass(frozen=True)
class LayerAddress:
  """Static hashing constants of one Engram layer."""
  multipliers: tuple[int, ...]
  primes: np.ndarray      # int64 [max_ngram - 1, n_heads]
  offsets: np.ndarray     # int64 [max_ngram - 1, n_heads]
  rows: int


@functools.lru_cache(maxsize=16)
def layer_addresses(cfg: ModelConfig) -> dict[int, LayerAddress]:
  """Engram layer id -> its multipliers, prime buckets and table size (pure Python, no arrays)."""
  primes = engram_hash.ngram_primes(cfg.engram_layer_ids, cfg.engram_max_ngram,
                                    cfg.engram_n_heads, cfg.engram_vocab_start)
  out = {}
  for layer in cfg.engram_layer_ids:
    p = primes[layer]
    mult = engram_hash.layer_multipliers(layer, cfg.engram_max_ngram, engram_vocab(cfg))
    out[layer] = LayerAddress(tuple(int(m) for m in mult), p, engram_hash.row_offsets(p),
                              engram_hash.table_rows(p))
  return out


def engram_vocab(cfg: ModelConfig) -> int:
  """Size of the (compressed) id space the hashes see; 0 in the config = the model vocabulary."""
  return cfg.engram_compressed_vocab_size or cfg.vocab_size


def dead_tokens(batch) -> jax.Array:
  """bool [B, T]: padding and image positions, where look-back stops and the gate is 0."""
  return (batch['segment_ids'] == 0) | (batch['modality'] != 0)


def row_ids(cfg: ModelConfig, addresses: dict[int, LayerAddress], batch) -> dict[int, jax.Array]:
  """Engram layer id -> int32 [B, T, (max_ngram - 1) * n_heads] row ids, once per batch.

  Hashes the ids in `batch['engram_tokens']` (the tokenizer-compressed ids) if present, else the
  raw token ids (no compression).
  """
  tokens_bt = batch.get('engram_tokens', batch['tokens'])
  dead_bt = dead_tokens(batch)
  pad_id = cfg.engram_pad_token_id
  return {layer: engram_hash.ngram_row_ids(tokens_bt, dead_bt, batch['segment_ids'],
                                           a.multipliers, a.primes, a.offsets, pad_id)
          for layer, a in addresses.items()}


class Engram(nnx.Module):

  def __init__(self, cfg: ModelConfig, rows: int, rngs: nnx.Rngs):
    n = cfg.hc_mult if cfg.residual != 'plain' else 1
    j = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
    self.n, self.d, self.eps = n, cfg.d_model, cfg.rms_norm_eps
    self.capacity = cfg.engram_exchange_capacity
    padded = -(-rows // cfg.engram_table_row_multiple) * cfg.engram_table_row_multiple
    self.table = normal_param(rngs, (padded, cfg.engram_head_dim), ('engram_rows', 'engram_dim'),
                              cfg.init_std, EngramTable)  # rows past `rows` are never addressed
    self.proj = normal_param(rngs, (j * cfg.engram_head_dim, (n + 1) * cfg.d_model),
                             ('engram_in', 'embed'), cfg.init_std)
    self.q_weight = const_param(1.0, (n, cfg.d_model), (None, 'norm'))
    self.k_weight = const_param(1.0, (n, cfg.d_model), (None, 'norm'))

  def __call__(self, x, row_ids_btj, dead_bt):
    """x: [B, T, n, D] streams (or [B, T, D] with a plain residual); returns (x + g * v, the
    lookups dropped by the table exchange: int32 [])."""
    plain = x.ndim == 3
    x_btnd = x[:, :, None, :] if plain else x
    b, t = row_ids_btj.shape[:2]
    dt = x.dtype
    rows_btjh, dropped = lookup_rows(self.table[...], row_ids_btj, capacity=self.capacity)
    rows_btjh = rows_btjh.astype(dt)
    kv = (rows_btjh.reshape(b, t, -1) @ self.proj[...].astype(dt)).reshape(b, t, self.n + 1, self.d)
    key_btnd, v_btd = kv[:, :, :self.n], kv[:, :, self.n]
    qk_nd = self.q_weight[...] * self.k_weight[...]
    dot_btn = jnp.sum(rms_normalize(x_btnd, self.eps) * qk_nd * rms_normalize(key_btnd, self.eps),
                      axis=-1) / jnp.sqrt(float(self.d))
    gate_btn = jax.nn.sigmoid(jnp.sign(dot_btn) * jnp.sqrt(jnp.maximum(jnp.abs(dot_btn), 1e-6)))
    gate_btn = jnp.where(dead_bt[..., None], 0.0, gate_btn)
    out = x_btnd.astype(jnp.float32) + gate_btn[..., None] * v_btd.astype(jnp.float32)[:, :, None]
    out = out.astype(dt)
    return (out[:, :, 0] if plain else out), dropped
