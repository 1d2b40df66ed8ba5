"""Generation: caches and decoding equal the full forward; CED prefill; speculative decoding."""

import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.config import load_config_file, resolve
from deepseek41.generate import programs, sampling
from deepseek41.generate.cache import empty_cache, global_bytes_per_token
from deepseek41.generate.decode import ced_prefill, forward_chunk, replay_windows
from deepseek41.generate.generator import GenerateError, decode_loop, exact_n_win
from deepseek41.generate.programs import Programs
from deepseek41.model.ced import exact_tail_rows
from deepseek41.model.dspark import DSpark
from deepseek41.model.layer_cache import CacheSpec
from deepseek41.model.shared import Shared
from deepseek41.model.transformer import Transformer
from deepseek41.packing import load, store
from deepseek41.quant import get_fake_quant
from deepseek41.tools.info import kv_cache_bytes
from tests.helpers import REPO_ROOT, resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = REPO_ROOT

# Every mechanism a cache must carry: CSA2 (ratio 2 and 1 sources, Reuse, Reindex with the
# candidate pool) with the released FP4/FP8 formats, Engram, single-pass mHC, a CED split.
FULL = {'model.init_std': 0.1, 'model.attention_variant': 'csa2', 'model.head_dim': 32,
        'model.rope_head_dim': 8,
        'model.index_n_heads': 2, 'model.index_head_dim': 32, 'model.index_topk': 4,
        'model.candidate_topk_blocks': 2, 'model.candidate_block_size': 2,
        'model.kv_quant': 'fp4_e4m3_16', 'model.index_quant': 'fp4_ue8m0_32',
        'model.swa_quant': 'fp8_ue8m0_32', 'model.engram': True, 'model.engram_layer_ids': (1, 3),
        'model.residual': 'mhc_single_pass'}
SPEC = CacheSpec(batch=2, max_len=40, max_chunk=3)


def _model(vocab=96, **extra):
  cfg = resolved(**{**FULL, 'model.vocab_size': vocab, **extra})
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, moe_backend=cfg.model.eval_moe_backend))  # dropless, as generation runs it
  return cfg, Transformer(cfg.model, nnx.Rngs(params=0))


@pytest.fixture(scope='module')
def full_model():
  return _model()


def _full_logits(model, tokens_bt):
  b, t = tokens_bt.shape
  batch = {'tokens': tokens_bt, 'segment_ids': np.ones((b, t), np.int32),
           'positions': np.tile(np.arange(t, dtype=np.int32), (b, 1)),
           'modality': np.zeros((b, t), np.int32)}
  return np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, batch))


def _exact_marginals(model, prompt, steps):
  """{step: the exact distribution of generated token `step` over the 8-token vocabulary} for
  each of `steps`, from one forward over every continuation of max(steps) tokens: the model is
  causal, so position len(prompt) - 1 + j gives p(token j | the prompt, tokens 0..j-1) whatever
  follows it."""
  depth = max(steps)
  conts = np.asarray(list(itertools.product(range(8), repeat=depth)), np.int32)  # lexicographic
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  probs = np.asarray(jax.nn.softmax(_full_logits(model, seqs), axis=-1))  # [8^d, P + d, 8]
  p0 = len(prompt) - 1
  joint, out = probs[0, p0], {}  # over token 0
  for j in range(1, depth + 1):
    # rows whose first j tokens enumerate every prefix in order (the rest zeros)
    nxt = probs[::8 ** (depth - j), p0 + j]  # [8^j, 8]: p(token j | prefix)
    joint = (joint.reshape(-1, 1) * nxt).reshape(-1)
    if j in steps:
      out[j] = joint.reshape(-1, 8).sum(0)
  return out


@nnx.jit
def _chunk(model, cache, tokens, valid):
  logits, _, cache = forward_chunk(model, cache, tokens, valid)
  return logits, cache


def test_decoding_with_caches_equals_the_full_forward(full_model):
  """Two rows of different prompt lengths in one padded prefill; a 3-token chunk of wrong
  tokens written and rolled back (a rejected verification); then one token at a time. Every
  logit row equals the full forward's over the final sequence, so greedy decoding agrees."""
  cfg, model = full_model
  rng = np.random.default_rng(0)
  seq = rng.integers(3, 96, (2, 30)).astype(np.int32)
  full = _full_logits(model, seq)
  lengths = np.array([9, 14], np.int32)
  prompt = np.where(np.arange(16)[None] < lengths[:, None], seq[:, :16], 0)
  cache = empty_cache(model, SPEC)
  logits, cache = _chunk(model, cache, jnp.asarray(prompt), jnp.asarray(prompt > -1) &
                         (np.arange(16)[None] < lengths[:, None]))
  for b in range(2):
    np.testing.assert_allclose(np.asarray(logits)[b, :lengths[b]], full[b, :lengths[b]],
                               rtol=2e-4, atol=2e-4)
  wrong = (seq[:, 16:19] + 1) % 96
  _, rejected = _chunk(model, cache, jnp.asarray(wrong), jnp.ones((2, 3), bool))
  cache = {**rejected, 'length': cache['length']}  # the rollback: nothing of it is kept
  got = {0: [], 1: []}
  for _ in range(12):
    length = np.asarray(cache['length'])
    tok = seq[np.arange(2), length][:, None]
    logits, cache = _chunk(model, cache, jnp.asarray(tok), jnp.ones((2, 1), bool))
    for b in range(2):
      got[b].append((length[b], np.asarray(logits)[b, 0]))
  for b in range(2):
    for pos, row in got[b]:
      np.testing.assert_allclose(row, full[b, pos], rtol=2e-4, atol=2e-4)
      assert row.argmax() == full[b, pos].argmax()


