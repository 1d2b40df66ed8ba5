"""The CSA2 sparse branch alone: fused Pallas kernel vs the gathered jnp path, and a GPU check.

Usage (GPU):
    python benchmarks/bench_sparse_kernel.py --out sparse.jsonl
    python benchmarks/bench_sparse_kernel.py --cases 1b --block_k 16,32,64   # tile sweep
    python benchmarks/bench_sparse_kernel.py --cases v41 --modes fwd,fwd_mass \
        --fwd_tiles 64:8:2:0,64:8:2:32 --no-gathered        # 64 heads in one or two programs

Cases: `1b` = configs/ablation_1b.py's shapes (16 heads x 512, ratio-2 source: N = T/2) and
`v41` = the released model's (64 heads x 512, ratio 4: N = T/4), both 64K queries, top-512.
Selections are 512 distinct causal entries per query, spread over the visible prefix (sorted,
as neighbouring queries overlap in real selections). Useful work is counted as
4 * heads * d * valid slots per query for the forward and 2.5x that for the backward (the
flash-attention convention: five matrix products against two). Check: at 2,048 queries the
kernel's outputs and gradients against the dense jnp reference, bf16 and fp32.
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
from timing import jsonl_emitter, time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops.gpu.sparse_kernel import sparse_partial_fused  # noqa: E402
from deepseek41.ops.sparse_attention import compressed_partial  # noqa: E402

CASES = {'1b': dict(h=16, d=512, ratio=2), 'v41': dict(h=64, d=512, ratio=4)}


def selection(key, t, n, k, ratio):
  """Distinct causal entries: query t picks k of its (t+1)//ratio visible entries (all if fewer)."""
  limit_t = (jnp.arange(t) + 1) // ratio
  u_tk = jnp.sort(jax.random.uniform(key, (t, k)), axis=-1)
  # Evenly spaced jittered picks are distinct whenever limit >= k.
  base_tk = (jnp.arange(k)[None, :] + u_tk) / k
  idx_tk = jnp.minimum(jnp.floor(base_tk * limit_t[:, None]).astype(jnp.int32),
                       limit_t[:, None] - 1)
  small = limit_t[:, None] <= k
  idx_tk = jnp.where(small, jnp.arange(k)[None, :], idx_tk)
  valid_tk = jnp.where(small, jnp.arange(k)[None, :] < limit_t[:, None], True)
  return jnp.minimum(idx_tk, n - 1)[None], valid_tk[None]


def make_inputs(seed, t, h, d, ratio, k, dtype):
  n = t // ratio
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (1, t, h, d), dtype)
  kv = jax.random.normal(ks[1], (1, n, d), dtype)
  idx, valid = selection(ks[2], t, n, k, ratio)
  ct = jax.random.normal(ks[3], (1, t, h, d), dtype)
  return q, kv, idx, valid, ct


def _bwd_of_sweep(tiles):
  """The backward tiles of the (block_k, num_warps) sweep; a forward-only spec (its four fields)
  leaves the backward at its defaults (its block_k at 64 heads would not fit shared memory)."""
  return (*tiles, 32) if tiles and len(tiles) == 2 else None


def partial_fn(impl, with_mass, tiles=None, bwd_tiles=None):
  def fn(q, kv, idx, valid):
    scale = q.shape[-1] ** -0.5
    if impl == 'fused':
      out = sparse_partial_fused(q, kv, idx, valid, scale=scale, with_mass=with_mass,
                                 fwd_tiles=tiles,
                                 bwd_tiles=bwd_tiles or _bwd_of_sweep(tiles))
      return out if with_mass else out[:2]
    return compressed_partial(q, kv, idx, valid, impl=impl, chunk=1024, scale=scale,
                              with_mass=with_mass)
  return fn


def set_atomics(mode):
  """Experiment hook: patch the Triton lowering's atomics (jax internals; benchmark only)."""
  if mode == 'acq_rel':  # Pallas's default, which ops/gpu/sparse_kernel.py relaxes
    from jax._src.pallas.triton import lowering  # noqa: PLC0415
    tt = lowering.tt_dialect
    lowering._atomic_rmw.__defaults__ = (None, tt.MemSemantic.ACQUIRE_RELEASE, tt.MemSyncScope.GPU)
  elif mode == 'none':
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415
    plt.atomic_add = lambda *a, **k: None
  elif mode == 'store':  # the same gradient tiles written by plain (racing) stores
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415
    plt.atomic_add = lambda ref, idx, val, mask=None: ref.__setitem__(idx, val)


