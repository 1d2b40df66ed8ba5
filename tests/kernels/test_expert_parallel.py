"""Expert parallelism (ops/parallel/expert_parallel.py) on 8 fake CPU devices against no mesh at
all.

Each backend's routed experts, forward and gradients (x, router weights, the three expert
tensors), on meshes that split the tokens, the experts and the expert width. f32 throughout;
the tolerance covers sums reordered across devices (~1e-6 relative).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from deepseek41.ops.parallel import expert_parallel as ep
from tests.helpers import REPO_ROOT

B, T, D, F, E, K = 8, 12, 16, 32, 8, 2
LIMIT = 7.0


def _inputs(seed=0, hot=False):
  ks = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(ks[0], (B, T, D), jnp.float32)
  logits = jax.random.normal(ks[1], (B, T, E))
  if hot:  # most tokens want expert 0 and 1: the first shard receives far more than its share
    logits = logits + jnp.array([6.0, 5.0] + [0.0] * (E - 2))
  _, idx = jax.lax.top_k(logits, K)
  wt = jax.nn.softmax(jax.random.normal(ks[2], (B, T, K)), axis=-1)
  valid = jnp.ones((B, T), bool).at[1, T - 3:].set(False)
  w = [jax.random.normal(k, s, jnp.float32) * 0.2
       for k, s in zip(ks[3:], ((E, D, F), (E, D, F), (E, F, D)))]
  return x, idx.astype(jnp.int32), wt, valid, *w


def _mesh(**sizes):
  axes = ('data', 'fsdp', 'expert', 'tensor', 'context')
  shape = tuple(sizes.get(a, 1) for a in axes)
  n = int(np.prod(shape))
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * 5, devices=jax.devices()[:n])


def _run(mesh, backend, inputs, **kw):
  x, idx, wt, valid, wg, wu, wd = inputs

  def loss(x, wt, wg, wu, wd):
    y, dropped = ep.routed_experts(x, idx, wt, valid, wg, wu, wd, swiglu_limit=LIMIT,
                                   backend=backend, capacity_factor=1.0, **kw)
    # A weighting that is not symmetric in tokens, so every output row's gradient differs.
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), (y, dropped)
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  if mesh is None:
    return grad(x, wt, wg, wu, wd)
  with jax.set_mesh(mesh):
    tok = jax.sharding.NamedSharding(mesh, P(('data', 'fsdp', 'expert')))
    return grad(jax.device_put(x, tok), jax.device_put(wt, tok), wg, wu, wd)


def _assert_same(got, want, rtol=2e-5):
  (_, (y, dropped)), grads = got
  (_, (y0, dropped0)), grads0 = want
  np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=rtol, atol=1e-6)
  assert int(dropped) == int(dropped0)
  for g, g0 in zip(grads, grads0):
    np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=rtol, atol=1e-6)


MESHES = {
    'expert8': dict(expert=8),
    'data2_expert4': dict(data=2, expert=4),
    'fsdp2_expert2_tensor2': dict(fsdp=2, expert=2, tensor=2),
    'data4_tensor2': dict(data=4, tensor=2),
}


# ragged_dot shares the dropless exchanges with the others: one mesh is enough for it. The
# dropless backends run both CPU exchanges (the ragged one is padded's semantics, below).
CASES = [(b, m, x) for b in ('reference', 'grouped') for m in MESHES
         for x in ('allgather', 'padded')] + [
    ('capacity_einsum', m, 'auto') for m in MESHES] + [
    ('ragged_dot', 'data2_expert4', 'allgather'), ('ragged_dot', 'data2_expert4', 'padded')] + [
    # grouped_fused: grouped's layout under both exchanges, the width split (its F slices and
    # the float32 partials of the allgather exchange) on one mesh each.
    ('grouped_fused', 'data2_expert4', 'allgather'), ('grouped_fused', 'data2_expert4', 'padded'),
    ('grouped_fused', 'fsdp2_expert2_tensor2', 'allgather')]


@pytest.mark.parametrize('backend,mesh_name,exchange', CASES)
def test_sharded_experts_match_one_device(backend, mesh_name, exchange):
  inputs = _inputs()
  want = _run(None, backend, inputs)
  got = _run(_mesh(**MESHES[mesh_name]), backend, inputs, exchange=exchange)
  _assert_same(got, want)


def test_allgather_sends_each_token_once():
  """The allgather exchange's collectives carry each token once (N rows per shard, S*N per
  group), never its K assignments: the forward's collectives and their result types."""
  x, idx, wt, valid, wg, wu, wd = _inputs()
  shards, n = 8, B * T // 8

  def fwd(x, wt):
    return ep.routed_experts(x, idx, wt, valid, wg, wu, wd, swiglu_limit=LIMIT,
                             backend='reference', capacity_factor=1.0, exchange='allgather')[0]
  mesh = _mesh(expert=shards)
  with jax.set_mesh(mesh):
    tok = jax.sharding.NamedSharding(mesh, P('expert'))
    hlo = jax.jit(fwd).lower(jax.device_put(x, tok), jax.device_put(wt, tok)).as_text()
  ops = re.findall(r'(?s)"stablehlo\.(all_gather|reduce_scatter|all_to_all)".*?-> tensor<([^>]*)>',
                   hlo)
  # tokens, router weights and expert ids out; the f32 partial outputs back.
  assert sorted(op for op, _ in ops) == ['all_gather'] * 3 + ['reduce_scatter'], ops
  gathered = sorted(t for op, t in ops if op == 'all_gather')
  assert gathered == sorted([f'{shards * n}x{D}xf32', f'{shards * n}x{K}xf32',
                             f'{shards * n}x{K}xi32']), gathered
  assert [t for op, t in ops if op == 'reduce_scatter'] == [f'{n}x{D}xf32']


