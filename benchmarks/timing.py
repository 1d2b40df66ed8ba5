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
