"""Expert-compute backends against the dense reference and against independent numpy math.

f32 throughout. Tolerance: |a - b| <= 1e-5 * max|b| elementwise (a normwise-relative bound; the
backends sum in different orders, so exact equality is not expected; observed error is ~1e-7).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops.expert_gemm import (ALL_BACKENDS, expert_capacity, expert_ffn,
                                        expert_ffn_batched)
from tests.helpers import jaxpr_eqns

N, D, F, E, K = 64, 32, 48, 8, 2
LIMIT = 1.0  # low enough that some pre-activations clip, so clip gradients are compared too
NO_DROP = E / K  # capacity N: nothing can drop
RTOL = 1e-5
SEEDS = (0, 1, 2)


def assert_close(a, b, rtol=RTOL, what=''):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(np.abs(b).max(), 1e-30)
  err = np.abs(a - b).max() / scale
  assert err <= rtol, f'{what}: max error {err:.2e} of max|ref| exceeds {rtol:.0e}'


def make_inputs(seed, n=N, hot_experts=0.0, pad_frac=0.15, gate_scale=1.0):
  """Random group: distinct top-K experts per token (optionally skewed towards low ids)."""
  ks = jax.random.split(jax.random.key(seed), 8)
  x = jax.random.normal(ks[0], (n, D), jnp.float32)
  logits = jax.random.uniform(ks[1], (n, E)) - hot_experts * jnp.arange(E) / E
  idx = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
  weight = jax.random.uniform(ks[2], (n, K), minval=0.1, maxval=1.0)
  valid = jax.random.uniform(ks[3], (n,)) >= pad_frac
  w_gate = gate_scale * jax.random.normal(ks[4], (E, D, F)) / np.sqrt(D)
  w_up = jax.random.normal(ks[5], (E, D, F)) / np.sqrt(D)
  w_down = jax.random.normal(ks[6], (E, F, D)) / np.sqrt(F)
  return x, idx, weight, valid, w_gate, w_up, w_down


@functools.partial(jax.jit, static_argnames=('backend', 'capacity_factor', 'limit'))
def run(x, idx, weight, valid, wg, wu, wd, *, backend, capacity_factor=NO_DROP, limit=LIMIT):
  return expert_ffn(x, idx, weight, valid, wg, wu, wd, swiglu_limit=limit, backend=backend,
                    capacity_factor=capacity_factor)


@functools.partial(jax.jit, static_argnames=('backend', 'capacity_factor'))
def grads(x, idx, weight, valid, wg, wu, wd, ct, *, backend, capacity_factor=NO_DROP):
  """Gradients of <y, ct> w.r.t. x, weight_nk and the three expert tensors."""
  def loss(x, weight, wg, wu, wd):
    y, _ = expert_ffn(x, idx, weight, valid, wg, wu, wd, swiglu_limit=LIMIT, backend=backend,
                      capacity_factor=capacity_factor)
    return jnp.sum(y * ct)
  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, weight, wg, wu, wd)


def expected_kept(idx, valid, cap):
  """First come, first served per expert in token order, padding skipped: numpy, independently."""
  idx, valid = np.asarray(idx), np.asarray(valid)
  load = np.zeros(E, np.int64)
  kept = np.zeros(idx.shape, bool)
  for n in range(idx.shape[0]):
    if not valid[n]:
      continue
    for k in range(K):
      kept[n, k] = load[idx[n, k]] < cap
      load[idx[n, k]] += 1
  return kept, int(np.maximum(load - cap, 0).sum())


def numpy_moe(x, idx, weight, valid, wg, wu, wd, limit):
  """Token-by-token float64 math of docs/architecture.md 3.11 (limit None: unclipped)."""
  x, idx, weight, valid, wg, wu, wd = (np.asarray(a, np.float64) if a.dtype.kind == 'f'
                                       else np.asarray(a)
                                       for a in (x, idx, weight, valid, wg, wu, wd))
  y = np.zeros_like(x)
  for n in range(x.shape[0]):
    if not valid[n]:
      continue
    for k in range(K):
      e = idx[n, k]
      g, u = x[n] @ wg[e], x[n] @ wu[e]
      if limit is not None:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
      y[n] += weight[n, k] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
  return y


def test_expert_capacity():
  assert expert_capacity(64, 2, 8, 1.25) == 20
  assert expert_capacity(4096, 6, 64, 1.25) == 480
  assert expert_capacity(3, 1, 64, 1.0) == 1  # never zero
  assert expert_capacity(64, 2, 8, 100.0) == 64  # never more than N
  assert expert_capacity(64, 2, 8, NO_DROP) == 64


@pytest.mark.parametrize('seed', SEEDS)
@pytest.mark.parametrize('backend', ['capacity_einsum', 'ragged_dot', 'grouped', 'gathered'])
def test_matches_reference_outputs_and_grads(backend, seed):
  inputs = make_inputs(seed)
  ct = jax.random.normal(jax.random.key(100 + seed), (N, D))
  y_ref, dropped_ref = run(*inputs, backend='reference')
  y, dropped = run(*inputs, backend=backend)
  assert y.dtype == jnp.float32 and y.shape == (N, D)
  assert int(dropped) == 0 and int(dropped_ref) == 0
  assert_close(y, y_ref, what='y')
  g_ref = grads(*inputs, ct, backend='reference')
  g = grads(*inputs, ct, backend=backend)
  for name, a, b in zip(('x', 'weight_nk', 'w_gate', 'w_up', 'w_down'), g, g_ref):
    assert np.abs(np.asarray(b)).max() > 0, name
    assert_close(a, b, what=f'd/d{name}')


@pytest.mark.parametrize('seed', SEEDS)
def test_reference_matches_numpy(seed):
  inputs = make_inputs(seed)
  y, _ = run(*inputs, backend='reference')
  assert_close(y, numpy_moe(*inputs, LIMIT), what='reference vs numpy')


@pytest.mark.parametrize('seed', SEEDS)
def test_capacity_drops_latest_assignments(seed):
  # Skewed routing and padding sprinkled through the group; padding must not take capacity.
  x, idx, weight, valid, wg, wu, wd = make_inputs(seed, hot_experts=1.0, pad_frac=0.25)
  factor = 0.5
  cap = expert_capacity(N, K, E, factor)
  kept, n_dropped = expected_kept(idx, valid, cap)
  assert n_dropped > 0  # the test must actually drop
  assert n_dropped == int((~kept & np.asarray(valid)[:, None]).sum())

  y, dropped = run(x, idx, weight, valid, wg, wu, wd, backend='capacity_einsum',
                   capacity_factor=factor)
  assert int(dropped) == n_dropped
  weight_kept = jnp.where(kept, weight, 0.0)
  y_ref, _ = run(x, idx, weight_kept, valid, wg, wu, wd, backend='reference')
  assert_close(y, y_ref, what='y with drops')

  # Gradients w.r.t. x and the experts equal those of the reference with dropped weights zeroed.
  ct = jax.random.normal(jax.random.key(200 + seed), (N, D))
  g = grads(x, idx, weight, valid, wg, wu, wd, ct, backend='capacity_einsum',
            capacity_factor=factor)
  g_ref = grads(x, idx, weight_kept, valid, wg, wu, wd, ct, backend='reference')
  for name, a, b in zip(('x', 'w_gate', 'w_up', 'w_down'), (g[0],) + g[2:], (g_ref[0],) + g_ref[2:]):
    assert_close(a, b, what=f'd/d{name} with drops')
  # Dropped assignments do not reach the output, so their router weights get no gradient.
  assert np.all(np.asarray(g[1])[~kept] == 0)


@pytest.mark.parametrize('backend', ALL_BACKENDS)
def test_padding_takes_no_capacity_and_outputs_zero(backend):
  x, idx, weight, valid, wg, wu, wd = make_inputs(3, hot_experts=1.0, pad_frac=0.0)
  # The first 16 tokens are padding, all routed to expert 0 and 1 that would fill their capacity.
  pad = jnp.arange(N) < 16
  valid = ~pad
  idx = jnp.where(pad[:, None], jnp.array([0, 1], jnp.int32), idx)
  factor = 0.75 if backend == 'capacity_einsum' else NO_DROP
  y, dropped = run(x, idx, weight, valid, wg, wu, wd, backend=backend, capacity_factor=factor)
  assert np.all(np.asarray(y)[:16] == 0)

  # Whatever padding holds (other experts, other activations, weights), nothing else changes.
  idx2 = jnp.where(pad[:, None], jnp.array([5, 6], jnp.int32), idx)
  x2 = jnp.where(pad[:, None], 7.0 * x, x)
  w2 = jnp.where(pad[:, None], 3.0, weight)
  y2, dropped2 = run(x2, idx2, w2, valid, wg, wu, wd, backend=backend, capacity_factor=factor)
  np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
  assert int(dropped2) == int(dropped)

  cap = expert_capacity(N, K, E, factor)
  kept, n_dropped = expected_kept(idx, valid, cap)
  assert int(dropped) == n_dropped
  y_ref, _ = run(x, idx, jnp.where(kept, weight, 0.0), valid, wg, wu, wd, backend='reference')
  assert_close(y, y_ref, what='y with padding')

  ct = jax.random.normal(jax.random.key(7), (N, D))
  g = grads(x, idx, weight, valid, wg, wu, wd, ct, backend=backend, capacity_factor=factor)
  assert np.all(np.asarray(g[0])[:16] == 0) and np.all(np.asarray(g[1])[:16] == 0)

  # A group of nothing but padding.
  y0, d0 = run(x, idx, weight, jnp.zeros(N, bool), wg, wu, wd, backend=backend,
               capacity_factor=factor)
  assert np.all(np.asarray(y0) == 0) and int(d0) == 0


@pytest.mark.parametrize('backend', ALL_BACKENDS)
def test_invalid_assignments_are_not_computed(backend):
  """valid per assignment [N, K] (an expert shard's view of gathered tokens): an invalid
  assignment adds nothing, whatever its expert, takes no capacity and is never counted as
  dropped; the result equals the float64 numpy MoE with those assignments' weights at 0."""
  x, idx, weight, valid_n, wg, wu, wd = make_inputs(4)
  valid_nk = valid_n[:, None] & (jax.random.uniform(jax.random.key(9), (N, K)) < 0.6)
  y, dropped = run(x, idx, weight, valid_nk, wg, wu, wd, backend=backend)
  assert int(dropped) == 0
  want = numpy_moe(x, idx, jnp.where(valid_nk, weight, 0.0), valid_n, wg, wu, wd, LIMIT)
  assert_close(y, want, what='y')
  # Other experts and weights behind the invalid assignments change nothing.
  idx2 = jnp.where(valid_nk, idx, (idx + 3) % E)
  idx2 = jnp.where(idx2[:, :1] == idx2[:, 1:], idx, idx2)  # keep a token's experts distinct
  y2, _ = run(x, idx2, jnp.where(valid_nk, weight, 5.0), valid_nk, wg, wu, wd, backend=backend)
  np.testing.assert_allclose(np.asarray(y2), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('backend', ALL_BACKENDS)
def test_clipping_is_effective(backend):
  # Large gate weights push x @ w_gate far past the limit; x @ w_up also saturates.
  inputs = make_inputs(4, gate_scale=8.0, pad_frac=0.0)
  x, idx, weight, valid, wg, wu, wd = inputs
  h_gate = np.einsum('nd,edf->nef', np.asarray(x), np.asarray(wg))
  h_up = np.einsum('nd,edf->nef', np.asarray(x), np.asarray(wu))
  assert (h_gate > LIMIT).mean() > 0.3 and (np.abs(h_up) > LIMIT).mean() > 0.2

  y, _ = run(*inputs, backend=backend)
  y_clipped = numpy_moe(*inputs, LIMIT)
  y_unclipped = numpy_moe(*inputs, None)
  assert_close(y, y_clipped, what='clipped math')
  assert np.abs(y_unclipped - y_clipped).max() > 10 * np.abs(y_clipped).max()

  y_none, _ = run(*inputs, backend=backend, limit=None)
  assert_close(y_none, y_unclipped, what='no limit')


@pytest.mark.parametrize('backend', ALL_BACKENDS)
def test_batched_equals_loop_over_groups(backend):
  groups = [make_inputs(10 + b, hot_experts=1.0, pad_frac=0.2) for b in range(3)]
  wg, wu, wd = groups[0][4:]
  x, idx, weight, valid = (jnp.stack([g[i] for g in groups]) for i in range(4))
  factor = 0.5 if backend == 'capacity_einsum' else NO_DROP

  @jax.jit
  def batched(x, idx, weight, valid, wg, wu, wd):
    return expert_ffn_batched(x, idx, weight, valid, wg, wu, wd, swiglu_limit=LIMIT,
                              backend=backend, capacity_factor=factor)

  y_b, dropped_b = batched(x, idx, weight, valid, wg, wu, wd)
  ys, total = [], 0
  for b in range(3):
    y, dropped = run(x[b], idx[b], weight[b], valid[b], wg, wu, wd, backend=backend,
                     capacity_factor=factor)
    ys.append(y)
    total += int(dropped)
  assert y_b.shape == (3, N, D)
  assert_close(y_b, jnp.stack(ys), what='batched vs loop')
  assert int(dropped_b) == total
  if backend == 'capacity_einsum':
    assert total > 0  # capacity is per group, and the groups do overflow


@pytest.mark.parametrize('backend', ['capacity_einsum', 'ragged_dot', 'grouped', 'gathered'])
def test_bf16_keeps_dtype_and_accuracy(backend):
  x, idx, weight, valid, wg, wu, wd = make_inputs(5)
  y, _ = run(x.astype(jnp.bfloat16), idx, weight, valid, wg, wu, wd, backend=backend)
  assert y.dtype == jnp.bfloat16
  y_ref, _ = run(x, idx, weight, valid, wg, wu, wd, backend='reference')
  assert_close(y, y_ref, rtol=3e-2, what='bf16')


def test_unknown_backend():
  with pytest.raises(ValueError, match='unknown expert backend'):
    expert_ffn(*make_inputs(0), swiglu_limit=LIMIT, backend='megablox')


def test_unknown_fp8_mode():
  with pytest.raises(ValueError, match='unknown fp8 mode'):
    expert_ffn(*make_inputs(0), swiglu_limit=LIMIT, backend='capacity_einsum', fp8='e5m2')


@pytest.mark.parametrize('tokens,gathers', [(1, True), (E // K, True), (E // K + 1, False)])
def test_small_calls_gather_their_experts(tokens, gathers):
  """routed_experts' gather_small: a call of at most E assignments (a decode step) runs the
  'gathered' backend instead of the dropless one asked for (no expert-sorted layout: no sort,
  no ragged dot), with the same outputs; larger calls, or gather_small off, keep the backend."""
  from deepseek41.ops.parallel.expert_parallel import routed_experts
  x, idx, weight, valid, wg, wu, wd = make_inputs(6, n=tokens, pad_frac=0.0)

  def call(gather_small):
    def f(x, weight):
      return routed_experts(x[None], idx[None], weight[None], valid[None], wg, wu, wd,
                            swiglu_limit=LIMIT, backend='ragged_dot', capacity_factor=NO_DROP,
                            gather_small=gather_small)[0][0]
    prims = {e.primitive.name for e in jaxpr_eqns(jax.make_jaxpr(f)(x, weight).jaxpr)}
    return prims, jax.jit(f)(x, weight)

  prims_on, y_on = call(True)
  prims_off, y_off = call(False)
  assert {'ragged_dot_general', 'sort'} <= prims_off
  assert (not {'ragged_dot_general', 'sort'} & prims_on) == gathers
  assert_close(y_on, y_off, what='gathered vs ragged_dot')
  assert_close(y_on, numpy_moe(x, idx, weight, valid, wg, wu, wd, LIMIT), what='vs numpy')
