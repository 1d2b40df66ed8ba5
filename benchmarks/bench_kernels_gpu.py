"""The window and top-k kernels on the GPU: compiled results against the jnp paths, and times.

    python benchmarks/bench_kernels_gpu.py --out kernels.jsonl

- window: `window_partial_fused` vs the chunked jnp path (configs/ablation_1b.py: 16 heads x
  512, window 128), outputs and gradients at 2 x 4,096 with documents and image spans; then
  forward and forward+backward times at 1 x 65,536.
- select: `topk_threshold` vs `jax.lax.top_k` on the blocked selection's row lengths at 64K
  tokens (8,192 rows of 8,192 block maxima and of 4,096 candidates, k = 512): same sets, times.
Median of --reps runs after a warm-up (benchmarks/timing.py); one JSON line per result.
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
from deepseek41.ops.gpu.topk_select import topk_threshold  # noqa: E402
from deepseek41.ops.gpu.window_kernel import window_partial_fused  # noqa: E402
from deepseek41.ops.swa_attention import swa_partial  # noqa: E402


def window_inputs(seed, b, t, h=16, d=512, spans=True):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
  kv = jax.random.normal(ks[1], (b, t, d), jnp.bfloat16)
  seg = jnp.where(jnp.arange(t) < t // 3, 1, 2)[None].repeat(b, 0).astype(jnp.int32)
  seg = seg.at[:, -17:].set(0)
  span = None
  if spans:  # two image spans of 200 and 50 positions
    pos = jnp.arange(t)
    span = jnp.where((pos >= 100) & (pos < 300), 1, jnp.where((pos >= 2000) & (pos < 2050), 2, 0))
    span = span[None].repeat(b, 0).astype(jnp.int32)
  ct = jax.random.normal(ks[2], (b, t, h, d), jnp.float32)
  return q, kv, seg, span, ct


def window_fn(impl, grad):
  def partial(q, kv, seg, span):
    return swa_partial(q, kv, seg, window=128, impl=impl, span_ids_bt=span)

  def loss(q, kv, seg, span, ct):
    o, lse = partial(q, kv, seg, span)
    return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
  if grad:
    return jax.jit(jax.grad(loss, argnums=(0, 1)))
  return jax.jit(lambda q, kv, seg, span, ct: partial(q, kv, seg, span))


def rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  fin = np.isfinite(b)
  return float(np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--seq_len', type=int, default=65536)
  p.add_argument('--window_tiles', default='',
                 help='window forward+backward tile sweep: BQ:BK:BQ_DKV:BK_DKV:WARPS[:STAGES] '
                      'specs, comma-separated (window_partial_fused arguments; BK is one for '
                      'the forward and dq or FWD/DQ, STAGES one or FWD/DQ/DKV)')
  p.add_argument('--only_tiles', action='store_true', help='skip the checks and default timings')
  p.add_argument('--out')
  args = p.parse_args(argv)

  emit = jsonl_emitter(args.out)

  t = args.seq_len
  if not args.only_tiles:
    try:
      inputs = window_inputs(0, 2, 4096)
      out = {impl: [*window_fn(impl, False)(*inputs), *window_fn(impl, True)(*inputs)]
             for impl in ('chunked', 'fused')}
      errs = {name: rel(a, b) for name, a, b in zip(('o', 'lse', 'dq', 'dkv'), out['fused'],
                                                    out['chunked'])}
      same_inf = bool(np.array_equal(np.isfinite(out['fused'][1]),
                                     np.isfinite(out['chunked'][1])))
      emit({'check': 'window', 'rel_err': errs, 'same_empty_rows': same_inf,
            'ok': same_inf and max(errs.values()) < 2e-2})
    except Exception as e:  # noqa: BLE001 - report, then go on
      emit({'check': 'window', 'error': f'{type(e).__name__}: {str(e)[:400]}'})
    for impl in ('chunked', 'fused'):
      for grad in (False, True):
        try:
          ms, compile_s = time_fn(window_fn(impl, grad),
                                  lambda s: window_inputs(s, 1, t, spans=False), args.reps)
          emit({'bench': 'window', 'impl': impl, 'mode': 'fwd_bwd' if grad else 'fwd', 't': t,
                'ms': round(ms, 3), 'compile_s': round(compile_s, 1)})
        except Exception as e:  # noqa: BLE001
          emit({'bench': 'window', 'impl': impl, 'grad': grad,
                'error': f'{type(e).__name__}: {str(e)[:400]}'})

  for spec in filter(None, args.window_tiles.split(',')):
    bq, bk, bq_dkv, bk_dkv, nw, *ns = spec.split(':')  # STAGES: one or FWD/DQ/DKV
    bk, bk_dq = (bk.split('/') * 2)[:2]  # BK: one for the forward and dq, or FWD/DQ
    bq, bk, bk_dq, bq_dkv, bk_dkv, nw = map(int, (bq, bk, bk_dq, bq_dkv, bk_dkv, nw))
    ns = tuple(int(v) for v in ns[0].split('/')) if ns else None
    ns = ns * 3 if ns and len(ns) == 1 else ns

    def partial(q, kv, seg, bq=bq, bk=bk, bk_dq=bk_dq, bq_dkv=bq_dkv, bk_dkv=bk_dkv, nw=nw,
                ns=ns):
      return window_partial_fused(q, kv, seg, window=128, block_q=bq, block_k=bk,
                                  block_k_dq=bk_dq, block_q_dkv=bq_dkv, block_k_dkv=bk_dkv,
                                  num_warps=nw, num_stages=ns)

    def loss(q, kv, seg, span, ct, partial=partial):
      o, lse = partial(q, kv, seg)
      return jnp.sum(o.astype(jnp.float32) * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
    runs = {'fwd': jax.jit(lambda q, kv, seg, span, ct, partial=partial: partial(q, kv, seg)),
            'fwd_bwd': jax.jit(jax.grad(loss, argnums=(0, 1)))}
    for mode, fn in runs.items():
      try:
        ms, _ = time_fn(fn, lambda s: window_inputs(s, 1, t, spans=False), args.reps)
        emit({'bench': 'window_tiles', 'tiles': spec, 'mode': mode, 't': t, 'ms': round(ms, 3)})
      except Exception as e:  # noqa: BLE001
        emit({'bench': 'window_tiles', 'tiles': spec, 'mode': mode,
              'error': f'{type(e).__name__}: {str(e)[:300]}'})

  if args.only_tiles:
    return

  def keys(seed, rows, length):
    x = jax.random.normal(jax.random.key(seed), (rows, length))
    return (jnp.round(x * 64) / 64,)  # many exact ties

  def by_top_k(x, k=512):
    vals, idx = jax.lax.top_k(x, k)
    return jnp.sort(jnp.where(vals > -jnp.inf, idx, -1), axis=-1)

  def by_threshold(x, k=512):
    idx, valid = topk_threshold(x, k)
    return jnp.sort(jnp.where(valid, idx, -1), axis=-1)
  for length in (8192, 4096):
    try:
      x, = keys(1, 1024, length)
      same = bool(jnp.array_equal(jax.jit(by_top_k)(x), jax.jit(by_threshold)(x)))
      emit({'check': 'select', 'length': length, 'same_sets': same})
      for name, fn in (('top_k', by_top_k), ('threshold', by_threshold)):
        ms, compile_s = time_fn(jax.jit(fn), lambda s: keys(s, 8192, length), args.reps)
        emit({'bench': 'select', 'impl': name, 'rows': 8192, 'length': length, 'k': 512,
              'ms': round(ms, 3)})
    except Exception as e:  # noqa: BLE001
      emit({'check': 'select', 'length': length, 'error': f'{type(e).__name__}: {str(e)[:400]}'})


if __name__ == '__main__':
  main()
