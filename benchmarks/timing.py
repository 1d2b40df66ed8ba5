"""Shared timing for the benchmarks: warm-up, fresh inputs per repetition, median."""

import json
import statistics
import time

import jax


def time_fn(fn, make_args, reps):
  """Median wall time (ms) of fn over reps fresh argument sets, after one warm-up (compile) call."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*make_args(0)))
  compile_s = time.perf_counter() - t0
  times = []
  for rep in range(reps):
    args = jax.block_until_ready(make_args(rep + 1))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), compile_s


def time_queued(fn, args, reps):
  """ms per call of `reps` calls queued back to back (no host sync between them), the best of
  three such runs after a warm-up: for kernels short enough that a per-call sync would count
  the dispatch."""
  jax.block_until_ready(fn(*args))
  best = float('inf')
  for _ in range(3):
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) * 1e3 / reps)
  return best


def jsonl_emitter(path):
  """emit(record): print it as one JSON line and, with a path, append it there at once."""
  def emit(rec):
    print(json.dumps(rec), flush=True)
    if path:
      with open(path, 'a') as f:
        f.write(json.dumps(rec) + '\n')
  return emit


def agreement(o, lse, o_ref, lse_ref) -> dict:
  """How an attention partial (o, lse) differs from another kernel's: the largest |o| and |lse|
  differences (lse over the rows that see something) and whether the rows that see nothing
  agree."""
  import jax.numpy as jnp
  finite = jnp.isfinite(lse_ref)
  return dict(max_abs_o=float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref.astype(jnp.float32)))),
              max_abs_lse=float(jnp.max(jnp.where(finite, jnp.abs(lse - lse_ref), 0.0))),
              same_blind_rows=bool(jnp.all(finite == jnp.isfinite(lse))))


def print_against_first(rows, case_keys):
  """A kernel table: one line per record (rows with ms, tflops, kernel and the `agreement`
  fields), the speed of each against the first record of its case (the same `case_keys`)."""
  print('\n' + ' '.join(f'{k:>9}' for k in case_keys) +
        f" {'kernel':<10} {'ms':>9} {'TFLOP/s':>8} {'vs first':>9} {'max|do|':>8} {'max|dlse|':>9}")
  first_ms = {}
  for r in rows:
    case = tuple(r[k] for k in case_keys)
    first_ms.setdefault(case, r['ms'])
    print(' '.join(f'{v!s:>9}' for v in case) +
          f" {r['kernel']:<10} {r['ms']:>9.4f} {r['tflops']:>8.1f}"
          f" {first_ms[case] / r['ms']:>8.2f}x {r.get('max_abs_o', 0.0):>8.4f}"
          f" {r.get('max_abs_lse', 0.0):>9.2e}")
