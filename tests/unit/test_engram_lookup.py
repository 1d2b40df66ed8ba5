"""The Engram table exchange (ops/parallel/engram_lookup.py) on 8 fake CPU devices against the
plain gather.

Rows and the table's gradient on meshes whose table group is one axis, two axes (fsdp x expert,
in rule order), or absent, with tokens split over data and context and replicated over tensor;
repeated ids (frequent n-grams, padding) included. The rows are copies, so they agree exactly;
the gradient is a scatter-add whose sums are split across devices (f32, ~1e-7).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from deepseek41.config import DEFAULT_RULES, mesh_rules
from deepseek41.ops.parallel import engram_lookup as el
from deepseek41.sharding import fitted_spec

B, T, J, R, H = 8, 32, 4, 4096, 8
AXES = ('data', 'fsdp', 'expert', 'tensor', 'context')


def _mesh(**sizes):
  shape = tuple(sizes.get(a, 1) for a in AXES)
  n = int(np.prod(shape))
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 5, devices=jax.devices()[:n])


def _inputs(seed=0):
  table = jax.random.normal(jax.random.key(seed), (R, H), jnp.float32)
  ids = jax.random.randint(jax.random.key(seed + 1), (B, T, J), 0, R)
  ids = ids.at[0].set(5).at[3, :, 1].set(R - 1)  # one row all one id; a column of the last row
  return table, ids


def _placed(mesh, table, ids):
  """Table and ids sharded as the trainer shards them (the rules' specs)."""
  rules = mesh_rules(DEFAULT_RULES)
  tab = fitted_spec(('engram_rows', 'engram_dim'), table.shape, rules, mesh)
  tok = fitted_spec(('batch', 'length', None), ids.shape, rules, mesh)
  return (jax.device_put(table, NamedSharding(mesh, tab)),
          jax.device_put(ids, NamedSharding(mesh, tok)))


def _loss(table, ids, capacity):
  rows, dropped = el.lookup_rows(table, ids, capacity=capacity)
  w = jnp.cos(jnp.arange(B * T * J * H, dtype=jnp.float32)).reshape(B, T, J, H)
  return jnp.sum(rows * w), (rows, dropped)


MESHES = {'fsdp2_expert2_data2': dict(data=2, fsdp=2, expert=2),
          'fsdp8': dict(fsdp=8),
          'expert2_tensor2_context2': dict(expert=2, tensor=2, context=2),
          'fsdp4_context2': dict(fsdp=4, context=2),
          'data8_no_group': dict(data=8)}


@pytest.mark.parametrize('capacity', [0.0, 2.0])
@pytest.mark.parametrize('mesh', MESHES)
def test_exchange_equals_the_plain_gather(mesh, capacity):
  table, ids = _inputs()
  (_, (want_rows, _)), want_grad = jax.value_and_grad(_loss, has_aux=True)(table, ids, capacity)
  m = _mesh(**MESHES[mesh])
  tab, tok = _placed(m, table, ids)
  with jax.set_mesh(m):
    fn = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=2)
    (_, (rows, dropped)), grad = fn(tab, tok, capacity)
    if mesh != 'data8_no_group':  # the ids travel to their owners: no gather of the group's ids
      hlo = fn.lower(tab, tok, capacity).compile().as_text()
      assert 'all-to-all' in hlo
  assert int(dropped) == 0
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-5)


def _expected_drops(ids, owners, width, rows_per_owner):
  """Per device (one batch row each on data=2 x fsdp=4): lookups whose distinct id ranks past
  `width` among its owner's distinct ids."""
  dropped, kept_masks = 0, []
  for b in range(ids.shape[0]):
    flat = np.asarray(ids[b]).ravel()
    uniq = np.unique(flat)
    owner = uniq // rows_per_owner
    keep = np.concatenate([uniq[owner == s][:width] for s in range(owners)])
    kept = np.isin(np.asarray(ids[b]), keep)
    dropped += int((~kept).sum())
    kept_masks.append(kept)
  return dropped, np.stack(kept_masks)


def test_overflowing_chunks_drop_and_count(monkeypatch):
  """Past a chunk the rows read zero and every lost lookup is counted; the rest stay exact."""
  monkeypatch.setattr(el, 'MIN_CHUNK', 1)
  table, ids = _inputs(seed=3)
  m = _mesh(data=2, fsdp=4)
  tab, tok = _placed(m, table, ids)
  # One batch row per device pair: 4 rows per data shard -> 1 row per (data, fsdp) device.
  lookups = (B // 8) * T * J
  width = el.chunk_ids(lookups, 4, 0.5)
  assert width < lookups
  with jax.set_mesh(m):
    rows, dropped = jax.jit(lambda t, i: el.lookup_rows(t, i, capacity=0.5))(tab, tok)
  want_dropped, kept = _expected_drops(ids, 4, width, R // 4)
  assert want_dropped > 0 and int(dropped) == want_dropped
  rows, plain = np.asarray(rows), np.asarray(el.lookup_reference(table, ids))
  np.testing.assert_array_equal(rows[kept], plain[kept])
  assert not rows[~kept].any()


def test_chunk_width():
  assert el.chunk_ids(100_000, 128, 2.0) == 1563
  assert el.chunk_ids(1000, 128, 2.0) == el.MIN_CHUNK      # small exchanges go whole-ish
  assert el.chunk_ids(100, 128, 2.0) == 100                # never more than the lookups
  assert el.chunk_ids(100_000, 128, 0.0) == 100_000        # exact
