"""One optimizer step on a model's real parameter tree: the optax chain against the fused AdamW.

Usage (GPU):  python benchmarks/bench_optimizer.py [--config configs/ablation_1b.py]
              [--reps 10] [--out optimizer.jsonl] [--hlo_dir DIR]

Variants, each jitted with the parameters and optimizer state donated (as the train step has
them), on fresh random gradients per repetition:
  optax    the chain (clip, AdamW, group multipliers) then optax.apply_updates
  per_leaf train/optimizer.py's fused apply with every leaf on the jnp reference (the same
           arithmetic written leaf by leaf: does the grouping alone change XLA's fusions?)
  kernel   the fused apply: ops/adamw_kernel.py for every leaf it takes (train.optimizer_impl
           =fused, the GPU default)
`bound_ms` is the bandwidth bound of one pass (fp32: read g, p, mu, nu and write p, mu, nu,
plus one read of g for the global norm: 32 bytes a parameter) at the H200's 4.8 TB/s.
`fusions` / `kernels`: the fusions and custom calls in the compiled step's entry computation.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import jsonl_emitter, time_fn  # noqa: E402
from deepseek41.config import load_config_file, resolve  # noqa: E402
from deepseek41.sharding import make_mesh  # noqa: E402
from deepseek41.train import state as state_lib  # noqa: E402
from deepseek41.train.optimizer import apply_gradients, fused_optimizer, reference_optimizer  # noqa: E402

HBM_TBPS = 4.8


def _entry_counts(hlo: str) -> tuple[int, int, int]:
  entry = hlo[hlo.index('\nENTRY'):]
  return tuple(len(re.findall(pattern, entry))
               for pattern in (r'= \S+ fusion\(', r'custom-call\(', r'= \S+ copy\('))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument('--config', default='configs/ablation_1b.py')
  ap.add_argument('--reps', type=int, default=10)
  ap.add_argument('--variants', default='optax,per_leaf,kernel')
  ap.add_argument('--out', default='')
  ap.add_argument('--hlo_dir', default='')
  ap.add_argument('--profile_dir', default='', help='a jax.profiler trace per variant, here')
  args = ap.parse_args(argv)
  emit = jsonl_emitter(args.out)

  cfg = resolve(load_config_file(args.config), num_devices=1)
  ref = reference_optimizer(cfg.train)
  state, _ = state_lib.init_state(cfg, ref, make_mesh(cfg.mesh, jax.devices()[:1]),
                                  cfg.mesh.rules)
  params, opt = state['params'], state['opt']
  leaves, treedef = jax.tree.flatten(params)
  n_params = sum(x.size for x in leaves)
  bound_ms = 32 * n_params / (HBM_TBPS * 1e12) * 1e3

  def grads_for(rep):
    keys = jax.random.split(jax.random.key(rep), len(leaves))
    return treedef.unflatten([1e-3 * jax.random.normal(k, x.shape, x.dtype)
                              for k, x in zip(keys, leaves)])

  variants = {'optax': ref, 'per_leaf': fused_optimizer(cfg.train, use_kernel=False),
              'kernel': fused_optimizer(cfg.train)}
  for name in args.variants.split(','):
    tx = variants[name]
    # the state in and out as one tree, donated, as the train step has it: JAX pairs donated
    # buffers with outputs by position and shape, so (params, opt) must come back in that order
    step = jax.jit(lambda g, c, tx=tx: apply_gradients(tx, g, c[1], c[0]), donate_argnums=(1,))
    carry = {'c': (params, opt)}
    hlo = step.lower(grads_for(0), (params, opt)).compile().as_text()
    fusions, kernels, copies = _entry_counts(hlo)
    if args.hlo_dir:
      os.makedirs(args.hlo_dir, exist_ok=True)
      with open(os.path.join(args.hlo_dir, f'optimizer_{name}.hlo.txt'), 'w') as f:
        f.write(hlo)

    def run(g):
      carry['c'] = step(g, carry['c'])
      return carry['c'][0]
    carry['c'] = jax.tree.map(jnp.copy, (params, opt))
    ms, compile_s = time_fn(run, lambda rep: (grads_for(rep),), args.reps)
    if args.profile_dir:
      g = jax.block_until_ready(grads_for(0))
      with jax.profiler.trace(os.path.join(args.profile_dir, name)):
        for _ in range(3):
          jax.block_until_ready(run(g))
    emit({'bench': 'optimizer', 'variant': name, 'config': args.config, 'params': n_params,
          'ms': round(ms, 3), 'bound_ms': round(bound_ms, 3),
          'gbps': round(32 * n_params / ms / 1e6, 1), 'fusions': fusions, 'kernels': kernels, 'copies': copies,
          'compile_s': round(compile_s, 1), 'device': jax.devices()[0].device_kind,
          'date': datetime.date.today().isoformat()})
  return 0


if __name__ == '__main__':
  sys.exit(main())
