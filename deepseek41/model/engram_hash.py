"""Engram addressing: hash constants, n-gram row ids (docs/architecture.md 3.12). The tokenizer
compression that maps token ids to the hashed ids lives with the data (data/engram_vocab.py).

Pure functions, no parameters. Everything here depends only on token ids and the config, so it runs
once per config (`layer_multipliers`, `ngram_primes`, `row_offsets`) or once per batch in the data
pipeline (`ngram_row_ids_np`).

Rules checked against HF41 (`huggingface/transformers`
`src/transformers/models/deepseek_v41/modeling_deepseek_v41.py`: `build_compressed_token_map`,
`compute_hash_multipliers`, `EngramLayout`, `DeepseekV41NgramHashState`) and VL41
(`vllm-project/vllm` `vllm/models/deepseek_v4_1/common/engram.py`: the same three builders and
`_hash_ids_kernel`); both agree on every rule used here.

Why the products never overflow: compressed ids are < V and multipliers are < (2^63 - 1) // V, so
`id * m < 2^63` and every rolling hash is a non-negative int64. Hashing is exact in numpy int64;
`ngram_row_ids` reproduces it bit for bit in uint32 limbs because this project runs JAX without x64.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------
# Hash constants
# ---------------------------------------------------------------------------------------------

def layer_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> np.ndarray:
  """Odd int64 multipliers m_0..m_{max_ngram-1} of one Engram layer (m_k weights tok_{t-k})."""
  bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
  rng = np.random.default_rng(10007 * layer_id)
  draws = rng.integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64)  # one call: stream
  return draws * 2 + 1


def _is_prime(n: int) -> bool:
  """Deterministic Miller-Rabin for n < 3.3e24 (bases = first 13 primes)."""
  if n < 2:
    return False
  bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
  if n in bases:
    return True
  if any(n % p == 0 for p in bases):
    return False
  d, r = n - 1, 0
  while d % 2 == 0:
    d, r = d // 2, r + 1
  for a in bases:
    x = pow(a, d, n)
    if x in (1, n - 1):
      continue
    for _ in range(r - 1):
      x = x * x % n
      if x == n - 1:
        break
    else:
      return False
  return True


def ngram_primes(layer_ids: Sequence[int], max_ngram: int, n_heads: int,
                 vocab_start: int) -> dict[int, np.ndarray]:
  """layer id -> bucket moduli p[n-2, head] (int64 [max_ngram-1, n_heads]).

  The references restart the search at `vocab_start - 1` for every (layer, n) and skip primes
  already handed out; that equals one running search over successive primes > vocab_start - 1,
  taken in (layer, n, head) order, which is what this does.
  """
  out, candidate = {}, vocab_start - 1
  for layer_id in layer_ids:
    p_nj = np.empty((max_ngram - 1, n_heads), np.int64)
    for idx in np.ndindex(p_nj.shape):
      candidate += 1
      while not _is_prime(candidate):
        candidate += 1
      p_nj[idx] = candidate
    out[layer_id] = p_nj
  return out


def table_rows(primes_nj: np.ndarray) -> int:
  """Rows of one layer's table: the (n, head) bucket ranges laid end to end."""
  return int(np.sum(primes_nj, dtype=np.int64))


def row_offsets(primes_nj: np.ndarray) -> np.ndarray:
  """First row of each (n, head) bucket range (int64, shape of primes_nj), n-major then head."""
  flat = np.asarray(primes_nj, np.int64).reshape(-1)
  return (np.cumsum(flat) - flat).reshape(np.shape(primes_nj))


# ---------------------------------------------------------------------------------------------
# Per-batch row ids
# ---------------------------------------------------------------------------------------------

def _shift_right(xp, x_bt, k: int, fill):
  """x[:, t-k] at t (fill where t < k)."""
  if k == 0:
    return x_bt
  b, t = x_bt.shape
  head = xp.full((b, min(k, t)), fill, dtype=x_bt.dtype)
  return xp.concatenate([head, x_bt[:, :max(t - k, 0)]], axis=1)


def _history(xp, tokens_bt, dead_bt, segment_ids_bt, max_ngram: int, pad_id: int):
  """tok_{t-k} for k = 0..max_ngram-1 as [B, T, K], pad_id from the first stop backwards.

  A stop is the row start, another segment (document), or a dead token; stops latch. k = 0 is
  included, so a dead current token gives an all-pad history, as in HF41/VL41; its row ids are
  still computed and the caller zeroes the gate there.
  """
  if segment_ids_bt is None:
    segment_ids_bt = xp.ones_like(tokens_bt)
  dead_bt = dead_bt | (segment_ids_bt == 0)  # [I] segment 0 = padding counts as dead
  blocked_bt = xp.zeros(tokens_bt.shape, dtype=bool)
  hist = []
  for k in range(max_ngram):
    stop_bt = (_shift_right(xp, dead_bt, k, True)
               | (_shift_right(xp, segment_ids_bt, k, -1) != segment_ids_bt))
    blocked_bt = blocked_bt | stop_bt
    hist.append(xp.where(blocked_bt, pad_id, _shift_right(xp, tokens_bt, k, pad_id)))
  return xp.stack(hist, axis=-1)


