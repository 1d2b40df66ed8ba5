"""The device side of generation: `Programs`, the jitted prefill, decode and speculative programs
over a model (and its DSpark drafter), and the pieces they trace: a row's stop at its
end-of-document or budget (`stop_rows`, `stop_run`), DSpark's features written into the cache's
ring, its drafts (`draft_block`) and their verification (`verify_block`). The host's loops over
these programs, the rows' bookkeeping and `Generator` are generator.py's.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.generate import sampling
from deepseek41.generate.cache import empty_cache
from deepseek41.generate.decode import (ced_decoder_tail, ced_encoder_chunk, ced_prefill,
                                        empty_tail, forward_chunk)
from deepseek41.generate.weight_reads import cast_where, read_only_as_mask, wider_float
from deepseek41.model.layer_cache import CacheSpec, ring_slots, scatter_rows
from deepseek41.model.params import dtype_of

NO_TOKEN = -1  # a decode step's output where its row emitted nothing (finished, or its EOS)


def stop_rows(next_b, done_b, left_b, eos_id):
  """(emitted_b, done_b, left_b) after a decode step that drew next_b: a running row emits its
  token unless it is the end-of-document (eos_id; -1: none), and finishes at its end-of-document
  or when its remaining budget left_b reaches 0. A finished row stays finished."""
  running_b = ~done_b
  eos_b = next_b == eos_id
  emitted_b = running_b & ~eos_b
  left_b = left_b - emitted_b.astype(left_b.dtype)
  return emitted_b, done_b | (running_b & eos_b) | (left_b <= 0), left_b


def stop_run(run_bj, valid_b, done_b, left_b, eos_id):
  """(emitted_b, done_b, left_b) after a round that produced the tokens run_bj[:, :valid_b]
  (a speculative round: the accepted drafts and the next token): a running row emits them up
  to its end-of-document (not emitted) and its remaining budget left_b, and finishes at either.
  `stop_rows` for runs of one token."""
  running_b = ~done_b
  slot_j = jnp.arange(run_bj.shape[1], dtype=jnp.int32)[None, :]
  eos_bj = (run_bj == eos_id) & (slot_j < valid_b[:, None])
  first_eos_b = jnp.min(jnp.where(eos_bj, slot_j, run_bj.shape[1]), axis=1)
  emitted_b = jnp.where(running_b, jnp.minimum(jnp.minimum(first_eos_b, valid_b), left_b), 0)
  left_b = left_b - emitted_b.astype(left_b.dtype)
  finished_b = running_b & ((first_eos_b < valid_b) | (left_b <= 0))
  return emitted_b.astype(jnp.int32), done_b | finished_b, left_b


def _write_features(dspark, cache, captured, valid_bq, start_b):
  """DSpark's context m_t of the chunk's rows into the cache's feature ring."""
  m_bqd = dspark.context(captured)
  tq = valid_bq.shape[1]
  pos_bq = start_b[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
  end_b = start_b + jnp.sum(valid_bq, axis=1, dtype=jnp.int32)
  cap = cache['feat_pos'].shape[1]
  slots = ring_slots(pos_bq, valid_bq, end_b, cap)
  return {**cache, 'feat': scatter_rows(cache['feat'], slots, m_bqd),
          'feat_pos': scatter_rows(cache['feat_pos'], slots, pos_bq)}


def _ced_tail_result(dspark, cache, logits_bwv, captured, lengths_b, features: bool):
  """(each row's last prompt logits, cache) from CED's decoder over the rows' last n_win
  positions, DSpark's features of them written when `features`."""
  n_win = logits_bwv.shape[1]
  tail_b = jnp.maximum(lengths_b - n_win, 0)
  if features:
    valid = (tail_b[:, None] + jnp.arange(n_win)[None, :]) < lengths_b[:, None]
    cache = _write_features(dspark, cache, captured, valid, tail_b)
  last = jnp.take_along_axis(logits_bwv, (lengths_b - 1 - tail_b)[:, None, None], axis=1)[:, 0]
  return last, cache


def draft_block(model, dspark, cache, anchor_b, key, temperature, top_p, k: int):
  """DSpark's k drafts after each row's anchor (the last token, not yet in the cache): (drafts
  int32 [B, k], their distributions q [B, k, V], each slot's confidence [B, k]). The drafter
  reads the feature ring's positions in the anchor's window; each slot's Markov bias follows
  the previous slot's token, so the slots draw in order."""
  p_b = cache['length']
  w = model.cfg.sliding_window
  fpos = cache['feat_pos']
  ok = (fpos >= 0) & (fpos >= p_b[:, None] - w) & (fpos < p_b[:, None])
  context = {'m_nwd': cache['feat'], 'positions_nw': jnp.maximum(fpos, 0), 'ok_nw': ok}
  h_nkd, base_nkv, _ = dspark.draft_rows(anchor_b, p_b, context, model.embed[...],
                                         model.head[...])
  prev, drafts, qs, confs = anchor_b, [], [], []
  for slot, sub in enumerate(jax.random.split(key, k)):
    bias_n1v, e_n1r = dspark.markov(prev[:, None])
    prev, q_nv = sampling.sample(sub, base_nkv[:, slot] + bias_n1v[:, 0], temperature, top_p)
    conf = jax.nn.sigmoid(dspark.confidence_logit(h_nkd[:, slot:slot + 1], e_n1r))[:, 0]
    drafts.append(prev)
    qs.append(q_nv)
    confs.append(conf)
  return jnp.stack(drafts, 1), jnp.stack(qs, 1), jnp.stack(confs, 1)


def verify_block(model, dspark, engram_map, cache, anchor_b, drafts_bj, q_bjv, admit_b, key,
                 temperature, top_p):
  """The backbone over [anchor, drafts] at each row's cached length, DSpark's features of
  every position written, then rejection sampling of each row's first admit_b drafts:
  (accepted_b, next_b, the chunk's logits [B, j + 1, V], the cache rolled back to start +
  accepted + 1). Rolling back is only the shorter length: what the rejected positions wrote
  (window and row ring slots, completed entries, features, tokens) lies at positions no later
  query sees before a later chunk overwrites it (cache.py)."""
  start = cache['length']
  chunk = jnp.concatenate([anchor_b[:, None], drafts_bj], axis=1)
  valid = jnp.ones(chunk.shape, bool)
  logits, captured, cache = forward_chunk(model, cache, chunk, valid, engram_map=engram_map,
                                          capture_layers=dspark.targets)
  cache = _write_features(dspark, cache, captured, valid, start)
  if temperature <= 0:  # the argmax of the logits, as of greedy `probs`' one-hot
    acc, nxt = sampling.verify_greedy(logits, drafts_bj, admit_b)
  else:
    acc, nxt = sampling.verify(key, sampling.probs(logits, temperature, top_p), q_bjv,
                               drafts_bj, admit_b, greedy=False)
  return acc, nxt, logits, {**cache, 'length': start + acc + 1}


PROBE_CHUNK = 128  # a prefill chunk's tokens in the probes: past every decode-sized path
# (model/transformer.py's MHC_TOKEN_BLOCK, expert_parallel's small calls)


def weights_in_compute_dtype(graph, state, engram_map):
  """`state` (of `nnx.split((model, dspark))`, concrete or abstract) with every weight that
  generation reads only as a cast to the compute dtype cast once (weight_reads.py). Decided by
  tracing the programs' pieces at decode size (one token, with DSpark's features and drafts
  when there is a drafter) and at a prefill chunk; a weight no probe reads (e.g. the vision
  tower's) stays as trained. A 1B decode step read 0.36 GB of such fp32 weights a token
  beyond the routed experts (docs/performance.md sections 53 and 55)."""
  model, dspark = nnx.merge(graph, state)
  dt = dtype_of(model.cfg.compute_dtype)
  if not any(wider_float(x, dt) for x in jax.tree.leaves(state)):
    return state  # fp32 compute: nothing to cast, nothing to trace
  targets = dspark.targets if dspark is not None else ()

  def forward(t: int):
    def probe(state):
      model, dspark = nnx.merge(graph, state)
      spec = CacheSpec(batch=1, max_len=2 * PROBE_CHUNK, max_chunk=t)
      cache = empty_cache(model, spec, model.cfg.d_model if targets else 0)
      valid = jnp.ones((1, t), bool)
      logits, captured, cache = forward_chunk(model, cache, jnp.zeros((1, t), jnp.int32),
                                              valid, engram_map=engram_map,
                                              capture_layers=targets)
      if targets:
        cache = _write_features(dspark, cache, captured, valid, jnp.zeros((1,), jnp.int32))
      return logits, cache
    return probe

  def draft(state):
    model, dspark = nnx.merge(graph, state)
    spec = CacheSpec(batch=1, max_len=2 * PROBE_CHUNK, max_chunk=2)
    cache = empty_cache(model, spec, model.cfg.d_model)
    return draft_block(model, dspark, cache, jnp.zeros((1,), jnp.int32),
                       jax.random.key(0), 1.0, 1.0, 2)
  probes = [forward(1), forward(PROBE_CHUNK)] + ([draft] if targets else [])
  return cast_where(state, read_only_as_mask(state, probes, dt), dt)


def compiler_options(model_cfg) -> dict | None:
  """XLA options of generation's programs (model.decode_vector_dots, config/schema.py)."""
  if model_cfg.decode_vector_dots == 'gemm':
    return {'xla_disable_hlo_passes': 'dot-strength-reduction'}
  return None


class Programs:
  """The jitted pieces of generation over the split model state (merged inside each program).
  `traces` counts how often each program was traced: once per shape of its inputs."""

  def __init__(self, model, dspark, engram_map, cast_weights: bool = True):
    """cast_weights=False keeps every weight as trained (a baseline for the benchmarks)."""
    self.model = model  # its layers build the caches (`empty_cache`)
    self.graph, state = nnx.split((model, dspark))
    self.state = weights_in_compute_dtype(self.graph, state, engram_map) if cast_weights \
        else state
    nnx.update((model, dspark), self.state)  # the caller's model shares them: one copy, not two
    self.engram_map = engram_map
    self.traces = collections.Counter()
    self.compiler_options = compiler_options(model.cfg)
    self._jit = {}

  def _merged(self, state):
    return nnx.merge(self.graph, state)

  def _compiled(self, name, fn, static, donate=()):
    if name not in self._jit:
      @functools.wraps(fn)
      def traced(*args, **kwargs):
        self.traces[name] += 1
        return fn(*args, **kwargs)
      self._jit[name] = jax.jit(traced, static_argnames=static, donate_argnames=donate,
                                compiler_options=self.compiler_options)
    return self._jit[name]

  def prefill_full(self, cache, tokens_bt, lengths_b, features: bool, images=None):
    def run(state, cache, tokens_bt, lengths_b, images, features):
      model, dspark = self._merged(state)
      valid = jnp.arange(tokens_bt.shape[1])[None, :] < lengths_b[:, None]
      start = jnp.zeros_like(lengths_b)
      logits, captured, cache = forward_chunk(
          model, cache, tokens_bt, valid, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else (), images=images)
      if features:
        cache = _write_features(dspark, cache, captured, valid, start)
      last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
      return last, cache
    return self._compiled('prefill_full', run, ('features',))(
        self.state, cache, tokens_bt, lengths_b, images, features=features)

  def prefill_full_chunk(self, cache, tokens_bq, lengths_b, last_bv, features: bool):
    """One chunk of a chunked full prefill (rows at their cached lengths): (the logits at each
    row's last prompt position where this chunk holds it, else `last_bv`; cache)."""
    def run(state, cache, tokens_bq, lengths_b, last_bv, features):
      model, dspark = self._merged(state)
      start_b = cache['length']
      valid = start_b[:, None] + jnp.arange(tokens_bq.shape[1])[None, :] < lengths_b[:, None]
      row_b = lengths_b - 1 - start_b
      logits, captured, cache = forward_chunk(
          model, cache, tokens_bq, valid, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else (), logits_row_b=row_b)
      if features:
        cache = _write_features(dspark, cache, captured, valid, start_b)
      here_b = (row_b >= 0) & (row_b < tokens_bq.shape[1])
      return jnp.where(here_b[:, None], logits[:, 0], last_bv), cache
    return self._compiled('prefill_full_chunk', run, ('features',), donate=('cache',))(
        self.state, cache, tokens_bq, lengths_b, last_bv, features=features)

  def prefill_ced_chunk(self, cache, tokens_bq, lengths_b, tail, features: bool):
    """One encoder chunk of a chunked CED prefill: (cache, tail)."""
    def run(state, cache, tokens_bq, lengths_b, tail, features):
      model, dspark = self._merged(state)
      start_b = cache['length']
      valid = start_b[:, None] + jnp.arange(tokens_bq.shape[1])[None, :] < lengths_b[:, None]
      tail_b = jnp.maximum(lengths_b - tail['x'].shape[1], 0)
      return ced_encoder_chunk(model, cache, tokens_bq, valid, tail, tail_b,
                               engram_map=self.engram_map,
                               capture_layers=dspark.targets if features else ())
    return self._compiled('prefill_ced_chunk', run, ('features',), donate=('cache', 'tail'))(
        self.state, cache, tokens_bq, lengths_b, tail, features=features)

  def prefill_ced_tail(self, cache, tail, lengths_b, features: bool):
    """The decoder over the tail a chunked CED prefill collected: (last logits, cache)."""
    def run(state, cache, tail, lengths_b, features):
      model, dspark = self._merged(state)
      logits, captured, cache = ced_decoder_tail(
          model, cache, tail, lengths_b, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else ())
      return _ced_tail_result(dspark, cache, logits, captured, lengths_b, features)
    return self._compiled('prefill_ced_tail', run, ('features',), donate=('cache',))(
        self.state, cache, tail, lengths_b, features=features)

  def tail_buffers(self, b: int, n_win: int, features: bool):
    _, dspark = self._merged(self.state)
    return empty_tail(self.model, b, n_win, dspark.targets if features else ())

  def prefill_ced(self, cache, tokens_bt, lengths_b, n_win: int, features: bool, images=None):
    def run(state, cache, tokens_bt, lengths_b, images, n_win, features):
      model, dspark = self._merged(state)
      logits, captured, cache = ced_prefill(
          model, cache, tokens_bt, lengths_b, n_win, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else (), images=images)
      return _ced_tail_result(dspark, cache, logits, captured, lengths_b, features)
    return self._compiled('prefill_ced', run, ('n_win', 'features'))(
        self.state, cache, tokens_bt, lengths_b, images, n_win=n_win, features=features)

  def plain(self, cache, tok_b, key, temperature, top_p, features: bool):
    def run(state, cache, tok_b, key, temperature, top_p, features):
      model, dspark = self._merged(state)
      start = cache['length']
      valid = jnp.ones((tok_b.shape[0], 1), bool)
      logits, captured, cache = forward_chunk(
          model, cache, tok_b[:, None], valid, engram_map=self.engram_map,
          capture_layers=dspark.targets if features else ())
      if features:
        cache = _write_features(dspark, cache, captured, valid, start)
      return sampling.sample(key, logits[:, 0], temperature, top_p)[0], cache
    return self._compiled('plain', run, ('temperature', 'top_p', 'features'))(
        self.state, cache, tok_b, key, temperature=temperature, top_p=top_p, features=features)

  def decode_steps(self, carry: dict, eos_id, steps, temperature, top_p, n: int):
    """Up to `steps` (<= n) plain decode steps in one dispatch, ending early once every row is
    done: each step is `plain`'s (key split, forward, draw) with `stop_rows` after it. `carry`:
    the cache (donated: updated in place), the last token, the key, each row's done flag and
    remaining budget. Returns ({'tokens': [B, n] (NO_TOKEN where a row emitted nothing),
    'count': [B] emitted, 'steps': steps run}, the carry after them)."""
    def run(state, carry, eos_id, steps, temperature, top_p, n):
      b = carry['last'].shape[0]

      def step(loop):
        i, carry, tokens_bn = loop
        model, _ = self._merged(state)
        key, sub = jax.random.split(carry['key'])
        valid = jnp.ones((b, 1), bool)
        logits, _, cache = forward_chunk(model, carry['cache'], carry['last'][:, None], valid,
                                         engram_map=self.engram_map)
        next_b = sampling.sample(sub, logits[:, 0], temperature, top_p)[0]
        emitted_b, done_b, left_b = stop_rows(next_b, carry['done'], carry['left'], eos_id)
        tokens_bn = tokens_bn.at[:, i].set(jnp.where(emitted_b, next_b, NO_TOKEN))
        return i + 1, {'cache': cache, 'last': next_b, 'key': key, 'done': done_b,
                       'left': left_b}, tokens_bn

      def running(loop):
        i, carry, _ = loop
        return (i < steps) & ~jnp.all(carry['done'])
      start = (jnp.int32(0), carry, jnp.full((b, n), NO_TOKEN, jnp.int32))
      ran, after, tokens_bn = jax.lax.while_loop(running, step, start)
      out = {'tokens': tokens_bn, 'count': carry['left'] - after['left'], 'steps': ran}
      return out, after
    return self._compiled('decode_steps', run, ('temperature', 'top_p', 'n'), ('carry',))(
        self.state, carry, eos_id, steps, temperature=temperature, top_p=top_p, n=n)

  def draft(self, cache, anchor_b, key, temperature, top_p, k: int):
    def run(state, cache, anchor_b, key, temperature, top_p, k):
      model, dspark = self._merged(state)
      return draft_block(model, dspark, cache, anchor_b, key, temperature, top_p, k)
    return self._compiled('draft', run, ('temperature', 'top_p', 'k'))(
        self.state, cache, anchor_b, key, temperature=temperature, top_p=top_p, k=k)

  def verify(self, cache, anchor_b, drafts_bj, q_bjv, admit_b, key, temperature, top_p):
    def run(state, cache, anchor_b, drafts_bj, q_bjv, admit_b, key, temperature, top_p):
      model, dspark = self._merged(state)
      acc, nxt, _, cache = verify_block(model, dspark, self.engram_map, cache, anchor_b,
                                        drafts_bj, q_bjv, admit_b, key, temperature, top_p)
      return acc, nxt, cache
    return self._compiled('verify', run, ('temperature', 'top_p'))(
        self.state, cache, anchor_b, drafts_bj, q_bjv, admit_b, key, temperature=temperature,
        top_p=top_p)

  def speculate(self, carry: dict, eos_id, rounds, verify_cost, temperature, top_p, k: int,
                n: int):
    """Up to `rounds` speculative rounds in one dispatch: each drafts k tokens per row
    (`draft_block`), admits each row's verify length on the device (`sampling.verify_length`
    of the confidences; 0 for finished rows), verifies all k drafts in one forward of fixed
    shape (`verify_block`: a row's drafts past its admit are rejected by construction), and
    stops rows at their end-of-document or budget (`stop_run`). The loop ends early once every
    row is done, or once a running row has no room for another round's k + 1 tokens among its
    n. The keys split per round as `_one_step_loop` splits them. `carry`: the cache (donated),
    the last token, the key, each row's done flag and remaining budget. Returns ({'tokens':
    [B, n] (NO_TOKEN past a row's count), 'count': [B] emitted, 'rounds': rounds run,
    'accepted': [B] drafts accepted by rows running at each round's start}, the carry)."""
    def run(state, carry, eos_id, rounds, verify_cost, temperature, top_p, k, n):
      b = carry['last'].shape[0]
      slot_k1 = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

      def one_round(loop):
        i, carry, tokens_bn, count_b, accepted_b = loop
        model, dspark = self._merged(state)
        key, sub = jax.random.split(carry['key'])
        key, dkey = jax.random.split(key)
        cache, anchor_b, running_b = carry['cache'], carry['last'], ~carry['done']
        start_b = cache['length']
        drafts_bk, q_bkv, conf_bk = draft_block(model, dspark, cache, anchor_b, dkey,
                                                temperature, top_p, k)
        admit_b = jnp.where(running_b, sampling.verify_length(conf_bk, verify_cost), 0)
        acc_b, next_b, logits_bjv, cache = verify_block(
            model, dspark, self.engram_map, cache, anchor_b, drafts_bk, q_bkv, admit_b, sub,
            temperature, top_p)
        if temperature > 0:  # no row admits a draft: the host loop's plain step draws it
          next_b = jax.lax.cond(
              jnp.any(admit_b > 0), lambda: next_b,
              lambda: sampling.sample(sub, logits_bjv[:, 0], temperature, top_p)[0])
        run_bk1 = jnp.where(slot_k1 == acc_b[:, None], next_b[:, None],
                            jnp.concatenate([drafts_bk, drafts_bk[:, :1]], axis=1))
        emitted_b, done_b, left_b = stop_run(run_bk1, acc_b + 1, carry['done'], carry['left'],
                                             eos_id)
        dest_bk1 = jnp.where(slot_k1 < emitted_b[:, None], count_b[:, None] + slot_k1, n)
        tokens_bn = tokens_bn.at[jnp.arange(b)[:, None], dest_bk1].set(run_bk1, mode='drop')
        # A finished row keeps its start: its later rounds write nothing past its budget.
        cache = {**cache, 'length': jnp.where(done_b, start_b, cache['length'])}
        carry = {'cache': cache, 'last': next_b, 'key': key, 'done': done_b, 'left': left_b}
        return (i + 1, carry, tokens_bn, count_b + emitted_b,
                accepted_b + jnp.where(running_b, acc_b, 0))

      def running(loop):
        i, carry, _, count_b, _ = loop
        room = jnp.all(carry['done'] | (count_b + k + 1 <= n))
        return (i < rounds) & ~jnp.all(carry['done']) & room
      zeros_b = jnp.zeros((b,), jnp.int32)
      start = (jnp.int32(0), carry, jnp.full((b, n), NO_TOKEN, jnp.int32), zeros_b, zeros_b)
      ran, after, tokens_bn, count_b, accepted_b = jax.lax.while_loop(running, one_round, start)
      out = {'tokens': tokens_bn, 'count': count_b, 'rounds': ran, 'accepted': accepted_b}
      return out, after
    return self._compiled('speculate', run, ('temperature', 'top_p', 'k', 'n'), ('carry',))(
        self.state, carry, eos_id, rounds, verify_cost, temperature=temperature, top_p=top_p,
        k=k, n=n)
