"""Every parallel axis on 8 fake CPU devices against 1 device, context parallelism above all.

(data x fsdp x expert trains on the jnp paths in tests/system/test_sharding.py, and runs every
kernel here; expert parallelism's exchanges per backend are tests/kernels/test_expert_parallel.py;
single kernels per device, tests/kernels/test_per_device.py.) The tiny model with CSA2
(compressed entries, indexer, top-k, sparse and window branches), Engram and single-pass mHC,
packed documents and padding: loss and every gradient. Once on the
jnp paths (GSPMD partitions them) and once with every Pallas kernel (interpreted; each runs on
its own stretch of queries, the window kernel with its halo from the previous shard). f32; the
tolerance covers sums reordered across devices and kernel tiles. `model.fp8` stays off: its
rowwise scales follow each device's tokens (docs/performance.md section 10.4).
"""

import dataclasses
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.helpers import (EVERY_KERNEL, GROUPED, MESH_KERNEL_SHAPES, kernels_outside_shard_map,
                           model_loss_fn, packed_batch, resolved)

from deepseek41.ops.cross_entropy import head_cross_entropy_sum
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

# Each axis is split in at least one mesh, with its neighbours: fsdp alone and data x tensor
# add no partitioning these do not (fsdp x data x expert trains in tests/system/test_sharding.py).
MESHES = {'context8': {'mesh.data': 1, 'mesh.context': 8},
          'data2_expert2_context2': {'mesh.data': 2, 'mesh.expert': 2, 'mesh.context': 2},
          'fsdp2_tensor2_context2': {'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.tensor': 2,
                                     'mesh.context': 2},
          # the fused LM head + loss in 4 chunks of 16 positions (one chunk on one device), the
          # vocabulary split over tensor and each chunk's positions over context
          'tensor2_context4_head_chunks': {'mesh.data': 1, 'mesh.tensor': 2, 'mesh.context': 4,
                                           'model.head_chunk': 16},
          # the batch over every axis that splits it, each kernel on its device's own rows
          'data2_fsdp2_expert2': {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.expert': 2}}


@functools.lru_cache(maxsize=None)  # the 1-device runs serve every mesh
def _one_device(kernels):
  return _grads(1, {'mesh.data': 1}, kernels)


def _grads(n, sizes, kernels):
  # 64 tokens: 8 per shard at context=8, one window (8) per shard.
  cfg = resolved(num_devices=n, **{**MESH_KERNEL_SHAPES, 'data.seq_len': 64, **sizes})
  if kernels:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **EVERY_KERNEL))
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:n])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  batch = {k: jax.device_put(v, batch_sharding(mesh, cfg.mesh.rules))
           for k, v in packed_batch(seed=6, docs_per_row=3, pad=5, t=64).items()}
  fn = jax.jit(jax.value_and_grad(model_loss_fn(cfg, tx)))
  with jax.set_mesh(mesh):
    traced = fn.trace(state['params'], state['router_bias'], batch)  # traced once, for both
    if kernels and n > 1:
      # GSPMD cannot split a pallas_call or top_k's custom call: outside a shard_map it would
      # gather the whole batch onto every device.
      outside = kernels_outside_shard_map(traced.jaxpr.jaxpr)
      assert not outside, f'pallas_calls GSPMD would run on the whole batch: {outside[:5]}'
      assert not kernels_outside_shard_map(traced.jaxpr.jaxpr, primitive='top_k')
    elif kernels:  # the walk does see kernels: on one device nothing is wrapped
      assert len(kernels_outside_shard_map(traced.jaxpr.jaxpr)) >= 5
    return traced.lower().compile()(state['params'], state['router_bias'], batch)


# The jnp paths on the meshes that split more than the batch (GSPMD partitions them; context
# is split in the other two). Every kernel on the batch-only split (each device's own rows), at
# context=8 (the split that needs the window halo) and, with the attention kernels' heads split
# over tensor, in test_deeper_wiring below.
KERNEL_MESHES = ('context8', 'data2_fsdp2_expert2')
CASES = [(m, False) for m in MESHES if m not in KERNEL_MESHES] + [(m, True) for m in KERNEL_MESHES]


