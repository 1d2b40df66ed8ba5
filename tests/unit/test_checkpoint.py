"""Checkpoints restore onto another mesh; the schedule and weight-decay mask do what they say."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.config import resolve
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.optimizer import (decay_mask, learning_rate_schedule, make_optimizer,
                                        schedule_values)
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
  # The trainer's step takes the schedule's numbers as an argument: one program serves every
  # lr, length and warm-up, and gives each the values of its schedule compiled in, bit for bit.
  traced = jax.jit(lambda c, v: learning_rate_schedule(cfg.train, v)(c))
  counts = jnp.arange(100)
  np.testing.assert_array_equal(traced(counts, schedule_values(cfg.train)), lr(counts))
  other = dataclasses.replace(cfg.train, lr=3e-4, steps=37, warmup_steps=0, min_lr_ratio=0.02,
                              wsd_decay_fraction=0.3)
  np.testing.assert_array_equal(traced(counts, schedule_values(other)),
                                learning_rate_schedule(other)(counts))
  assert traced._cache_size() == 1


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


def _state_bytes_on_disk(step_dir):
  return sum(os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(os.path.join(step_dir, 'state')) for f in files)


def test_state_arrays_are_stored_uncompressed_and_either_codec_restores(tmp_path):
  """checkpoint.compress=False (the default) stores the arrays' bytes as they are: a state of
  ones takes its full size, where zstd shrinks it to almost nothing. A checkpoint records its
  codec, so one saved with compression restores under the default and the other way round."""
  state = {'w': jax.numpy.ones((256, 1024), jax.numpy.float32), 'step': jax.numpy.int32(3)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  sizes = {}
  for compress in (False, True):
    cfg = resolve(small_config(**{'checkpoint.compress': compress}), backend='cpu').checkpoint
    ck = Checkpointer(str(tmp_path / str(compress)), cfg)
    ck.save(1, state, None, {}, {})
    ck.close()
    sizes[compress] = _state_bytes_on_disk(ck.step_dir(1))
    other = resolve(small_config(**{'checkpoint.compress': not compress}),
                    backend='cpu').checkpoint
    reader = Checkpointer(str(tmp_path / str(compress)), other)
    assert reader.verify(1)
    restored = reader.restore(1, target, None)
    reader.close()
    np.testing.assert_array_equal(np.asarray(restored['w']), 1.0)
    assert int(restored['step']) == 3
  assert sizes[False] > 256 * 1024 * 4 > 50 * sizes[True], sizes
