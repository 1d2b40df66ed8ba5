"""One update of a config from its initialisation, and which parameters it leaves non-finite
or moves most: a first look when a run stops with a non-finite loss at its second step.

    python benchmarks/check_update_finite.py --config=configs/ablation_1b.py \
        --config.train.optimizer=muon_hybrid --config.data.seq_len=4096 \
        --config.train.batch_size=8 --config.train.remat=none
"""

from __future__ import annotations

import jax
import numpy as np
from absl import app
from ml_collections import config_flags

from deepseek41.config import resolve
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.state import named_leaves

_CONFIG = config_flags.DEFINE_config_file('config', None, 'A get_config() file.')


def synthetic_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  b, t = cfg.train.batch_size, cfg.data.seq_len
  tokens = rng.integers(3, cfg.model.vocab_size, (b, t + 1)).astype(np.int32)
  return {'tokens': tokens[:, :-1], 'targets': tokens[:, 1:],
          'segment_ids': np.ones((b, t), np.int32),
          'positions': np.tile(np.arange(t, dtype=np.int32), (b, 1)),
          'loss_mask': np.ones((b, t), np.int32), 'modality': np.zeros((b, t), np.int32)}


def main(argv):
  del argv
  cfg = resolve(_CONFIG.value)
  mesh = make_mesh(cfg.mesh)
  tx = make_optimizer(cfg.train)
  state, shardings = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  md = state_lib.model_def(cfg, tx)
  bsh = batch_sharding(mesh, cfg.mesh.rules)
  batch = {k: jax.device_put(v, bsh) for k, v in synthetic_batch(cfg).items()}
  before = {k: np.asarray(v, np.float32) for k, v in named_leaves(state['params']).items()}
  with jax.set_mesh(mesh):
    step = jax.jit(objective_for(cfg).make_train_step(md), in_shardings=(shardings, bsh),
                   out_shardings=(shardings, None))
    new, metrics = step(state, batch)
  print(f"loss {float(metrics['loss']):.6f} grad_norm {float(metrics['grad_norm']):.6f}")
  rows = []
  for name, after in named_leaves(new['params']).items():
    after = np.asarray(after, np.float32)
    delta = after - before[name]
    finite = bool(np.isfinite(after).all())
    rms = float(np.sqrt(np.mean(np.square(delta)))) if finite else float('nan')
    rows.append((not finite, rms, name, after.shape))
  bad = [r for r in rows if r[0]]
  print(f'{len(bad)} of {len(rows)} parameters non-finite after the update')
  for _, _, name, shape in bad[:20]:
    print(f'  non-finite: {name} {shape}')
  for _, rms, name, shape in sorted((r for r in rows if not r[0]), key=lambda r: -r[1])[:10]:
    print(f'  update rms {rms:.3e}: {name} {shape}')


if __name__ == '__main__':
  app.run(main)
