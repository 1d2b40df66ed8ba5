"""The image-span branch alone (ops/span_attention.py `gathered`): forward + backward time and
the compiled program's temporary bytes, whole spans kept (`span_chunk=0`) against chunks
recomputed in the backward.

Usage (GPU):
    python benchmarks/bench_span.py --chunks 0,512,256 --out span.jsonl

Cases: `1b_mm` = benchmarks/gpu_multimodal.sh's batch (4 rows of 4,096, 16 image slots of 134
positions, 16 heads x 512) and `v41_mm` = the released model's per-device multimodal batch on
fsdp 16 x expert 8 x tensor 2 (1 row of 4,096, 4 slots padded to 2,051 positions, 32 heads of 64
per tensor shard, x 512), with one 2,051-position image and one 1,000-position image in the row.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from timing import jsonl_emitter, time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops.span_attention import span_partial  # noqa: E402

CASES = {
    '1b_mm': dict(b=4, t=4096, h=16, d=512, slots=16, max_span=134, spans=[134] * 16),
    'v41_mm': dict(b=1, t=4096, h=32, d=512, slots=4, max_span=2051, spans=[2051, 1000]),
}


def span_ids(case):
  ids, pos = jnp.zeros((case['t'],), jnp.int32), 100
  for n, length in enumerate(case['spans']):
    ids = ids.at[pos:pos + length].set(n + 1)
    pos += length + 90  # a caption between images
  return jnp.broadcast_to(ids, (case['b'], case['t']))


def make_inputs(seed, case):
  ks = jax.random.split(jax.random.key(seed), 3)
  b, t, h, d = case['b'], case['t'], case['h'], case['d']
  return (jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16),
          jax.random.normal(ks[1], (b, t, d), jnp.bfloat16),
          jax.random.normal(ks[2], (b, t, h, d), jnp.float32))


def step_fn(case, chunk):
  ids = span_ids(case)

  def step(q, kv, ct):
    def loss(q, kv):
      o, lse = span_partial(q, kv, ids, num_spans=case['slots'], max_span=case['max_span'],
                            chunk=chunk)
      return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(jnp.where(jnp.isinf(lse), 0, lse))
    return jax.grad(loss, argnums=(0, 1))(q, kv)
  return jax.jit(step)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='1b_mm,v41_mm')
  p.add_argument('--chunks', default='0,512,256')
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  for name in args.cases.split(','):
    case = CASES[name]
    for chunk in map(int, args.chunks.split(',')):
      run = step_fn(case, chunk)
      mem = run.lower(*make_inputs(0, case)).compile().memory_analysis()
      ms, compile_s = time_fn(run, lambda s: make_inputs(s, case), args.reps)
      emit({'case': name, 'span_chunk': chunk, 'fwd_bwd_ms': round(ms, 3),
            'temp_gib': round(mem.temp_size_in_bytes / 2**30, 3) if mem else None,
            'compile_s': round(compile_s, 1)})


if __name__ == '__main__':
  main()
