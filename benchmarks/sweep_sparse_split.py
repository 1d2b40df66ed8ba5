"""Tile sweep of the sparse kernels alone (ops/gpu/sparse_kernel.py): block_k x warps x stages.

Times the forward (`--fwd`), the fused backward (`--bwd`), and the deferred backward's two
kernels: `dq_and_coefficients` (`--dq`, every CSA2 layer's backward in a group) and
`dkv_from_coefficients` (`--dkv`, once per group of `--uses` calls), each alone, at
configs/ablation_1b.py's shapes (16 heads x 512, top-512, ratio-2 rows; `--heads 64
--head_group 32 --ratio 4` for the released model's). Tiles are BKxNWxNS; best of three runs
of back-to-back calls. docs/performance.md section 26 has the numbers that set `default_tiles`.

    python benchmarks/sweep_sparse_split.py [--t 65536] [--dq 32x4x1,64x4x3] [--dkv 32x4x1]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import jsonl_emitter, time_queued  # noqa: E402
from bench_sparse_kernel import make_inputs  # noqa: E402
from deepseek41.ops.gpu import sparse_kernel as S  # noqa: E402


def _tiles(spec):
  return [tuple(int(v) for v in s.split('x')) for s in spec.split(',') if s]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--t', type=int, default=65536)
  ap.add_argument('--dq', default='32x4x1,32x4x2,64x4x1,64x4x2,64x8x2,128x4x2')
  ap.add_argument('--dkv', default='32x4x1,32x4x2,64x4x1,64x8x1,16x4x1')
  ap.add_argument('--bwd', default='', help='the fused backward (no grouping), same format')
  ap.add_argument('--fwd', default='', help='the forward, same format')
  ap.add_argument('--heads', type=int, default=16)
  ap.add_argument('--head_group', type=int, default=16)
  ap.add_argument('--ratio', type=int, default=2)
  ap.add_argument('--uses', type=int, default=4)
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--out')
  args = ap.parse_args(argv)
  emit = jsonl_emitter(args.out)
  common = dict(date=datetime.datetime.now().isoformat(timespec='seconds'),
                device=str(jax.devices()[0].device_kind), command=' '.join(sys.argv))
  h, d, ratio, k = args.heads, 512, args.ratio, 512
  q, kv, idx, valid, ct = make_inputs(0, args.t, h, d, ratio, k, jnp.bfloat16)
  hg = args.head_group
  scale = d ** -0.5
  fwd_bk, fwd_nw, fwd_ns = S.default_tiles(h)[0]
  o, lse, _ = jax.jit(functools.partial(S._forward, scale=scale, with_mass=False, heads=h,
                                        block_k=fwd_bk, num_warps=fwd_nw, num_stages=fwd_ns,
                                        interpret=False))(
      q, kv, idx, valid)
  dlse = jnp.zeros_like(lse)
  ref = None
  for bk, nw, ns in _tiles(args.fwd):
    fn = jax.jit(functools.partial(S._forward, scale=scale, with_mass=False, heads=h,
                                   block_k=bk, num_warps=nw, num_stages=ns, interpret=False))
    rec = dict(kernel='forward', tiles=f'{bk}x{nw}x{ns}', t=args.t, heads=h)
    try:
      rec['ms'] = time_queued(fn, (q, kv, idx, valid), args.reps)
    except Exception as e:  # noqa: BLE001
      rec['error'] = f'{type(e).__name__}: {str(e)[:300]}'
    emit({**rec, **common})
  for bk, nw, ns in _tiles(args.bwd):
    fn = jax.jit(functools.partial(S._backward, scale=scale, block_k=bk, num_warps=nw,
                                   head_group=hg, dkv_chunk=256 if h <= 16 else S.FULL_WIDTH,
                                   num_stages=ns, interpret=False))
    rec = dict(kernel='fused backward', tiles=f'{bk}x{nw}x{ns}', t=args.t, heads=h)
    try:
      rec['ms'] = time_queued(fn, (q, kv, idx, valid, o, lse, ct, dlse), args.reps)
    except Exception as e:  # noqa: BLE001
      rec['error'] = f'{type(e).__name__}: {str(e)[:300]}'
    emit({**rec, **common})
  for bk, nw, ns in _tiles(args.dq):
    fn = jax.jit(functools.partial(S.dq_and_coefficients, scale=scale, block_k=bk,
                                   num_warps=nw, head_group=hg, num_stages=ns,
                                   interpret=False))
    rec = dict(kernel='dq_and_coefficients', tiles=f'{bk}x{nw}x{ns}', t=args.t, heads=h)
    try:
      dq = fn(q, kv, idx, valid, o, lse, ct, dlse)[0]
      ref = dq if ref is None else ref
      rec['dq_err'] = float(jnp.max(jnp.abs(dq.astype(jnp.float32) - ref.astype(jnp.float32))))
      rec['ms'] = time_queued(fn, (q, kv, idx, valid, o, lse, ct, dlse), args.reps)
    except Exception as e:  # noqa: BLE001
      rec['error'] = f'{type(e).__name__}: {str(e)[:300]}'
    emit({**rec, **common})
  dq_tiles = S.default_tiles(h)[1]  # the coefficients as training makes them
  _, ds, p = jax.jit(functools.partial(S.dq_and_coefficients, scale=scale,
                                       block_k=dq_tiles.dq_block_k, num_warps=dq_tiles.dq_warps,
                                       head_group=hg, num_stages=dq_tiles.dq_stages,
                                       interpret=False))(
      q, kv, idx, valid, o, lse, ct, dlse)
  parts = [(ds, p, q, ct)] * args.uses
  ref = None
  stages = {'n': 1}  # the deferred key/value kernel's depth is not a parameter of the library
  original = S.compiler_params
  S.compiler_params = lambda num_warps, _: original(num_warps, stages['n'])
  try:
    for bk, nw, ns in _tiles(args.dkv):
      stages['n'] = ns
      fn = jax.jit(functools.partial(S.dkv_from_coefficients, block_k=bk, num_warps=nw,
                                     dkv_chunk=256 if h <= 16 else S.FULL_WIDTH, interpret=False))
      rec = dict(kernel=f'dkv_from_coefficients x{args.uses}', tiles=f'{bk}x{nw}x{ns}', t=args.t,
                 heads=h)
      try:
        dkv = fn(kv, idx, valid, parts)
        ref = dkv if ref is None else ref
        rec['dkv_err'] = float(jnp.max(jnp.abs(dkv.astype(jnp.float32) -
                                               ref.astype(jnp.float32))))
        rec['ms'] = time_queued(fn, (kv, idx, valid, parts), args.reps)
      except Exception as e:  # noqa: BLE001
        rec['error'] = f'{type(e).__name__}: {str(e)[:300]}'
      emit({**rec, **common})
  finally:
    S.compiler_params = original


if __name__ == '__main__':
  main()
