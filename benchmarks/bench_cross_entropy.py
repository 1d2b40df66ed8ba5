"""The LM head + cross-entropy alone (ops/cross_entropy.py): forward + backward time and the
compiled program's temporary bytes, the whole logits (`model.head_chunk=0`) against the fused op
at several chunks.

Usage (GPU):
    python benchmarks/bench_cross_entropy.py --out head_ce.jsonl
    python benchmarks/bench_cross_entropy.py --small      # CPU smoke run (tiny shapes)

Cases: `1b_4k` = configs/ablation_1b.py's head at 8 x 4,096 tokens (D 1,024, V 16,384);
`1b_64k` = the same head at its shipped 1 x 65,536; `v41_vocab_64k` = V4.1's 129,280-token
vocabulary at 1 x 65,536 tokens, D 4,096. The inputs are in the compute dtype (bf16), the logits
fp32, as in training; one JSON line per (case, chunk): fwd_bwd_ms (median of --reps, fresh
inputs each), temp_gib (memory_analysis of the compiled program), model TFLOP/s (6 B T D V: the
fused op computes 8, its backward recomputing the logits), the loss, and the gradients' largest
difference from the whole-logits path relative to their largest magnitude.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from timing import jsonl_emitter, time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops.cross_entropy import (head_cross_entropy_sum,  # noqa: E402
                                          head_cross_entropy_sum_reference)

CASES = {
    '1b_4k': dict(b=8, t=4096, d=1024, v=16384),
    '1b_64k': dict(b=1, t=65536, d=1024, v=16384),
    'v41_vocab_64k': dict(b=1, t=65536, d=4096, v=129280),
}
SMALL_CASES = {
    'small': dict(b=2, t=96, d=32, v=512),
    'small_padded': dict(b=3, t=50, d=16, v=300),
}
CHUNKS = (0, 512, 1024, 2048)
SMALL_CHUNKS = (16, 40)


def make_inputs(seed, case, dtype):
  ks = jax.random.split(jax.random.key(seed), 4)
  b, t, d, v = case['b'], case['t'], case['d'], case['v']
  h = jax.random.normal(ks[0], (b, t, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(ks[1], (d, v), jnp.float32) * d ** -0.5).astype(dtype)
  targets = jax.random.randint(ks[2], (b, t), 0, v)
  mask = (jax.random.uniform(ks[3], (b, t)) > 0.05).astype(jnp.int32)  # a few masked targets
  return h, w, targets, mask


def step_fn(chunk):
  """jit(value and gradients w.r.t. h and W) of the mean token CE, as the train step takes it."""
  def loss(h, w, targets, mask):
    if chunk:
      ce_sum, n = head_cross_entropy_sum(h, w, targets, mask, chunk)
    else:
      ce_sum, n = head_cross_entropy_sum_reference(h, w, targets, mask)
    return ce_sum / jnp.maximum(n, 1.0)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _relative_error(got, want):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', help=f'comma list of {", ".join(CASES)}')
  p.add_argument('--chunks', help='comma list of head_chunk values; 0 = the whole logits')
  p.add_argument('--reps', type=int, default=10)
  p.add_argument('--dtype', help='the compute dtype of h and W (default bfloat16; --small: '
                 'float32)')
  p.add_argument('--small', action='store_true', help='tiny shapes for a CPU smoke run')
  p.add_argument('--out')
  args = p.parse_args(argv)
  cases = SMALL_CASES if args.small else CASES
  names = args.cases.split(',') if args.cases else list(cases)
  default_chunks = (0, *SMALL_CHUNKS) if args.small else CHUNKS
  chunks = [int(c) for c in args.chunks.split(',')] if args.chunks else list(default_chunks)
  dtype = jnp.dtype(args.dtype or ('float32' if args.small else 'bfloat16'))
  emit = jsonl_emitter(args.out)
  for name in names:
    case = cases[name]
    model_flop = 6 * case['b'] * case['t'] * case['d'] * case['v']
    plain = None  # the whole-logits path's (loss, grads) at seed 0, when it ran
    for chunk in chunks:
      row = {'case': name, **case, 'dtype': dtype.name, 'head_chunk': chunk,
             'device': jax.devices()[0].device_kind}
      run = step_fn(chunk)
      try:
        ms, compile_s = time_fn(run, lambda s: make_inputs(s, case, dtype), args.reps)
        mem = run.lower(*make_inputs(0, case, dtype)).compile().memory_analysis()
        loss, grads = run(*make_inputs(0, case, dtype))
      except jax.errors.JaxRuntimeError as e:  # the whole logits may not fit
        emit({**row, 'error': str(e).splitlines()[0][:300]})
        continue
      row.update(fwd_bwd_ms=round(ms, 3), model_tflops=round(model_flop / ms / 1e9, 1),
                 temp_gib=round(mem.temp_size_in_bytes / 2**30, 3) if mem else None,
                 temp_bytes=mem.temp_size_in_bytes if mem else None,
                 compile_s=round(compile_s, 1), loss=float(loss))
      if chunk == 0:
        plain = (loss, grads)
      elif plain is not None:
        row.update(dh_rel_err=_relative_error(grads[0], plain[1][0]),
                   dw_rel_err=_relative_error(grads[1], plain[1][1]))
      emit(row)


if __name__ == '__main__':
  main()
