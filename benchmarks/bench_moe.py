"""Time the routed-expert backends of deepseek41.ops.expert_gemm, forward and forward+backward.

Usage (GPU, the 1B ablation shape):   python benchmarks/bench_moe.py --out moe.json
       (GPU, grouped against grouped_fused at the 1B and the released expert shapes):
         python benchmarks/bench_moe.py --case 1b --backends FUSED
         python benchmarks/bench_moe.py --case rel4k --backends FUSED
         with FUSED = grouped,grouped_fused,grouped_fused_atomic,grouped_fused_saved
       (CPU smoke run, small shapes):  python benchmarks/bench_moe.py --small

Cases (--case): `1b` = configs/ablation_1b.py's experts (E 64, D 1024, F 384, top-6) on 8 x 4,096
tokens; `rel4k` = the released expert shapes (D 5120, F 2304, top-6) for one device's 48 local
experts (384 over expert=8) at 4,096 assignments per expert, one group of 32,768 tokens.
`grouped_fused_atomic` is the grouped_fused backend with its atomic combine (fused_combine),
`grouped_fused_saved` with gate and up saved for the backward (fused_recompute=False).
The grouped backends take the platform's tiles (ops/gpu/grouped_gemm.py GPU_TILES) with the
weight-gradient kernel of --wgrad (auto: model.grouped_wgrad's rule, Mosaic from D 4096 up).

Method (docs/performance.md): jit, warm up, block_until_ready, median over --reps runs, each on freshly
drawn inputs. FLOPs counted are the useful ones only, 2 * 3 * (B*T) * K * D * F forward (three
matmuls per assignment) and three times that for forward+backward; capacity padding, the dense
reference's E/K overwork and ragged_dot's per-group dense compute are not credited.

Accuracy: each backend runs one group (the first --check_tokens tokens) in the benchmark dtype with
a capacity that drops nothing, against the f32 reference at highest matmul precision; the error is
max|y - y_ref| / max|y_ref|. Drops at the benchmarked capacity factor are reported separately.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops.expert_gemm import (GROUPED_BACKENDS, clipped_swiglu,  # noqa: E402
                                        expert_capacity, expert_ffn, expert_ffn_batched)
from deepseek41.ops.gpu.grouped_gemm import default_tiles  # noqa: E402

SWIGLU_LIMIT = 10.0
FULL = dict(tokens=4096, groups=2, d=1024, f=512, experts=64, k=6, dtype='bfloat16', reps=10)
SMALL = dict(tokens=256, groups=2, d=64, f=32, experts=8, k=2, dtype='float32', reps=5)
CASES = {
    '1b': dict(FULL, tokens=4096, groups=8, f=384),
    'rel4k': dict(FULL, tokens=4096 * 48 // 6, groups=1, d=5120, f=2304, experts=48),
}
# Benchmark names of a backend with options: name -> (backend, more expert_ffn_batched arguments).
VARIANTS = {'grouped_fused_atomic': ('grouped_fused', dict(fused_combine='atomic')),
            'grouped_fused_saved': ('grouped_fused', dict(fused_recompute=False))}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tokens', type=int, help='tokens per group T (capacity is per group)')
  p.add_argument('--groups', type=int, help='groups B (sequences)')
  p.add_argument('--d', type=int, help='model width D')
  p.add_argument('--f', type=int, help='expert intermediate width F')
  p.add_argument('--experts', type=int, help='routed experts E')
  p.add_argument('--k', type=int, help='experts per token K')
  p.add_argument('--dtype', choices=('bfloat16', 'float32'))
  p.add_argument('--capacity_factor', type=float, default=1.25)
  p.add_argument('--reps', type=int)
  p.add_argument('--skew', type=float, default=0.0,
                 help='std of a per-expert router-logit bias: >0 makes the load uneven')
  p.add_argument('--check_tokens', type=int, default=1024, help='group length of the accuracy check')
  p.add_argument('--backends',
                 default='reference,capacity_einsum,ragged_dot,grouped,grouped_fused,einsum_only',
                 help='comma list; reference is timed only with --small or --time_reference; '
                 'einsum_only is the expert matmuls alone on a dispatched buffer (the ceiling)')
  p.add_argument('--time_reference', action='store_true')
  p.add_argument('--small', action='store_true', help='small shapes for a CPU smoke run')
  p.add_argument('--case', choices=tuple(CASES), help='preset shapes (module docstring)')
  p.add_argument('--wgrad', default='auto', choices=('auto', 'triton', 'mosaic'),
                 help='the grouped backends\' weight-gradient kernel (model.grouped_wgrad)')
  p.add_argument('--out', help='write the results as JSON here')
  args = p.parse_args(argv)
  for key, value in (SMALL if args.small else CASES.get(args.case, FULL)).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  return args


def make_inputs(key, args, groups, tokens, dtype):
  """Router-like decisions: distinct top-K of random logits, softmax-normalised weights x 1.5."""
  k_x, k_logit, k_bias = jax.random.split(key, 3)
  x = jax.random.normal(k_x, (groups, tokens, args.d), jnp.float32).astype(dtype)
  bias_e = args.skew * jax.random.normal(k_bias, (args.experts,))
  logits = jax.random.normal(k_logit, (groups, tokens, args.experts)) + bias_e
  top_val, idx = jax.lax.top_k(logits, args.k)
  weight = 1.5 * jax.nn.softmax(top_val, axis=-1)
  valid = jnp.ones((groups, tokens), bool)
  return x, idx.astype(jnp.int32), weight, valid


def make_experts(key, args, dtype):
  k_g, k_u, k_d = jax.random.split(key, 3)
  e, d, f = args.experts, args.d, args.f
  w_gate = (jax.random.normal(k_g, (e, d, f)) / d**0.5).astype(dtype)
  w_up = (jax.random.normal(k_u, (e, d, f)) / d**0.5).astype(dtype)
  w_down = (jax.random.normal(k_d, (e, f, d)) / f**0.5).astype(dtype)
  return w_gate, w_up, w_down


def build(backend, capacity_factor, **extra):
  """Jitted forward and forward+backward (grads w.r.t. x, router weights and all experts).

  extra: more keyword arguments of expert_ffn_batched (e.g. grouped_tiles).
  """
  kw = dict(swiglu_limit=SWIGLU_LIMIT, backend=backend, capacity_factor=capacity_factor, **extra)

  @jax.jit
  def fwd(x, idx, weight, valid, wg, wu, wd):
    return expert_ffn_batched(x, idx, weight, valid, wg, wu, wd, **kw)

  @jax.jit
  def fwd_bwd(x, idx, weight, valid, wg, wu, wd, ct):
    def loss(x, weight, wg, wu, wd):
      y, dropped = expert_ffn_batched(x, idx, weight, valid, wg, wu, wd, **kw)
      return jnp.sum(y.astype(jnp.float32) * ct), dropped
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, weight, wg, wu, wd)

  return fwd, fwd_bwd


def build_einsum_only(args, dtype):
  """The expert matmuls alone on an already-dispatched [B, E, C, D] buffer: the ceiling that
  capacity_einsum's sort, dispatch and combine are measured against."""
  cap = expert_capacity(args.tokens, args.k, args.experts, args.capacity_factor)

  def ffn(buf_becd, wg, wu, wd):
    h_gate = jnp.einsum('becd,edf->becf', buf_becd, wg)
    h_up = jnp.einsum('becd,edf->becf', buf_becd, wu)
    return jnp.einsum('becf,efd->becd', clipped_swiglu(h_gate, h_up, SWIGLU_LIMIT), wd)

  @jax.jit
  def fwd_bwd(buf, wg, wu, wd, ct):
    loss = lambda *a: jnp.sum(ffn(*a).astype(jnp.float32) * ct)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3))(buf, wg, wu, wd)

  shape = (args.groups, args.experts, cap, args.d)
  return jax.jit(ffn), fwd_bwd, shape


