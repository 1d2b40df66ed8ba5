"""The selected-entry indexer scores: the kernel (Pallas interpreter) equals the jnp reference.

Outputs and the gradients into q, w and the keys, on selections with documents, queries that
see nothing and valid slots scattered through the row; per device under a mesh; and the whole
model's loss and gradients with `model.index_impl='fused'` against 'reference'.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.ops.gpu.selected_scores import selected_scores_fused
from deepseek41.ops.selected_scores import selected_scores, selected_scores_reference
from flax import nnx

from deepseek41.model.transformer import Transformer
from tests.helpers import RELEASED_QUANT, REPO_ROOT, packed_batch, random_selection, resolved

C = 16


def _inputs(seed, b=2, t=24, n=12, k=6, dtype=jnp.float32, prefix=True, h=16):
  kq, kw, kk, ks, kg = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(kq, (b, t, h, C), dtype)
  w = jax.random.normal(kw, (b, t, h), jnp.float32)
  keys = jax.random.normal(kk, (b, n, C), dtype)
  idx, valid = random_selection(ks, b, t, n, k, prefix=prefix)
  ct = jax.random.normal(kg, (b, t, k))
  return q, w, keys, idx, valid, ct


def _value_and_grads(fn, q, w, keys, ct):
  def loss(q, w, keys):
    s = fn(q, w, keys)
    return jnp.sum(s * ct) + jnp.sum(jnp.sin(s)), s
  (_, s), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, w, keys)
  return s, grads


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize('prefix,block_k,heads', [(True, 4, 16), (False, 4, 16), (True, 16, 4)])
def test_kernel_equals_reference(dtype, tol, prefix, block_k, heads):
  # heads=4: padded to 16 zero-weighted heads inside, which must move nothing.
  q, w, keys, idx, valid, ct = _inputs(0, dtype=dtype, prefix=prefix, h=heads)
  s_ref, g_ref = _value_and_grads(
      lambda q, w, k: selected_scores_reference(q, w, k, idx, valid, chunk=8), q, w, keys, ct)
  s_k, g_k = _value_and_grads(
      lambda q, w, k: selected_scores_fused(q, w, k, idx, valid, block_k=block_k,
                                            interpret=True), q, w, keys, ct)
  assert s_k.shape == s_ref.shape == idx.shape and s_k.dtype == jnp.float32
  assert not np.any(np.asarray(s_k)[~np.asarray(valid)])  # invalid slots score exactly 0
  assert np.any(~np.asarray(valid)) and np.abs(np.asarray(s_ref)).max() > 0.1
  scale = float(jnp.abs(s_ref).max())
  np.testing.assert_allclose(s_k, s_ref, rtol=tol, atol=tol * scale)
  for name, a, b in zip(('q', 'w', 'keys'), g_k, g_ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape and np.abs(b).max() > 0, name
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)


def test_the_gradient_ignores_invalid_slots():
  # A cotangent on invalid slots (the caller's loss masks them, but a kernel must not rely on
  # it) moves no gradient, as in the reference.
  q, w, keys, idx, valid, _ = _inputs(1)
  ct = jnp.where(valid, 0.0, 1.0)
  for fn in (lambda q, w, k: selected_scores_reference(q, w, k, idx, valid, chunk=8),
             lambda q, w, k: selected_scores_fused(q, w, k, idx, valid, interpret=True)):
    _, grads = _value_and_grads(fn, q, w, keys, ct)
    _, grads_sin = _value_and_grads(fn, q, w, keys, jnp.zeros_like(ct))
    for a, b in zip(grads, grads_sin):
      np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize('sizes', [dict(data=2, context=2, tensor=2), dict(data=2, fsdp=2,
                                                                          expert=2)])
def test_per_device_under_a_mesh(sizes):
  """Each device scores its own queries against the whole keys; the keys' gradient sums over the
  context shards' queries, and tensor shards (which all see every head) do not count twice."""
  q, w, keys, idx, valid, ct = _inputs(2, b=8, t=16, n=8, k=4)
  fn_ref = lambda q, w, k: selected_scores(q, w, k, idx, valid, impl='reference', chunk=8)
  fn_k = lambda q, w, k: selected_scores(q, w, k, idx, valid, impl='fused')
  want = jax.jit(lambda *a: _value_and_grads(fn_ref, *a))(q, w, keys, ct)
  axes = ('data', 'fsdp', 'expert', 'tensor', 'context')
  mesh = jax.make_mesh(tuple(sizes.get(a, 1) for a in axes), axes,
                       axis_types=(jax.sharding.AxisType.Auto,) * 5)
  batch_axes = tuple(a for a in ('data', 'fsdp', 'expert') if a in sizes)
  with jax.set_mesh(mesh):
    seq = 'context' if 'context' in sizes else None
    tok = NamedSharding(mesh, P(batch_axes, seq))
    q_s, w_s, ct_s = (jax.device_put(a, tok) for a in (q, w, ct))
    keys_s = jax.device_put(keys, NamedSharding(mesh, P(batch_axes)))
    jaxpr = jax.make_jaxpr(lambda *a: _value_and_grads(fn_k, *a))(q_s, w_s, keys_s, ct_s)
    assert 'shard_map' in str(jaxpr)
    got = jax.jit(lambda *a: _value_and_grads(fn_k, *a))(q_s, w_s, keys_s, ct_s)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _loss_and_grads(cfg, impl, batch):
  """The LM loss plus the indexer's distillation loss (the only loss that reaches the indexer),
  with both indexer scorers on `impl`."""
  model = Transformer(dataclasses.replace(cfg, index_impl=impl, selected_scores_impl=impl),
                      nnx.Rngs(params=0))

  def loss(m):
    logits, aux = m(batch)
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, batch['targets'][..., None], axis=-1)[..., 0]
    return jnp.sum(ce * batch['loss_mask']) / batch['loss_mask'].sum() + aux['indexer_loss']
  return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)


