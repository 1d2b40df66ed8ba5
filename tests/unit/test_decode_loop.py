"""The decode loop's bookkeeping without a model: length buckets, per-row budgets and stops,
streamed text, and the bad input it names."""

import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.generate.generator import (NO_TOKEN, GenerateError, Rows, TextStream,
                                           decode_loop, length_bucket, max_positions, row_budgets,
                                           stop_rows)
from tests.helpers import resolved


def test_length_buckets_are_few_and_tight():
  assert [length_bucket(n) for n in (1, 16, 17, 128, 129, 200, 257, 1000, 4097)] == \
      [16, 16, 32, 128, 160, 224, 320, 1024, 5120]
  buckets = {length_bucket(n) for n in range(1025, 2049)}
  assert len(buckets) == 4  # one doubling
  for n in range(1, 5000):
    assert n <= length_bucket(n) < max(n * 1.25, n + 16)
    assert length_bucket(length_bucket(n)) == length_bucket(n)


def test_stop_rows_stops_each_row_on_its_own():
  """Row 0 runs on, row 1 draws the end-of-document (not emitted), row 2 spends its last
  budget token (emitted), row 3 was done already (emits nothing, whatever it draws)."""
  next_b = jnp.asarray([5, 2, 7, 2])
  emitted, done, left = stop_rows(next_b, jnp.asarray([False, False, False, True]),
                                  jnp.asarray([3, 3, 1, 0]), jnp.int32(2))
  assert np.asarray(emitted).tolist() == [True, False, True, False]
  assert np.asarray(done).tolist() == [False, True, True, True]
  assert np.asarray(left).tolist() == [2, 3, 0, 0]
  emitted, done, _ = stop_rows(next_b, jnp.zeros(4, bool), jnp.full(4, 5), jnp.int32(NO_TOKEN))
  assert np.asarray(emitted).all() and not np.asarray(done).any()  # no end-of-document


def test_rows_cut_at_the_end_of_document_and_the_budget():
  rows = Rows(np.asarray([3, 5, 4]), eos_id=0)
  seen = []
  rows.add([[7], [8], [0]])
  rows.publish(lambda row, new: seen.append((row, new)))
  assert rows.tokens == [[7], [8], []] and rows.done.tolist() == [False, False, True]
  rows.add([[1, 2, 3], [4, 0, 6], [9]])
  rows.publish(lambda row, new: seen.append((row, new)))
  assert rows.tokens == [[7, 1, 2], [8, 4], []] and rows.done.all()
  assert seen == [(0, [7]), (1, [8]), (0, [1, 2]), (1, [4])]
  rows = Rows(np.asarray([4, 4]), eos_id=None)
  rows.add([[1], [2]], finished=np.asarray([False, True]))  # the device loop saw row 1's end
  assert rows.done.tolist() == [False, True] and rows.counts().tolist() == [1, 1]


def test_text_stream_holds_back_a_split_character():
  table = {1: b'caf', 2: b'\xc3', 3: b'\xa9', 4: b' ok'}
  stream = TextStream(lambda ids: b''.join(table[i] for i in ids).decode('utf-8', 'replace'))
  pieces = [stream.add(0, [1, 2]), stream.add(0, [3]), stream.add(0, [4])]
  assert pieces == ['caf', '\xe9', ' ok']
  assert stream.rest(0, 'caf\xe9 ok') == ''
  assert stream.add(1, [2]) == '' and stream.rest(1, '\ufffd') == '\ufffd'


def test_bad_options_are_named():
  cfg = resolved()
  prompts = [np.ones(3, np.int32), np.ones(4, np.int32)]
  with pytest.raises(GenerateError, match='--tokens_per_dispatch must be >= 1, got 0'):
    decode_loop(None, cfg, prompts, eos_id=None, tokens_per_dispatch=0)
  with pytest.raises(GenerateError, match='max_new_tokens: 3 budgets for 2 prompts'):
    decode_loop(None, cfg, prompts, eos_id=None, max_new_tokens=[1, 2, 3])
  with pytest.raises(GenerateError, match=r'max_new_tokens\[1\] \(prompt 1\) must be >= 1'):
    row_budgets([4, 0], 2)
  with pytest.raises(GenerateError, match='--max_new_tokens must be >= 1, got 0'):
    row_budgets(0, 2)
  limit = max_positions(cfg)
  with pytest.raises(GenerateError, match=rf'prompt 1: 4 tokens \+ --max_new_tokens={limit} '):
    decode_loop(None, cfg, prompts, eos_id=None, max_new_tokens=[1, limit])
  assert row_budgets(np.int64(3), 2).tolist() == [3, 3]