@pytest.mark.parametrize('backend', ['reference', 'grouped', 'grouped_fused'])
def test_bounded_allgather_drops_exactly_the_overflow(backend):
  """expert_buffer_factor with the allgather exchange: each expert shard computes the first
  buffer_factor * N * K of its assignments in (local expert, token) order and drops the rest,
  counted. Against one device given the same assignments (numpy picks them), forward and every
  gradient."""
  x, idx, wt, valid, *w = inputs = _inputs(hot=True)
  shards, factor = 4, 1.5
  n_local, e_local = B * T // shards, E // shards
  bound = int(np.ceil(factor * n_local * K))
  idx_a = np.asarray(idx).reshape(-1)
  mine_a = np.broadcast_to(np.asarray(valid).reshape(-1, 1), (B * T, K)).reshape(-1)
  kept_a = np.zeros_like(mine_a)
  for s in range(shards):
    ours = np.flatnonzero(mine_a & (idx_a // e_local == s))
    order = ours[np.argsort(idx_a[ours], kind='stable')]  # by expert, then token
    kept_a[order[:bound]] = True
  dropped_want = int(mine_a.sum() - kept_a.sum())
  assert dropped_want > 0  # the hot experts overflow their shard's bound

  def one_device(x, wt, *w):
    from deepseek41.ops.expert_gemm import expert_ffn
    y, _ = expert_ffn(x.reshape(B * T, D), idx.reshape(B * T, K), wt.reshape(B * T, K),
                      jnp.asarray(kept_a.reshape(B * T, K)), *w, swiglu_limit=LIMIT,
                      backend=backend)
    y = y.reshape(B, T, D)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), (y, dropped_want)
  want = jax.jit(jax.value_and_grad(one_device, argnums=(0, 1, 2, 3, 4), has_aux=True))(
      x, wt, *w)
  got = _run(_mesh(expert=shards), backend, inputs, exchange='allgather', buffer_factor=factor)
  _assert_same(got, want)


def test_capacity_drops_are_those_of_one_device():
  inputs = _inputs(hot=True)
  want = _run(None, 'capacity_einsum', inputs)
  assert int(want[0][1][1]) > 0  # the test means something only if there are drops
  _assert_same(_run(_mesh(data=2, expert=4), 'capacity_einsum', inputs), want)


def test_skewed_routing_is_dropless_with_the_default_buffer():
  inputs = _inputs(hot=True)
  want = _run(None, 'reference', inputs)
  got = _run(_mesh(expert=8), 'reference', inputs)
  assert int(got[0][1][1]) == 0
  _assert_same(got, want)


@pytest.mark.parametrize('exchange', ['allgather', 'padded'])
def test_a_small_buffer_drops_and_counts(exchange):
  inputs = _inputs(hot=True)
  (_, (y, dropped)), _ = _run(_mesh(expert=8), 'reference', inputs, buffer_factor=1.0,
                              exchange=exchange)
  (_, (y0, _)), _ = _run(None, 'reference', inputs)
  assert int(dropped) > 0
  # Every assignment either arrived or was counted: the outputs differ exactly where one dropped.
  assert not np.allclose(np.asarray(y), np.asarray(y0))


def test_receive_rows():
  assert ep.receive_rows(100, 8, 0.0) == 800
  assert ep.receive_rows(100, 8, 2.5) == 250
  assert ep.receive_rows(100, 8, 20.0) == 800


def test_padded_exchange_is_a_ragged_all_to_all():
  """The CPU exchange against ragged_all_to_all's documented semantics, written out in numpy."""
  mesh = _mesh(expert=4)
  s, rows, out_rows, d = 4, 6, 9, 3
  rng = np.random.default_rng(0)
  send = rng.integers(0, 3, size=(s, s)).astype(np.int32)       # [source, dest]
  send_off = np.cumsum(send, axis=1) - send
  land = np.cumsum(send, axis=0) - send                           # offset in dest's buffer
  x = rng.normal(size=(s, rows, d)).astype(np.float32)

  want = np.zeros((s, out_rows, d), np.float32)
  for j in range(s):
    for r in range(s):
      n = send[j, r]
      want[r, land[j, r]:land[j, r] + n] = x[j, send_off[j, r]:send_off[j, r] + n]

  # Its transpose (the custom backward): each landed chunk's cotangent back where it left.
  dy = rng.normal(size=(s, out_rows, d)).astype(np.float32)
  want_dx = np.zeros_like(x)
  for j in range(s):
    for r in range(s):
      n = send[j, r]
      want_dx[j, send_off[j, r]:send_off[j, r] + n] = dy[r, land[j, r]:land[j, r] + n]

  def f(x, send, send_off, land, recv):
    return ep.padded_exchange(x[0], out_rows, send_off[0], send[0], land[0], recv[0],
                              'expert')[None]
  spec = P('expert')
  move = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
  args = (send, send_off, land, send.T.copy())
  with jax.set_mesh(mesh):
    got = jax.jit(move)(x, *args)
    dx = jax.jit(jax.grad(lambda x: jnp.sum(move(x, *args) * dy)))(x)
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(np.asarray(dx), want_dx)


def test_uneven_expert_split_is_refused():
  inputs = _inputs()
  mesh = _mesh(expert=8)
  x, idx, wt, valid, wg, wu, wd = inputs
  with jax.set_mesh(mesh), pytest.raises(ValueError, match='mesh.expert'):
    ep.routed_experts(x, idx, wt, valid, wg[:6], wu[:6], wd[:6], swiglu_limit=LIMIT,
                      backend='reference', capacity_factor=1.0)


def test_model_with_dropless_expert_parallelism_matches_one_device():
  """The tiny model's loss and gradients, experts over 4 shards (dropless), against 1 device."""
  from deepseek41.sharding import batch_sharding, make_mesh
  from deepseek41.train import state as state_lib
  from deepseek41.train.optimizer import make_optimizer
  from deepseek41.train.step import forward_loss
  from tests.helpers import packed_batch, resolved

  batch = packed_batch(seed=1)
  out = []
  for n, sizes in ((1, {'mesh.data': 1}), (8, {'mesh.data': 2, 'mesh.expert': 4})):
    cfg = resolved(num_devices=n, **sizes, **{'model.moe_backend': 'reference'})
    tx = make_optimizer(cfg.train)
    mesh = make_mesh(cfg.mesh, jax.devices()[:n])
    state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
    md = state_lib.model_def(cfg, tx)
    bsh = batch_sharding(mesh, cfg.mesh.rules)

    def loss_fn(params, biases, b):
      ce, cnt, _ = forward_loss(md, params, biases, b)
      return ce / cnt
    with jax.set_mesh(mesh):
      out.append(jax.jit(jax.value_and_grad(loss_fn))(
          state['params'], state['router_bias'],
          {k: jax.device_put(v, bsh) for k, v in batch.items()}))
  (l1, g1), (l8, g8) = out
  np.testing.assert_allclose(l8, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


def test_allgather_partials_in_the_compute_dtype():
  """model.expert_partials=compute: the partial outputs travel back in bf16 (the reduce-scatter's
  type) and the result stays within bf16 rounding of one device's; float32 keeps f32 partials."""
  x, idx, wt, valid, wg, wu, wd = _inputs()
  x, wg, wu, wd = (a.astype(jnp.bfloat16) for a in (x, wg, wu, wd))
  shards, n = 4, B * T // 4

  def fwd(x, wt, partials):
    return ep.routed_experts(x, idx, wt, valid, wg, wu, wd, swiglu_limit=LIMIT,
                             backend='reference', capacity_factor=1.0, exchange='allgather',
                             partials=partials)[0]
  want = np.asarray(fwd(x, wt, 'float32').astype(jnp.float32))
  mesh = _mesh(expert=shards)
  with jax.set_mesh(mesh):
    tok = jax.sharding.NamedSharding(mesh, P('expert'))
    xs, wts = jax.device_put(x, tok), jax.device_put(wt, tok)
    for partials, dtype in (('float32', 'f32'), ('compute', 'bf16')):
      step = jax.jit(functools.partial(fwd, partials=partials))
      hlo = step.lower(xs, wts).as_text()
      scattered = re.findall(r'(?s)"stablehlo\.reduce_scatter".*?-> tensor<([^>]*)>', hlo)
      assert scattered == [f'{n}x{D}x{dtype}'], scattered
      got = np.asarray(step(xs, wts).astype(jnp.float32))
      # bf16 output either way; the compute-dtype partials add a rounding per shard.
      np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
  with pytest.raises(ValueError, match='expert partials'):
    fwd(x, wt, 'float16')


def test_exchange_benchmark_runs_every_case():
  """benchmarks/check_expert_exchange.py (the GPU call's microbenchmark) at CPU shapes: every
  exchange runs and matches the experts without one, and every emulated case is timed."""
  import json
  import os
  import subprocess
  import sys
  root = REPO_ROOT
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': '', 'PYTHONPATH': root}
  out = subprocess.run(
      [sys.executable, os.path.join(root, 'benchmarks', 'check_expert_exchange.py'),
       '--backend', 'reference', '--tokens', '64', '--d', '16', '--f', '8', '--experts', '4',
       '--k', '2', '--reps', '1', '--exchanges', 'allgather', 'padded', '--emulate', '2'],
      capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')]
  exchanges = [r for r in rows if 'exchange' in r]
  assert [r['exchange'] for r in exchanges] == ['allgather', 'padded']
  assert all(r['ok'] and r['max_err'] <= 1e-2 * r['scale'] for r in exchanges), exchanges
  cases = {r['case'] for r in rows if 'case' in r}
  assert {'one_device', 'allgather_shard_of_2_float32', 'allgather_shard_of_2_bfloat16',
          'allgather_shard_of_2_float32_buffer_1.25'} <= cases, cases
