"""Generation measured on a trained checkpoint (docs/performance.md section 15).

    python benchmarks/bench_generate.py --workdir=/tmp/gen --batch_sizes=1,32 --out=$OUT/gen.json

For each batch size: plain greedy decoding at each --tokens_per_dispatch (`b<B>_plain_n<N>`:
N decode steps per dispatch to the device; 1 is the one-step loop, a host round trip per
token), then speculative decoding (DSpark drafts, greedy verification) at each
--speculative_per_dispatch (`b<B>_speculative_n<N>`: 1 is the host loop, a draft and a
verification of the longest admitted row per round trip; N > 1 runs rounds on the device, each
verification of fixed shape, up to N tokens a row per dispatch), each run twice with the same
shapes and the second one timed (tokens/s after compilation, summed over the batch's rows); the
share of tokens where speculative and plain agree, the drafts accepted per verification, and
its speed against each plain. Then the
global cache's bytes per token, the bounded-replay KL on held-out sequences, and the compiled
FLOPs of one plain decode step against the context length. Prompts are the first
--prompt_tokens (+-25%) tokens of the interpreter's standard-library sources, one file per row.
Phases past --deadline_s seconds are skipped; the JSON is rewritten after every phase.

With --contexts (e.g. 4096,65536,262144,1048576) only the long-context phase runs: batch 1, a
prompt of random token ids exactly that long, prefilled --context_prefill_chunk positions per
dispatch through each of --context_prefills (ced, full), then --new_tokens greedy tokens at
--tokens_per_dispatch's largest; each context's prefill tokens/s, decode tokens/s and the
device's memory in use after it (`ctx<L>_<prefill>`). The checkpoint's model must have the
positions (`model.yarn_factor` x `model.yarn_original_max_position`).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKDIR = flags.DEFINE_string('workdir', None, 'A DSpark-stage (or pretraining) work directory.')
_BATCHES = flags.DEFINE_list('batch_sizes', ['1', '32'], 'Batch sizes.')
_PROMPT = flags.DEFINE_integer('prompt_tokens', 512, 'Mean prompt length.')
_NEW = flags.DEFINE_integer('new_tokens', 128, 'Tokens generated per row.')
_PER_DISPATCH = flags.DEFINE_list('tokens_per_dispatch', ['1', '32'],
                                  'Plain decoding steps per dispatch, one run each.')
_SPEC_PER_DISPATCH = flags.DEFINE_list(
    'speculative_per_dispatch', ['1', '32'],
    'Speculative decoding\'s tokens per dispatch (1: the host loop), one run each.')
_REPLAY_CONTEXT = flags.DEFINE_integer('replay_context', 2048, 'Held-out sequence length.')
_REPLAY_WINS = flags.DEFINE_list('replay_n_win', ['128', '512'], 'Replay lengths (+ the exact one).')
_REPLAY_SEQS = flags.DEFINE_integer('replay_sequences', 32, 'Held-out sequences (0: no replay).')
_FLOP_CONTEXTS = flags.DEFINE_list('flop_contexts', ['4096', '65536'], 'Decode FLOPs at these.')
_DEADLINE = flags.DEFINE_float('deadline_s', 1e9, 'Skip phases that start later than this.')
_OUT = flags.DEFINE_string('out', '/tmp/bench_generate.json', 'Result JSON.')
_PROFILE = flags.DEFINE_string(
    'profile_dir', '', 'After each timed mode at the first batch size, one more run under '
    'jax.profiler.trace(DIR/b<B>_<mode>) (benchmarks/trace_summary.py reads it); with '
    '--contexts, one more run at each, traced after its first dispatch (DIR/ctx<L>_<prefill>).')
_CONTEXTS = flags.DEFINE_list('contexts', [], 'Long-context phase only: prompt lengths.')
_EXECUTION = flags.DEFINE_list('execution', [], 'Execution-only model keys to override, '
                               'KEY=VALUE,... (python -m deepseek41.generate --execution).')
_CONTEXT_PREFILLS = flags.DEFINE_list('context_prefills', ['ced', 'full'],
                                      'Long-context phase: the prefill paths.')
_CONTEXT_CHUNK = flags.DEFINE_integer('context_prefill_chunk', 65536,
                                      'Long-context phase: prompt positions per prefill dispatch.')


def stdlib_prompts(tokenizer, count: int, mean_len: int) -> list[np.ndarray]:
  files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), '*.py')))
  rng = np.random.default_rng(0)
  out = []
  for path in files:
    ids = tokenizer.hf.encode(open(path, encoding='utf-8', errors='replace').read()[:20 * mean_len],
                              add_special_tokens=False).ids
    want = int(mean_len * rng.uniform(0.75, 1.25))
    if len(ids) >= want:
      out.append(np.asarray(ids[:want], np.int32))
    if len(out) == count:
      return out
  raise SystemExit(f'only {len(out)} standard-library files have {mean_len} tokens')


def main(argv):
  del argv
  from deepseek41.generate.cache import empty_cache, global_bytes_per_token
  from deepseek41.generate.generator import Generator, decode_loop, execution_overrides
  from deepseek41.generate.replay import exact_replay_window, held_out_sequences, next_token_kl
  from deepseek41.model.layer_cache import CacheSpec
  from deepseek41.tools.info import kv_cache_bytes
  start = time.perf_counter()
  result = {'device': str(jax.devices()[0].device_kind)}

  def save():
    with open(_OUT.value, 'w') as f:
      json.dump(result, f, indent=1)

  def time_left(phase):
    if time.perf_counter() - start > _DEADLINE.value:
      result.setdefault('skipped', []).append(phase)
      save()
      return False
    return True

  t0 = time.perf_counter()
  gen = Generator(_WORKDIR.value, execution=execution_overrides(_EXECUTION.value))
  result['execution'] = _EXECUTION.value
  result['restore_s'] = time.perf_counter() - t0
  result['step'] = gen.step
  cfg = gen.cfg
  if _CONTEXTS.value:
    long_contexts(gen, result, save, time_left)
    return
  speculative = gen.dspark is not None
  for b in (int(x) for x in _BATCHES.value):
    prompts = stdlib_prompts(gen.tokenizer, b, _PROMPT.value)
    plains = [f'plain_n{n}' for n in _PER_DISPATCH.value]
    specs = [f'speculative_n{n}' for n in _SPEC_PER_DISPATCH.value] if speculative else []
    for mode in plains + specs:
      if not time_left(f'b{b}_{mode}'):
        continue
      n = int(mode.rsplit('_n', 1)[1])
      kw = dict(eos_id=None, max_new_tokens=_NEW.value, temperature=0.0,
                speculative=mode in specs, verify_cost=0.0, tokens_per_dispatch=n)
      with jax.set_mesh(gen.mesh):
        t1 = time.perf_counter()
        decode_loop(gen._programs, cfg, prompts, **kw)  # compiles
        compile_s = time.perf_counter() - t1
        runs = decode_loop(gen._programs, cfg, prompts, **kw)
        if _PROFILE.value and b == int(_BATCHES.value[0]):
          with jax.profiler.trace(os.path.join(_PROFILE.value, f'b{b}_{mode}')):
            decode_loop(gen._programs, cfg, prompts, **kw)
      decode_s = runs[0].decode_s
      row = {'tokens_per_s': sum(r.timed_tokens for r in runs) / decode_s,
             'decode_s': decode_s, 'forwards': runs[0].forwards,
             'first_run_s': compile_s, 'prefill_s': runs[0].prefill_s,
             'tokens_per_dispatch': n,
             'tokens': [r.tokens for r in runs]}
      if mode in specs:
        row['accepted_per_verify'] = float(np.mean([r.accepted_drafts for r in runs])) / \
            max(runs[0].forwards, 1)
        timed = [result[f'b{b}_{p}'] for p in plains if f'b{b}_{p}' in result]
        if timed:  # every plain run returns the same greedy tokens
          same = [sum(x == y for x, y in zip(p, s)) / len(p)
                  for p, s in zip(timed[0]['tokens'], row['tokens'])]
          row['greedy_agreement'] = float(np.mean(same))
        for plain in timed:
          row[f'speedup_vs_n{plain["tokens_per_dispatch"]}'] = \
              row['tokens_per_s'] / plain['tokens_per_s']
      result[f'b{b}_{mode}'] = row
      print(mode, b, {k: v for k, v in row.items() if k != 'tokens'}, flush=True)
      save()

  spec = CacheSpec(batch=1, max_len=4096, max_chunk=1)
  shapes = jax.eval_shape(lambda: empty_cache(gen.model, spec))
  result['global_bytes_per_token'] = global_bytes_per_token(shapes, spec)
  result['info_global_bytes_per_token'] = kv_cache_bytes(cfg)['global_bytes_per_token']
  save()

  if _REPLAY_SEQS.value and time_left('replay'):
    wins = sorted({int(w) for w in _REPLAY_WINS.value} | {exact_replay_window(cfg.model)})
    wins = [w for w in wins if w <= _REPLAY_CONTEXT.value]
    tokens = held_out_sequences(gen.data_cfg, gen.tokenizer, _REPLAY_CONTEXT.value,
                                _REPLAY_SEQS.value)
    with jax.set_mesh(gen.mesh):
      result['replay'] = {str(w): r for w, r in next_token_kl(
          gen.model, cfg, tokens, wins, engram_map=gen.engram_map).items()}
    print('replay', result['replay'], flush=True)
    save()

  for context in (int(x) for x in _FLOP_CONTEXTS.value):
    if not time_left(f'flops_{context}'):
      continue
    spec = CacheSpec(batch=1, max_len=context + 8, max_chunk=1)
    cache = jax.eval_shape(lambda: empty_cache(gen.model, spec))
    cache['length'] = jax.ShapeDtypeStruct((1,), jnp.int32)
    progs = gen._programs
    fn = progs._compiled('plain', None, ('temperature', 'top_p', 'features')) \
        if 'plain' in progs._jit else None
    if fn is None:
      continue
    compiled = fn.lower(progs.state, cache, jax.ShapeDtypeStruct((1,), jnp.int32),
                        jax.random.key(0), temperature=0.0, top_p=1.0,
                        features=False).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    result[f'decode_flops_{context}'] = float(cost.get('flops', float('nan')))
    print('flops', context, result[f'decode_flops_{context}'], flush=True)
    save()
  result['total_s'] = time.perf_counter() - start
  save()


def device_memory_gb() -> dict[str, float]:
  stats = jax.devices()[0].memory_stats() or {}
  return {k + '_gb': stats[k] / 2**30 for k in ('bytes_in_use', 'peak_bytes_in_use')
          if k in stats}


def long_contexts(gen, result, save, time_left):
  """Prefill and decode speed at each of --contexts, batch 1 (module docstring)."""
  from deepseek41.generate.generator import decode_loop
  n = max(int(x) for x in _PER_DISPATCH.value)
  rng = np.random.default_rng(0)
  for context in (int(x) for x in _CONTEXTS.value):
    prompt = rng.integers(3, gen.cfg.model.vocab_size, context).astype(np.int32)
    for prefill in _CONTEXT_PREFILLS.value:
      name = f'ctx{context}_{prefill}'
      if not time_left(name):
        continue
      kw = dict(eos_id=None, max_new_tokens=_NEW.value, temperature=0.0, prefill=prefill,
                prefill_chunk=_CONTEXT_CHUNK.value, tokens_per_dispatch=n)
      try:
        with jax.set_mesh(gen.mesh):
          t1 = time.perf_counter()
          decode_loop(gen._programs, gen.cfg, [prompt], **kw)  # compiles
          first_s = time.perf_counter() - t1
          [run] = decode_loop(gen._programs, gen.cfg, [prompt], **kw)
      except Exception as e:  # noqa: BLE001 - out of memory at one length: record, go on
        result[name] = {'error': f'{type(e).__name__}: {str(e)[:300]}'}
        print(name, result[name], flush=True)
        save()
        continue
      if _PROFILE.value:
        profile_decoding(gen, prompt, kw, os.path.join(_PROFILE.value, name))
      row = {'context': context, 'prefill': prefill, 'first_run_s': first_s,
             'prefill_s': run.prefill_s, 'prefill_tokens_per_s': context / run.prefill_s,
             'decode_tokens_per_s': run.timed_tokens / run.decode_s if run.decode_s else None,
             'tokens_per_dispatch': n, **device_memory_gb()}
      result[name] = row
      print(name, row, flush=True)
      save()


def profile_decoding(gen, prompt, kw, trace_dir):
  """One more run, traced from its first streamed tokens on: the dispatches after the first,
  without the prefill (at 1M tokens of context the prefill is 10,000 times a dispatch)."""
  from deepseek41.generate.generator import decode_loop
  tracing = []

  def start_after_first_dispatch(row, new):
    if not tracing:
      jax.profiler.start_trace(trace_dir)
      tracing.append(True)
  with jax.set_mesh(gen.mesh):
    decode_loop(gen._programs, gen.cfg, [prompt], stream=start_after_first_dispatch, **kw)
  if tracing:
    jax.profiler.stop_trace()


if __name__ == '__main__':
  app.run(main)
