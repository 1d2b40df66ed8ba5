"""Engram addressing (docs/architecture.md 3.12): hash constants, n-gram row ids.

Expected row ids come from hand arithmetic or from `_slow_row_ids`, a per-position Python-int walk
written from the section's text, not from engram_hash helpers.
"""

import jax
import numpy as np
import pytest

from deepseek41.model.engram_hash import (layer_multipliers, ngram_primes, ngram_row_ids,
                                          ngram_row_ids_np, row_offsets, table_rows)

# Released config (HF41 configuration defaults).
RELEASED = dict(layer_ids=(1, 14), max_ngram=4, n_heads=8, vocab_start=16_000_000)
RELEASED_V = 99_092
# Toy config (docs/architecture.md section 7).
TOY = dict(layer_ids=(1, 3), max_ngram=3, n_heads=2, vocab_start=1000)


def _slow_row_ids(tokens_bt, dead_bt, seg_bt, mults, primes_nj, pad_id):
  """Walk back from each t in Python ints; the first stop (row start, other document, dead) and
  everything before it read as pad_id."""
  b_, t_ = tokens_bt.shape
  offsets = np.cumsum([0] + [int(p) for p in primes_nj.reshape(-1)])
  out = np.zeros((b_, t_, primes_nj.size), np.int64)
  for b in range(b_):
    for t in range(t_):
      h, blocked = 0, False
      for k, m in enumerate(mults):
        s = t - k
        blocked = (blocked or s < 0 or dead_bt[b, s] or seg_bt[b, s] != seg_bt[b, t]
                   or seg_bt[b, s] == 0)
        h ^= (pad_id if blocked else int(tokens_bt[b, s])) * int(m)
        for j, p in enumerate(primes_nj[k - 1] if k else []):
          col = (k - 1) * primes_nj.shape[1] + j
          out[b, t, col] = h % int(p) + offsets[col]
  return out


def _both(tokens_bt, dead_bt, seg_bt, mults, primes_nj, pad_id):
  """numpy and jnp row ids, checked equal."""
  offs = row_offsets(primes_nj)
  ids_np = ngram_row_ids_np(tokens_bt, dead_bt, seg_bt, mults, primes_nj, offs, pad_id)
  ids_jx = ngram_row_ids(tokens_bt, dead_bt, seg_bt, mults, primes_nj, offs, pad_id)
  assert ids_jx.dtype == np.int32
  np.testing.assert_array_equal(np.asarray(ids_jx), ids_np)
  return ids_np


# ---- hash constants -------------------------------------------------------------------------

def _primes_reference_rule(layer_ids, max_ngram, n_heads, vocab_start):
  """The HF41/VL41 loop: per (layer, n) restart at vocab_start - 1, next prime not seen yet."""
  def is_prime(x):
    return x > 1 and all(x % d for d in range(2, int(x**0.5) + 1))
  seen, out = set(), {}
  for layer in layer_ids:
    rows = []
    for _ in range(max_ngram - 1):
      cur, row = vocab_start - 1, []
      for _ in range(n_heads):
        cur += 1
        while not is_prime(cur) or cur in seen:
          cur += 1
        seen.add(cur)
        row.append(cur)
      rows.append(row)
    out[layer] = np.array(rows)
  return out


def test_released_primes_and_table_rows():
  primes = ngram_primes(**RELEASED)
  assert list(primes) == [1, 14]
  assert primes[1].shape == (3, 8) and primes[1].dtype == np.int64
  assert table_rows(primes[1]) == 384_006_168
  assert table_rows(primes[14]) == 384_016_682
  assert primes[1][0, 0] == 16_000_057  # the first prime >= 16,000,000
  assert len(set(np.concatenate([p.reshape(-1) for p in primes.values()]).tolist())) == 48
  for layer, p in _primes_reference_rule(**RELEASED).items():
    np.testing.assert_array_equal(primes[layer], p)


def test_row_offsets_are_n_major_running_sums():
  p = ngram_primes(**RELEASED)[14]
  offs = row_offsets(p)
  assert offs.shape == p.shape
  assert offs[0, 0] == 0 and offs[0, 1] == p[0, 0] and offs[1, 0] == p[0].sum()
  assert offs[-1, -1] + p[-1, -1] == table_rows(p)


def test_toy_config_constants():
  primes = ngram_primes(**TOY)
  np.testing.assert_array_equal(primes[1], [[1009, 1013], [1019, 1021]])
  np.testing.assert_array_equal(primes[3], [[1031, 1033], [1039, 1049]])
  assert (table_rows(primes[1]), table_rows(primes[3])) == (4062, 4152)
  np.testing.assert_array_equal(row_offsets(primes[1]), [[0, 1009], [2022, 3041]])
  # the search starts AT vocab_start: a prime vocab_start is the first modulus
  np.testing.assert_array_equal(ngram_primes((0,), 2, 2, 1009)[0], [[1009, 1013]])


def test_multipliers_odd_deterministic_and_pinned():
  m1 = layer_multipliers(1, 4, RELEASED_V)
  assert m1.dtype == np.int64 and m1.shape == (4,)
  np.testing.assert_array_equal(m1, layer_multipliers(1, 4, RELEASED_V))
  # Values for the released layers as pinned by an independent port (numpy default_rng stream).
  assert m1.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
  assert layer_multipliers(14, 4, RELEASED_V).tolist() == [
      67716810739261, 51510806800915, 30921347202721, 82619226485591]
  for layer in (1, 3, 14):
    m = layer_multipliers(layer, 4, RELEASED_V)
    assert np.all(m % 2 == 1)
    assert all(int(x) * (RELEASED_V - 1) < 2**63 for x in m)  # no int64 overflow in the hash
  assert not np.array_equal(m1, layer_multipliers(3, 4, RELEASED_V))