def test_a_chunks_one_softmax_equals_its_partials_merged(full_model, monkeypatch):
  """model.decode_union_rows: chunks of up to that many tokens attend over all their keys in one
  softmax (ops/union_attention.py; the default, which the test above runs); 0 keeps a partial
  per key set and their merge. Both give the same logits, prefill and token by token."""
  from deepseek41.model import attention as attention_module
  cfg, union = full_model
  _, partials = _model(**{'model.decode_union_rows': 0})
  seq = np.random.default_rng(1).integers(3, 96, (2, 12)).astype(np.int32)

  def one_softmax_layers(model):  # the layers whose one-token step takes the one softmax
    calls, original = [], attention_module.union_attention

    def counting(*args, **kw):
      calls.append(1)
      return original(*args, **kw)
    with monkeypatch.context() as m:
      m.setattr(attention_module, 'union_attention', counting)
      graph, state = nnx.split(model)
      jax.make_jaxpr(lambda st: forward_chunk(nnx.merge(graph, st), empty_cache(model, SPEC),
                                              jnp.asarray(seq[:, :1]), jnp.ones((2, 1), bool)))(
          state)
    return len(calls)
  assert one_softmax_layers(union) == cfg.model.num_layers
  assert one_softmax_layers(partials) == 0
  logits = {}
  for name, model in (('union', union), ('partials', partials)):
    cache = empty_cache(model, SPEC)
    rows, cache = _chunk(model, cache, jnp.asarray(seq[:, :8]), jnp.ones((2, 8), bool))
    steps = [np.asarray(rows)]
    for p in range(8, 12):
      rows, cache = _chunk(model, cache, jnp.asarray(seq[:, p:p + 1]), jnp.ones((2, 1), bool))
      steps.append(np.asarray(rows))
    logits[name] = steps
  for got, want in zip(logits['union'], logits['partials']):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_packed_cache_holds_the_fake_quantized_values(full_model):
  """The stored bytes unpack to exactly the training path's fake quantization, and the cached
  entries of a prefill are the full forward's compressed KV."""
  x = jax.random.normal(jax.random.key(1), (3, 5, 64)) * 3
  for fmt in ('fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32'):
    np.testing.assert_array_equal(np.asarray(load(fmt, store(fmt, x), jnp.float32)),
                                  np.asarray(get_fake_quant(fmt)(x)))
  cfg, model = full_model
  tokens = np.random.default_rng(2).integers(3, 96, (2, 16)).astype(np.int32)
  batch = {'tokens': tokens, 'segment_ids': np.ones((2, 16), np.int32),
           'positions': np.tile(np.arange(16, dtype=np.int32), (2, 1)),
           'modality': np.zeros((2, 16), np.int32)}

  @nnx.jit
  def published(m, batch):
    batch = m.with_engram_rows(batch)
    x, pre = m.residual_input(batch)
    return m.run_blocks(x, pre, batch, Shared())[-1]
  shared = published(model, batch)
  _, cache = _chunk(model, empty_cache(model, SPEC), jnp.asarray(tokens),
                    jnp.ones((2, 16), bool))
  for layer, ratio in ((1, 2), (2, 1)):
    comp, keys = shared.kv[layer]
    entries = cache['layers'][layer].entries
    n = 16 // ratio
    written = np.asarray(entries.written_bn)
    assert written[:, :n].all() and not written[:, n:].any()
    np.testing.assert_allclose(
        np.asarray(load(cfg.model.kv_quant, entries.kv_bnd, jnp.float32))[:, :n],
        np.asarray(comp.kv_bnd), atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(load(cfg.model.index_quant, entries.keys_bnc, jnp.float32))[:, :n],
        np.asarray(keys), atol=1e-5)
  assert cache['layers'][3].entries is None  # a Reindex layer holds nothing of its own


