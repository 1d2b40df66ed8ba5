"""The fused LM head + cross-entropy (ops/cross_entropy.py, `model.head_chunk`): the plain path's
loss and gradients for any chunk, the train step and the DSpark stage unchanged by it, and no
[B, T, V] buffer in its compiled program."""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.config.keys import ConfigError
from deepseek41.ops.cross_entropy import (chunk_layout, head_cross_entropy_sum,
                                          head_cross_entropy_sum_reference)
from deepseek41.train import state as state_lib
from deepseek41.train.objectives import dspark as dspark_objective
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import forward_loss
from tests.helpers import DRAFTER, REPO_ROOT, packed_batch, resolved

B, T, D, V = 3, 37, 24, 160
G = 0.37  # the loss's cotangent (the step scales the CE sum by 1 / its token count)


def _inputs(dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (B, T, D), jnp.float32).astype(dtype)
  w = (0.3 * jax.random.normal(k[1], (D, V), jnp.float32)).astype(dtype)
  targets = jax.random.randint(k[2], (B, T), 0, V)
  mask = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.int32)
  mask = mask.at[1].set(0).at[2, -4:].set(0)  # a whole row and a tail without targets
  return h, w, targets, mask


def _loss_and_grads(fn, h, w, targets, mask):
  def objective(h, w):
    ce_sum, n = fn(h, w, targets, mask)
    return G * ce_sum, n
  (loss, n), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(h, w)
  return loss, n, grads


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('chunk', [1, 5, 8, 37, 64])
def test_fused_equals_the_plain_path(dtype, chunk):
  """Loss, count and the gradients w.r.t. h and W, for chunks that divide T, do not (padded), or
  cover it (one chunk); fp32 to fp32 rounding, bf16 within bf16 rounding of the gradients (both
  paths round the logits' cotangent to bf16 before the products)."""
  h, w, targets, mask = _inputs(jnp.dtype(dtype))
  fused = lambda *a: head_cross_entropy_sum(*a, chunk)
  loss, n, (dh, dw) = _loss_and_grads(fused, h, w, targets, mask)
  loss_ref, n_ref, (dh_ref, dw_ref) = _loss_and_grads(head_cross_entropy_sum_reference,
                                                      h, w, targets, mask)
  assert float(n) == float(n_ref) == float(jnp.sum(mask))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  assert dh.dtype == h.dtype and dw.dtype == w.dtype
  # The masked positions get no gradient, on both paths.
  assert float(jnp.abs(dh[1]).max()) == 0.0 and float(jnp.abs(dh[2, -4:]).max()) == 0.0
  for got, want in ((dh, dh_ref), (dw, dw_ref)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    assert scale > 0
    tol = 1e-6 if dtype == 'float32' else 2 ** -7  # bf16 keeps 8 significant bits
    np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=tol)


def test_chunk_layout():
  """The fewest chunks of at most `chunk` positions, padded by less than one position each."""
  assert chunk_layout(4096, 1024) == (4, 1024)
  assert chunk_layout(37, 8) == (5, 8)
  assert chunk_layout(37, 64) == (1, 37)
  assert chunk_layout(101, 30) == (4, 26)
  for t in (1, 7, 48, 100, 4097):
    for chunk in (1, 3, 16, 1024):
      n, c = chunk_layout(t, chunk)
      assert c <= chunk and n * c >= t and n * c - t < n
  with pytest.raises(ValueError, match='model.head_chunk'):
    chunk_layout(48, 0)


def test_a_negative_chunk_is_refused_naming_the_key():
  with pytest.raises(ConfigError, match='model.head_chunk'):
    resolved(**{'model.head_chunk': -1})


def test_the_fused_op_holds_no_whole_logits():
  """The compiled forward + backward's temporaries: the plain path's hold the [B, T, V] fp32
  logits (and their cotangent), the fused op's one chunk's."""
  b, t, d, v, chunk = 2, 1024, 16, 2048, 64
  logits_bytes = b * t * v * 4
  args = (jnp.zeros((b, t, d)), jnp.zeros((d, v)), jnp.zeros((b, t), jnp.int32),
          jnp.ones((b, t), jnp.int32))

  def temp_bytes(fn):
    grad = jax.grad(lambda h, w, tg, m: fn(h, w, tg, m)[0], argnums=(0, 1))
    return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

  plain = temp_bytes(head_cross_entropy_sum_reference)
  fused = temp_bytes(lambda *a: head_cross_entropy_sum(*a, chunk))
  assert plain >= logits_bytes, (plain, logits_bytes)
  assert fused < logits_bytes / 4, (fused, logits_bytes)