@pytest.mark.parametrize('mesh,kernels', CASES)
def test_parallel_axes_match_one_device(mesh, kernels):
  l1, g1 = _one_device(kernels)
  l8, g8 = _grads(8, MESHES[mesh], kernels)
  np.testing.assert_allclose(l8, l1, rtol=1e-6)
  # Measured: the Engram tables' gradients move by up to 1.1e-6 absolute on values of ~3e-4 when
  # the sums are split across devices; every other gradient agrees to ~6e-7, except the token
  # embedding's (values up to 3.2e-2): 2.5e-6 on one element with the kernels at context=8.
  # Engram's gate sigmoid(sign(s) sqrt(|s|)) amplifies the reordered fp32 sums where s is near 0
  # (slope 1 / (2 sqrt(|s|)); with a smooth gate in its place these agree to ~1e-10). The
  # embedding's error scales with its larger values, hence its second absolute term.
  for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g8)):
    a, b = np.asarray(a), np.asarray(b)
    table = jax.tree_util.keystr(path).startswith("['embed']")
    atol = 2e-6 + (1e-4 * float(np.abs(b).max()) if table else 0.0)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_deeper_wiring_matches_one_device():
  """Six layers whose Reuse layers read their index sources' selections (GROUPED of
  tests/kernels/test_sparse_kernel.py), every kernel, on the context and tensor split: the same loss and
  gradients as one device, with the layers of a selection adding their key/value gradient once
  (`model.sparse_group_dkv`, the default). Each layer adding its own is the path of a layer that
  shares its selection with none, which the meshes of `test_parallel_axes_match_one_device` run;
  tests/kernels/test_sparse_kernel.py holds the two equal on one device.

  Engram is off here. Its gate, sigmoid(sign(s) sqrt(|s|)), has slope 1 / (2 sqrt(|s|)) (up to
  500 at its 1e-6 floor), so in this deeper model the fp32 sums reordered across devices move
  its table's, its q/k weights' and the embedding's gradients by ~1e-3 of their largest
  values, on a batch split as much as on a context split. With a smooth gate in its place they
  agree to ~1e-10. Measured without Engram: at most 3.5e-8 apart.
  """
  mesh = MESHES['fsdp2_tensor2_context2']
  deep = {**GROUPED, 'model.engram': False}
  l1, g1 = _grads(1, {'mesh.data': 1, **deep}, True)
  l8, g8 = _grads(8, {**mesh, **deep}, True)
  np.testing.assert_allclose(l8, l1, rtol=1e-6)
  for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g8)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-7,
                               err_msg=jax.tree_util.keystr(path))


def _sequence_splits(jaxpr) -> int:
  """sharding_constraint eqns (any depth) that split dim 1 over context and tensor together."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'sharding_constraint':
      spec = tuple(eqn.params['sharding'].spec)
      count += len(spec) > 1 and spec[1] == ('context', 'tensor')
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _sequence_splits(sub)
  return count


@pytest.mark.parametrize('sequence_parallel', [True, False])
def test_sequence_parallel_splits_the_kept_residual(sequence_parallel):
  """mesh.sequence_parallel: every layer's output (what block remat keeps) is split along the
  sequence over context x tensor; off, over context only. Numerics: the test above (its tensor
  meshes run with it on)."""
  cfg = resolved(num_devices=8, **MESHES['fsdp2_tensor2_context2'], **MESH_KERNEL_SHAPES,
                 **{'data.seq_len': 64, 'train.remat': 'block',
                    'mesh.sequence_parallel': sequence_parallel})
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:8])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  batch = packed_batch(seed=6, docs_per_row=3, pad=5, t=64)
  with jax.set_mesh(mesh):
    jaxpr = jax.make_jaxpr(jax.grad(model_loss_fn(cfg, tx)))(
        state['params'], state['router_bias'], batch).jaxpr
  splits = _sequence_splits(jaxpr)
  if sequence_parallel:
    assert splits >= cfg.model.num_layers + 1  # the embedding's output and every layer's
  else:
    assert splits == 0


@pytest.mark.parametrize('axes', [('data',), ('fsdp', 'tensor'), ('data', 'tensor', 'context')])
def test_fused_head_reduces_its_weight_gradient_once(axes):
  """The fused LM head + loss (ops/cross_entropy.py) on a split batch: its W gradient is summed
  over the devices once, after the chunks, not once a chunk (GSPMD reduces a loop-carried sum
  over a split axis inside the loop unless the carry keeps one partial sum per token shard), and
  it equals one device's. fsdp: W's rows split as well (`embed` over fsdp)."""
  b, t, d, v, chunk = 8, 64, 16, 256, 8  # 8 chunks
  sizes = {'data': 8 // 2 ** (len(axes) - 1)} if axes[0] == 'data' else {'fsdp': 4}
  sizes.update({a: 2 for a in axes[1:]})
  mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
  batch_axes = tuple(a for a in axes if a in ('data', 'fsdp'))
  tokens = NamedSharding(mesh, P(batch_axes, 'context' if 'context' in axes else None))
  w_spec = P('fsdp' if 'fsdp' in axes else None, 'tensor' if 'tensor' in axes else None)
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (b, t, d))
  w = 0.3 * jax.random.normal(k[1], (d, v))
  targets = jax.random.randint(k[2], (b, t), 0, v)
  mask = jnp.ones((b, t), jnp.int32).at[:, -3:].set(0)
  grad = jax.jit(jax.grad(lambda h, w, tg, m: head_cross_entropy_sum(h, w, tg, m, chunk)[0],
                          argnums=(0, 1)))
  want = grad(h, w, targets, mask)
  args = (jax.device_put(h, tokens), jax.device_put(w, NamedSharding(mesh, w_spec)),
          jax.device_put(targets, tokens), jax.device_put(mask, tokens))
  with jax.set_mesh(mesh):
    compiled = grad.lower(*args).compile()
    got = compiled(*args)
  for a, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6)
  # The all-reduces of W's gradient ([.., D, V / tensor] f32): after the loop, in the entry
  # computation (one per split axis or one over all of them).
  v_shard = v // sizes.get('tensor', 1)
  per_computation = re.split(r'\n(?=\S)', compiled.as_text())
  big = [(c.split('\n', 1)[0].startswith('ENTRY'), line) for c in per_computation
         for line in c.splitlines()
         if re.search(rf'f32\[(1,1,)?{d},{v_shard}\]\S* all-reduce\(', line)]
  assert big and all(in_entry for in_entry, _ in big), big