def test_ced_prefill_then_decoding_is_exact(full_model):
  """CED prefill over the smallest exact tail: its last rows and every decoded token after it
  equal the full forward (the decoder's windows hold exactly the full path's keys)."""
  cfg, model = full_model
  rng = np.random.default_rng(3)
  seq = rng.integers(3, 96, (2, 36)).astype(np.int32)
  full = _full_logits(model, seq)
  lengths = np.array([26, 30], np.int32)
  n_win = exact_n_win(cfg)
  assert n_win < 26
  prompt = np.where(np.arange(32)[None] < lengths[:, None], seq[:, :32], 0)
  logits, _, cache = nnx.jit(lambda m, c, t, l: ced_prefill(m, c, t, l, n_win))(
      model, empty_cache(model, SPEC), jnp.asarray(prompt), jnp.asarray(lengths))
  exact = exact_tail_rows(cfg.model, n_win)
  assert exact >= cfg.model.sliding_window
  for b in range(2):  # tail row i is position lengths - n_win + i
    np.testing.assert_allclose(np.asarray(logits)[b, n_win - exact:],
                               full[b, lengths[b] - exact:lengths[b]], rtol=2e-4, atol=2e-4)
  for _ in range(4):
    length = np.asarray(cache['length'])
    tok = seq[np.arange(2), length][:, None]
    logits, cache = _chunk(model, cache, jnp.asarray(tok), jnp.ones((2, 1), bool))
    for b in range(2):
      np.testing.assert_allclose(np.asarray(logits)[b, 0], full[b, length[b]], rtol=2e-4,
                                 atol=2e-4)


def test_bounded_replay_rebuilds_the_windows(full_model):
  """Dropping the windows and replaying the last n_win tokens: with n_win covering every
  window's reach the next-token logits are the exact ones; a short replay moves them."""
  cfg, model = full_model
  tokens = np.random.default_rng(4).integers(3, 96, (2, 36)).astype(np.int32)
  _, cache = _chunk(model, empty_cache(model, SPEC), jnp.asarray(tokens),
                    jnp.ones((2, 36), bool))
  full = _full_logits(model, tokens)[:, -1]
  replay = nnx.jit(lambda m, c, n: replay_windows(m, c, n)[0][:, -1], static_argnums=2)
  long_ = np.asarray(replay(model, cache, cfg.model.num_layers * 7 + 1))
  np.testing.assert_allclose(long_, full, rtol=2e-4, atol=2e-4)
  short = np.asarray(replay(model, cache, 4))
  assert np.abs(short - full).max() > 1e-3


def test_released_cache_is_890_bytes_per_token():
  cfg = resolve(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')),
                num_devices=8, backend='cpu')
  spec = CacheSpec(batch=1, max_len=64, max_chunk=1)
  model = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(params=0)))
  cache = jax.eval_shape(lambda: empty_cache(model, spec))
  assert global_bytes_per_token(cache, spec) == \
      kv_cache_bytes(cfg)['global_bytes_per_token'] == 890


# ---- the decode loop on the device ---------------------------------------------------------


@pytest.fixture(scope='module')
def plain_programs(full_model):
  cfg, model = full_model
  return cfg, Programs(model, None, None)


def _tokens(results):
  return [r.tokens for r in results]


def test_device_loop_equals_the_one_step_loop(plain_programs):
  """fp32, three prompts of different lengths and budgets: N steps per dispatch return the
  one-step loop's tokens, greedy (4, which divides no row's steps) and sampled (32: all of them
  in one; the keys split step by step as there); an end-of-document stops only the rows that
  draw it, each at its first."""
  cfg, progs = plain_programs
  rng = np.random.default_rng(9)
  prompts = [rng.integers(3, 96, n).astype(np.int32) for n in (5, 12, 9)]
  budgets = [10, 7, 12]
  kw = dict(max_new_tokens=budgets, seed=3)
  one_step = decode_loop(progs, cfg, prompts, eos_id=None, tokens_per_dispatch=1, **kw)
  assert [len(t) for t in _tokens(one_step)] == budgets
  device = decode_loop(progs, cfg, prompts, eos_id=None, tokens_per_dispatch=4, **kw)
  assert _tokens(device) == _tokens(one_step)
  assert device[0].forwards == one_step[0].forwards == max(budgets) - 1
  assert [r.timed_tokens for r in device] == [r.timed_tokens for r in one_step]
  # The end-of-document: a token row 0 draws at step 3 and not before.
  eos = next(x for i, x in enumerate(_tokens(one_step)[0]) if i >= 3 and
             x not in _tokens(one_step)[0][:i])
  cut = [t[:t.index(eos)] if eos in t else t for t in _tokens(one_step)]
  assert len(cut[0]) < budgets[0] and any(len(c) == b for c, b in zip(cut, budgets))
  for n in (1, 4):
    assert _tokens(decode_loop(progs, cfg, prompts, eos_id=eos, tokens_per_dispatch=n,
                               **kw)) == cut
  sampled = dict(temperature=0.8, top_p=0.9, **kw)
  one_step = decode_loop(progs, cfg, prompts, eos_id=None, tokens_per_dispatch=1, **sampled)
  device = decode_loop(progs, cfg, prompts, eos_id=None, tokens_per_dispatch=32, **sampled)
  assert _tokens(device) == _tokens(one_step)
  assert device[0].forwards == max(budgets) - 1
  assert _tokens(device) != _tokens(decode_loop(progs, cfg, prompts, eos_id=None,
                                                tokens_per_dispatch=32, **{**sampled, 'seed': 4}))


