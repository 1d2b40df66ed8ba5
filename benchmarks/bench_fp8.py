"""FP8 training GEMMs (model.fp8 = 'rowwise', ops/fp8_matmul.py) against bf16 on the GPU.

Usage (GPU):
    python benchmarks/bench_fp8.py --out fp8.jsonl                  # all cases
    python benchmarks/bench_fp8.py --cases 1b --tokens 32768         # one config, other M
    JAX_PLATFORMS=cpu python benchmarks/bench_fp8.py --smoke         # CPU: tiny shapes, runs only

Records (one JSON line each, to stdout and appended to --out):
  kind=proj: one projection of the model, [M, K] @ [K, N] (wo_a: G groups of [M, K] @ [K, N]),
    impl bf16 (x @ w, as model.fp8 = 'off') and fp8 (fp8_matmul, quantization included; wo_a:
    fp8 is the vmap the model uses, fp8_loop one fp8_matmul per group). fwd_ms and fwd_bwd_ms
    (grads of x and w), TFLOP/s of 2MKN (x3 for fwd+bwd), the speedup over bf16, and f8_gemms:
    how many cuBLASLt FP8 GEMMs the compiled fwd+bwd holds (3 per matmul when XLA took them all;
    cublas_gemms counts all cuBLAS GEMM calls).
  kind=block: the routed-expert block of expert_gemm (dispatch, 3 projections, combine), grouped
    and capacity_einsum backends, fp8 'off' vs 'rowwise' (bench_grouped_gemm.py's cases: 1b, and
    rel4k = the released expert shapes for 48 local experts); useful FLOPs 6 N K D F forward.
  kind=kernel: one grouped gmm alone (forward x @ W_e, and the transposed dgrad), bf16 against
    the fp8 kernel on pre-quantized operands (the quantization is not timed here).
  rel_err: normwise error of the fp8 forward against a float32 matmul of the same inputs.
Shapes: configs/ablation_1b.py (d 1024, q_lora 512, 16 heads x 512, 4 output groups of o_lora
512, expert/shared inter 384) and the released configs/v41_flash.py (d 5120, q_lora 1280, 64 x
512, 8 groups of 1024, expert inter 2304). M = --tokens tokens per device.
Method: jit, warm-up, median over --reps runs on fresh inputs (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from bench_grouped_gemm import CASES as EXPERT_CASES  # noqa: E402
from bench_grouped_gemm import kernel_inputs, make_experts, routing  # noqa: E402
from bench_moe import build  # noqa: E402  (benchmarks/bench_moe.py)
from timing import jsonl_emitter, time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops import launch  # noqa: E402
from deepseek41.ops.fp8_matmul import (batched_fp8_matmul, fp8_matmul,  # noqa: E402
                                       quantize_rowwise)
from deepseek41.ops.gpu import grouped_gemm as gg  # noqa: E402

INTERPRET = launch.interpreted()


def projections(d, q_lora, heads, head_dim, groups, o_lora, inter):
  """name -> (K, N, G): the fp8 GEMMs of one layer (G > 1: grouped wo_a)."""
  return {
      'wq_a': (d, q_lora, 1),
      'wq_b': (q_lora, heads * head_dim, 1),
      'wkv': (d, head_dim, 1),
      'wo_a': (heads // groups * head_dim, o_lora, groups),
      'wo_b': (groups * o_lora, d, 1),
      'shared_gate_up': (d, inter, 1),
      'shared_down': (inter, d, 1),
  }


PROJ_CASES = {
    '1b': projections(1024, 512, 16, 512, 4, 512, 384),
    'rel': projections(5120, 1280, 64, 512, 8, 1024, 2304),
    'tiny': projections(64, 32, 4, 16, 2, 32, 48),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='1b,rel', help=f'projection cases of {list(PROJ_CASES)}')
  p.add_argument('--expert_cases', default='1b,rel4k', help=f'of {list(EXPERT_CASES)}')
  p.add_argument('--backends', default='grouped,capacity_einsum', help='routed-expert block')
  p.add_argument('--tokens', type=int, default=16384, help='M of the projections')
  p.add_argument('--capacity_factor', type=float, default=1.25)
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--no_block', action='store_true')
  p.add_argument('--no_kernel', action='store_true')
  p.add_argument('--smoke', action='store_true', help='tiny shapes, 2 reps (CPU check)')
  p.add_argument('--out', help='append the JSON lines here')
  args = p.parse_args(argv)
  if args.smoke:
    args.cases, args.expert_cases, args.tokens, args.reps = 'tiny', 'tiny', 256, 2
  return args


def gemm_counts(fn, *args):
  """(cuBLASLt FP8 GEMMs, all cuBLAS GEMMs) in the compiled program (0, 0 on the CPU)."""
  text = fn.lower(*args).compile().as_text()
  return text.count('__cublas$lt$matmul$f8'), text.count('custom_call_target="__cublas')


def matmul_fns(impl, groups):
  """(fwd, fwd_bwd) jitted: y = x @ w, and the grads of <y, dy> w.r.t. x and w."""
  if groups == 1:
    mm = (lambda x, w: x @ w) if impl == 'bf16' else fp8_matmul
  elif impl == 'bf16':
    mm = lambda x, w: jnp.einsum('gmk,gkn->gmn', x, w)  # noqa: E731  (the model's einsum)
  elif impl == 'fp8':
    mm = batched_fp8_matmul
  else:  # fp8_loop
    mm = lambda x, w: jnp.stack([fp8_matmul(x[g], w[g]) for g in range(groups)])  # noqa: E731

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(mm, x, w)
    return y, vjp(dy)
  return jax.jit(mm), jax.jit(fwd_bwd)


def bench_proj(emit, case, name, k, n, groups, args):
  m = args.tokens
  lead = (groups,) if groups > 1 else ()
  flops = 2 * m * k * n * groups

  def make_args(rep, with_dy=False):
    key = jax.random.fold_in(jax.random.key(0), rep)
    x = jax.random.normal(key, (*lead, m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (*lead, k, n)) / k**0.5)
    out = (x, w.astype(jnp.bfloat16))
    if with_dy:
      out += (jax.random.normal(jax.random.fold_in(key, 2), (*lead, m, n)).astype(jnp.bfloat16),)
    return out

  x, w = make_args(0)
  exact = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  impls = ('bf16', 'fp8', 'fp8_loop') if groups > 1 else ('bf16', 'fp8')
  base = None
  for impl in impls:
    fwd, fwd_bwd = matmul_fns(impl, groups)
    rec = dict(kind='proj', case=case, proj=name, m=m, k=k, n=n, groups=groups, impl=impl)
    try:
      fwd_ms, c1 = time_fn(fwd, make_args, args.reps)
      bwd_ms, c2 = time_fn(fwd_bwd, functools.partial(make_args, with_dy=True), args.reps)
      y = fwd(x, w).astype(jnp.float32)
      f8_gemms, gemms = gemm_counts(fwd_bwd, *make_args(0, with_dy=True))
      rec.update(fwd_ms=fwd_ms, fwd_bwd_ms=bwd_ms, fwd_tflops=flops / fwd_ms / 1e9,
                 fwd_bwd_tflops=3 * flops / bwd_ms / 1e9, compile_s=c1 + c2,
                 rel_err=float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)),
                 f8_gemms=f8_gemms, cublas_gemms=gemms)
      if impl == 'bf16':
        base = rec
      elif base is not None:
        rec.update(fwd_speedup=base['fwd_ms'] / fwd_ms, fwd_bwd_speedup=base['fwd_bwd_ms'] / bwd_ms)
    except Exception as exc:  # noqa: BLE001  (one failing case must not end the run)
      rec.update(error=repr(exc)[:500])
    emit(rec)


def bench_block(emit, case, c, backend, args):
  n, e, k, d, f = c['tokens'], c['experts'], c['k'], c['d'], c['f']
  b = n // c['group']
  flops_fwd = 6 * n * k * d * f
  experts = make_experts(jax.random.key(0), e, d, f, jnp.bfloat16)

  def make_args(rep, with_ct=False):
    key = jax.random.fold_in(jax.random.key(1), rep)
    idx, weight = routing(key, n, e, k, 0.0)
    x = jax.random.normal(jax.random.fold_in(key, 3), (n, d), jnp.float32).astype(jnp.bfloat16)
    out = (x.reshape(b, n // b, d), idx.reshape(b, n // b, k), weight.reshape(b, n // b, k),
           jnp.ones((b, n // b), bool), *experts)
    if with_ct:
      out += (jax.random.normal(jax.random.fold_in(key, 7), (b, n // b, d), jnp.float32),)
    return out

  base = None
  for fp8 in ('off', 'rowwise'):
    fwd, fwd_bwd = build(backend, args.capacity_factor, fp8=fp8)
    rec = dict(kind='block', case=case, backend=backend, fp8=fp8, tokens=n, experts=e, k=k, d=d,
               f=f)
    try:
      fwd_ms, c1 = time_fn(fwd, make_args, args.reps)
      bwd_ms, c2 = time_fn(fwd_bwd, functools.partial(make_args, with_ct=True), args.reps)
      rec.update(fwd_ms=fwd_ms, fwd_bwd_ms=bwd_ms, fwd_tflops=flops_fwd / fwd_ms / 1e9,
                 fwd_bwd_tflops=3 * flops_fwd / bwd_ms / 1e9, compile_s=c1 + c2)
      if fp8 == 'off':
        base = rec
      elif base is not None:
        rec.update(fwd_speedup=base['fwd_ms'] / fwd_ms, fwd_bwd_speedup=base['fwd_bwd_ms'] / bwd_ms)
    except Exception as exc:  # noqa: BLE001
      rec.update(error=repr(exc)[:500])
    emit(rec)


def bench_kernel(emit, case, c, args):
  """gmm and gmm_t alone: bf16 operands against e4m3 operands with the scaled epilogue."""
  tiles = gg.INTERPRET_TILES if INTERPRET else gg.GPU_TILES
  e, d, f = c['experts'], c['d'], c['f']
  flops = 2 * c['tokens'] * c['k'] * d * f
  w_edf = make_experts(jax.random.key(0), e, d, f, jnp.bfloat16)[0]
  kw = dict(tiles=tiles, interpret=INTERPRET)
  wq_fwd, sw_fwd = quantize_rowwise(w_edf, axis=1)
  wq_t, sw_t = quantize_rowwise(w_edf, axis=2)
  weights = {'bf16': (w_edf, w_edf), 'fp8': ((wq_fwd, sw_fwd[:, 0, :]), (wq_t, sw_t[:, :, 0]))}
  # Weights are arguments, not closed-over constants (a GB constant would bloat the program).
  fns = {
      ('gmm', 'bf16'): lambda lay, x, dy, w: gg.gmm(x, w[0], lay.tile_expert_t, **kw),
      ('gmm_t', 'bf16'): lambda lay, x, dy, w: gg.gmm(dy, w[1], lay.tile_expert_t,
                                                      transpose_rhs=True, **kw),
      ('gmm', 'fp8'): lambda lay, x, dy, w: gg.gmm(
          x[0], w[0][0], lay.tile_expert_t, x[1], w[0][1], out_dtype=jnp.bfloat16, **kw),
      ('gmm_t', 'fp8'): lambda lay, x, dy, w: gg.gmm(
          dy[0], w[1][0], lay.tile_expert_t, dy[1], w[1][1], transpose_rhs=True,
          out_dtype=jnp.bfloat16, **kw),
  }
  for (name, impl), fn in fns.items():
    def make_args(rep, impl=impl):
      lay, x, dy, _ = kernel_inputs(c, jnp.bfloat16, tiles.block_m, rep)
      if impl == 'fp8':  # pre-quantized: the kernel alone
        (xq, sx), (dyq, sdy) = quantize_rowwise(x, 1), quantize_rowwise(dy, 1)
        x, dy = (xq, sx[:, 0]), (dyq, sdy[:, 0])
      return lay, x, dy, weights[impl]
    rec = dict(kind='kernel', case=case, kernel=name, impl=impl)
    try:
      ms, _ = time_fn(jax.jit(fn), make_args, args.reps)
      rec.update(ms=ms, tflops=flops / ms / 1e9)
    except Exception as exc:  # noqa: BLE001  (e.g. the Triton lowering refuses e4m3)
      rec.update(error=repr(exc)[:500])
    emit(rec)


def main(argv=None):
  args = parse_args(argv)
  emit = jsonl_emitter(args.out)
  emit(dict(kind='env', device=str(jax.devices()[0].device_kind), jax=jax.__version__,
            tokens=args.tokens, reps=args.reps))
  for case in filter(None, args.cases.split(',')):
    for name, (k, n, groups) in PROJ_CASES[case].items():
      bench_proj(emit, case, name, k, n, groups, args)
  for case in filter(None, args.expert_cases.split(',')):
    c = EXPERT_CASES[case]
    if not args.no_kernel:
      bench_kernel(emit, case, c, args)
    if not args.no_block:
      for backend in filter(None, args.backends.split(',')):
        bench_block(emit, case, c, backend, args)


if __name__ == '__main__':
  np.set_printoptions(precision=4)
  main()
