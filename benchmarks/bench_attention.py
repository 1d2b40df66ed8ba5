"""Time the sliding-window attention branch (deepseek41.ops.swa_attention), forward and fwd+bwd.

Usage (GPU, V4.1-like shapes):   python benchmarks/bench_attention.py --out swa.json
      (all 64 heads):            python benchmarks/bench_attention.py --heads 64 --out swa64.json
      (CPU smoke run):           python benchmarks/bench_attention.py --small

Method (docs/performance.md): jit, one warm-up (compile) call, block_until_ready, median over --reps
runs, each on freshly drawn inputs. One document per row (no padding).

FLOPs: two matmuls (q.k and p.v) of 2*d each per (query, key, head): forward = 4*B*T*K*H*d;
forward+backward counts three times that (the backward has four matmuls of the same size:
dp, dq, dkv from the scores, dkv from the values; autodiff keeps the probabilities, no recompute).
Two key counts K per query are reported:
- computed: what the kernel multiplies, (lookback + 1) * chunk keys for every (padded) query
  (2 * window with the default chunk = window);
- useful: keys inside the window, mean over queries of min(t + 1, window).
TFLOP/s on computed keys says how well the matmuls run; on useful keys, what the model gets.

Accuracy: where the dense reference runs too (T <= --reference_max_len), the chunked output is
compared with it on the same inputs: max |o_chunked - o_ref| / max |o_ref|.
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
from timing import time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops.swa_attention import chunk_geometry, swa_attention  # noqa: E402

FULL = dict(batch=1, seq_lens='4096,16384', heads=16, head_dim=512, window=128, chunks='',
            dtype='bfloat16', reps=10, reference_max_len=4096)
SMALL = dict(batch=2, seq_lens='256,1024', heads=4, head_dim=64, window=32, chunks='32,16',
             dtype='float32', reps=5, reference_max_len=1024)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--batch', type=int, help='sequences B')
  p.add_argument('--seq_lens', help='comma list of sequence lengths T')
  p.add_argument('--heads', type=int, help='query heads H sharing one K=V latent')
  p.add_argument('--head_dim', type=int, help='latent width d')
  p.add_argument('--window', type=int, help='sliding window W')
  p.add_argument('--chunks', help="comma list of query block sizes for 'chunked'; '' = window")
  p.add_argument('--dtype', choices=('bfloat16', 'float32'))
  p.add_argument('--reps', type=int)
  p.add_argument('--impls', default='chunked,reference', help='comma list')
  p.add_argument('--reference_max_len', type=int,
                 help='time the dense [T, T] reference only up to this T')
  p.add_argument('--small', action='store_true', help='small shapes for a CPU smoke run')
  p.add_argument('--out', help='write the results as JSON here')
  args = p.parse_args(argv)
  for key, value in (SMALL if args.small else FULL).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  return args


def make_inputs(rep, args, seq_len, dtype):
  key = jax.random.fold_in(jax.random.key(0), rep)
  k_q, k_kv, k_s, k_ct = jax.random.split(key, 4)
  b, h, d = args.batch, args.heads, args.head_dim
  q = jax.random.normal(k_q, (b, seq_len, h, d), jnp.float32).astype(dtype)
  kv = jax.random.normal(k_kv, (b, seq_len, d), jnp.float32).astype(dtype)
  segment_ids = jnp.ones((b, seq_len), jnp.int32)
  sink = jax.random.normal(k_s, (h,), jnp.float32)
  cotangent = jax.random.normal(k_ct, (b, seq_len, h, d), jnp.float32).astype(dtype)
  return q, kv, segment_ids, sink, cotangent


def build(impl, window, chunk):
  kw = dict(window=window, impl=impl, chunk=chunk)

  @jax.jit
  def fwd(q, kv, seg, sink, ct):
    del ct
    return swa_attention(q, kv, seg, sink, **kw)[0]

  @jax.jit
  def fwd_bwd(q, kv, seg, sink, ct):
    def loss(q, kv, sink):
      o, _ = swa_attention(q, kv, seg, sink, **kw)
      return jnp.sum(o.astype(jnp.float32) * ct.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, kv, sink)

  return fwd, fwd_bwd


def key_counts(seq_len, window, impl, chunk):
  """(computed, useful) keys per query, averaged over the T real queries."""
  w = min(window, seq_len)
  useful = sum(min(t + 1, w) for t in range(seq_len)) / seq_len
  if impl == 'reference':
    return float(seq_len), useful
  _, c, lookback, t_pad = chunk_geometry(seq_len, window, chunk)
  return (lookback + 1) * c * t_pad / seq_len, useful


def bench_one(impl, seq_len, chunk, args, dtype):
  fwd, fwd_bwd = build(impl, args.window, chunk)
  make_args = lambda rep: make_inputs(rep, args, seq_len, dtype)  # noqa: E731
  fwd_ms, fwd_compile = time_fn(fwd, make_args, args.reps)
  bwd_ms, bwd_compile = time_fn(fwd_bwd, make_args, args.reps)
  computed, useful = key_counts(seq_len, args.window, impl, chunk)
  per_key = 4 * args.batch * seq_len * args.heads * args.head_dim  # forward FLOPs per key/query
  return dict(
      impl=impl, seq_len=seq_len, chunk=chunk_geometry(seq_len, args.window, chunk)[1]
      if impl == 'chunked' else None,
      keys_computed=computed, keys_useful=useful,
      fwd_ms=fwd_ms, fwd_bwd_ms=bwd_ms,
      fwd_tflops_computed=per_key * computed / fwd_ms / 1e9,
      fwd_tflops_useful=per_key * useful / fwd_ms / 1e9,
      fwd_bwd_tflops_computed=3 * per_key * computed / bwd_ms / 1e9,
      fwd_bwd_tflops_useful=3 * per_key * useful / bwd_ms / 1e9,
      compile_s=fwd_compile + bwd_compile)


def check_accuracy(seq_len, chunk, args, dtype):
  q, kv, seg, sink, _ = make_inputs(12345, args, seq_len, dtype)
  o_ref = jax.jit(lambda *a: swa_attention(*a, window=args.window, impl='reference')[0])(
      q, kv, seg, sink).astype(jnp.float32)
  o = jax.jit(lambda *a: swa_attention(*a, window=args.window, impl='chunked', chunk=chunk)[0])(
      q, kv, seg, sink).astype(jnp.float32)
  return float(jnp.max(jnp.abs(o - o_ref)) / jnp.max(jnp.abs(o_ref)))


def markdown(rows, args):
  head = (f'B={args.batch} H={args.heads} d={args.head_dim} window={args.window} {args.dtype} '
          f'on {jax.devices()[0].device_kind}, median of {args.reps}; TFLOP/s on computed / '
          f'useful keys')
  lines = [head, '',
           '| impl | T | chunk | keys/query computed / useful | fwd ms | fwd TFLOP/s | '
           'fwd+bwd ms | fwd+bwd TFLOP/s | rel err vs ref | compile s |',
           '| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |']
  for r in rows:
    err = r.get('max_rel_err_vs_reference')
    lines.append(
        f"| {r['impl']} | {r['seq_len']} | {r['chunk'] or '-'} | "
        f"{r['keys_computed']:.0f} / {r['keys_useful']:.1f} | {r['fwd_ms']:.3f} | "
        f"{r['fwd_tflops_computed']:.3g} / {r['fwd_tflops_useful']:.3g} | {r['fwd_bwd_ms']:.3f} | "
        f"{r['fwd_bwd_tflops_computed']:.3g} / {r['fwd_bwd_tflops_useful']:.3g} | "
        f"{'-' if err is None else f'{err:.1e}'} | {r['compile_s']:.1f} |")
  return '\n'.join(lines)


def main(argv=None):
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  seq_lens = [int(s) for s in args.seq_lens.split(',') if s]
  chunks = [int(c) for c in args.chunks.split(',') if c] or [None]
  impls = [i for i in args.impls.split(',') if i]
  rows = []
  for seq_len in seq_lens:
    runs = [('chunked', c) for c in chunks] if 'chunked' in impls else []
    if 'reference' in impls and seq_len <= args.reference_max_len:
      runs.append(('reference', None))
    for impl, chunk in runs:
      row = bench_one(impl, seq_len, chunk, args, dtype)
      if impl == 'chunked' and seq_len <= args.reference_max_len:
        row['max_rel_err_vs_reference'] = check_accuracy(seq_len, chunk, args, dtype)
      print(json.dumps(row), flush=True)
      rows.append(row)
  table = markdown(rows, args)
  print('\n' + table)
  if args.out:
    with open(args.out, 'w') as fh:
      json.dump(dict(config=vars(args), command=' '.join(sys.argv),
                     date=datetime.datetime.now().isoformat(timespec='seconds'),
                     device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     results=rows, table=table), fh, indent=2)


if __name__ == '__main__':
  main()
