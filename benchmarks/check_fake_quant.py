"""Check on a device that the jitted fake quantizers really quantize and match the host reference.

Usage (GPU):        python benchmarks/check_fake_quant.py            (exit 1 on a failure)
       (CPU smoke):  JAX_PLATFORMS=cpu python benchmarks/check_fake_quant.py --reps 5

Why: with XLA's default `xla_allow_excess_precision`, a jitted `astype(float4).astype(bf16)` round
trip is folded away on the H200 (docs/performance.md, first trap), so a QAT can train nothing in low
precision while the CPU tests pass. For each format of deepseek41.quant, in bf16 and f32 on
[rows, cols] inputs (normal values, per-row magnitudes 2^-10..2^10), this reports
  (a) max |fq(x) - x|, which must be > 0;
  (b) the fraction of elements equal to `quant.qdq_reference` computed with numpy and ml_dtypes
      on the host, which must be 1.0;
  (c) whether jit(grad) of sum(fq(x) * w) is exactly w (the straight-through estimator);
  (d) the median time per jitted call over --reps fresh inputs (benchmarks/timing.py).
Rows `cast:*` are the naive convert round trips, for information only: on a device that folds
them, max |diff| is 0 and they do not match the reference; they never fail the check.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41 import quant  # noqa: E402

FORMATS = ('fp4_e4m3_16', 'fp4_ue8m0_32', 'fp8_ue8m0_32')
DTYPES = {'bfloat16': (jnp.bfloat16, ml_dtypes.bfloat16), 'float32': (jnp.float32, np.float32)}


def naive_casts():
  """The convert round trips the trap is about (no block scale): name -> (jax fn, host fn)."""
  def fp4(x):
    return x.astype(jnp.float4_e2m1fn).astype(x.dtype)

  def fp8(x):  # e4m3fn has no inf: clip or the cast gives NaN
    return jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn).astype(x.dtype)

  def fp4_host(x):
    return x.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(x.dtype)

  def fp8_host(x):
    return np.clip(x.astype(np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(x.dtype)

  return {'cast:float4_e2m1fn': (fp4, fp4_host), 'cast:float8_e4m3fn': (fp8, fp8_host)}


def make_input(key, shape, dtype):
  k_x, k_m = jax.random.split(key)
  mag = jnp.exp2(jax.random.uniform(k_m, shape[:-1] + (1,), minval=-10.0, maxval=10.0))
  return (jax.random.normal(k_x, shape) * mag).astype(dtype)


def equal_fraction(a, b):
  a = np.asarray(a).astype(np.float32)
  b = np.asarray(b).astype(np.float32)
  return float(np.mean((a == b) | (np.isnan(a) & np.isnan(b))))


def check(name, fn, host_fn, dtype_name, args):
  jdtype, _ = DTYPES[dtype_name]
  shape = (args.rows, args.cols)
  make = jax.jit(functools.partial(make_input, shape=shape, dtype=jdtype))
  x = make(jax.random.key(0))
  f = jax.jit(fn)
  out = f(x)
  x_host = np.asarray(x)
  max_diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - x.astype(jnp.float32))))
  eq = equal_fraction(out, host_fn(x_host))

  w = make(jax.random.key(1))
  grad = jax.jit(jax.grad(lambda v: jnp.sum(fn(v) * w)))(x)
  ste = bool(np.array_equal(np.asarray(grad).astype(np.float32), np.asarray(w).astype(np.float32)))

  ms, _ = time_fn(f, lambda i: (make(jax.random.key(100 + i)),), args.reps)
  return dict(quantizer=name, dtype=dtype_name, max_abs_diff=max_diff, equal_to_reference=eq,
              ste_exact=ste, median_ms=ms, out_dtype=str(out.dtype))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rows', type=int, default=4096)
  p.add_argument('--cols', type=int, default=512)
  p.add_argument('--reps', type=int, default=20)
  p.add_argument('--out', help='write the results as JSON here')
  args = p.parse_args(argv)

  dev = jax.devices()[0]
  print(f'# fake-quant check on {dev.platform} ({dev.device_kind}), jax {jax.__version__}, '
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, shape [{args.rows}, {args.cols}]\n")

  rows, failed = [], []
  cases = [(name, quant.get_fake_quant(name), functools.partial(quant.qdq_reference, name), True)
           for name in FORMATS]
  cases += [(name, fn, host, False) for name, (fn, host) in naive_casts().items()]
  for name, fn, host_fn, required in cases:
    for dtype_name in DTYPES:
      r = check(name, fn, host_fn, dtype_name, args)
      bad = []
      if r['max_abs_diff'] <= 0:
        bad.append('no-op')
      if r['equal_to_reference'] < 1.0:
        bad.append('differs from reference')
      if not r['ste_exact'] and required:
        bad.append('grad != w')
      if r['out_dtype'] != dtype_name:
        bad.append(f"dtype {r['out_dtype']}")
      r['status'] = (('FAIL: ' if required else 'info: ') + ', '.join(bad)) if bad else 'ok'
      if bad and required:
        failed.append(f'{name}/{dtype_name}')
      if not required:
        r['ste_exact'] = None  # a cast's gradient goes through the cast too: no STE to check
      rows.append(r)

  print('| quantizer | dtype | max abs(fq(x) - x) | equal to host ref | STE grad == w | '
        'median ms | status |')
  print('|---|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['quantizer']} | {r['dtype']} | {r['max_abs_diff']:.4g} | "
          f"{r['equal_to_reference']:.6f} | {'-' if r['ste_exact'] is None else r['ste_exact']} | "
          f"{r['median_ms']:.3f} | "
          f"{r['status']} |")
  if args.out:
    with open(args.out, 'w') as fh:
      json.dump(dict(device=f'{dev.platform} {dev.device_kind}', jax=jax.__version__,
                     xla_flags=os.environ.get('XLA_FLAGS', ''), shape=[args.rows, args.cols],
                     rows=rows), fh, indent=1)
  if failed:
    print(f'\nFAILED: {", ".join(failed)}')
    return 1
  print('\nall fake quantizers quantize and match the host reference')
  return 0


if __name__ == '__main__':
  sys.exit(main())
