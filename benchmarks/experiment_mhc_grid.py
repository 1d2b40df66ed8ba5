"""Experiment: the mHC streaming kernels on a (token block, D block) grid, no walk over D.

The shipped kernels (deepseek41/ops/mhc_kernel.py) give each program a block of tokens and walk
its n*D values in chunks, doing the per-token site math (RMS, projection, Sinkhorn) after the
walk; they move the streams at a third of the copy bandwidth (docs/performance.md 10.1, 24).
Here each program owns a [tb, n, bd] tile and does only elementwise work and partial sums over
its bd columns; the per-token reductions come out as [D / bd, rows, w] partials, and the
coefficients (Sinkhorn) run in a separate one-token-per-thread kernel. Timed against the
shipped kernels and an XLA elementwise fusion that moves the same bytes (the roofline).

    python benchmarks/experiment_mhc_grid.py [--tiles 64x128x4,...] [--check] [--out f.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import jsonl_emitter, time_queued  # noqa: E402
from deepseek41.ops import mhc_kernel as K  # noqa: E402

N = 4
ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6
F32 = jnp.float32


def _params(num_warps, interpret):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415
  return plt.CompilerParams(num_warps=num_warps, num_stages=1)


def _col(ref, c):
  return ref[:, pl.ds(c, 1)].astype(F32)


# --- forward: expand (+ partial site sums + given collapse) on one [tb, n, bd] tile ----------


def _expand_tile(x_ref, f_ref, post_ref, comb_ref, n):
  xs = [x_ref[:, k, :].astype(F32) for k in range(n)]
  f = f_ref[...].astype(F32)
  xp = []
  for k in range(n):
    acc = _col(post_ref, k) * f
    for j in range(n):
      acc = acc + _col(comb_ref, j * n + k) * xs[j]
    xp.append(acc)
  return xs, f, xp


def _expand_kernel(x_ref, f_ref, post_ref, comb_ref, xo_ref, *, n):
  _, _, xp = _expand_tile(x_ref, f_ref, post_ref, comb_ref, n)
  for k in range(n):
    xo_ref[:, k, :] = xp[k].astype(xo_ref.dtype)


def _esc_kernel(x_ref, f_ref, post_ref, comb_ref, pin_ref, w_ref, xo_ref, u_ref, part_ref, *,
                n, nc):
  """expand -> X' written; partial sum of squares and fn . X' over this tile; given collapse."""
  _, _, xp = _expand_tile(x_ref, f_ref, post_ref, comb_ref, n)
  xq = []
  for k in range(n):
    v = xp[k].astype(xo_ref.dtype)
    xo_ref[:, k, :] = v
    xq.append(v)
  _site_partials(xq, pin_ref, w_ref, u_ref, part_ref, n, nc)


def _sc_kernel(x_ref, pin_ref, w_ref, u_ref, part_ref, *, n, nc):
  _site_partials([x_ref[:, k, :] for k in range(n)], pin_ref, w_ref, u_ref, part_ref, n, nc)


def _site_partials(xq, pin_ref, w_ref, u_ref, part_ref, n, nc):
  # xq: n [tb, bd] tiles in the streams' dtype; w: [n, bd, cols] in the same dtype.
  proj = functools.reduce(jnp.add, [jnp.dot(xq[k], w_ref[k], preferred_element_type=F32)
                                    for k in range(n)])
  xf = [v.astype(F32) for v in xq]
  sumsq = functools.reduce(jnp.add, [jnp.sum(v * v, axis=1) for v in xf])
  col = jax.lax.broadcasted_iota(jnp.int32, proj.shape, 1)
  part_ref[...] = jnp.where(col == nc, sumsq[:, None], proj)
  u = functools.reduce(jnp.add, [_col(pin_ref, k) * xf[k] for k in range(n)])
  u_ref[...] = u.astype(u_ref.dtype)


def _coef_kernel(part_ref, sb_ref, pre_ref, post_ref, comb_ref, m_ref, *, n, nc, d, splits):
  """Per token (one per thread): sum the partials, r, m, and the coefficients (Sinkhorn)."""
  cols = m_ref.shape[1]
  tot = [functools.reduce(jnp.add, [part_ref[s, :, pl.ds(c, 1)] for s in range(splits)])
         for c in range(nc + 1)]
  r = 1.0 / jnp.sqrt(tot[nc] / (n * d) + NORM_EPS)
  m = [v * r for v in tot[:nc]]
  a = [m[c] * sb_ref[pl.ds(0, 1), pl.ds(c, 1)] + sb_ref[pl.ds(1, 1), pl.ds(c, 1)]
       for c in range(nc)]
  pre, post, comb = K.coefficients_flat(a, n, ITERS, EPS)
  for k in range(n):
    pre_ref[:, pl.ds(k, 1)] = pre[k]
    post_ref[:, pl.ds(k, 1)] = post[k]
  for i in range(n * n):
    comb_ref[:, pl.ds(i, 1)] = comb[i]
  for c in range(cols):
    m_ref[:, pl.ds(c, 1)] = m[c] if c < nc else (r if c == nc else jnp.zeros_like(r))


# --- backward of expand alone: dX, dF and the partial dpost / dcomb -----------------------


def _expand_bwd_kernel(x_ref, f_ref, post_ref, comb_ref, g_ref, dx_ref, df_ref, dpost_ref,
                       dcomb_ref, *, n):
  xs = [x_ref[:, k, :].astype(F32) for k in range(n)]
  f = f_ref[...].astype(F32)
  g = [g_ref[:, k, :].astype(F32) for k in range(n)]
  for j in range(n):
    dxj = functools.reduce(jnp.add, [_col(comb_ref, j * n + k) * g[k] for k in range(n)])
    dx_ref[:, j, :] = dxj.astype(dx_ref.dtype)
  df = functools.reduce(jnp.add, [_col(post_ref, k) * g[k] for k in range(n)])
  df_ref[...] = df.astype(df_ref.dtype)
  for k in range(n):
    dpost_ref[:, pl.ds(k, 1)] = jnp.sum(g[k] * f, axis=1, keepdims=True)
  for i in range(n * n):
    dcomb_ref[:, pl.ds(i, 1)] = jnp.sum(xs[i // n] * g[i % n], axis=1, keepdims=True)


# --- pallas_call plumbing ---------------------------------------------------------------------


def _tile(tb, n, bd):
  return pl.BlockSpec((tb, n, bd), lambda i, c: (i, 0, c))


def _dtile(tb, bd):
  return pl.BlockSpec((tb, bd), lambda i, c: (i, c))


def _rows(tb, w):
  return pl.BlockSpec((tb, w), lambda i, c: (i, 0))


def _part(tb, w):
  return pl.BlockSpec((None, tb, w), lambda i, c: (c, i, 0))


def expand_grid(x, f, post, comb, *, tb, bd, nw, interpret=False):
  rows, n, d = x.shape
  return pl.pallas_call(
      functools.partial(_expand_kernel, n=n), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(rows // tb, d // bd),
      in_specs=[_tile(tb, n, bd), _dtile(tb, bd), _rows(tb, n), _rows(tb, n * n)],
      out_specs=_tile(tb, n, bd), compiler_params=_params(nw, interpret), interpret=interpret,
      name='mhc_grid_expand')(x, f, post, comb)


def expand_bwd_grid(x, f, post, comb, g, *, tb, bd, nw, interpret=False):
  rows, n, d = x.shape
  s = d // bd
  dx, df, dpost, dcomb = pl.pallas_call(
      functools.partial(_expand_bwd_kernel, n=n),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(f.shape, f.dtype),
                 jax.ShapeDtypeStruct((s, rows, n), F32),
                 jax.ShapeDtypeStruct((s, rows, n * n), F32)],
      grid=(rows // tb, s),
      in_specs=[_tile(tb, n, bd), _dtile(tb, bd), _rows(tb, n), _rows(tb, n * n),
                _tile(tb, n, bd)],
      out_specs=[_tile(tb, n, bd), _dtile(tb, bd), _part(tb, n), _part(tb, n * n)],
      compiler_params=_params(nw, interpret), interpret=interpret,
      name='mhc_grid_expand_bwd')(x, f, post, comb, g)
  return dx, df, dpost.sum(0), dcomb.sum(0)


def _site_inputs(fn, base, scale, n, d, dtype):
  nc = (2 + n) * n
  cols = max(16, pl.next_power_of_2(nc + 1))
  w_cnd = jnp.pad(fn.astype(F32).reshape(nc, n, d), ((0, cols - nc), (0, 0), (0, 0)))
  w_ndc = jnp.transpose(w_cnd, (1, 2, 0)).astype(dtype)
  srow = jnp.concatenate([jnp.full((n,), scale[0]), jnp.full((n,), scale[1]),
                          jnp.full((n * n,), scale[2]), jnp.zeros((cols - nc,))]).astype(F32)
  brow = jnp.pad(base.astype(F32), (0, cols - nc))
  return nc, cols, w_ndc, jnp.stack([srow, brow])


def _coefficients(part, sb, n, nc, cols, d, interpret, tc=128):
  s, rows, _ = part.shape
  outs = pl.pallas_call(
      functools.partial(_coef_kernel, n=n, nc=nc, d=d, splits=s),
      out_shape=[jax.ShapeDtypeStruct((rows, w), F32) for w in (n, n, n * n, cols)],
      grid=(rows // tc,),
      in_specs=[pl.BlockSpec((s, tc, cols), lambda i: (0, i, 0)),
                pl.BlockSpec((2, cols), lambda i: (0, 0))],
      out_specs=[pl.BlockSpec((tc, w), lambda i: (i, 0)) for w in (n, n, n * n, cols)],
      compiler_params=_params(4, interpret), interpret=interpret,
      name='mhc_grid_coef')(part, sb)
  return outs


def site_collapse_grid(x, pin, fn, base, scale, *, tb, bd, nw, interpret=False):
  rows, n, d = x.shape
  nc, cols, w_ndc, sb = _site_inputs(fn, base, scale, n, d, x.dtype)
  u, part = pl.pallas_call(
      functools.partial(_sc_kernel, n=n, nc=nc),
      out_shape=[jax.ShapeDtypeStruct((rows, d), x.dtype),
                 jax.ShapeDtypeStruct((d // bd, rows, cols), F32)],
      grid=(rows // tb, d // bd),
      in_specs=[_tile(tb, n, bd), _rows(tb, n),
                pl.BlockSpec((n, bd, cols), lambda i, c: (0, c, 0))],
      out_specs=[_dtile(tb, bd), _part(tb, cols)],
      compiler_params=_params(nw, interpret), interpret=interpret,
      name='mhc_grid_sc')(x, pin, w_ndc)
  pre, post, comb, _ = _coefficients(part, sb, n, nc, cols, d, interpret)
  return u, pre, post, comb


def expand_site_collapse_grid(x, f, post, comb, pin, fn, base, scale, *, tb, bd, nw,
                              interpret=False):
  rows, n, d = x.shape
  nc, cols, w_ndc, sb = _site_inputs(fn, base, scale, n, d, x.dtype)
  xo, u, part = pl.pallas_call(
      functools.partial(_esc_kernel, n=n, nc=nc),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((rows, d), x.dtype),
                 jax.ShapeDtypeStruct((d // bd, rows, cols), F32)],
      grid=(rows // tb, d // bd),
      in_specs=[_tile(tb, n, bd), _dtile(tb, bd), _rows(tb, n), _rows(tb, n * n), _rows(tb, n),
                pl.BlockSpec((n, bd, cols), lambda i, c: (0, c, 0))],
      out_specs=[_tile(tb, n, bd), _dtile(tb, bd), _part(tb, cols)],
      compiler_params=_params(nw, interpret), interpret=interpret,
      name='mhc_grid_esc')(x, f, post, comb, pin, w_ndc)
  pre, post_o, comb_o, _ = _coefficients(part, sb, n, nc, cols, d, interpret)
  return xo, u, pre, post_o, comb_o


# --- timing -----------------------------------------------------------------------------------


def make(key, rows, d, dtype):
  ks = jax.random.split(key, 8)
  fn = 0.02 * jax.random.normal(ks[5], ((2 + N) * N, N * d))
  return dict(x=jax.random.normal(ks[0], (rows, N, d), dtype),
              f=jax.random.normal(ks[1], (rows, d), dtype),
              g=jax.random.normal(ks[6], (rows, N, d), dtype),
              post=2 * jax.nn.sigmoid(jax.random.normal(ks[2], (rows, N))),
              comb=jax.nn.softmax(jax.random.normal(ks[3], (rows, N * N)), -1),
              pre=jax.nn.sigmoid(jax.random.normal(ks[4], (rows, N))),
              fn=fn, base=0.1 * jax.random.normal(ks[7], ((2 + N) * N,)), scale=jnp.ones((3,)))


def shipped(case, p):
  """The shipped kernels ([B, T, ...] entry points; rows as B = 1)."""
  x, f, post, comb, pre = (p['x'][None], p['f'][None], p['post'][None],
                           p['comb'][None].reshape(1, -1, N, N), p['pre'][None])
  if case == 'expand':
    return K.expand_fused(x, f, post, comb)
  if case == 'site_collapse':
    return K.site_collapse(x, p['fn'], p['base'], p['scale'], pre, iters=ITERS, eps=EPS,
                           norm_eps=NORM_EPS)
  return K.expand_site_collapse(x, f, post, comb, p['fn'], p['base'], p['scale'], pre,
                                iters=ITERS, eps=EPS, norm_eps=NORM_EPS)


def grid(case, p, tb, bd, nw, interpret=False):
  kw = dict(tb=tb, bd=bd, nw=nw, interpret=interpret)
  if case == 'expand':
    return expand_grid(p['x'], p['f'], p['post'], p['comb'], **kw)
  if case == 'site_collapse':
    return site_collapse_grid(p['x'], p['pre'], p['fn'], p['base'], p['scale'], **kw)
  return expand_site_collapse_grid(p['x'], p['f'], p['post'], p['comb'], p['pre'], p['fn'],
                                   p['base'], p['scale'], **kw)


def roofline(case, p):
  """An XLA fusion moving the case's bytes: X (and F) read, X' (and u) written."""
  x = p['x'].astype(F32)
  if case == 'expand':
    return (x * 1.001 + p['f'][:, None, :].astype(F32)).astype(p['x'].dtype)
  if case == 'site_collapse':
    return jnp.sum(x, axis=1).astype(p['x'].dtype)
  y = x * 1.001 + p['f'][:, None, :].astype(F32)
  return y.astype(p['x'].dtype), jnp.sum(y, axis=1).astype(p['x'].dtype)


BYTES = {'expand': (2, 1), 'site_collapse': (1, 1), 'expand_site_collapse': (2, 2),
         'expand_bwd': (3, 1)}  # (X-sized, D-sized) tensors moved; expand_bwd: +2/+1 below


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--rows', type=int, default=8 * 4096)
  ap.add_argument('--d', type=int, default=1024)
  ap.add_argument('--cases', default='expand,site_collapse,expand_site_collapse,expand_bwd')
  ap.add_argument('--tiles', default='32x128x4,64x64x4,64x128x4,64x128x8,128x64x8,32x256x4,'
                                     '64x256x8,128x128x8')
  ap.add_argument('--reps', type=int, default=20)
  ap.add_argument('--check', action='store_true')
  ap.add_argument('--out')
  args = ap.parse_args(argv)
  emit = jsonl_emitter(args.out)
  common = dict(date=datetime.datetime.now().isoformat(timespec='seconds'),
                device=str(jax.devices()[0].device_kind), command=' '.join(sys.argv))
  p = make(jax.random.key(0), args.rows, args.d, jnp.bfloat16)
  unit = args.rows * N * args.d * 2
  tiles = [tuple(int(v) for v in t.split('x')) for t in args.tiles.split(',')]
  for case in args.cases.split(','):
    xs, ds = BYTES[case] if case != 'expand_bwd' else (5, 3)
    nbytes = xs * unit + ds * unit // N
    if case == 'expand_bwd':
      def vjp_shipped(p):
        _, pull = jax.vjp(lambda x, f, po, co: K.expand_fused(x, f, po, co),
                          p['x'][None], p['f'][None], p['post'][None],
                          p['comb'][None].reshape(1, -1, N, N))
        return pull(p['g'][None])
      runs = [('shipped_fwd_bwd', jax.jit(vjp_shipped), None)]
      runs += [(f'grid_bwd {t}', jax.jit(lambda p, t=t: expand_bwd_grid(
          p['x'], p['f'], p['post'], p['comb'], p['g'], tb=t[0], bd=t[1], nw=t[2])), t)
               for t in tiles]
    else:
      runs = [('xla_roofline', jax.jit(functools.partial(roofline, case)), None),
              ('shipped', jax.jit(functools.partial(shipped, case)), None)]
      runs += [(f'grid {t}', jax.jit(lambda p, t=t, case=case: grid(case, p, *t)), t)
               for t in tiles]
    want = None
    for name, fn, _ in runs:
      rec = dict(case=case, impl=name, rows=args.rows, d=args.d, bytes=nbytes)
      try:
        ms = time_queued(fn, (p,), args.reps)
        rec.update(ms=ms, gbps=nbytes / ms / 1e6)
        if args.check and not name.startswith('xla'):
          got = jax.tree.leaves(fn(p))
          got = [g.reshape(-1) for g in got]
          if want is None:
            want = got
          else:
            rec['rel_err'] = max(float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32))) /
                                       (jnp.max(jnp.abs(b.astype(F32))) + 1e-30))
                                 for a, b in zip(got, want))
      except Exception as e:  # noqa: BLE001
        rec['error'] = f'{type(e).__name__}: {str(e)[:300]}'
      emit({**rec, **common})


if __name__ == '__main__':
  main()
