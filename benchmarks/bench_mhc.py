"""Fused mHC kernels (deepseek41/ops/gpu/mhc_kernel.py) against the jnp path (model/mhc.py): time.

Usage (GPU):  python benchmarks/bench_mhc.py [--d 1024,5120] [--check] [--out mhc.jsonl]
              [--configs 128x16x8/64x16x4,...]  (block_t x block_d x num_warps of the
              forward / of the backward; one 'BTxBDxNW' sets both; one run each; a fourth
              number on the forward's, e.g. 128x16x8x3, sets Triton's num_stages for both)
              [--prefetch 0,1]  (each config without / with the walks' look-ahead loads; default 1)
              [--decode_splits 0,16]  (each config with the forward split over D in that many
              programs where the call is one token block, e.g. --batch 1 --seq 1; default 0)

Cases, at B x T tokens, n = 4 streams, bf16 streams (the model's compute dtype):
  site_collapse         single-pass layer start: the attention site's coefficients from X and
                        the collapse with the previous site's pre (one pass over X)
  expand_site_collapse  after attention: X' = expand(X, F), the ffn site on X', the collapse of
                        X' with the attention pre (X, F read once, X' written once)
  expand                after the MoE
  layer                 the three in the single-pass order of one block (the sublayers replaced
                        by F = u), i.e. all of one layer's mHC work
  layer_multi           the same in the multi-pass order (each collapse uses its own pre)
each forward ('fwd') and forward + backward ('fwd_bwd': grads w.r.t. X and every site's fn,
base, scale). `x_bytes` counts the [B, T, n, D] stream bytes a perfect fusion moves (reads +
writes of X-sized tensors; F and u, a quarter of that each, are counted too), `gbps` = x_bytes /
time. One JSON line per (case, mode, impl, config) to stdout and `--out`. `--check` adds the max
|fused - jnp| / max |jnp| over every output and gradient of each case.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import jsonl_emitter, time_fn  # noqa: E402
from deepseek41.model.mhc import collapse, expand, site_coefficients  # noqa: E402
from deepseek41.ops.gpu import mhc_kernel as K  # noqa: E402

N = 4
ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6


def _site(x, s):
  return site_coefficients(x, s['fn'], s['base'], s['scale'], ITERS, EPS, NORM_EPS)


def reference_cases():
  def site_collapse(p):
    pre, post, comb = _site(p['x'], p['sa'])
    return collapse(p['x'], p['pre']), pre, post, comb

  def expand_site_collapse(p):
    x = expand(p['x'], p['f'], p['post'], p['comb'])
    pre, post, comb = _site(x, p['sf'])
    return x, collapse(x, p['pre']), pre, post, comb

  def expand_(p):
    return (expand(p['x'], p['f'], p['post'], p['comb']),)

  def layer(p, single=True):
    x = p['x']
    pre_a, post_a, comb_a = _site(x, p['sa'])
    u = collapse(x, p['pre'] if single else pre_a)
    x = expand(x, u, post_a, comb_a)
    pre_f, post_f, comb_f = _site(x, p['sf'])
    u = collapse(x, pre_a if single else pre_f)
    return expand(x, u, post_f, comb_f), pre_f
  return dict(site_collapse=site_collapse, expand_site_collapse=expand_site_collapse,
              expand=expand_, layer=layer, layer_multi=lambda p: layer(p, False))


def fused_cases(knobs):
  kw = dict(knobs, iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
  sargs = lambda s: (s['fn'], s['base'], s['scale'])  # noqa: E731

  def site_collapse(p):
    return K.site_collapse(p['x'], *sargs(p['sa']), p['pre'], **kw)

  def expand_site_collapse(p):
    return K.expand_site_collapse(p['x'], p['f'], p['post'], p['comb'], *sargs(p['sf']),
                                  p['pre'], **kw)

  def expand_(p):
    return (K.expand_fused(p['x'], p['f'], p['post'], p['comb'], **kw),)

  def layer(p, single=True):
    u, pre_a, post_a, comb_a = K.site_collapse(p['x'], *sargs(p['sa']),
                                               p['pre'] if single else None, **kw)
    x, u, pre_f, post_f, comb_f = K.expand_site_collapse(
        p['x'], u, post_a, comb_a, *sargs(p['sf']), pre_a if single else None, **kw)
    return K.expand_fused(x, u, post_f, comb_f, **kw), pre_f
  return dict(site_collapse=site_collapse, expand_site_collapse=expand_site_collapse,
              expand=expand_, layer=layer, layer_multi=lambda p: layer(p, False))


def stream_units(case):
  """(X-sized, D-sized) tensors a perfect fusion moves, forward and forward + backward."""
  return {  # fwd: X r, (X' w), u w, F r ...; bwd: the forward + dX' r, X (and F) r, dX w, dF w..
      'site_collapse': ((1, 1), (1 + 1 + 1, 1 + 1)),
      'expand_site_collapse': ((2, 2), (2 + 3 + 1, 2 + 4)),
      'expand': ((2, 1), (2 + 3, 1 + 2)),
      'layer': ((3, 4), (3 + 5 + 2, 4 + 8)),
      'layer_multi': ((3, 4), (3 + 5 + 2, 4 + 8)),
  }[case]


def make_params(key, b, t, d, dtype):
  ks = jax.random.split(key, 8)

  def site(k):
    k1, k2 = jax.random.split(k)
    return dict(fn=0.02 * jax.random.normal(k1, ((2 + N) * N, N * d)),
                base=0.1 * jax.random.normal(k2, ((2 + N) * N,)), scale=jnp.ones((3,)))
  return dict(x=jax.random.normal(ks[0], (b, t, N, d), dtype),
              f=jax.random.normal(ks[1], (b, t, d), dtype),
              post=2 * jax.nn.sigmoid(jax.random.normal(ks[2], (b, t, N))),
              comb=jax.nn.softmax(jax.random.normal(ks[3], (b, t, N, N)), -1),
              pre=jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, N))),
              sa=site(ks[5]), sf=site(ks[6]))


def fwd_bwd(run):
  def loss(p):
    outs = run(p)
    return sum(jnp.sum(o.astype(jnp.float32) * (1.0 + 0.01 * i)) for i, o in enumerate(outs))
  return jax.jit(jax.value_and_grad(loss))


def rel_err(got, want):
  errs = jax.tree.map(lambda g, w: float(jnp.max(jnp.abs(g.astype(jnp.float32) -
                                                         w.astype(jnp.float32))) /
                                         (float(jnp.max(jnp.abs(w.astype(jnp.float32)))) +
                                          1e-30)), got, want)
  return max(jax.tree.leaves(errs))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--d', default='1024,5120')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--seq', type=int, default=4096)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--cases', default='site_collapse,expand_site_collapse,expand,layer,layer_multi')
  p.add_argument('--modes', default='fwd,fwd_bwd')
  p.add_argument('--configs', default='128x32x8/64x32x8,128x16x8/64x16x4,64x32x8/32x32x4')
  p.add_argument('--prefetch', default='1')
  p.add_argument('--decode_splits', default='0')
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--check', action='store_true')
  p.add_argument('--skip_jnp', action='store_true')
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  dtype = jnp.dtype(args.dtype)
  b, t = args.batch, args.seq
  common = dict(date=datetime.datetime.now().isoformat(timespec='seconds'),
                device=str(jax.devices()[0].device_kind), command=' '.join(sys.argv))
  ref_cases = reference_cases()
  # 'BTxBDxNW' (forward and backward alike) or 'forward/backward'
  configs = [tuple(tuple(int(v) for v in half.split('x')) for half in (c.split('/') * 2)[:2])
             for c in args.configs.split(',')]  # each half BTxBDxNW, the forward's may add xNS
  for d in (int(v) for v in args.d.split(',')):
    make_args = lambda rep, d=d: (make_params(jax.random.key(rep), b, t, d, dtype),)  # noqa: E731
    x_bytes_unit = b * t * N * d * dtype.itemsize
    for case in args.cases.split(','):
      for mode in args.modes.split(','):
        units = stream_units(case)[mode == 'fwd_bwd']
        x_bytes = units[0] * x_bytes_unit + units[1] * x_bytes_unit // N
        impls = [] if args.skip_jnp else [('jnp', None)]
        impls += [('fused', (c, int(pf), int(sp))) for c in configs
                  for pf in args.prefetch.split(',') for sp in args.decode_splits.split(',')]
        want = None
        for impl, cfg in impls:
          if impl == 'jnp':
            run = ref_cases[case]
          else:
            ((bt, bd, nw, *ns), (btb, bdb, nwb, *_)), pf, sp = cfg
            run = fused_cases(dict(block_t=bt, block_d=bd, num_warps=nw, block_t_bwd=btb,
                                   block_d_bwd=bdb, num_warps_bwd=nwb,
                                   num_stages=ns[0] if ns else 1, prefetch=bool(pf),
                                   decode_splits=sp))[case]
          fn = jax.jit(run) if mode == 'fwd' else fwd_bwd(run)
          rec = dict(case=case, mode=mode, impl=impl, d=d, batch=b, seq=t, dtype=args.dtype,
                     config=None if cfg is None else '/'.join('x'.join(map(str, h)) for h in cfg[0]),
                     prefetch=None if cfg is None else bool(cfg[1]),
                     decode_splits=None if cfg is None else cfg[2])
          try:
            if args.check:
              got = fn(*make_args(123))
              if impl == 'jnp':
                want = got
              elif want is not None:
                rec['rel_err'] = rel_err(got, want)
              del got
            ms, compile_s = time_fn(fn, make_args, args.reps)
          except Exception as e:  # noqa: BLE001  (one failing config must not stop the sweep)
            rec['error'] = f'{type(e).__name__}: {str(e)[:400]}'
            emit({**rec, **common})
            continue
          rec.update(ms=ms, compile_s=compile_s, x_bytes=x_bytes, gbps=x_bytes / ms / 1e6)
          emit({**rec, **common})
        want = None


if __name__ == '__main__':
  main()