def check(dtype, tol, h=16, bwd_tiles=None, fwd_tiles=None):
  t, d, ratio, k = 2048, 512, 2, 512
  q, kv, idx, valid, ct = make_inputs(7, t, h, d, ratio, k, dtype)
  res = {}
  for impl in ('reference', 'fused'):
    fn = partial_fn(impl, True, fwd_tiles, bwd_tiles=bwd_tiles)

    def loss(q, kv):
      o, lse, _ = fn(q, kv, idx, valid)
      return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
    out = jax.jit(fn)(q, kv, idx, valid)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)
    res[impl] = [np.asarray(x, np.float32) for x in (*out, *grads)]
  errs = {}
  for name, a, b in zip(('o', 'lse', 'mass', 'dq', 'dkv'), res['fused'], res['reference']):
    fin = np.isfinite(b)
    errs[name] = float(np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30))
  ok = all(e < tol for e in errs.values())
  return {'check': str(jnp.dtype(dtype)), 'heads': h, 'fwd_tiles': fwd_tiles,
          'bwd_tiles': bwd_tiles, 'rel_err': errs, 'ok': ok}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='1b,v41')
  p.add_argument('--seq_len', type=int, default=65536)
  p.add_argument('--topk', type=int, default=512)
  p.add_argument('--block_k', default='64,16', help='fused tile sweep: rows per step')
  p.add_argument('--num_warps', default='4,8', help='fused tile sweep: warps per program')
  p.add_argument('--fwd_tiles', default='',
                 help='forward tile sweep (over --block_k/--num_warps): comma-separated '
                      'block_k:num_warps:num_stages:head_group (head_group 0: all heads)')
  p.add_argument('--modes', default='fwd,fwd_mass,fwd_bwd')
  p.add_argument('--bwd_tiles', default='',
                 help='backward tile sweep (fwd_bwd only, default forward tiles): comma-separated '
                      'block_k:num_warps:head_group:dkv_chunk')
  p.add_argument('--atomics', default='relaxed',
                 choices=('acq_rel', 'relaxed', 'none', 'store'),
                 help='experiment: the semantics of the backward atomics (none: skip them, '
                      'which gives wrong gradients: a floor for the rest of the kernel; store: '
                      'plain racing stores of the same tiles, also wrong)')
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--no-gathered', dest='gathered', action='store_false')
  p.add_argument('--no-check', dest='check', action='store_false')
  p.add_argument('--out')
  args = p.parse_args(argv)

  emit = jsonl_emitter(args.out)

  set_atomics(args.atomics)
  if args.check:
    emit(check(jnp.float32, 1e-3))  # Triton's fp32 dot is tf32: ~3e-4
    emit(check(jnp.bfloat16, 2e-2))
    emit(check(jnp.bfloat16, 2e-2, h=64))  # the slot mass from bf16 scores (V4.1's heads)
    for v in filter(None, args.bwd_tiles.split(',')):  # the swept tiles too
      emit(check(jnp.bfloat16, 2e-2, bwd_tiles=tuple(map(int, v.split(':')))))
    for v in filter(None, args.fwd_tiles.split(',')):
      emit(check(jnp.bfloat16, 2e-2, h=64, fwd_tiles=tuple(map(int, v.split(':')))))
  t, k = args.seq_len, args.topk
  for case in args.cases.split(','):
    h, d, ratio = CASES[case]['h'], CASES[case]['d'], CASES[case]['ratio']
    valid_slots = float(jnp.sum(make_inputs(0, t, h, d, ratio, k, jnp.bfloat16)[3]))
    fwd_flops = 4 * h * d * valid_slots
    if args.bwd_tiles:
      variants = [('fused', None, tuple(map(int, v.split(':'))))
                  for v in args.bwd_tiles.split(',')]
    elif args.fwd_tiles:
      variants = [('fused', tuple(map(int, v.split(':'))), None)
                  for v in args.fwd_tiles.split(',')]
    else:
      variants = [('fused', (bk, nw), None) for bk in map(int, args.block_k.split(','))
                  for nw in map(int, args.num_warps.split(','))]
    if args.gathered:
      variants.append(('gathered', None, None))
    for impl, tiles, bwd in variants:
      bk, nw = tiles[:2] if tiles else (None, None)
      for mode in ['fwd_bwd'] if bwd else args.modes.split(','):
        fn = partial_fn(impl, mode == 'fwd_mass', tiles, bwd)
        if mode == 'fwd_bwd':
          def step(q, kv, idx, valid, ct, fn=fn):
            def loss(q, kv):
              o, lse = fn(q, kv, idx, valid)[:2]
              return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(
                  jnp.where(jnp.isfinite(lse), lse, 0.0))
            return jax.grad(loss, argnums=(0, 1))(q, kv)
          run = jax.jit(step)
        else:
          run = jax.jit(lambda q, kv, idx, valid, ct, fn=fn: fn(q, kv, idx, valid))
        try:
          ms, compile_s = time_fn(run, lambda s: make_inputs(s, t, h, d, ratio, k, jnp.bfloat16),
                                  args.reps)
        except Exception as e:  # noqa: BLE001 - report and go on to the next variant
          emit({'case': case, 'impl': impl, 'block_k': bk, 'num_warps': nw, 'bwd_tiles': bwd,
                'mode': mode, 'error': f'{type(e).__name__}: {str(e)[:300]}'})
          continue
        flops = fwd_flops * (3.5 if mode == 'fwd_bwd' else 1.0)
        emit({'case': case, 'impl': impl, 'block_k': bk, 'num_warps': nw, 'fwd_tiles': tiles,
              'bwd_tiles': bwd, 'mode': mode, 't': t,
              'atomics': args.atomics,
              'ms': round(ms, 3), 'compile_s': round(compile_s, 1),
              'useful_tflops': round(flops / ms / 1e9, 1)})


if __name__ == '__main__':
  main()