def test_the_programs_compile_with_generations_xla_options(full_model, monkeypatch):
  """model.decode_vector_dots reaches XLA through every program's compile options: an option
  XLA does not know fails the first program's compile, naming it."""
  cfg, model = full_model
  monkeypatch.setattr(programs, 'compiler_options', lambda model_cfg: {'xla_no_such_pass': 1})
  progs = Programs(model, None, None)
  assert progs.compiler_options == {'xla_no_such_pass': 1}
  with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option: 'xla_no_such"):
    decode_loop(progs, cfg, [np.arange(3, 8, dtype=np.int32)], eos_id=None, max_new_tokens=2,
                tokens_per_dispatch=1)


TOY_PROMPT = np.array([3, 5, 1, 6, 2], np.int32)


@pytest.fixture(scope='module')
def toy8():
  """A toy model over 8 tokens with a drafter, and the exact marginals of its generated tokens
  1-3 after TOY_PROMPT."""
  cfg, progs = _drafting(vocab=8)
  return cfg, progs, _exact_marginals(nnx.merge(progs.graph, progs.state)[0], TOY_PROMPT,
                                      (1, 2, 3))


def test_sampled_device_loop_matches_the_model(toy8):
  """3,000 rows of the toy model: the third and fourth generated tokens (two steps of one
  dispatch) are distributed as their exact marginals from full forwards."""
  cfg, progs, exact = toy8
  n = 3000
  out = decode_loop(progs, cfg, [TOY_PROMPT] * n, eos_id=None, max_new_tokens=4,
                    temperature=1.0, prefill='full', seed=1, tokens_per_dispatch=8)
  assert out[0].forwards == 3
  for step in (2, 3):
    freq = np.bincount([r.tokens[step] for r in out], minlength=8) / n
    assert np.abs(freq - exact[step]).sum() < 0.06, step


def test_prompts_in_one_bucket_share_compiled_programs(plain_programs):
  """Prompt lengths and budgets that fall in one length bucket trace the prefill and the
  device loop once; a longer prompt, in the next bucket, traces the prefill again."""
  cfg, progs = plain_programs
  rng = np.random.default_rng(10)
  # Three rows, as test_device_loop_equals_the_one_step_loop's: the programs it compiled for
  # the first bucket serve here (the rows' count is a dimension of every program).
  run = lambda n, new: decode_loop(progs, cfg, [rng.integers(3, 96, n).astype(np.int32)] * 3,
                                   eos_id=None, max_new_tokens=new, tokens_per_dispatch=4)
  run(5, 6)
  traces = dict(progs.traces)
  run(11, 9)
  assert progs.traces == traces
  run(20, 6)
  assert progs.traces['prefill_ced'] == traces['prefill_ced'] + 1


def test_chunked_prefill_equals_the_whole_prompt(plain_programs):
  """Prompts prefilled 16 positions per dispatch (a full prefill chunk by chunk, or CED's
  encoder chunk by chunk, then its decoder over the tail) decode the tokens of the whole prompt
  at once, fp32; rows of different lengths, one shorter than a chunk."""
  cfg, progs = plain_programs
  rng = np.random.default_rng(12)
  prompts = [rng.integers(3, 96, n).astype(np.int32) for n in (40, 6, 31)]
  for prefill in ('full', 'ced'):
    kw = dict(eos_id=None, max_new_tokens=6, prefill=prefill, tokens_per_dispatch=4)
    whole = decode_loop(progs, cfg, prompts, prefill_chunk=0, **kw)
    traces = dict(progs.traces)
    chunked = decode_loop(progs, cfg, prompts, prefill_chunk=16, **kw)
    assert _tokens(chunked) == _tokens(whole), prefill
    name = 'prefill_full_chunk' if prefill == 'full' else 'prefill_ced_chunk'
    assert progs.traces[name] == traces.get(name, 0) + 1  # one program for every chunk
  with pytest.raises(GenerateError, match='--prefill_chunk must be >= 0'):
    decode_loop(progs, cfg, prompts, eos_id=None, prefill_chunk=-1)


# ---- speculative decoding ------------------------------------------------------------------


def _drafting(vocab=96):
  cfg, model = _model(vocab, **{'dspark.num_blocks': 1, 'dspark.block_size': 3,
                                'dspark.target_layer_ids': (2, 3), 'dspark.markov_rank': 8,
                                'dspark.n_routed_experts': 4, 'dspark.num_experts_per_tok': 2})
  return cfg, Programs(model, DSpark(cfg.model, cfg.dspark, nnx.Rngs(params=1)), None)


