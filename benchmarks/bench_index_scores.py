"""The fused indexer-score kernel against the jnp reference on one device: accuracy and time.

Usage (GPU):  python benchmarks/bench_index_scores.py [--out scores.jsonl]

One query chunk as the model runs it (B=1, `--chunk` queries, 32 index heads x 128, bf16 q and
k, fp32 head weights) against N compressed entries. Reported: max |fused - reference| over
visible entries relative to max |reference|, and median ms of each (benchmarks/timing.py).
The chunk sits at the end of the sequence, so every key tile is visible (no causal skipping).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import time_fn  # noqa: E402
from deepseek41.ops.gpu.index_scores import index_scores_fused  # noqa: E402
from deepseek41.ops.index_scores import index_scores_reference as index_scores  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--chunk', type=int, default=1024)
  p.add_argument('--entries', default='8192,32768,65536')
  p.add_argument('--heads', type=int, default=32)
  p.add_argument('--dim', type=int, default=128)
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--out')
  args = p.parse_args(argv)
  for n in (int(x) for x in args.entries.split(',')):
    def make_args(rep, n=n):
      kq, kw, kk = jax.random.split(jax.random.fold_in(jax.random.key(0), rep), 3)
      q = jax.random.normal(kq, (1, args.chunk, args.heads, args.dim), jnp.bfloat16)
      w = jax.random.normal(kw, (1, args.chunk, args.heads), jnp.float32)
      k = jax.random.normal(kk, (1, n, args.dim), jnp.bfloat16)
      return q, w, k
    limit = jnp.full((1, args.chunk), n, jnp.int32)
    fused = jax.jit(lambda q, w, k: index_scores_fused(q, w, k, limit))
    reference = jax.jit(index_scores)
    q, w, k = make_args(99)
    ref = reference(q, w, k)
    err = float(jnp.max(jnp.abs(fused(q, w, k) - ref)) / jnp.max(jnp.abs(ref)))
    fused_ms, _ = time_fn(fused, make_args, args.reps)
    ref_ms, _ = time_fn(reference, make_args, args.reps)
    flops = 2 * args.chunk * n * args.heads * args.dim
    row = dict(case='index_scores', chunk=args.chunk, entries=n, heads=args.heads,
               dim=args.dim, rel_err=err, fused_ms=fused_ms, reference_ms=ref_ms,
               fused_tflops=flops / fused_ms / 1e9, reference_tflops=flops / ref_ms / 1e9,
               date=datetime.datetime.now().isoformat(timespec='seconds'),
               device=str(jax.devices()[0].device_kind), command=' '.join(sys.argv))
    print(json.dumps(row), flush=True)
    if args.out:
      with open(args.out, 'a') as fh:
        fh.write(json.dumps(row) + '\n')


if __name__ == '__main__':
  main()
