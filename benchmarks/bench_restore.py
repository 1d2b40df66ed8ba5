"""Where a restart's checkpoint restore goes: a synthetic fp32 state of --gb gigabytes in
--leaves arrays (a model's parameters and optimizer moments stand-in) saved through the
trainer's Checkpointer with and without zstd on the arrays (checkpoint.compress), then, each
timed on its own: the checksum verification the trainer runs before a restore (in one thread,
as before docs/performance.md section 62, and in parallel pieces), and Orbax's restore of the
state onto the default device. One JSON line per codec.

    .venv/bin/python benchmarks/bench_restore.py --gb=4 [--leaves=600] [--dir=/tmp/restore]

The files were just written, so they are read from the page cache, as in a restart soon after
the save; a restart from a cold disk reads at the disk's speed (not measured here).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from deepseek41.config import CheckpointConfig, base_config
from deepseek41.train import checksums
from deepseek41.train.checkpoint import Checkpointer

_GB = flags.DEFINE_float('gb', 2.0, 'Size of the fp32 state.')
_LEAVES = flags.DEFINE_integer('leaves', 400, 'Arrays in the state.')
_DIR = flags.DEFINE_string('dir', '/tmp/bench_restore', 'Work directory (emptied first).')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Timings of each part.')


def _state(gb: float, leaves: int):
  per = max(1, int(gb * 1e9 / 4 / leaves))
  cols = 1024
  rows = max(1, per // cols)
  key = jax.random.key(0)
  return {f'w{i:04d}': jax.random.normal(jax.random.fold_in(key, i), (rows, cols), jnp.float32)
          for i in range(leaves)}


def _timed(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return out, min(times)


def _measure(state, compress: bool) -> dict:
  shutil.rmtree(_DIR.value, ignore_errors=True)
  nbytes = sum(x.nbytes for x in state.values())
  ck = Checkpointer(_DIR.value, CheckpointConfig(
      **{**base_config().checkpoint.to_dict(), 'async_save': False, 'compress': compress}))
  t0 = time.perf_counter()
  ck.save(1, state, None, {}, {})
  ck.wait()
  save_s = time.perf_counter() - t0
  step_dir = ck.step_dir(1)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  one, one_s = _timed(lambda: checksums.file_checksums(step_dir, threads=1), _REPEATS.value)
  many, many_s = _timed(lambda: checksums.file_checksums(step_dir), _REPEATS.value)
  assert one == many
  _, verify_s = _timed(lambda: ck.verify(1), _REPEATS.value)
  restored, restore_s = _timed(lambda: jax.block_until_ready(ck.restore(1, target, None)),
                               _REPEATS.value)
  assert all(bool(jnp.array_equal(restored[k], state[k])) for k in list(state)[:3])
  ck.close()
  files = [os.path.join(r, f) for r, _, names in os.walk(step_dir) for f in names]
  out = {
      'compress': compress, 'state_gb': round(nbytes / 1e9, 2),
      'disk_gb': round(sum(os.path.getsize(f) for f in files) / 1e9, 2),
      'leaves': len(state), 'files': len(files), 'cpus': os.cpu_count(),
      'device': str(jax.devices()[0].device_kind), 'save_s': round(save_s, 2),
      'checksums_one_thread_s': round(one_s, 2), 'checksums_parallel_s': round(many_s, 2),
      'verify_s': round(verify_s, 2), 'restore_s': round(restore_s, 2),
      'restore_gb_per_s': round(nbytes / 1e9 / restore_s, 2)}
  shutil.rmtree(_DIR.value, ignore_errors=True)
  return out


def main(argv):
  del argv
  state = _state(_GB.value, _LEAVES.value)
  for compress in (True, False):  # Orbax's zstd (before section 62), then the default
    print(json.dumps(_measure(state, compress)), flush=True)


if __name__ == '__main__':
  app.run(main)
