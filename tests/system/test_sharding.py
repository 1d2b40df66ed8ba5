"""8 fake CPU devices, mesh data=2 x fsdp=2 x expert=2, against the degenerate 1-device mesh."""

import jax
import numpy as np
import pytest

from deepseek41.sharding import batch_sharding, logical_to_spec, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import forward_loss, make_train_step
from tests.helpers import packed_batch, resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

MESH8 = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.expert': 2}
# mHC streams, sharded tables; the capacity experts (the CPU default is `reference`) because
# their sort, gathers and capacity buffers are what sharding can get wrong.
FULL = {'model.residual': 'mhc_single_pass', 'model.engram': True,
        'model.moe_backend': 'capacity_einsum'}


def test_logical_rules_map_to_mesh_axes():
  cfg = resolved(num_devices=8, **MESH8)
  mesh = make_mesh(cfg.mesh)
  spec = logical_to_spec(('experts', 'embed', 'expert_mlp'), cfg.mesh.rules, mesh)
  assert tuple(spec) == ('expert', 'fsdp', None)
  assert tuple(logical_to_spec(('batch', 'length'), cfg.mesh.rules, mesh)) == (
      ('data', 'fsdp', 'expert'), None)


def _setup(num_devices, overrides):
  cfg = resolved(num_devices=num_devices, **overrides)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:num_devices])
  state, shardings = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  return cfg, tx, mesh, state, shardings


@pytest.fixture(scope='module')
def runs():
  out = {}
  batch = packed_batch(seed=0, image_rows=(1,))
  for name, n, overrides in (('one', 1, {'mesh.data': 1}), ('eight', 8, MESH8)):
    cfg, tx, mesh, state, shardings = _setup(n, {**overrides, **FULL})
    md = state_lib.model_def(cfg, tx)
    bsh = batch_sharding(mesh, cfg.mesh.rules)
    gbatch = {k: jax.device_put(v, bsh) for k, v in batch.items()}

    def loss_fn(params, biases, b):
      ce, cnt, _ = forward_loss(md, params, biases, b)
      return ce / cnt
    step = make_train_step(cfg, md)

    # One program per mesh (XLA shares the two backward passes): compiles as one, not two.
    def loss_grads_and_step(state, b):
      loss, grads = jax.value_and_grad(loss_fn)(state['params'], state['router_bias'], b)
      return loss, grads, *step(state, b)
    with jax.set_mesh(mesh):
      loss, grads, new_state, metrics = jax.jit(
          loss_grads_and_step, in_shardings=(shardings, bsh),
          out_shardings=(None, None, shardings, None))(state, gbatch)
    out[name] = dict(state=state, loss=loss, grads=grads, new_state=new_state, metrics=metrics)
  return out


def test_initialisation_is_identical(runs):
  for a, b in zip(jax.tree.leaves(runs['one']['state']), jax.tree.leaves(runs['eight']['state'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loss_and_gradients_match_single_device(runs):
  # Tolerance: f32 reductions are split across devices, so sums are reordered (~1e-7 relative).
  np.testing.assert_allclose(runs['eight']['loss'], runs['one']['loss'], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(runs['eight']['grads']), jax.tree.leaves(runs['one']['grads'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


def test_train_step_matches_single_device(runs):
  m8, m1 = runs['eight']['metrics'], runs['one']['metrics']
  np.testing.assert_allclose(m8['loss'], m1['loss'], rtol=1e-6)
  np.testing.assert_allclose(m8['grad_norm'], m1['grad_norm'], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(m8['load_lme']), np.asarray(m1['load_lme']))
  # Parameters after one Adam step are not compared elementwise: Adam's first update is
  # ~lr * sign(g), so a gradient of ~1e-9 that flips sign under reordered sums moves a weight by
  # ~lr. The gradients themselves are compared above; the bias update must agree exactly.
  for a, b in zip(jax.tree.leaves(runs['eight']['new_state']['router_bias']),
                  jax.tree.leaves(runs['one']['new_state']['router_bias'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_parameters_are_really_sharded(runs):
  params = runs['eight']['new_state']['params']
  w_gate = params['blocks'][0]['moe']['w_gate'].get_value()
  assert tuple(w_gate.sharding.spec) == ('expert', 'fsdp', None)
  shard_shape = w_gate.addressable_shards[0].data.shape
  assert shard_shape == (w_gate.shape[0] // 2, w_gate.shape[1] // 2, w_gate.shape[2])
  embed = params['embed'].get_value()
  assert embed.addressable_shards[0].data.shape == (embed.shape[0], embed.shape[1] // 2)
  # Engram rows ask for fsdp x expert; 4,062 rows (a sum of primes) divide by 2, not 4, so the
  # rules keep the axes that divide them.
  table = params['blocks'][1]['engram']['table'].get_value()
  assert table.shape[0] == 4062 and tuple(table.sharding.spec)[0] == 'fsdp'
  assert table.addressable_shards[0].data.shape[0] == table.shape[0] // 2
  # optimizer moments follow their parameters
  mu = runs['eight']['new_state']['opt'][1][0].mu
  assert tuple(mu['blocks'][0]['moe']['w_gate'].get_value().sharding.spec) == (
      'expert', 'fsdp', None)


def test_prng_kernel_only_where_nothing_is_split():
  """The GPU threefry kernel (fast compiles) draws whole tensors: init_state asks for it only
  where every leaf of the state is replicated, and leaves the global flag as it found it."""
  for n, overrides, pays in ((1, {'mesh.data': 1}, True), (2, {'mesh.data': 2}, True),
                             (8, MESH8, False)):
    cfg = resolved(num_devices=n, **overrides)
    mesh = make_mesh(cfg.mesh, jax.devices()[:n])
    tx = make_optimizer(cfg.train)
    shardings = state_lib.state_shardings(state_lib.abstract_state(cfg, tx), mesh,
                                          cfg.mesh.rules)
    assert state_lib.prng_kernel_pays(shardings) is pays, (n, overrides)
  seen = []
  with state_lib._prng_kernel(True):
    seen.append(jax.config.jax_threefry_gpu_kernel_lowering)
  assert seen == [True] and jax.config.jax_threefry_gpu_kernel_lowering is False


def test_replicated_init_draws_the_split_state_exactly():
  """A split state drawn whole on every device and sliced (init_state's path for a state that
  fits one GPU, with the threefry kernel there) equals the one drawn split, value for value
  and sharding for sharding; and the rule asks for it only on a split state that fits."""
  cfg = resolved(num_devices=8, **MESH8, **FULL)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:8])
  split, shardings = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules, replicated=False)
  sliced, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules, replicated=True)
  leaves, want = jax.tree.leaves(sliced), jax.tree.leaves(split)
  assert len(leaves) == len(want)
  for got, ref in zip(leaves, want):
    assert got.sharding.is_equivalent_to(ref.sharding, got.ndim), (got.sharding, ref.sharding)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert any(not x.sharding.is_fully_replicated for x in leaves)

  abstract = state_lib.abstract_state(cfg, tx)
  whole = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  pays = state_lib.replicated_init_pays
  assert pays(abstract, shardings, int(whole / state_lib.REPLICATED_INIT_SHARE) + 1)
  assert not pays(abstract, shardings, int(whole))           # too large for the device
  assert not pays(abstract, shardings, None)                  # not a GPU
  one = make_mesh(resolved(num_devices=1, **{'mesh.data': 1}).mesh, jax.devices()[:1])
  unsplit = state_lib.state_shardings(abstract, one, cfg.mesh.rules)
  assert not pays(abstract, unsplit, 10**15)                  # nothing split: the kernel in place
