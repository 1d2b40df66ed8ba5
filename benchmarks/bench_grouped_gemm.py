"""Routed experts on the GPU: the dropless Pallas grouped GEMM against the other backends.

Usage (GPU):
    python benchmarks/bench_grouped_gemm.py --out gmm.jsonl                   # all cases
    python benchmarks/bench_grouped_gemm.py --check                           # numerics only
    python benchmarks/bench_grouped_gemm.py --cases 1b --sweep block_m=64,128 \\
        --sweep block_n=64,128,256 --sweep block_k=32,64 --sweep num_warps=4,8 \\
        --sweep num_stages=3,4 --sweep block_d=64,128 --sweep block_f=64,128 \
        --sweep block_r=32,64                                                 # tile sweep

Cases: `1b` = configs/ablation_1b.py (E=64, D=1024, F=384, top-6, N=32768 tokens in groups of
4096); `rel1k`, `rel4k`, `rel8k` = the released expert shapes (D=5120, F=2304, top-6) for one
device's 48 local experts (384 routed experts over expert=8, configs/v41_flash.py) at 1K, 4K, 8K
assignments per expert (N = tokens_per_expert * 48 / 6). `1b_down` is `1b` with D and F swapped:
the down projection's kernels, for the kernel timings and sweeps.

Records (one JSON line each, to stdout and appended to --out):
  kind=block: the routed-expert block (dispatch + 3 projections + combine), forward and
    forward+backward, per backend (grouped, capacity_einsum, ragged_dot; grouped_fused on
    request). Useful work is
    6 * N * K * D * F forward and 3x that forward+backward; padding, capacity slots and
    ragged_dot's per-group dense work are not credited. drop_frac is capacity_einsum's.
  kind=kernel: one grouped matmul alone, 2 * N * K * D * F useful FLOPs, on expert-sorted rows:
    ours (gmm x@W, gmm_t dy@W^T, tgmm x^T@dy) and, where importable, jax's Mosaic GPU Hopper
    kernels (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu, transposed_ragged_dot_mgpu).
  kind=sweep: ours per kernel for each tile configuration of the --sweep grid.
  kind=check: grouped vs the dense reference on a small shape (outputs and all gradients).
Method: jit, warm-up, median over --reps runs on fresh inputs (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from bench_moe import build  # noqa: E402  (benchmarks/bench_moe.py)
from timing import jsonl_emitter, time_fn, time_queued  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops import grouped_gemm, launch  # noqa: E402
from deepseek41.ops.expert_gemm import GROUPED_BACKENDS, expert_ffn  # noqa: E402
from deepseek41.ops.gpu import grouped_gemm as gg  # noqa: E402

SWIGLU_LIMIT = 10.0
_REL = dict(d=5120, f=2304, experts=48, k=6, group=4096)
CASES = {
    '1b': dict(d=1024, f=384, experts=64, k=6, tokens=32768, group=4096),
    'rel1k': dict(_REL, tokens=1024 * 48 // 6),
    'rel4k': dict(_REL, tokens=4096 * 48 // 6),
    'rel8k': dict(_REL, tokens=8192 * 48 // 6),
    'tiny': dict(d=64, f=32, experts=8, k=2, tokens=256, group=128),  # CPU smoke run
}
# The down projection's kernels (x [M, F] @ W [F, D], and their transposes) for the kernel
# timings and sweeps: case 1b with D and F swapped.
CASES['1b_down'] = dict(CASES['1b'], d=CASES['1b']['f'], f=CASES['1b']['d'])
INTERPRET = launch.interpreted()  # our kernels in the Pallas interpreter on the CPU (smoke runs)
GMM_FIELDS = ('block_m', 'block_n', 'block_k', 'num_warps', 'num_stages')
TGMM_FIELDS = ('block_m', 'block_d', 'block_f', 'block_r', 'tgmm_warps', 'tgmm_stages')


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='1b,rel1k,rel4k,rel8k', help=f'comma list of {list(CASES)}')
  p.add_argument('--backends', default='grouped,capacity_einsum,ragged_dot')
  p.add_argument('--kernels', default='ours,mgpu', help='kernel-alone timings: ours, mgpu; "" none')
  p.add_argument('--no_block', action='store_true', help='skip the whole-block timings')
  p.add_argument('--dtype', default='bfloat16', choices=('bfloat16', 'float32'))
  p.add_argument('--capacity_factor', type=float, default=1.25)
  p.add_argument('--skew', type=float, default=0.0, help='std of a per-expert router-logit bias')
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--ragged_dot_max_tflop', type=float, default=200.0,
                 help='skip ragged_dot where E x the useful fwd+bwd work exceeds this (it is dense '
                 'per group on CUDA: seconds per step)')
  p.add_argument('--tiles', default='',
                 help='grouped tiles over GPU_TILES, e.g. block_m=128,block_n=256,num_warps=8')
  p.add_argument('--sweep', action='append', default=[],
                 help='FIELD=v1,v2,... (repeatable, Tiles fields): time our kernels per config')
  p.add_argument('--queued', action='store_true',
                 help='kernel timings as --reps calls queued back to back on one input set (best '
                 'of three; timing.time_queued) instead of the median of synced calls on fresh '
                 'inputs: a synced sub-millisecond kernel reads the dispatch too')
  p.add_argument('--check', action='store_true', help='only the numerical check on the GPU')
  p.add_argument('--out', help='append the JSON lines here')
  return p.parse_args(argv)


def parse_tiles(spec: str) -> gg.Tiles:
  kw = {}
  for item in filter(None, spec.split(',')):
    key, value = item.split('=')
    kw[key] = value if key == 'wgrad' else int(value)
  return dataclasses.replace(gg.GPU_TILES, **kw)


def routing(key, tokens, experts, k, skew):
  """Router-like decisions: distinct top-K of random logits, softmax-normalised weights x 1.5."""
  k_logit, k_bias = jax.random.split(key)
  bias_e = skew * jax.random.normal(k_bias, (experts,))
  top_val, idx = jax.lax.top_k(jax.random.normal(k_logit, (tokens, experts)) + bias_e, k)
  return idx.astype(jnp.int32), 1.5 * jax.nn.softmax(top_val, axis=-1)


def make_experts(key, e, d, f, dtype):
  k_g, k_u, k_d = jax.random.split(key, 3)
  return ((jax.random.normal(k_g, (e, d, f)) / d**0.5).astype(dtype),
          (jax.random.normal(k_u, (e, d, f)) / d**0.5).astype(dtype),
          (jax.random.normal(k_d, (e, f, d)) / f**0.5).astype(dtype))


def tflops(flops, ms):
  return flops / ms / 1e9


# ---- the routed-expert block -------------------------------------------------------------------


def bench_block(emit, case, c, backend, args, dtype, tiles):
  n, e, k, d, f = c['tokens'], c['experts'], c['k'], c['d'], c['f']
  b = n // c['group']
  flops_fwd = 6 * n * k * d * f
  if backend == 'ragged_dot' and e * 3 * flops_fwd / 1e12 > args.ragged_dot_max_tflop:
    emit(dict(kind='block', case=case, backend=backend, skipped='over --ragged_dot_max_tflop'))
    return
  experts = make_experts(jax.random.key(0), e, d, f, dtype)
  fwd, fwd_bwd = build(backend, args.capacity_factor,
                       grouped_tiles=tiles if backend in GROUPED_BACKENDS else None)

  def make_args(rep, with_ct=False):
    key = jax.random.fold_in(jax.random.key(1), rep)
    idx, weight = routing(key, n, e, k, args.skew)
    x = jax.random.normal(jax.random.fold_in(key, 3), (n, d), jnp.float32).astype(dtype)
    out = (x.reshape(b, n // b, d), idx.reshape(b, n // b, k), weight.reshape(b, n // b, k),
           jnp.ones((b, n // b), bool), *experts)
    if with_ct:
      out += (jax.random.normal(jax.random.fold_in(key, 7), (b, n // b, d), jnp.float32),)
    return out

  try:
    fwd_ms, c1 = time_fn(fwd, make_args, args.reps)
    bwd_ms, c2 = time_fn(fwd_bwd, functools.partial(make_args, with_ct=True), args.reps)
    _, dropped = fwd(*make_args(0))
  except Exception as exc:  # noqa: BLE001  (one failing backend must not end the run)
    emit(dict(kind='block', case=case, backend=backend, error=repr(exc)[:500]))
    return
  emit(dict(kind='block', case=case, backend=backend, tokens=n, experts=e, k=k, d=d, f=f,
            groups=b, dtype=str(dtype), fwd_ms=fwd_ms, fwd_bwd_ms=bwd_ms,
            fwd_tflops=tflops(flops_fwd, fwd_ms), fwd_bwd_tflops=tflops(3 * flops_fwd, bwd_ms),
            drop_frac=int(dropped) / (n * k), compile_s=c1 + c2,
            tiles=dataclasses.asdict(tiles) if backend in GROUPED_BACKENDS else None))


# ---- one grouped matmul alone ------------------------------------------------------------------


def kernel_inputs(c, dtype, block_m, rep):
  """Expert-sorted rows of one routing: our padded layout and the unpadded one with group sizes."""
  n, e, k, d, f = c['tokens'], c['experts'], c['k'], c['d'], c['f']
  key = jax.random.fold_in(jax.random.key(5), rep)
  idx, _ = routing(key, n, e, k, 0.0)
  lay = grouped_gemm.make_layout(idx, jnp.ones(n, bool), e, block_m)
  x_md = jnp.where(lay.used_m[:, None],
                   jax.random.normal(jax.random.fold_in(key, 1), (lay.used_m.shape[0], d)), 0)
  dy_mf = jnp.where(lay.used_m[:, None],
                    jax.random.normal(jax.random.fold_in(key, 2), (lay.used_m.shape[0], f)), 0)
  counts_e = jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)
  return lay, x_md.astype(dtype), dy_mf.astype(dtype), counts_e


def our_kernels(tiles):
  """name -> (jitted fn of (lay, x_md, dy_mf, w_edf)), for gmm, gmm_t and tgmm."""
  kw = dict(tiles=tiles, interpret=INTERPRET)
  return {
      'gmm': jax.jit(lambda lay, x, dy, w: gg.gmm(x, w, lay.tile_expert_t, **kw)),
      'gmm_t': jax.jit(lambda lay, x, dy, w: gg.gmm(dy, w, lay.tile_expert_t, transpose_rhs=True,
                                                    **kw)),
      'tgmm': jax.jit(lambda lay, x, dy, w: gg.tgmm(x, dy, lay.group_tiles_e1,
                                                    block_m=tiles.block_m, **kw)),
  }


def time_ours(emit, case, c, dtype, tiles, reps, names=('gmm', 'gmm_t', 'tgmm'), kind='kernel',
              queued=False):
  e, d, f = c['experts'], c['d'], c['f']
  flops = 2 * c['tokens'] * c['k'] * d * f
  w_edf = make_experts(jax.random.key(0), e, d, f, dtype)[0]
  fns = our_kernels(tiles)
  for name in names:
    def make_args(rep):
      lay, x, dy, _ = kernel_inputs(c, dtype, tiles.block_m, rep)
      return lay, x, dy, w_edf
    rec = dict(kind=kind, case=case, impl='ours', kernel=name,
               tiles={key: getattr(tiles, key) for key in
                      (TGMM_FIELDS if name == 'tgmm' else GMM_FIELDS)})
    try:
      ms = (time_queued(fns[name], make_args(0), reps) if queued else
            time_fn(fns[name], make_args, reps)[0])
      rec.update(ms=ms, tflops=tflops(flops, ms), timing='queued' if queued else 'synced')
    except Exception as exc:  # noqa: BLE001  (e.g. a tile config over the shared-memory limit)
      rec.update(error=repr(exc)[:300])
    emit(rec)


def time_mgpu(emit, case, c, dtype, reps):
  """jax's Mosaic GPU Hopper ragged dot (x@W, dy@W^T) and transposed ragged dot (x^T@dy)."""
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd  # noqa: PLC0415
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd  # noqa: PLC0415
  except Exception as exc:  # noqa: BLE001
    emit(dict(kind='kernel', case=case, impl='mgpu', skipped=repr(exc)[:200]))
    return
  e, d, f, rows = c['experts'], c['d'], c['f'], c['tokens'] * c['k']
  flops = 2 * rows * d * f
  w_edf = make_experts(jax.random.key(0), e, d, f, dtype)[0]
  cfg = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
  fns = {
      'gmm': jax.jit(lambda x, dy, g: rd.ragged_dot(x, w_edf, group_sizes=g, **cfg)),
      'gmm_t': jax.jit(lambda x, dy, g: rd.ragged_dot(dy, w_edf, group_sizes=g,
                                                      transpose_rhs=True, **cfg)),
      'tgmm': jax.jit(lambda x, dy, g: trd.transposed_ragged_dot(x, dy, group_sizes=g, **cfg)),
  }

  def make_args(rep):  # unpadded expert-sorted rows
    key = jax.random.fold_in(jax.random.key(5), rep)
    idx, _ = routing(key, c['tokens'], e, c['k'], 0.0)
    g = jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, d)).astype(dtype)
    dy = jax.random.normal(jax.random.fold_in(key, 2), (rows, f)).astype(dtype)
    return x, dy, g

  for name, fn in fns.items():
    rec = dict(kind='kernel', case=case, impl='mgpu', kernel=name, config=cfg)
    try:
      ms, _ = time_fn(fn, make_args, reps)
      rec.update(ms=ms, tflops=tflops(flops, ms))
    except Exception as exc:  # noqa: BLE001
      rec.update(error=repr(exc)[:300])
    emit(rec)


