"""CSA2's indexer trained by the train step: its distillation loss falls and its recall rises."""

import jax
import numpy as np

from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import make_train_step
from tests.helpers import CSA2_SMALL, aligned_batch, resolved


def test_indexer_learns_its_target():
  cfg = resolved(**{**CSA2_SMALL, 'train.lr': 1e-2, 'train.warmup_steps': 1, 'train.steps': 40})
  tx = make_optimizer(cfg.train)
  state, _ = state_lib.init_state(cfg, tx, make_mesh(cfg.mesh, jax.devices()[:1]),
                                  cfg.mesh.rules)
  step = jax.jit(make_train_step(cfg, state_lib.model_def(cfg, tx)))
  batch = aligned_batch(7)
  history = []
  for _ in range(40):
    state, m = step(state, batch)
    history.append((float(m['indexer_loss']), float(m['indexer_recall'])))
  (loss0, recall0), (loss1, recall1) = np.mean(history[:3], 0), np.mean(history[-3:], 0)
  assert loss1 < 0.85 * loss0
  assert recall1 > recall0