def test_the_model_loss_with_the_fused_head_holds_no_whole_logits():
  """The same in the model's loss (train/step.py `forward_loss`, forward + backward), at a
  vocabulary whose logits outweigh the toy model's activations."""
  def temp_bytes(chunk):
    cfg = resolved(**{'model.vocab_size': 4096, 'model.head_chunk': chunk})
    tx = make_optimizer(cfg.train)
    md = state_lib.model_def(cfg, tx)
    state = jax.eval_shape(state_lib._init_fn(cfg, tx))
    batch = {k: jnp.asarray(x) for k, x in packed_batch(seed=1, vocab=4096).items()}
    grad = jax.grad(lambda p, biases: forward_loss(md, p, biases, batch)[0])
    compiled = jax.jit(grad).lower(state['params'], state['router_bias']).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  b, t = packed_batch()['tokens'].shape
  logits_bytes = b * t * 4096 * 4
  plain, fused = temp_bytes(0), temp_bytes(8)
  assert plain > fused + 1.5 * logits_bytes, (plain, fused, logits_bytes)


def test_the_dspark_stage_is_the_same_with_the_fused_head():
  """Post-training DSpark with model.head_chunk on: the backbone's CE through the fused op, the
  targets' logits through the head at the anchors only, and the objective equal those with it
  off (the fused op's gradients: the tests above)."""
  batch = {k: jnp.asarray(x) for k, x in packed_batch(seed=1).items()}
  key = jax.random.key(0)
  out = {}
  for chunk in (0, 16):
    cfg = resolved(**{**DRAFTER, 'model.head_chunk': chunk})
    tx = make_optimizer(cfg.train)
    md = state_lib.model_def(cfg, tx)
    state = jax.jit(state_lib._init_fn(cfg, tx))()

    def objective(p, cfg=cfg, md=md, state=state):
      loss, (ce_sum, n, _, _, targets_nkv, _, _) = dspark_objective.stage_loss(
          cfg, md.graphdef, p, None, state['router_bias'], batch, key)
      return loss, ce_sum, n, targets_nkv
    out[chunk] = jax.jit(objective)(state['params'])
  (loss, ce, n, targets), (loss_ref, ce_ref, n_ref, targets_ref) = out[16], out[0]
  assert float(n) == float(n_ref) > 0
  np.testing.assert_allclose(ce, ce_ref, rtol=1e-6)
  assert targets.shape == targets_ref.shape and targets.shape[-1] == cfg.model.vocab_size
  np.testing.assert_allclose(np.asarray(targets), np.asarray(targets_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)


def test_the_benchmark_runs_at_cpu_shapes(monkeypatch, capsys):
  """benchmarks/bench_cross_entropy.py (the GPU call's benchmark) at its --small shapes: one JSON
  line per case and path, the fused path's temporaries below the plain path's."""
  monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, 'benchmarks'))
  bench = importlib.import_module('bench_cross_entropy')  # a script beside benchmarks/timing.py
  bench.main(['--small', '--reps', '1'])
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
          if line.startswith('{')]
  cases = {r['case'] for r in rows}
  assert len(cases) == 2 and {r['head_chunk'] for r in rows} == {0, *bench.SMALL_CHUNKS}
  for case in cases:
    by_chunk = {r['head_chunk']: r for r in rows if r['case'] == case}
    assert all(r['fwd_bwd_ms'] > 0 for r in by_chunk.values())
    assert all(by_chunk[c]['temp_bytes'] < by_chunk[0]['temp_bytes'] for c in bench.SMALL_CHUNKS)
    assert all(abs(r['loss'] - by_chunk[0]['loss']) <= 1e-5 * abs(by_chunk[0]['loss'])
               for r in by_chunk.values())
