"""The window branch's forward: the Mosaic GPU kernel (ops/gpu/window_mgpu.py) against the Pallas
Triton one (`window_kernel.window_partial_fused`'s forward), timed and checked against each other.

Usage (an H100 / H200; `--smoke` runs tiny shapes in the interpreters on the CPU):
    python benchmarks/bench_window_mgpu.py --out window_mgpu.jsonl
    python benchmarks/bench_window_mgpu.py --cases 1b --shapes 8x4096 --stages 1,2

Cases: `1b` = configs/ablation_1b.py's 16 heads x 512, `v41` = the released model's 64 heads x
512; shapes are BxT (default 8x4096 and 1x65536), window 128, bf16. Each row holds documents of
`--doc_len` tokens (the last one cut short), so both kernels mask document starts. Timing: ms per
call of calls queued back to back (timing.time_queued: the kernels are sub-millisecond), after a
compile; `tflops` counts the useful work, 4 * d FLOPs per (query, head, visible key). Check: the
largest |o| and |lse| differences between the two kernels (lse over rows that see something; the
rows that see nothing must agree).
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
from timing import (agreement, jsonl_emitter, print_against_first,  # noqa: E402
                    time_queued)  # benchmarks/timing.py
from deepseek41.ops.gpu.window_kernel import window_partial_fused  # noqa: E402
from deepseek41.ops.gpu.window_mgpu import window_forward_mgpu  # noqa: E402

CASES = {'1b': dict(h=16, d=512), 'v41': dict(h=64, d=512)}


def inputs(b, t, h, d, doc_len, seed=0):
  kq, kk = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
  kv = jax.random.normal(kk, (b, t, d), jnp.bfloat16)
  seg = (jnp.arange(t, dtype=jnp.int32) // doc_len + 1)[None].repeat(b, 0)
  return q, kv, seg


def visible_keys(seg, window):
  """Sum over queries of their visible keys (host numpy; documents contiguous)."""
  seg = np.asarray(seg)
  b, t = seg.shape
  pos = np.arange(t)
  total = 0
  for row in seg:
    start = np.zeros(t, np.int64)  # first position of each query's document
    new = np.concatenate([[True], row[1:] != row[:-1]])
    start[new] = pos[new]
    start = np.maximum.accumulate(start)
    total += int(np.sum(np.where(row != 0, pos - np.maximum(start, pos - window + 1) + 1, 0)))
  return total


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='1b,v41')
  p.add_argument('--shapes', default='8x4096,1x65536', help='BxT, comma separated')
  p.add_argument('--window', type=int, default=128)
  p.add_argument('--doc_len', type=int, default=3000)
  p.add_argument('--stages', default='2', help="the Mosaic kernel's key stages to try")
  p.add_argument('--reps', type=int, default=20)
  p.add_argument('--smoke', action='store_true', help='tiny shapes in the interpreters (CPU)')
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  interpret = True if args.smoke else None  # None: compiled on the GPU (ops/launch.py)
  shapes = ([(1, 48)] if args.smoke else
            [tuple(int(v) for v in s.split('x')) for s in args.shapes.split(',')])
  reps = 1 if args.smoke else args.reps
  doc_len = 29 if args.smoke else args.doc_len
  window = args.window
  rows = []
  for case in args.cases.split(','):
    h, d = CASES[case]['h'], 128 if args.smoke else CASES[case]['d']
    for b, t in shapes:
      q, kv, seg = inputs(b, t, h, d, doc_len)
      flops = 4.0 * d * h * visible_keys(seg, window)
      triton = jax.jit(lambda q, kv, seg: window_partial_fused(q, kv, seg, window=window,
                                                               interpret=interpret))
      o_ref, lse_ref = jax.block_until_ready(triton(q, kv, seg))
      base = {'case': case, 'b': b, 't': t, 'h': h, 'd': d, 'window': window,
              'device': jax.devices()[0].device_kind}
      ms = time_queued(triton, (q, kv, seg), reps)
      rec = dict(base, kernel='triton', ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
      emit(rec)
      rows.append(rec)
      for stages in (int(v) for v in args.stages.split(',')):
        mgpu = jax.jit(lambda q, kv, seg, stages=stages: window_forward_mgpu(
            q, kv, seg, window=window, stages=stages, interpret=interpret))
        o, lse = jax.block_until_ready(mgpu(q, kv, seg))
        ms = time_queued(mgpu, (q, kv, seg), reps)
        rec = dict(base, kernel=f'mosaic_s{stages}', ms=round(ms, 4),
                   tflops=round(flops / ms / 1e9, 1), **agreement(o, lse, o_ref, lse_ref))
        emit(rec)
        rows.append(rec)
  print_against_first(rows, ('case', 'b', 't'))  # the first of each case: Triton's


if __name__ == '__main__':
  main()