def test_model_with_the_fused_indexer_equals_reference():
  """The whole model (documents packed, released fake quantization) with both indexer kernels
  (model.index_impl and model.selected_scores_impl 'fused') against both jnp scorers."""
  shapes = {'model.attention_variant': 'csa2', 'model.num_heads': 16, 'model.o_groups': 2,
            'model.index_n_heads': 16, 'model.index_head_dim': 32, 'model.sparse_chunk': 16,
            'model.index_topk_block': 2, **RELEASED_QUANT}
  cfg = resolved(**shapes).model
  batch = {k: jnp.asarray(v)[:2] for k, v in packed_batch(seed=5, docs_per_row=2, pad=4).items()}
  l_ref, g_ref = _loss_and_grads(cfg, 'reference', batch)
  l_k, g_k = _loss_and_grads(cfg, 'fused', batch)
  np.testing.assert_allclose(l_k, l_ref, rtol=1e-5)
  leaves_ref, leaves_k = jax.tree.leaves(g_ref), jax.tree.leaves(g_k)
  assert len(leaves_ref) == len(leaves_k)
  for a, b in zip(leaves_k, leaves_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)
  # ... and the comparison covers the kernel's gradient: the indexer's parameters get one.
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(g_k)}
  indexer = {p: v for p, v in flat.items() if 'index_keys' in p or 'index_query' in p}
  assert len(indexer) >= 4 and all(float(jnp.abs(v).max()) > 0 for v in indexer.values())


def test_benchmark_runs_at_cpu_shapes():
  """benchmarks/bench_selected_scores.py (the GPU call's microbenchmark), the kernel interpreted:
  its check passes and every path is timed."""
  import json
  import os
  import subprocess
  import sys
  root = REPO_ROOT
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': '', 'PYTHONPATH': root}
  out = subprocess.run(
      [sys.executable, os.path.join(root, 'benchmarks', 'bench_selected_scores.py'),
       '--interpret', '--batch', '1', '--seq_len', '64', '--topk', '16', '--chunk', '32',
       '--reps', '1', '--ratios', '2', '--block_k', '16'],
      capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')]
  assert [r['ok'] for r in rows if 'check' in r] == [True]
  timed = {(r['impl'], r['mode']) for r in rows if 'ms' in r}
  assert timed == {(i, m) for i in ('reference', 'fused') for m in ('fwd', 'fwd_bwd')}, rows