@pytest.fixture(scope='module')
def drafting():
  return _drafting()


def _oracle_drafter(table_bl, vocab):
  """`programs.draft_block` as an oracle reading the true continuation table_bl [B, L] (the
  prompt, then plain greedy's tokens): right but for slot length % 4 (none when that is 3),
  so that verifications accept 0, 1, 2 or all 3 drafts. Traceable, for both loops."""
  real_draft = programs.draft_block
  table = jnp.asarray(table_bl)

  def oracle(model, dspark, cache, anchor_b, key, temperature, top_p, k):
    _, _, conf = real_draft(model, dspark, cache, anchor_b, key, temperature, top_p, k)
    length = cache['length'][:, None]
    at = jnp.clip(length + 1 + jnp.arange(k)[None, :], 0, table.shape[1] - 1)
    truth = jnp.take_along_axis(table, at, axis=1)
    wrong = jnp.arange(k)[None, :] == length % 4
    drafts = jnp.where(wrong, (truth + 1) % vocab, truth)
    return drafts, jax.nn.one_hot(drafts, vocab), jnp.ones_like(conf)
  return oracle


def _oracle_runs(prompt_len: int, budget: int):
  """[(first, last) generated token index] of each oracle round (`_oracle_drafter`)."""
  e, runs = 1, []
  while e < budget:
    acc = (prompt_len + e - 1) % 4
    runs.append((e, e + acc))
    e += acc + 1
  return runs


def test_greedy_speculative_decoding_returns_plain_greedy_tokens(drafting, monkeypatch):
  """fp32, prompts of different lengths and budgets: speculative greedy decoding returns plain
  greedy's tokens, one round per dispatch (the host loop, tokens_per_dispatch=1) and, with an
  oracle drafter whose verifications accept 0 to 3 drafts, on the device one round (4 = k + 1)
  or many (32) per dispatch: the same tokens, accepted counts and forwards from both loops, and
  an end-of-document inside an accepted run stops its row there, its budget a run in the
  middle."""
  cfg, progs = drafting
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, 96, n).astype(np.int32) for n in (7, 12, 3)]
  budgets = [14, 9, 11]
  kw = dict(eos_id=None, max_new_tokens=budgets, prefill='full')
  longer = [r.tokens for r in decode_loop(progs, cfg, prompts, **{
      **kw, 'max_new_tokens': [b + 4 for b in budgets]})]  # what the oracle drafts past a budget
  plain = [t[:b] for t, b in zip(longer, budgets)]
  spec = decode_loop(progs, cfg, prompts, speculative=True, verify_cost=0.0,
                     tokens_per_dispatch=1, **kw)  # the device loop: the oracle's below
  assert [r.tokens for r in spec] == plain
  chunked = decode_loop(progs, cfg, prompts, speculative=True, verify_cost=0.0,
                        prefill_chunk=8, **kw)  # the drafter's features written chunk by chunk
  assert [r.tokens for r in chunked] == plain
  shorter = decode_loop(progs, cfg, prompts, speculative=True, verify_cost=0.6,
                        **kw)  # rows admit fewer drafts than the verification holds, or none
  assert [r.tokens for r in shorter] == plain

  table = np.zeros((3, 40), np.int32)
  for b, (p, t) in enumerate(zip(prompts, longer)):
    table[b, :len(p) + len(t)] = list(p) + t
  monkeypatch.setattr(programs, 'draft_block', _oracle_drafter(table, 96))
  oracle = Programs(*nnx.merge(progs.graph, progs.state), None)  # traced with the oracle
  runs, streamed = {}, {}
  for n in (1, 4, 32):
    streamed[n] = [[] for _ in prompts]
    runs[n] = decode_loop(oracle, cfg, prompts, speculative=True, verify_cost=0.0,
                          tokens_per_dispatch=n, **kw,
                          stream=lambda row, new: streamed[n][row].extend(new))
    assert [r.tokens for r in runs[n]] == plain == streamed[n], n
    stats = [(r.accepted_drafts, r.forwards, r.timed_tokens) for r in runs[n]]
    assert stats == [(r.accepted_drafts, r.forwards, r.timed_tokens) for r in runs[1]], n
  assert oracle.traces['speculate'] == 2  # per tokens_per_dispatch: one for every dispatch
  rounds = [_oracle_runs(len(p), b) for p, b in zip(prompts, budgets)]
  assert [r.accepted_drafts for r in runs[1]] == [sum(l - f for f, l in rs) for rs in rounds]
  assert runs[1][0].forwards == max(len(rs) for rs in rounds) < max(budgets) - 1
  # Row 2's budget ends inside a run; the end-of-document: a token of row 0 that first occurs
  # inside an accepted run, not at its end.
  assert rounds[2][-1][1] >= budgets[2]
  eos, at = next((plain[0][i], i) for f, l in rounds[0] for i in range(f, l)
                 if plain[0][i] not in plain[0][:i])
  cut = [t[:t.index(eos)] if eos in t else t for t in plain]
  assert len(cut[0]) == at < budgets[0]
  for n in (1, 4, 32):
    out = decode_loop(oracle, cfg, prompts, speculative=True, verify_cost=0.0,
                      tokens_per_dispatch=n, **{**kw, 'eos_id': eos})
    assert [r.tokens for r in out] == cut, n