def ngram_row_ids_np(tokens_bt, dead_bt, segment_ids_bt, multipliers_k, primes_nj, offsets_nj,
                     pad_id: int) -> np.ndarray:
  """Row ids int64 [B, T, (max_ngram-1) * n_heads] of one Engram layer, in numpy int64.

  tokens_bt: compressed ids (0 <= id < compressed vocab); dead_bt: image/padding; segment_ids_bt:
  document ids (0 = padding) or None. Column j = (n - 2) * n_heads + head. Exactly the references'
  int64 arithmetic; for the data pipeline.
  """
  tokens_bt = np.asarray(tokens_bt, np.int64)
  seg_bt = None if segment_ids_bt is None else np.asarray(segment_ids_bt)
  hist_btk = _history(np, tokens_bt, np.asarray(dead_bt, bool), seg_bt, len(multipliers_k),
                      pad_id)
  prod_btk = hist_btk * np.asarray(multipliers_k, np.int64)
  rolling_bt, ids = prod_btk[..., 0], []
  for n in range(1, len(multipliers_k)):  # after XOR-ing tok_{t-n}: the (n+1)-gram hash
    rolling_bt = rolling_bt ^ prod_btk[..., n]
    ids.append(rolling_bt[..., None] % primes_nj[n - 1] + offsets_nj[n - 1])
  return np.concatenate(ids, axis=-1)


# uint32 limb arithmetic for `ngram_row_ids`: a 64-bit value is 4 little-endian 16-bit limbs, so
# every partial product (< 2^32) and every column sum stays exact in uint32.

def _mul_limbs(x_bt, m: int):
  """Limbs of (x * m) mod 2^64 for uint32 x and a Python int m."""
  x_limbs = (x_bt & 0xFFFF, x_bt >> 16)
  m_limbs = [(m >> (16 * i)) & 0xFFFF for i in range(4)]
  cols = [jnp.zeros_like(x_bt) for _ in range(5)]
  for i, mi in enumerate(m_limbs):
    for j, xj in enumerate(x_limbs):
      if i + j < 4:
        p = xj * jnp.uint32(mi)
        cols[i + j] = cols[i + j] + (p & 0xFFFF)
        cols[i + j + 1] = cols[i + j + 1] + (p >> 16)
  out, carry = [], jnp.zeros_like(x_bt)
  for c in cols[:4]:  # column 4 and the final carry are the part above 2^64: dropped
    c = c + carry
    out.append(c & 0xFFFF)
    carry = c >> 16
  return out


def _mod_limbs(limbs, p_j):
  """(64-bit value) mod p per head, for p < 2^24: byte-wise Horner keeps r * 256 < 2^32."""
  r = jnp.zeros(limbs[0].shape + p_j.shape, jnp.uint32)
  for limb in reversed(limbs):
    for byte in (limb >> 8, limb & 0xFF):
      r = (r * 256 + byte[..., None]) % p_j
  return r


def ngram_row_ids(tokens_bt, dead_bt, segment_ids_bt, multipliers_k, primes_nj, offsets_nj,
                  pad_id: int):
  """`ngram_row_ids_np` in jax.numpy without x64: int32 [B, T, (max_ngram-1) * n_heads].

  multipliers/primes/offsets are host numpy constants; needs primes < 2^24 and rows < 2^31
  (released: primes ~1.6e7, 3.8e8 rows per layer).
  """
  primes_nj, offsets_nj = np.asarray(primes_nj), np.asarray(offsets_nj)
  if primes_nj.max() >= 2**24 or table_rows(primes_nj) >= 2**31:
    raise ValueError('ngram_row_ids needs primes < 2^24 and < 2^31 rows; use ngram_row_ids_np')
  seg_bt = None if segment_ids_bt is None else jnp.asarray(segment_ids_bt, jnp.int32)
  hist_btk = _history(jnp, jnp.asarray(tokens_bt, jnp.int32), jnp.asarray(dead_bt, bool), seg_bt,
                      len(multipliers_k), pad_id).astype(jnp.uint32)
  rolling, ids = None, []
  for k, m in enumerate(np.asarray(multipliers_k)):
    prod = _mul_limbs(hist_btk[..., k], int(m))
    rolling = prod if rolling is None else [a ^ b for a, b in zip(rolling, prod)]
    if k > 0:
      r_btj = _mod_limbs(rolling, jnp.asarray(primes_nj[k - 1], jnp.uint32))
      ids.append(r_btj.astype(jnp.int32) + jnp.asarray(offsets_nj[k - 1], jnp.int32))
  return jnp.concatenate(ids, axis=-1)