def sweep(emit, case, c, dtype, grid, reps, queued):
  """Every config of the grid, each kernel timed once per distinct setting of its own fields."""
  keys = list(grid)
  seen = set()
  for values in itertools.product(*(grid[key] for key in keys)):
    tiles = dataclasses.replace(gg.GPU_TILES, **dict(zip(keys, values)))
    for name in ('gmm', 'gmm_t', 'tgmm'):
      fields = TGMM_FIELDS if name == 'tgmm' else GMM_FIELDS
      sig = (name,) + tuple(getattr(tiles, key) for key in fields)
      if sig in seen:
        continue
      seen.add(sig)
      time_ours(emit, case, c, dtype, tiles, reps, names=(name,), kind='sweep', queued=queued)


# ---- numerical check ---------------------------------------------------------------------------


def check(emit, tiles):
  """grouped vs the dense reference (HIGHEST precision, f32) on a small uneven shape, f32 and bf16.

  Returns True when every error is within tolerance (f32 5e-5, bf16 3e-2 of max|ref|). The
  SwiGLU limit is the model's 10, out of reach here: with a reachable one, a pre-activation within
  rounding of the limit flips its clip gradient between two summation orders (seen: 1e-3 in dx).
  """
  n, e, k, d, f = 1024, 16, 4, 256, 192
  ks = jax.random.split(jax.random.key(11), 6)
  logits = jax.random.normal(ks[0], (n, e)) + 2.0 * (jnp.arange(e) == 0)  # a hot expert
  logits = logits.at[:, 5].set(-1e9)  # and an empty one
  top_val, idx = jax.lax.top_k(logits, k)
  weight = jax.nn.softmax(top_val, axis=-1)
  valid = jax.random.uniform(ks[1], (n,)) > 0.1
  x = jax.random.normal(ks[2], (n, d))
  experts = make_experts(ks[3], e, d, f, jnp.float32)
  ct = jax.random.normal(ks[4], (n, d))

  def loss(backend, dtype, x, weight, wg, wu, wd):
    y, _ = expert_ffn(x.astype(dtype), idx, weight, valid, wg.astype(dtype), wu.astype(dtype),
                      wd.astype(dtype), swiglu_limit=SWIGLU_LIMIT, backend=backend,
                      grouped_tiles=tiles)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  ok = True
  for dtype, tol in ((jnp.float32, 5e-5), (jnp.bfloat16, 3e-2)):
    with jax.default_matmul_precision('highest'):
      (_, y_ref), g_ref = jax.jit(jax.value_and_grad(
          functools.partial(loss, 'reference', jnp.float32), argnums=(0, 1, 2, 3, 4),
          has_aux=True))(x, weight, *experts)
    with jax.default_matmul_precision('highest'):  # XLA's f32 combine einsum: not TF32 either
      (_, y), g = jax.jit(jax.value_and_grad(functools.partial(loss, 'grouped', dtype),
                                             argnums=(0, 1, 2, 3, 4), has_aux=True))(
          x, weight, *experts)
    errs = {}
    for name, a, r in zip(('y', 'dx', 'dweight', 'dw_gate', 'dw_up', 'dw_down'),
                          (y, *g), (y_ref, *g_ref)):
      a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
      errs[name] = float(np.abs(a - r).max() / max(np.abs(r).max(), 1e-30))
    passed = all(v <= tol for v in errs.values())
    ok &= passed
    emit(dict(kind='check', dtype=jnp.dtype(dtype).name, tol=tol, passed=passed, max_rel_err=errs,
              tiles=dataclasses.asdict(tiles), device=str(jax.devices()[0].device_kind)))
  return ok


def main(argv=None):
  args = parse_args(argv)
  emit = jsonl_emitter(args.out)
  dtype = jnp.dtype(args.dtype)
  tiles = parse_tiles(args.tiles)
  if args.check:
    sys.exit(0 if check(emit, tiles) else 1)
  grid = {}
  for item in args.sweep:
    key, values = item.split('=')
    grid[key] = [int(v) for v in values.split(',')]
  for case in filter(None, args.cases.split(',')):
    c = CASES[case]
    try:
      if grid:
        sweep(emit, case, c, dtype, grid, args.reps, args.queued)
        continue
      if not args.no_block:
        for backend in filter(None, args.backends.split(',')):
          bench_block(emit, case, c, backend, args, dtype, tiles)
      kernels = args.kernels.split(',')
      if 'ours' in kernels:
        time_ours(emit, case, c, dtype, tiles, args.reps, queued=args.queued)
      if 'mgpu' in kernels:
        time_mgpu(emit, case, c, dtype, args.reps)
    except Exception:  # noqa: BLE001  (report and go on to the next case)
      emit(dict(case=case, error=traceback.format_exc()[-800:]))


if __name__ == '__main__':
  main()