def test_sampled_speculative_device_loop_equals_the_host_loop(drafting, monkeypatch):
  """Sampled (temperature and top-p), three rows of different budgets: the device loop's
  rounds split the keys as the host loop's, so both return the same tokens and accepted
  drafts, every draft admitted (verify_cost 0) or the rows' own lengths admitted, some rounds
  none (where the host loop takes a plain step); another seed returns other tokens."""
  cfg, progs = drafting
  plain_steps = []
  real_plain = Programs.plain
  monkeypatch.setattr(Programs, 'plain',
                      lambda self, *a, **k: plain_steps.append(1) or real_plain(self, *a, **k))
  rng = np.random.default_rng(11)
  prompts = [rng.integers(3, 96, n).astype(np.int32) for n in (5, 12, 9)]
  for cost in (0.0, 0.6):
    kw = dict(eos_id=None, max_new_tokens=[10, 7, 12], prefill='full', speculative=True,
              verify_cost=cost, temperature=0.8, top_p=0.9, seed=3)
    plain_steps.clear()
    host = decode_loop(progs, cfg, prompts, tokens_per_dispatch=1, **kw)
    assert sum(r.accepted_drafts for r in host) > 0
    assert (len(plain_steps) > 0) == (cost > 0)
    device = decode_loop(progs, cfg, prompts, tokens_per_dispatch=32, **kw)  # many rounds
    assert [r.tokens for r in device] == [r.tokens for r in host], cost
    assert [(r.accepted_drafts, r.forwards) for r in device] == \
        [(r.accepted_drafts, r.forwards) for r in host], cost
  other = decode_loop(progs, cfg, prompts, tokens_per_dispatch=32, **{**kw, 'seed': 4})
  assert [r.tokens for r in other] != [r.tokens for r in host]


def test_a_fixed_length_verification_rolls_back_exactly(drafting):
  """A verification of all k = 3 drafts of which the rows accept 1 and 2: rolled back to start
  + accepted + 1, the cache decodes and drafts as plain steps over the accepted tokens do. A
  ratio-2 group straddles each row's last accepted and first rejected position (its entry is
  written from a rejected token, its first row kept in the row ring); the rejected positions'
  window slots, ratio-1 entries, features and tokens are written too."""
  cfg, progs = drafting
  model, _ = nnx.merge(progs.graph, progs.state)
  k, v = 3, cfg.model.vocab_size
  spec = CacheSpec(batch=2, max_len=48, max_chunk=k + 1)
  lengths = np.array([7, 12], np.int32)
  prompt = np.random.default_rng(7).integers(3, v, (2, 16)).astype(np.int32)
  prompt = np.where(np.arange(16)[None] < lengths[:, None], prompt, 0)
  last, start = progs.prefill_full(empty_cache(model, spec, cfg.model.d_model),
                                   jnp.asarray(prompt), jnp.asarray(lengths), True)
  seq, steps = [np.asarray(jnp.argmax(last, -1), np.int32)], [start]
  for _ in range(3):  # plain greedy steps: steps[i] holds i tokens after the prompt
    tok, cache = progs.plain(steps[-1], jnp.asarray(seq[-1]), jax.random.key(0), 0.0, 1.0, True)
    seq.append(np.asarray(tok))
    steps.append(cache)
  seq = np.stack(seq, 1)
  drafts = seq[:, 1:4].copy()
  drafts[0, 1:] = (drafts[0, 1:] + 1) % v
  drafts[1, 2] = (drafts[1, 2] + 1) % v
  acc, nxt, verified = progs.verify(start, jnp.asarray(seq[:, 0]), jnp.asarray(drafts),
                                    jax.nn.one_hot(drafts, v), jnp.asarray([k, k]),
                                    jax.random.key(0), 0.0, 1.0)
  assert np.asarray(acc).tolist() == [1, 2]
  assert np.asarray(nxt).tolist() == [seq[0, 2], seq[1, 3]]
  # The plain reference: row 0 after 2 steps, row 1 after 3 (rows are independent).
  ref = jax.tree.map(lambda a, b: a.at[1].set(b[1]), steps[2], steps[3])
  np.testing.assert_array_equal(np.asarray(verified['length']), np.asarray(ref['length']))
  got = progs.draft(verified, nxt, jax.random.key(1), 0.0, 1.0, k)
  want = progs.draft(ref, nxt, jax.random.key(1), 0.0, 1.0, k)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-4, atol=1e-5)
  tok = np.asarray(nxt)[:, None]
  for _ in range(5):
    logits, verified = _chunk(model, verified, jnp.asarray(tok), jnp.ones((2, 1), bool))
    logits_ref, ref = _chunk(model, ref, jnp.asarray(tok), jnp.ones((2, 1), bool))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), rtol=2e-4, atol=2e-4)
    tok = np.asarray(jnp.argmax(logits_ref, -1), np.int32)


