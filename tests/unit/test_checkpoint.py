"""Checkpoints restore onto another mesh; the schedule and weight-decay mask do what they say."""

import jax
import numpy as np
import pytest

from deepseek41.config import resolve
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from deepseek41.train.warm_start import check_fits
from tests.helpers import small_config


def test_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path):
  mesh_a = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.expert': 2}
  mesh_b = {'mesh.data': 1, 'mesh.fsdp': 4, 'mesh.expert': 2}
  cfg_a = resolve(small_config(**mesh_a), num_devices=8, backend='cpu')
  tx = make_optimizer(cfg_a.train)
  state, _ = state_lib.init_state(cfg_a, tx, make_mesh(cfg_a.mesh), cfg_a.mesh.rules)
  ck = Checkpointer(str(tmp_path), cfg_a.checkpoint)
  abstract = state_lib.abstract_state(cfg_a, tx)
  ck.save(0, state, None, cfg_a.to_dict(), state_lib.state_layout(abstract))
  ck.close()

  for overrides in (mesh_b, {'mesh.data': 8}):
    cfg_b = resolve(small_config(**overrides), num_devices=8, backend='cpu')
    mesh = make_mesh(cfg_b.mesh)
    shardings = state_lib.state_shardings(abstract, mesh, cfg_b.mesh.rules)
    ck = Checkpointer(str(tmp_path), cfg_b.checkpoint)
    warnings = check_fits(ck, 0, state_lib.state_layout(abstract), cfg_b.to_dict())
    assert warnings and all(w.startswith('mesh.') for w in warnings), warnings  # only the mesh
    restored = ck.restore(0, state_lib.with_shardings(abstract, shardings), None)
    ck.close()
    for a, b, sh in zip(jax.tree.leaves(state), jax.tree.leaves(restored),
                        jax.tree.leaves(shardings)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      assert b.sharding.is_equivalent_to(sh, b.ndim)


@pytest.mark.parametrize('schedule', ['cosine', 'wsd', 'constant'])
def test_schedules(schedule):
  cfg = resolve(small_config(**{'train.schedule': schedule, 'train.steps': 100,
                                'train.warmup_steps': 10, 'train.lr': 1.0,
                                'train.min_lr_ratio': 0.1, 'train.wsd_decay_fraction': 0.5}),
                num_devices=1, backend='cpu')
  lr = learning_rate_schedule(cfg.train)
  values = [float(lr(c)) for c in range(100)]
  assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)  # warm-up
  assert all(a < b for a, b in zip(values[:9], values[1:10]))
  if schedule == 'cosine':
    assert values[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(values[9:], values[10:]))
  elif schedule == 'wsd':
    assert values[50] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1)
  else:
    assert values[-1] == pytest.approx(1.0)


def test_no_weight_decay_on_vectors():
  cfg = resolve(small_config(), num_devices=1, backend='cpu')
  abstract = state_lib.abstract_state(cfg, make_optimizer(cfg.train))
  mask = decay_mask(abstract['params'])
  flat = jax.tree_util.tree_flatten_with_path(mask)[0]
  names = {jax.tree_util.keystr(p): m for p, m in flat}
  assert any(m for m in names.values())
  for path, m in names.items():
    if any(s in path for s in ('norm', 'sink')):
      assert not m, path
    if any(s in path for s in ('w_gate', 'wq_a', 'embed', 'head')):
      assert m, path