# ---- row ids --------------------------------------------------------------------------------

def test_hand_computed_ngrams():
  mults, primes, pad = np.array([3, 5, 7]), np.array([[11, 13], [17, 19]]), 2
  tokens = np.array([[4, 9, 6]])
  ids = _both(tokens, np.zeros_like(tokens, bool), None, mults, primes, pad)
  # offsets: 0, 11, 24, 41
  # t=0, history (4, pad, pad): h2 = 12^10 = 6, h3 = 6^14 = 8
  assert ids[0, 0].tolist() == [6, 11 + 6, 24 + 8, 41 + 8]
  # t=1, history (9, 4, pad): h2 = 27^20 = 15, h3 = 15^14 = 1
  assert ids[0, 1].tolist() == [15 % 11, 11 + 15 % 13, 24 + 1, 41 + 1]
  # t=2, history (6, 9, 4): h2 = 18^45 = 63, h3 = 63^28 = 35
  assert ids[0, 2].tolist() == [63 % 11, 11 + 63 % 13, 24 + 35 % 17, 41 + 35 % 19]


def test_lookback_stops_at_document_start():
  mults, primes = layer_multipliers(1, 3, 512), ngram_primes(**TOY)[1]
  doc = np.array([7, 8, 9, 10])
  packed = np.array([[1, 2, 3, *doc]])
  seg = np.array([[1, 1, 1, 2, 2, 2, 2]])
  no_dead = np.zeros_like(packed, bool)
  ids = _both(packed, no_dead, seg, mults, primes, 2)
  alone = _both(doc[None], no_dead[:, :4], None, mults, primes, 2)
  np.testing.assert_array_equal(ids[:, 3:], alone)
  # and without the segment ids the first tokens of doc 2 would see doc 1
  assert not np.array_equal(_both(packed, no_dead, None, mults, primes, 2)[:, 3:], alone)


def test_lookback_latches_on_dead_tokens():
  mults, primes, pad = layer_multipliers(3, 3, 512), ngram_primes(**TOY)[3], 2
  tokens = np.array([[5, 6, 300, 7, 8, 9], [50, 60, 301, 7, 8, 9]])
  dead = np.array([[0, 0, 1, 0, 0, 0]] * 2, bool)
  ids = _both(tokens, dead, None, mults, primes, pad)
  np.testing.assert_array_equal(ids[0, 3:], ids[1, 3:])  # nothing before the dead token leaks
  tail = _both(np.array([[7, 8, 9]]), np.zeros((1, 3), bool), None, mults, primes, pad)
  np.testing.assert_array_equal(ids[:1, 3:], tail)  # the dead token acts like a row start
  # A dead current token hashes an all-pad history (the caller zeroes its gate).
  all_pad = _both(np.array([[pad]]), np.zeros((1, 1), bool), None, mults, primes, pad)
  np.testing.assert_array_equal(ids[:, 2], np.broadcast_to(all_pad[0, 0], (2, 4)))


def test_padding_segment_is_dead():
  mults, primes = layer_multipliers(1, 3, 512), ngram_primes(**TOY)[1]
  tokens, seg = np.array([[4, 5, 6, 7]]), np.array([[1, 1, 0, 0]])
  ids = _both(tokens, np.zeros_like(tokens, bool), seg, mults, primes, 2)
  np.testing.assert_array_equal(ids[0, 2], ids[0, 3])


@pytest.mark.parametrize('config, vocab', [(RELEASED, RELEASED_V), (TOY, 512)])
def test_matches_slow_walk(config, vocab):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (3, 40))
  tokens[0, :8] = tokens[0, 20:28]  # a repeated n-gram must hash the same
  dead = rng.random((3, 40)) < 0.1
  seg = np.sort(rng.integers(0, 4, (3, 40)), axis=1)
  primes = ngram_primes(**config)
  for layer in config['layer_ids']:
    mults = layer_multipliers(layer, config['max_ngram'], vocab)
    ids = _both(tokens, dead, seg, mults, primes[layer], 2)
    np.testing.assert_array_equal(ids, _slow_row_ids(tokens, dead, seg, mults, primes[layer], 2))
    offs, p = row_offsets(primes[layer]).reshape(-1), primes[layer].reshape(-1)
    assert np.all((ids >= offs) & (ids < offs + p))  # each column stays in its bucket range


def test_jnp_row_ids_jit():
  primes, mults = ngram_primes(**RELEASED)[14], layer_multipliers(14, 4, RELEASED_V)
  offs = row_offsets(primes)
  tokens = np.random.default_rng(1).integers(0, RELEASED_V, (2, 16))
  dead = np.zeros_like(tokens, bool)
  fn = jax.jit(lambda t, d: ngram_row_ids(t, d, None, mults, primes, offs, 2))
  np.testing.assert_array_equal(np.asarray(fn(tokens, dead)),
                                ngram_row_ids_np(tokens, dead, None, mults, primes, offs, 2))
