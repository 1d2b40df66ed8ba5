"""Kernels and row-indexed ops run on each device's own batch rows under a mesh.

GSPMD cannot split a pallas_call (it would gather the batch onto every device), so each kernel
sits inside a shard_map (ops/parallel/per_device.py, ops/parallel/expert_parallel.py). The whole
model with every kernel is checked in tests/kernels/test_parallel_axes.py (no pallas_call or
top_k outside a shard_map in the traced train loss; loss and gradients equal to 1 device, on
the data x fsdp x expert mesh among others). Here, the ops the model's kernel set leaves out or
that need their own splits: the indexer-score kernel (a GPU-only config choice), the image-span
attention, and the attention kernels' heads over tensor.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.ops.index_scores import index_scores_per_device, index_scores_reference
from deepseek41.sharding import make_mesh
from tests.helpers import kernels_outside_shard_map, resolved, sub_jaxprs

MESH8 = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.expert': 2}


def test_index_scores_per_device():
  mesh = make_mesh(resolved(num_devices=8, **MESH8).mesh, jax.devices()[:8])
  kq, kw, kk = jax.random.split(jax.random.key(0), 3)
  q, w = jax.random.normal(kq, (8, 32, 2, 16)), jax.random.normal(kw, (8, 32, 2))
  k = jax.random.normal(kk, (8, 32, 16))
  limit = jnp.full((8, 32), 32, jnp.int32)
  split = NamedSharding(mesh, P(('data', 'fsdp', 'expert')))
  args = [jax.device_put(a, split) for a in (q, w, k, limit)]
  with jax.set_mesh(mesh):
    got = jax.jit(index_scores_per_device)(*args)
    assert not kernels_outside_shard_map(jax.make_jaxpr(index_scores_per_device)(*args).jaxpr)
  np.testing.assert_allclose(np.asarray(got), np.asarray(index_scores_reference(q, w, k)),
                             rtol=1e-5, atol=1e-5)


def _ops_outside_shard_map(jaxpr, names, inside=False):
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names and not inside:
      found.append(eqn.primitive.name)
    for sub in sub_jaxprs(eqn.params.values()):
      found += _ops_outside_shard_map(sub, names, inside or eqn.primitive.name == 'shard_map')
  return found


@pytest.mark.parametrize('sizes', [dict(data=2, fsdp=2, expert=2), dict(data=4, context=2)])
def test_span_attention_per_device(sizes):
  """The gathered image-span attention indexes rows explicitly, which GSPMD cannot split by
  batch: it runs per device on whole rows (spans cut by a context split included)."""
  from deepseek41.ops.span_attention import span_partial
  axes = ('data', 'fsdp', 'expert', 'tensor', 'context')
  mesh = jax.make_mesh(tuple(sizes.get(a, 1) for a in axes), axes,
                       axis_types=(jax.sharding.AxisType.Auto,) * 5)
  kq, kk = jax.random.split(jax.random.key(1))
  q, kv = jax.random.normal(kq, (8, 32, 2, 16)), jax.random.normal(kk, (8, 32, 16))
  span = np.zeros((8, 32), np.int32)
  span[:, 10:22] = 1        # crosses the middle, where context=2 cuts
  span[::2, 24:30] = 2
  fn = functools.partial(span_partial, num_spans=2, max_span=16, impl='gathered')
  want = jax.jit(fn)(q, kv, span)
  with jax.set_mesh(mesh):
    split = NamedSharding(mesh, P(('data', 'fsdp', 'expert'), 'context' if 'context' in sizes
                                  else None))
    args = [jax.device_put(a, split) for a in (q, kv, span)]
    got = jax.jit(fn)(*args)
    assert not _ops_outside_shard_map(jax.make_jaxpr(fn)(*args).jaxpr, ('gather', 'scatter'))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_attention_kernels_split_heads_over_tensor():
  """Under tensor parallelism each shard runs the window and sparse kernels on its own heads
  (the heads dimension of q and of the outputs is split over `tensor`), with the same results."""
  from deepseek41.ops.sparse_attention import compressed_partial
  from deepseek41.ops.swa_attention import swa_partial
  axes = ('data', 'fsdp', 'expert', 'tensor', 'context')
  mesh = jax.make_mesh((4, 1, 1, 2, 1), axes, axis_types=(jax.sharding.AxisType.Auto,) * 5)
  kq, kk, ki = jax.random.split(jax.random.key(2), 3)
  q, kv = jax.random.normal(kq, (4, 32, 16, 16)), jax.random.normal(kk, (4, 32, 16))
  seg = np.ones((4, 32), np.int32)
  idx = jax.random.randint(ki, (4, 32, 4), 0, 8)
  valid = np.ones((4, 32, 4), bool)
  ops = {
      'window': lambda q, kv: swa_partial(q, kv, seg, window=8, impl='fused'),
      'sparse': lambda q, kv: compressed_partial(q, kv[:, :8], idx, valid, impl='fused',
                                                 with_mass=True),
  }
  for name, op in ops.items():
    want = jax.jit(op)(q, kv)
    with jax.set_mesh(mesh):
      q_s = jax.device_put(q, NamedSharding(mesh, P('data', None, 'tensor')))
      got = jax.jit(op)(q_s, kv)
      specs = [str(e.params['in_specs']) for e in jax.make_jaxpr(op)(q_s, kv).jaxpr.eqns
               if e.primitive.name == 'shard_map']
    assert specs and all("'tensor'" in s for s in specs), (name, specs)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