def backend_options(name, args):
  """(backend, expert_ffn_batched keyword arguments) of a benchmark name (VARIANTS)."""
  backend, extra = VARIANTS.get(name, (name, {}))
  extra = dict(extra)
  if backend in GROUPED_BACKENDS:
    wgrad = args.wgrad if args.wgrad != 'auto' else ('mosaic' if args.d >= 4096 else 'triton')
    extra['grouped_tiles'] = default_tiles(wgrad)
  return backend, extra


def check_accuracy(name, args, dtype):
  """One group in the benchmark dtype, no drops, vs the f32 reference at highest precision."""
  backend, extra = backend_options(name, args)
  n = min(args.check_tokens, args.tokens)
  x, idx, weight, valid = make_inputs(jax.random.key(12345), args, 1, n, jnp.float32)
  experts = make_experts(jax.random.key(54321), args, jnp.float32)
  squeeze = lambda t: t[0]  # noqa: E731
  x, idx, weight, valid = map(squeeze, (x, idx, weight, valid))
  no_drop = args.experts / args.k
  with jax.default_matmul_precision('highest'):
    y_ref, _ = jax.jit(functools.partial(expert_ffn, swiglu_limit=SWIGLU_LIMIT,
                                         backend='reference'))(x, idx, weight, valid, *experts)
  y, dropped = jax.jit(functools.partial(expert_ffn, swiglu_limit=SWIGLU_LIMIT, backend=backend,
                                         capacity_factor=no_drop, **extra))(
      x.astype(dtype), idx, weight, valid, *(w.astype(dtype) for w in experts))
  assert int(dropped) == 0
  err = jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref)) / jnp.max(jnp.abs(y_ref))
  return float(err)