def test_rejection_sampling_returns_the_target_distribution():
  """Monte-Carlo over 200K rows: the first token out of a verification is distributed as p_0,
  and the second, given the first draft was accepted, as p_1."""
  v, n = 6, 200_000
  rng = np.random.default_rng(6)
  p = jnp.asarray(rng.dirichlet(np.ones(v), 3), jnp.float32)  # p_0, p_1, p_2
  q = jnp.asarray(rng.dirichlet(np.ones(v), 2), jnp.float32)  # the drafts' q_1, q_2
  kd, kv = jax.random.split(jax.random.key(0))
  drafts = jax.random.categorical(kd, jnp.log(q)[None].repeat(n, 0))
  acc, nxt = jax.jit(sampling.verify, static_argnums=5)(
      kv, jnp.broadcast_to(p, (n, 3, v)), jnp.broadcast_to(q, (n, 2, v)), drafts,
      jnp.full((n,), 2), False)
  acc, nxt, drafts = np.asarray(acc), np.asarray(nxt), np.asarray(drafts)
  first = np.where(acc >= 1, drafts[:, 0], nxt)
  freq = np.bincount(first, minlength=v) / n
  assert np.abs(freq - np.asarray(p[0])).sum() < 0.01
  ok = acc >= 1
  second = np.where(acc[ok] >= 2, drafts[ok, 1], nxt[ok])
  freq = np.bincount(second, minlength=v) / ok.sum()
  assert np.abs(freq - np.asarray(p[1])).sum() < 0.02
  assert 0.2 < ok.mean() < 0.9  # both branches exercised


def test_sampled_speculative_decoding_matches_the_model(toy8):
  """3,000 rows of the toy model decoding 4 tokens speculatively on the device (the first
  dispatch one round, the second the rest, rows at their own positions): the second to fourth
  generated tokens are distributed as their exact marginals from full forwards."""
  cfg, progs, exact = toy8
  n = 3000
  out = decode_loop(progs, cfg, [TOY_PROMPT] * n, eos_id=None, max_new_tokens=4,
                    temperature=1.0, speculative=True, verify_cost=0.0, prefill='full', seed=1,
                    tokens_per_dispatch=8)
  assert sum(r.accepted_drafts for r in out) > 100  # drafts were accepted, not only resampled
  for step in (1, 2, 3):
    freq = np.bincount([r.tokens[step] for r in out], minlength=8) / n
    assert np.abs(freq - exact[step]).sum() < 0.06, step


def test_verify_length_admits_while_the_rate_rises():
  conf = jnp.array([[0.9, 0.9, 0.1], [0.1, 0.9, 0.9], [0.99, 0.99, 0.99]])
  assert np.asarray(sampling.verify_length(conf, 0.2)).tolist() == [2, 0, 3]
  assert np.asarray(sampling.verify_length(conf, 0.0)).tolist() == [3, 3, 3]


