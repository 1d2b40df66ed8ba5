"""The indexer's selected-entry scores (its training signal): the kernel vs the jnp chunks.

Usage (GPU):
    python benchmarks/bench_selected_scores.py --out selected.jsonl
    python benchmarks/bench_selected_scores.py --block_k 32,64,128 --num_warps 4,8   # tiles

Shapes of configs/ablation_1b.py at 8 x 4,096 tokens: 16 index heads x 128, top-512 of a
ratio-1 (N = T) or ratio-2 (N = T / 2) source, selections as benchmarks/bench_sparse_kernel.py
draws them. `reference` is ops/selected_scores.py's jnp path in chunks of `--chunk` queries, as
the model runs it (recomputed in the backward). Check: at 1,024 queries the kernel's scores and
gradients against the reference's, both on bf16 inputs.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from bench_sparse_kernel import selection  # noqa: E402  (benchmarks/)
from timing import jsonl_emitter, time_fn  # noqa: E402
from deepseek41.ops.gpu.selected_scores import selected_scores_fused  # noqa: E402
from deepseek41.ops.selected_scores import selected_scores_reference  # noqa: E402


def make_inputs(seed, b, t, h, c, ratio, k, dtype):
  n = t // ratio
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, t, h, c), dtype)
  w = jax.random.normal(ks[1], (b, t, h), jnp.float32)
  keys = jax.random.normal(ks[2], (b, n, c), dtype)
  idx, valid = selection(ks[3], t, n, k, ratio)
  ct = jax.random.normal(ks[4], (b, t, k), jnp.float32)
  return q, w, keys, jnp.repeat(idx, b, 0), jnp.repeat(valid, b, 0), ct


def scorer(impl, chunk, tiles, interpret=False):
  if impl == 'fused':
    return lambda q, w, k, idx, valid: selected_scores_fused(
        q, w, k, idx, valid, block_k=tiles[0], num_warps=tiles[1], interpret=interpret)
  return lambda q, w, k, idx, valid: selected_scores_reference(q, w, k, idx, valid, chunk)


def grads_fn(fn):
  def step(q, w, keys, idx, valid, ct):
    return jax.grad(lambda q, w, keys: jnp.sum(fn(q, w, keys, idx, valid) * ct),
                    argnums=(0, 1, 2))(q, w, keys)
  return step


def check(chunk, tiles, t=1024, interpret=False):
  args32 = make_inputs(7, 2, t, 16, 128, 1, 512, jnp.float32)
  q, w, keys, idx, valid, ct = args32
  args16 = (q.astype(jnp.bfloat16), w, keys.astype(jnp.bfloat16), idx, valid, ct)
  # Against the reference on the same bf16 inputs: where a dot product is near 0, bf16 rounding
  # of q and k flips relu's gradient mask, which no kernel can avoid.
  ref = scorer('reference', chunk, None)
  want = [jax.jit(ref)(*args16[:5]), *jax.jit(grads_fn(ref))(*args16)]
  fused = scorer('fused', chunk, tiles, interpret)
  got = [jax.jit(fused)(*args16[:5]), *jax.jit(grads_fn(fused))(*args16)]
  errs = {}
  for name, a, b in zip(('scores', 'dq', 'dw', 'dk'), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    errs[name] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
  return {'check': 'bf16 kernel vs the bf16 reference', 'tiles': tiles, 'rel_err': errs,
          'ok': all(e < 2e-2 for e in errs.values())}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--seq_len', type=int, default=4096)
  p.add_argument('--ratios', default='1,2')
  p.add_argument('--topk', type=int, default=512)
  p.add_argument('--heads', type=int, default=16)
  p.add_argument('--dim', type=int, default=128)
  p.add_argument('--chunk', type=int, default=1024)
  p.add_argument('--block_k', default='64', help='fused tile sweep: keys gathered per step')
  p.add_argument('--num_warps', default='4', help='fused tile sweep: warps per program')
  p.add_argument('--modes', default='fwd,fwd_bwd')
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--no-check', dest='check', action='store_false')
  p.add_argument('--interpret', action='store_true',
                 help='CPU smoke run: the kernel in the Pallas interpreter (use small shapes)')
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  tiles = [(bk, nw) for bk in map(int, args.block_k.split(','))
           for nw in map(int, args.num_warps.split(','))]
  if args.check:
    for t in tiles:
      emit(check(args.chunk, t, min(1024, args.seq_len), args.interpret))
  b, t, h, c, k = args.batch, args.seq_len, args.heads, args.dim, args.topk
  for ratio in map(int, args.ratios.split(',')):
    valid_slots = float(jnp.sum(make_inputs(0, 1, t, h, c, ratio, k, jnp.bfloat16)[4])) * b
    for impl, tile in [('reference', None)] + [('fused', x) for x in tiles]:
      fn = scorer(impl, args.chunk, tile, args.interpret)
      for mode in args.modes.split(','):
        run = jax.jit(grads_fn(fn) if mode == 'fwd_bwd' else
                      (lambda q, w, keys, idx, valid, ct, fn=fn: fn(q, w, keys, idx, valid)))
        try:
          ms, compile_s = time_fn(run, lambda s: make_inputs(s, b, t, h, c, ratio, k,
                                                             jnp.bfloat16), args.reps)
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
          emit({'ratio': ratio, 'impl': impl, 'tiles': tile, 'mode': mode,
                'error': f'{type(e).__name__}: {str(e)[:300]}'})
          continue
        emit({'ratio': ratio, 'impl': impl, 'tiles': tile, 'mode': mode, 'b': b, 't': t,
              'valid_slots': valid_slots, 'ms': round(ms, 3), 'compile_s': round(compile_s, 1)})


if __name__ == '__main__':
  main()