def bench_backend(backend, args, dtype):
  n_total = args.groups * args.tokens
  flops_fwd = 2 * 3 * n_total * args.k * args.d * args.f
  if backend == 'einsum_only':
    return bench_einsum_only(args, dtype, flops_fwd)
  name, (backend, extra) = backend, backend_options(backend, args)
  fwd, fwd_bwd = build(backend, args.capacity_factor, **extra)
  experts = make_experts(jax.random.key(0), args, dtype)

  def make_args(rep, with_ct=False):
    key = jax.random.fold_in(jax.random.key(1), rep)
    x, idx, weight, valid = make_inputs(key, args, args.groups, args.tokens, dtype)
    out = (x, idx, weight, valid, *experts)
    if with_ct:
      out += (jax.random.normal(jax.random.fold_in(key, 7), x.shape, jnp.float32),)
    return out

  fwd_ms, fwd_compile = time_fn(fwd, make_args, args.reps)
  bwd_ms, bwd_compile = time_fn(fwd_bwd, functools.partial(make_args, with_ct=True), args.reps)
  _, dropped = fwd(*make_args(0))
  return dict(
      backend=name,
      fwd_ms=fwd_ms,
      fwd_bwd_ms=bwd_ms,
      fwd_tflops=flops_fwd / fwd_ms / 1e9,
      fwd_bwd_tflops=3 * flops_fwd / bwd_ms / 1e9,
      drop_frac=int(dropped) / (n_total * args.k),
      max_rel_err=check_accuracy(name, args, dtype),
      compile_s=fwd_compile + bwd_compile,
  )


def bench_einsum_only(args, dtype, flops_fwd):
  fwd, fwd_bwd, shape = build_einsum_only(args, dtype)
  experts = make_experts(jax.random.key(0), args, dtype)

  def make_args(rep, with_ct=False):
    key = jax.random.fold_in(jax.random.key(2), rep)
    buf = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    ct = (jax.random.normal(jax.random.fold_in(key, 7), shape, jnp.float32),) if with_ct else ()
    return (buf, *experts, *ct)

  fwd_ms, fwd_compile = time_fn(fwd, make_args, args.reps)
  bwd_ms, bwd_compile = time_fn(fwd_bwd, functools.partial(make_args, with_ct=True), args.reps)
  return dict(backend='einsum_only', fwd_ms=fwd_ms, fwd_bwd_ms=bwd_ms,
              fwd_tflops=flops_fwd / fwd_ms / 1e9, fwd_bwd_tflops=3 * flops_fwd / bwd_ms / 1e9,
              drop_frac=float('nan'), max_rel_err=float('nan'),
              compile_s=fwd_compile + bwd_compile)


def markdown(rows, args):
  cap = expert_capacity(args.tokens, args.k, args.experts, args.capacity_factor)
  head = (f'T={args.tokens} B={args.groups} D={args.d} F={args.f} E={args.experts} K={args.k} '
          f'{args.dtype} capacity_factor={args.capacity_factor} (C={cap}) skew={args.skew} '
          f'on {jax.devices()[0].device_kind}, median of {args.reps}')
  lines = [head, '',
           '| backend | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | dropped | '
           'max rel err | compile s |',
           '| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |']
  for r in rows:
    drop = '-' if r['drop_frac'] != r['drop_frac'] else f"{100 * r['drop_frac']:.2f}%"
    err = '-' if r['max_rel_err'] != r['max_rel_err'] else f"{r['max_rel_err']:.1e}"
    lines.append(f"| {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.3g} | "
                 f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.3g} | {drop} | {err} | "
                 f"{r['compile_s']:.1f} |")
  return '\n'.join(lines)


def main(argv=None):
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  backends = [b for b in args.backends.split(',') if b]
  if 'reference' in backends and not (args.small or args.time_reference):
    backends.remove('reference')  # E/K times the useful work: only worth timing at small sizes
  rows = []
  for backend in backends:
    row = bench_backend(backend, args, dtype)
    print(json.dumps(row), flush=True)
    rows.append(row)
  table = markdown(rows, args)
  print('\n' + table)
  if args.out:
    with open(args.out, 'w') as fh:
      json.dump(dict(config=vars(args), date=datetime.datetime.now().isoformat(timespec='seconds'),
                     device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     results=rows, table=table), fh, indent=2)


if __name__ == '__main__':
  main()