def test_image_prompts_decode_like_the_full_forward():
  """A prompt with an image span (laid out as training lays it out): prefill, full or CED, and
  decoding after it equal the full forward over the same sequence."""
  from deepseek41.data.multimodal import build_document
  from deepseek41.generate.generator import image_fields
  vision = {'model.vision': True, 'model.vision_layers': 1, 'model.vision_dim': 16,
            'model.vision_heads': 2, 'model.vision_mlp': 16, 'model.vision_patch': 2,
            'model.vision_max_image_tokens': 4, 'model.image_token_id': 5,
            'data.max_images_per_row': 2}
  cfg, model = _model(**vision)
  rng = np.random.default_rng(8)
  image = rng.integers(0, 256, (12, 10, 3)).astype(np.uint8)
  encode = lambda text: [6 + ord(c) % 80 for c in text]  # noqa: E731
  doc = build_document([{'text': 'a prompt'}, {'image': image}, {'text': 'and more'}], encode, 1,
                       cfg.data.images, 'test')
  prompt = doc.tokens[:-1]
  n = len(prompt)
  seq = np.concatenate([prompt, rng.integers(6, 96, 4).astype(np.int32)])[None]
  fields = image_fields(cfg, [doc], len(seq[0]))
  batch = {'tokens': seq, 'segment_ids': np.ones_like(seq), 'modality':
           (fields['image_role'] != 0).astype(np.int32),
           'positions': np.arange(seq.shape[1], dtype=np.int32)[None], **fields}
  full = np.asarray(nnx.jit(lambda m, b: m(b)[0])(model, batch))[0]
  spec = CacheSpec(batch=1, max_len=48, max_chunk=1)
  images = jax.tree.map(jnp.asarray, image_fields(cfg, [doc], n))
  lengths = jnp.asarray([n], jnp.int32)

  @nnx.jit
  def prefill_full(m, tokens):
    logits, _, cache = forward_chunk(m, empty_cache(m, spec), tokens,
                                     jnp.ones(tokens.shape, bool), images=images)
    return logits[:, -1], cache

  @nnx.jit
  def prefill_ced(m, tokens):
    logits, _, cache = ced_prefill(m, empty_cache(m, spec), tokens, lengths, n,
                                   images=images)
    return logits[:, -1], cache
  for prefill in (prefill_full, prefill_ced):
    last, cache = prefill(model, jnp.asarray(prompt[None]))
    np.testing.assert_allclose(np.asarray(last)[0], full[n - 1], rtol=2e-4, atol=2e-4)
    for pos in range(n, n + 3):
      logits, cache = _chunk(model, cache, jnp.asarray(seq[:, pos:pos + 1]), jnp.ones((1, 1), bool))
      np.testing.assert_allclose(np.asarray(logits)[0, 0], full[pos], rtol=2e-4, atol=2e-4)


def _dtypes(state):
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  return {jax.tree_util.keystr(p): x.dtype for p, x in leaves}


def test_weights_read_only_in_bf16_are_cast_once_and_decode_the_same():
  """bf16 compute, with a DSpark drafter: Programs holds in bf16 every weight that generation
  reads only cast to bf16 (cast at load, not at every step; weight_reads.py; the probes cover
  the drafter's features and drafts) and every other parameter as trained. The logits are those
  of the state as trained, bit for bit, and speculative decoding returns its tokens and
  acceptances."""
  extra = {'model.compute_dtype': 'bfloat16', 'dspark.num_blocks': 1, 'dspark.block_size': 3,
           'dspark.target_layer_ids': (2, 3), 'dspark.markov_rank': 8,
           'dspark.n_routed_experts': 4, 'dspark.num_experts_per_tok': 2}

  def build(cast_weights):
    cfg, model = _model(**extra)
    return cfg, model, Programs(model, DSpark(cfg.model, cfg.dspark, nnx.Rngs(params=1)), None,
                                cast_weights=cast_weights)
  cfg, model, progs = build(True)
  dtypes = _dtypes(progs.state)
  cast = {k for k, d in dtypes.items() if d == jnp.bfloat16}
  for layer in range(cfg.model.num_layers):
    for name in ("['attn']['wq_a']", "['attn']['wo_b']", "['moe']['w_gate']", "['moe']['w_down']",
                 "['moe']['shared_up']"):
      assert f"[0]['blocks'][{layer}]{name}.value" in cast
  assert "[0]['head'].value" in cast
  assert any(k.startswith('[1]') for k in cast)  # the drafter's weights too
  kept = [k for k in dtypes if any(s in k for s in ('norm', 'router', '_site', "['embed']"))]
  assert kept and not cast & set(kept)  # fp32 reads: RMSNorm scales, the router, mHC, a gather
  assert all(d == jnp.float32 for k, d in dtypes.items() if k not in cast)
  # the caller's model holds the same cast arrays: one copy on the device, not two
  assert model.blocks[0].moe.w_gate[...].dtype == jnp.bfloat16
  assert model.blocks[0].attn.wq_a[...].dtype == jnp.bfloat16

  _, _, as_trained = build(False)  # the same weights, uncast
  assert set(_dtypes(as_trained.state).values()) == {jnp.dtype(jnp.float32)}
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(3, 96, (2, 9)), jnp.int32)

  @jax.jit
  def logits(state):
    model, _ = nnx.merge(progs.graph, state)
    return forward_chunk(model, empty_cache(model, dataclasses.replace(SPEC, max_chunk=9)), tokens,
                         jnp.ones(tokens.shape, bool))[0]
  np.testing.assert_array_equal(np.asarray(logits(progs.state)),
                                np.asarray(logits(as_trained.state)))
  prompts = [np.arange(3, 3 + n, dtype=np.int32) for n in (7, 12)]
  kw = dict(max_new_tokens=9, seed=3, eos_id=None, tokens_per_dispatch=6, speculative=True,
            temperature=0.0)
  runs, plain = decode_loop(progs, cfg, prompts, **kw), decode_loop(as_trained, cfg, prompts, **kw)
  assert _tokens(runs) == _tokens(plain)
  assert [r.accepted_drafts for r in runs] == [r.accepted_drafts for r in plain]
