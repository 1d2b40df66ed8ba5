"""The decode loop's bookkeeping without a model: length buckets, per-row budgets and stops,
streamed text, the bad input it names; the sampling pieces speculative rounds rely on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.generate import sampling
from deepseek41.generate.generator import (HOST_VERIFY_COST, GenerateError, Rows, TextStream,
                                           decode_loop, default_verify_cost, length_bucket,
                                           max_positions, row_budgets)
from deepseek41.generate.programs import NO_TOKEN, stop_rows, stop_run
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


def test_stop_run_cuts_a_round_at_the_end_of_document_and_the_budget():
  """A speculative round's tokens (accepted drafts, then the next token; slots past `valid`
  are not the row's): row 0 emits its three, row 1 stops before its end-of-document in the
  middle of the run, row 2's budget cuts the run, row 3 was done, row 4 has an end-of-document
  token past its valid slots (not seen), row 5 ends exactly at its budget. Rows.add of the
  emitted tokens agrees, and runs of one token are `stop_rows`."""
  run = jnp.asarray([[5, 6, 7, 8], [5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2], [5, 6, 2, 8],
                     [5, 6, 7, 8]])
  valid = jnp.asarray([3, 4, 4, 1, 2, 2])
  done = jnp.asarray([False, False, False, True, False, False])
  left = jnp.asarray([9, 9, 2, 0, 9, 2])
  emitted, done_after, left_after = stop_run(run, valid, done, left, jnp.int32(2))
  assert np.asarray(emitted).tolist() == [3, 1, 2, 0, 2, 2]
  assert np.asarray(done_after).tolist() == [False, True, True, True, False, True]
  assert np.asarray(left_after).tolist() == [6, 8, 0, 0, 7, 0]
  rows = Rows(np.asarray([9, 9, 2, 1, 9, 2]), eos_id=2)
  rows.done[3] = True
  rows.add([np.asarray(run)[i, :int(v)] for i, v in enumerate(valid)])
  assert rows.counts().tolist() == [3, 1, 2, 0, 2, 2]
  assert rows.done.tolist() == np.asarray(done_after).tolist()
  next_b = jnp.asarray([5, 2, 7, 2])
  for eos in (2, NO_TOKEN):
    one = stop_run(next_b[:, None], jnp.ones(4, jnp.int32), jnp.asarray([False] * 3 + [True]),
                   jnp.asarray([3, 3, 1, 0]), jnp.int32(eos))
    ref = stop_rows(next_b, jnp.asarray([False] * 3 + [True]), jnp.asarray([3, 3, 1, 0]),
                    jnp.int32(eos))
    assert np.asarray(one[0]).tolist() == np.asarray(ref[0]).astype(int).tolist()
    for a, b in zip(one[1:], ref[1:]):
      assert np.asarray(a).tolist() == np.asarray(b).tolist()


def test_greedy_sample_is_the_draw_from_the_one_hot():
  logits = jax.random.normal(jax.random.key(0), (3, 5, 40)) * 3
  key = jax.random.key(1)
  tokens, p = sampling.sample(key, logits, 0.0)
  assert np.asarray(tokens).tolist() == np.asarray(sampling.draw(key, p)).tolist()
  np.testing.assert_array_equal(np.asarray(p), np.asarray(sampling.probs(logits, 0.0)))
  tokens, p = sampling.sample(key, logits, 0.7, 0.9)
  assert np.asarray(tokens).tolist() == \
      np.asarray(sampling.draw(key, sampling.probs(logits, 0.7, 0.9))).tolist()


def test_verifying_more_drafts_accepts_what_fewer_would():
  """Rows admit j <= J drafts: verifying all 5 drafts accepts and draws the same as verifying
  only the longest admitted 3 (the host loop's shape), sampled and greedy."""
  v, b = 7, 64
  kp, kq, kd, kv = jax.random.split(jax.random.key(2), 4)
  p = jax.nn.softmax(jax.random.normal(kp, (b, 6, v)) * 2, axis=-1)
  q = jax.nn.softmax(jax.random.normal(kq, (b, 5, v)) * 2, axis=-1)
  drafts = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)
  admit = jnp.asarray(np.arange(b) % 4, jnp.int32)  # 0..3
  for greedy in (False, True):
    long = sampling.verify(kv, p, q, drafts, admit, greedy)
    short = sampling.verify(kv, p[:, :4], q[:, :3], drafts[:, :3], admit, greedy)
    for a, s in zip(long, short):
      assert np.asarray(a).tolist() == np.asarray(s).tolist()
    if not greedy:  # acceptance and rejection both happen
      assert 0 < np.asarray(long[0]).sum() < np.asarray(admit).sum()
  one_hot = sampling.probs(jnp.log(p), 0.0)  # greedy: the logits' argmax as its one-hot's
  drafts = drafts.at[::2, 0].set(jnp.argmax(p[::2, 0], axis=-1))  # some accepted
  got = sampling.verify_greedy(jnp.log(p), drafts, admit)
  for a, s in zip(got, sampling.verify(kv, one_hot, q, drafts, admit, True)):
    assert np.asarray(a).tolist() == np.asarray(s).tolist()
  assert np.asarray(got[0]).sum() > 0


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


def test_the_verify_cost_defaults_to_each_loops_own():
  """The host loop's verification of j drafts is its own shape (a cost per draft pays); the
  device loop verifies every draft in one shape (cost 0 admits them all); a given cost stands."""
  assert default_verify_cost(None, 1) == HOST_VERIFY_COST > 0
  assert default_verify_cost(None, 32) == 0.0
  assert default_verify_cost(0.3, 32) == default_verify_cost(0.3, 1) == 0.3
