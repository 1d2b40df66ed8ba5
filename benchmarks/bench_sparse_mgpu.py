"""CSA2's sparse forward over selected latent rows: the Mosaic GPU kernel (ops/gpu/sparse_mgpu.py)
against the Pallas Triton one (`sparse_kernel.sparse_partial_fused`'s forward, without the slot
mass), timed and checked against each other.

Usage (an H100 / H200; `--smoke` runs tiny shapes in the interpreters on the CPU):
    python benchmarks/bench_sparse_mgpu.py --out sparse_mgpu.jsonl
    python benchmarks/bench_sparse_mgpu.py --cases v41 --shapes 1x16384 --topk 512,1024

Cases: `v41` = the released model's 64 heads x 512 (shapes 1x65536 and 1x16384), `1b` =
configs/ablation_1b.py's 16 heads x 512 (8x4096; the Mosaic kernel pads the heads to 64);
`--shapes` overrides the BxT of every case. N = T/4 entries; K = 512 slots by default. Each
query selects among the entries visible to it ((t + 1) // 4): its K/2 most recent and K/2 drawn
one from each of K/2 equal strata of the older ones (distinct, with locality, as a top-k of the
indexer tends to be); queries that see fewer than K entries take all of them and leave the rest
of their slots invalid. Timing: ms per call of calls queued back to back (timing.time_queued),
after a compile; `tflops` counts the useful work, 4 * d FLOPs per (query, head, valid slot).
Check: the largest |o| and |lse| differences between the two kernels (lse over queries that see
something; the queries that see nothing must agree).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from timing import (agreement, jsonl_emitter, print_against_first,  # noqa: E402
                    time_queued)  # benchmarks/timing.py
from deepseek41.ops.gpu.sparse_kernel import sparse_partial_fused  # noqa: E402
from deepseek41.ops.gpu.sparse_mgpu import sparse_forward_mgpu  # noqa: E402

CASES = {'v41': dict(h=64, d=512, shapes='1x65536,1x16384'),
         '1b': dict(h=16, d=512, shapes='8x4096')}


def local_selection(key, b, t, k, ratio=4):
  """(idx_btk int32, valid_btk bool) as the module docstring describes; entries N = T / ratio."""
  n_vis_t = (jnp.arange(t, dtype=jnp.int32) + 1) // ratio
  half = k // 2
  slot_k = jnp.arange(k, dtype=jnp.int32)
  # recent: entries n_vis - 1, n_vis - 2, ...; older: one per stratum of [0, n_vis - half)
  older_t = jnp.maximum(n_vis_t - half, 0)
  u_btk = jax.random.uniform(key, (b, t, half))
  stratum_k = jnp.arange(half, dtype=jnp.float32)
  old_btk = jnp.floor((stratum_k + u_btk) * older_t[None, :, None] / half).astype(jnp.int32)
  recent_tk = n_vis_t[:, None] - 1 - slot_k[None, :half]
  many_t = n_vis_t >= k
  idx_btk = jnp.where(many_t[None, :, None],
                      jnp.concatenate([jnp.broadcast_to(recent_tk, (b, t, half)), old_btk], -1),
                      slot_k[None, None, :])
  valid_btk = jnp.broadcast_to(many_t[:, None] | (slot_k[None, :] < n_vis_t[:, None]), (b, t, k))
  return jnp.where(valid_btk, idx_btk, 0), valid_btk


def inputs(b, t, h, d, k, seed=0):
  kq, kk, ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
  kv = jax.random.normal(kk, (b, max(t // 4, 1), d), jnp.bfloat16)
  idx, valid = local_selection(ks, b, t, k)
  return q, kv, idx, valid


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='v41,1b')
  p.add_argument('--shapes', help='BxT, comma separated (default: each case its own)')
  p.add_argument('--topk', default='512', help='K, comma separated')
  p.add_argument('--reps', type=int, default=20)
  p.add_argument('--smoke', action='store_true', help='tiny shapes in the interpreters (CPU)')
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  interpret = True if args.smoke else None  # None: compiled on the GPU (ops/launch.py)
  reps = 1 if args.smoke else args.reps
  rows = []
  for case in args.cases.split(','):
    h, d = CASES[case]['h'], 128 if args.smoke else CASES[case]['d']
    shapes = '1x20' if args.smoke else (args.shapes or CASES[case]['shapes'])
    for b, t in (tuple(int(v) for v in s.split('x')) for s in shapes.split(',')):
      for k in (64,) if args.smoke else (int(v) for v in args.topk.split(',')):
        q, kv, idx, valid = inputs(b, t, h, d, k)
        scale = d ** -0.5
        flops = 4.0 * d * h * float(jnp.sum(valid))
        base = {'case': case, 'b': b, 't': t, 'h': h, 'd': d, 'k': k, 'n': kv.shape[1],
                'device': jax.devices()[0].device_kind}
        triton = jax.jit(lambda q, kv, idx, valid: sparse_partial_fused(
            q, kv, idx, valid, scale=scale, interpret=interpret)[:2])
        mgpu = jax.jit(lambda q, kv, idx, valid: sparse_forward_mgpu(
            q, kv, idx, valid, scale=scale, interpret=interpret))
        o_ref, lse_ref = jax.block_until_ready(triton(q, kv, idx, valid))
        o, lse = jax.block_until_ready(mgpu(q, kv, idx, valid))
        check = agreement(o, lse, o_ref, lse_ref)
        del o, lse, o_ref, lse_ref
        for name, fn, extra in (('triton', triton, {}), ('mosaic', mgpu, check)):
          ms = time_queued(fn, (q, kv, idx, valid), reps)
          rec = dict(base, kernel=name, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                     **extra)
          emit(rec)
          rows.append(rec)
  print_against_first(rows, ('case', 'b', 't', 'k'))  # the first of each case: Triton's

if __name__ == '__main__':
  main()
