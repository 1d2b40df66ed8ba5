"""Where a run's start-up goes: trace, compile and run of the state initialisation program.

    python benchmarks/bench_init.py configs/ablation_1b.py [--threefry_kernel] [--run]

Prints one JSON line: seconds to trace (eval_shape + lower), compile and (with --run) execute
the program that `train/state.py:init_state` jits on one device, its fusion count, and a
checksum of the parameters (to hold the values equal across variants).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from deepseek41.config import load_config_file, resolve
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('config')
  ap.add_argument('--threefry_kernel', action='store_true',
                  help='jax_threefry_gpu_kernel_lowering: the PRNG as one GPU kernel')
  ap.add_argument('--run', action='store_true')
  args = ap.parse_args()
  jax.config.update('jax_threefry_gpu_kernel_lowering', args.threefry_kernel)
  cfg = resolve(load_config_file(args.config), num_devices=1, backend=jax.default_backend())
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  t0 = time.perf_counter()
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, cfg.mesh.rules)
  with jax.set_mesh(mesh):
    lowered = jax.jit(state_lib._init_fn(cfg, tx), out_shardings=shardings).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    rec = {'config': args.config, 'backend': jax.default_backend(),
           'threefry_kernel': args.threefry_kernel, 'trace_s': round(t1 - t0, 2),
           'compile_s': round(t2 - t1, 2), 'fusions': compiled.as_text().count('fusion(')}
    if args.run:
      state = jax.block_until_ready(compiled())
      rec['run_s'] = round(time.perf_counter() - t2, 2)
      leaves = jax.tree.leaves(state['params'])
      rec['param_checksum'] = float(sum(np.float64(jnp.sum(x.astype(jnp.float32) ** 2))
                                        for x in leaves))
  print(json.dumps(rec), flush=True)


if __name__ == '__main__':
  main()
