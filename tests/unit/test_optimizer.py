"""train.optimizer=muon_hybrid (train/optimizer.py, train/muon.py): each parameter group gets the
update it should, Newton-Schulz against the SVD's polar factor, the Sinkhorn balance, the DSpark
stage's step, the bytes tools.info counts, the config checks. (On 8 devices and through the
trainer: tests/system/test_muon_hybrid.py.)"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import _muon as optax_muon

from deepseek41.config import ConfigError, resolve
from deepseek41.model.params import EngramTable, TokenTable
from deepseek41.tools.info import bytes_per_device
from deepseek41.train import state as state_lib
from deepseek41.train import muon as muon_lib
from deepseek41.train.muon import (newton_schulz, ns_coefficients, sinkhorn_balance,
                                   sinkhorn_balance_reference, unit_lines)
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import (ADAMW, MUON, SINKHORN, hybrid_group, hybrid_labels,
                                        learning_rate_schedule, make_optimizer)
from tests.helpers import (VISION, leaf_value, random_like, resolved, singular_values,
                           small_config)

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

COEFFS = ns_coefficients(((3.4445, -4.775, 2.0315), (2.0, -1.5, 0.5)), (8, 2))
# The whole structure: Engram tables, mHC's static parameters, experts, head-wise Q.
# The source's 8 + 2 iterations: the updates below are held to the SVD's polar factor, which the
# default 4 + 1 reaches only to a few percent (its own test below).
HYBRID = {'train.optimizer': 'muon_hybrid', 'model.engram': True,
          'model.residual': 'mhc_single_pass', 'train.muon_ns_steps': (8, 2)}
# + CSA2 (the indexer's head-wise Q) and the ViT (its fused q/k/v), for the updates alone (no
# forward pass to compile)
EVERY_GROUP = {**HYBRID, **VISION, 'model.attention_variant': 'csa2'}


def _polar(x):
  u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
  return u @ vt


# ---- Newton-Schulz and the Sinkhorn balance ------------------------------------------------------


@pytest.mark.parametrize('shape', [(48, 24), (24, 48), (32, 32)])
def test_newton_schulz_is_the_polar_factor(shape):
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  out = np.asarray(newton_schulz(jnp.asarray(x), COEFFS))
  # fp32, 8 fast + 2 stable iterations: measured max |error| 1e-4 (2e-4 square), singular values
  # in [1.0000, 1.0005].
  np.testing.assert_allclose(out, _polar(x), atol=5e-4)
  assert np.all(np.abs(singular_values(out) - 1) < 1e-3)
  # bf16 iterations: singular values within 0.7% of 1 (measured 0.993-1.007), the factor itself
  # within 1.6e-2 of the SVD's (entries ~0.15): what train.muon_ns_dtype=bfloat16 trades.
  out16 = np.asarray(newton_schulz(jnp.asarray(x), COEFFS, jnp.bfloat16))
  assert out16.dtype == np.float32
  assert np.all(np.abs(singular_values(out16) - 1) < 1.5e-2)
  np.testing.assert_allclose(out16, _polar(x), atol=3e-2)


def test_the_default_schedule_orthogonalises_a_rectangular_matrix_to_5_percent():
  # 4 + 1 iterations (train.muon_ns_steps' default, [I]): a random 96 x 384 matrix (singular
  # values about 0.1 after the Frobenius scaling) comes out within 4%; what the schedule gives up
  # against 8 + 2 is the directions that start far smaller (docs/architecture.md section 4.2).
  t = small_config(**{'train.optimizer': 'muon_hybrid'}).train
  assert t.muon_ns_steps == (4, 1)
  coeffs = ns_coefficients(t.muon_ns_coeffs, t.muon_ns_steps)
  x = np.random.default_rng(0).normal(size=(96, 384)).astype(np.float32)
  sv = singular_values(np.asarray(newton_schulz(jnp.asarray(x), coeffs)))
  assert np.all(np.abs(sv - 1) < 0.05), (sv.min(), sv.max())
  assert np.abs(singular_values(np.asarray(newton_schulz(jnp.asarray(x), COEFFS))) - 1).max() < 1e-3


def test_newton_schulz_matches_optax_contrib():
  """Same iteration as optax.contrib.muon's (fp32; its eps is 1e-8, ours 1e-7)."""
  x = np.random.default_rng(1).normal(size=(40, 24)).astype(np.float32)
  theirs = optax_muon.orthogonalize_via_newton_schulz(jnp.asarray(x), jnp.asarray(COEFFS),
                                                      ns_steps=len(COEFFS))
  np.testing.assert_allclose(np.asarray(newton_schulz(jnp.asarray(x), COEFFS)),
                             np.asarray(theirs), atol=1e-6)


def test_newton_schulz_keeps_zero():
  np.testing.assert_array_equal(np.asarray(newton_schulz(jnp.zeros((8, 4)), COEFFS)), 0.0)


def test_sinkhorn_balance_rows_and_columns():
  rng = np.random.default_rng(2)
  # rows and columns at very different scales, and rows of tokens absent from recent batches
  x = rng.normal(size=(64, 16)) * rng.uniform(0.1, 10, (64, 1)) * rng.uniform(0.1, 10, (1, 16))
  x[:8] *= 1e-5   # decayed momentum: below tau x the mean row norm
  x[8:12] = 0.0   # never seen
  out = np.asarray(sinkhorn_balance(jnp.asarray(x, jnp.float32), 11, 1e-3, 1e-20))
  np.testing.assert_array_equal(out[:12], 0.0)
  live = out[12:]
  # the last of the 11 normalisations is the rows': every live row has RMS 1 exactly
  np.testing.assert_allclose(np.sqrt(np.mean(live ** 2, axis=1)), 1.0, rtol=1e-5)
  # the columns, balanced within 1%: the input's spread over columns was up to 100x
  col = np.linalg.norm(live, axis=0)
  assert col.max() / col.min() < 1.01, col
  assert np.all(np.sign(live) == np.sign(x[12:]))  # a positive rescaling of each entry


@pytest.mark.parametrize('shape, normalizations', [((64, 16), 11), ((300, 7), 3), ((5, 40), 1)])
def test_sinkhorn_balance_matches_its_reference(shape, normalizations):
  """The scale-vector form equals the table normalised line by line, dead and zero rows too."""
  rng = np.random.default_rng(shape[0])
  x = rng.normal(size=shape) * rng.uniform(0.1, 10, (shape[0], 1)) * rng.uniform(0.1, 10, shape[1])
  x[:2] *= 1e-6
  x[2] = 0.0
  x = jnp.asarray(x, jnp.float32)
  np.testing.assert_allclose(np.asarray(sinkhorn_balance(x, normalizations, 1e-3, 1e-20)),
                             np.asarray(sinkhorn_balance_reference(x, normalizations, 1e-3, 1e-20)),
                             rtol=2e-5, atol=1e-7)


def test_unit_lines_is_finite_and_zero_where_the_norm_is():
  """The balance's normalisation: x / (|x| + eps) where the norm is positive, and 0 (not x / eps)
  where it is zero, also for entries whose squares underflow (as a GPU flushes tiny squares);
  finite for entries whose squares overflow. The 1B model's first GPU update went non-finite on
  exactly the tables with all-zero rows (docs/performance.md section 39)."""
  x = np.zeros((5, 4), np.float32)
  x[0] = [3.0, 4.0, 0.0, 0.0]  # norm 5
  x[1] = [1e-30, -1e-30, 0.0, 1e-30]  # squares underflow to 0: a zero norm, nonzero entries
  x[3] = [3e30, 0.0, 0.0, -4e30]  # squares overflow: an infinite norm
  out = np.asarray(unit_lines(jnp.asarray(x), axis=1, eps=1e-20))
  np.testing.assert_allclose(out[0], x[0] / (5.0 + 1e-20), rtol=1e-6)
  np.testing.assert_array_equal(out[1:3], 0.0)
  assert np.isfinite(out).all()
  cols = np.asarray(unit_lines(jnp.asarray(x[[0, 2]]), axis=0, eps=1e-20))
  np.testing.assert_allclose(cols, [[1, 1, 0, 0], [0, 0, 0, 0]], rtol=1e-6)


# ---- each group gets its update ------------------------------------------------------------------


def _params(cfg):
  model = state_lib.build_model(cfg)
  return objective_for(cfg).split(model).params


@functools.lru_cache(maxsize=None)
def _first_update():
  """One muon_hybrid update of the small model from random gradients (no weight decay, so the
  directions are bare); half the vocabulary absent from the batch."""
  cfg = resolved(**EVERY_GROUP, **{'train.weight_decay': 0.0})
  params = _params(cfg)
  grads = random_like(params, 0)
  absent = np.arange(cfg.model.vocab_size) % 2 == 1
  grads['embed'].set_value(jnp.where(absent[:, None], 0.0, grads['embed'].get_value()))
  tx = make_optimizer(cfg.train)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return cfg, params, grads, updates, _lr(cfg), absent


def _lr(cfg):
  return float(learning_rate_schedule(cfg.train)(0))


def _assert_orthogonal(direction_mn, grad_mn, rms):
  """direction = rms x sqrt(max(m, n)) x polar(grad): its singular values near equal (a square
  random matrix's smallest ones converge last: measured 0.988 for one of 32)."""
  m, n = direction_mn.shape
  unit = direction_mn / (rms * math.sqrt(max(m, n)))
  np.testing.assert_allclose(singular_values(unit), 1.0, atol=2e-2)
  np.testing.assert_allclose(unit, _polar(grad_mn), atol=5e-3)


def test_groups_are_chosen_by_type_and_metadata():
  cfg, params, *_ = _first_update()
  labels = hybrid_labels(params)
  assert labels['embed'] == labels['head'] == SINKHORN
  assert labels['blocks'][1]['engram']['table'] == SINKHORN
  for matrix in ('wq_a', 'wq_b', 'wkv', 'wo_a', 'wo_b'):
    assert labels['blocks'][0]['attn'][matrix] == MUON
  for w in ('w_gate', 'w_up', 'w_down', 'w_router', 'shared_up'):
    assert labels['blocks'][0]['moe'][w] == MUON
  assert labels['blocks'][0]['attn_site']['fn'] == MUON
  # vectors and elementwise weights, the [n, d] Engram norm weights included
  for path in (('blocks', 0, 'attn', 'sink'), ('blocks', 0, 'attn_norm', 'scale'),
               ('blocks', 0, 'attn_site', 'base'), ('blocks', 0, 'attn_site', 'scale'),
               ('blocks', 1, 'engram', 'q_weight'), ('final_norm', 'scale')):
    node = labels
    for p in path:
      node = node[p]
    assert node == ADAMW, path
  assert isinstance(params['head'], TokenTable) and isinstance(
      params['blocks'][1]['engram']['table'], EngramTable)


def test_a_matrix_moves_by_its_polar_factor():
  cfg, _, grads, updates, lr, _ = _first_update()
  rms = cfg.train.muon_rms_match
  for name in ('wkv', 'wq_a', 'wo_b'):
    _assert_orthogonal(-leaf_value(updates, 'blocks', 0, 'attn', name) / lr,
                       leaf_value(grads, 'blocks', 0, 'attn', name), rms)
  fn = -leaf_value(updates, 'blocks', 2, 'ffn_site', 'fn') / lr
  _assert_orthogonal(fn, leaf_value(grads, 'blocks', 2, 'ffn_site', 'fn'), rms)
  # the RMS matched to AdamW's: rms x lr
  assert np.sqrt(np.mean(fn ** 2)) == pytest.approx(rms, rel=1e-3)


def test_each_expert_and_each_q_head_is_orthogonalised_on_its_own():
  cfg, _, grads, updates, lr, _ = _first_update()
  rms = cfg.train.muon_rms_match
  up_edf = -leaf_value(updates, 'blocks', 0, 'moe', 'w_up') / lr
  g_edf = leaf_value(grads, 'blocks', 0, 'moe', 'w_up')
  for e in range(up_edf.shape[0]):
    _assert_orthogonal(up_edf[e], g_edf[e], rms)
  # (the stack orthogonalised as one [E x d, f] matrix would leave each slice's singular
  # values near 1/sqrt(E), not 1)
  whole = _polar(g_edf.reshape(-1, g_edf.shape[-1])).reshape(g_edf.shape)
  assert singular_values(whole[0]).max() < 0.7
  q_rhd = -leaf_value(updates, 'blocks', 1, 'attn', 'wq_b') / lr
  g_rhd = leaf_value(grads, 'blocks', 1, 'attn', 'wq_b')
  for h in range(q_rhd.shape[1]):
    _assert_orthogonal(q_rhd[:, h], g_rhd[:, h], rms)
  # the indexer's head-concatenated Q and the grouped output projection, likewise
  iq = -leaf_value(updates, 'blocks', 1, 'attn', 'csa2', 'index_query', 'wq_b') / lr
  giq = leaf_value(grads, 'blocks', 1, 'attn', 'csa2', 'index_query', 'wq_b')
  for h in range(iq.shape[1]):
    _assert_orthogonal(iq[:, h], giq[:, h], rms)
  wo = -leaf_value(updates, 'blocks', 0, 'attn', 'wo_a') / lr
  gwo = leaf_value(grads, 'blocks', 0, 'attn', 'wo_a')
  for g in range(wo.shape[0]):
    _assert_orthogonal(wo[g], gwo[g], rms)
  # the ViT's fused [d, 3, heads, head_dim]: each of q, k, v of each head
  qkv = -leaf_value(updates, 'vision', 'blocks', 0, 'attn', 'w_qkv') / lr
  gqkv = leaf_value(grads, 'vision', 'blocks', 0, 'attn', 'w_qkv')
  for j in range(3):
    for h in range(qkv.shape[2]):
      _assert_orthogonal(qkv[:, j, h], gqkv[:, j, h], rms)


def test_same_shaped_weights_are_orthogonalised_as_one_batch():
  """The layers' copies of a weight form one Newton-Schulz batch (cut at train.muon_batch_mib),
  and the batch changes no update: each weight alone gives the same one."""
  cfg, params, grads, updates, _, _ = _first_update()
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  muon = [i for i, v in enumerate(leaves) if hybrid_group(v) == MUON]
  batches = muon_lib._batches([leaves[i] if i in muon else None for i in range(len(leaves))],
                              2, 1 << 30)
  assert sorted(i for b in batches for i in b) == muon
  assert len(batches) < len(muon)
  w_up = {i for i, v in enumerate(leaves) if hybrid_group(v) == MUON
          and v.get_value().shape == leaf_value(params, 'blocks', 0, 'moe', 'w_up').shape
          and muon_lib.stack_axes_of(v) == (0,)}
  assert len(w_up) > 1 and any(w_up <= set(b) for b in batches)
  for b in batches:  # one shape, layout and dtype in each
    assert len({(leaves[i].get_value().shape, leaves[i].get_metadata().get('logical_axes'))
                for i in b}) == 1
  one_byte_batches = muon_lib._batches([leaves[i] for i in muon], 2, 1)
  assert all(len(b) == 1 for b in one_byte_batches)
  # each weight on its own: the same update
  alone = dataclasses.replace(cfg.train, muon_batch_mib=0)
  tx = make_optimizer(alone)
  updates_alone, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(updates_alone)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_a_norm_weight_moves_like_adamw():
  cfg, params, grads, updates, lr, _ = _first_update()
  t = cfg.train
  adamw = optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=0.0)
  clip = min(1.0, t.grad_clip_norm / float(optax.tree.norm(grads)))  # before every group
  for path in (('blocks', 0, 'attn_norm', 'scale'), ('blocks', 0, 'attn', 'sink'),
               ('blocks', 0, 'ffn_site', 'base'), ('blocks', 1, 'engram', 'k_weight')):
    g, p = clip * jnp.asarray(leaf_value(grads, *path)), jnp.asarray(leaf_value(params, *path))
    expected, _ = adamw.update(g, adamw.init(p), p)
    np.testing.assert_allclose(leaf_value(updates, *path), np.asarray(expected), rtol=1e-4,
                               err_msg=str(path))


def test_token_tables_get_the_sinkhorn_update():
  cfg, _, grads, updates, lr, absent = _first_update()
  t = cfg.train
  step = t.sinkhorn_gamma * lr
  embed = -leaf_value(updates, 'embed') / step
  np.testing.assert_array_equal(embed[absent], 0.0)   # tokens not in the batch: no update
  np.testing.assert_allclose(np.sqrt(np.mean(embed[~absent] ** 2, axis=1)), 1.0, rtol=1e-4)
  np.testing.assert_allclose(
      embed[~absent], np.asarray(sinkhorn_balance(jnp.asarray(leaf_value(grads, 'embed')[~absent]),
                                                  t.sinkhorn_normalizations, t.sinkhorn_tau,
                                                  t.sinkhorn_eps)), rtol=1e-4, atol=1e-6)
  # the head's rows are its columns ([d_model, vocab]): one RMS-1 column per token
  head = -leaf_value(updates, 'head') / step
  np.testing.assert_allclose(np.sqrt(np.mean(head ** 2, axis=0)), 1.0, rtol=1e-4)
  # Engram tables: the same update at engram_table_lr_multiplier x the rate
  table = -leaf_value(updates, 'blocks', 1, 'engram', 'table') / (step * t.engram_table_lr_multiplier)
  live = np.abs(leaf_value(grads, 'blocks', 1, 'engram', 'table')).sum(axis=1) > 0
  np.testing.assert_allclose(np.sqrt(np.mean(table[live] ** 2, axis=1)), 1.0, rtol=1e-4)


def test_weight_decay_reaches_only_the_matrices():
  cfg = resolved(**HYBRID)  # train.weight_decay 0.1 on the Muon matrices
  params = _params(cfg)
  tx = make_optimizer(cfg.train)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zero, tx.init(params), params)
  lr = _lr(cfg)
  w = leaf_value(params, 'blocks', 0, 'moe', 'w_down')
  np.testing.assert_allclose(leaf_value(updates, 'blocks', 0, 'moe', 'w_down'),
                             -lr * cfg.train.weight_decay * w, rtol=1e-5)
  for path in (('embed',), ('head',), ('final_norm', 'scale'), ('blocks', 0, 'attn', 'sink')):
    np.testing.assert_array_equal(leaf_value(updates, *path), 0.0)


# ---- bytes, config, the DSpark stage -------------------------------------------------------------


def test_tools_info_counts_one_moment_for_matrices_and_tables():
  cfg = resolved(**HYBRID, num_devices=4, **{'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.tensor': 2})
  abstract = state_lib.abstract_state(cfg, make_optimizer(cfg.train))
  sizes = {'fsdp': 2, 'tensor': 2}
  labels = jax.tree.leaves(hybrid_labels(abstract['params']))
  per_param = [bytes_per_device({'params': {'x': v}, 'opt': {}, 'router_bias': {}},
                                cfg.mesh.rules, sizes)['params']
               for v in jax.tree.leaves(abstract['params'],
                                        is_leaf=lambda x: isinstance(x, nnx.Variable))]
  moments = {MUON: 1, SINKHORN: 1, ADAMW: 2}
  expected = sum(moments[g] * b for g, b in zip(labels, per_param))
  got = bytes_per_device(abstract, cfg.mesh.rules, sizes)['optimizer']
  assert 0 <= got - expected <= 64   # beyond the moments: a few int32 step counts
  adamw = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer='adamw'))
  adamw_bytes = bytes_per_device(state_lib.abstract_state(adamw, make_optimizer(adamw.train)),
                                 cfg.mesh.rules, sizes)['optimizer']
  assert got < 0.6 * adamw_bytes


@pytest.mark.parametrize('override,culprit', [
    ({'train.optimizer': 'lion'}, 'train.optimizer'),
    ({'train.sinkhorn_normalizations': 10}, 'train.sinkhorn_normalizations'),
    ({'train.muon_ns_steps': (8,)}, 'train.muon_ns_steps'),
    ({'train.muon_ns_coeffs': ((3.4, -4.7),), 'train.muon_ns_steps': (5,)},
     'train.muon_ns_coeffs'),
    ({'train.muon_momentum': 1.0}, 'train.muon_momentum'),
    ({'train.sinkhorn_tau': -1.0}, 'train.sinkhorn_tau'),
    ({'train.muon_ns_dtype': 'float16'}, 'train.muon_ns_dtype'),
    ({'train.muon_batch_mib': -1}, 'train.muon_batch_mib')])
def test_bad_keys_are_named(override, culprit):
  with pytest.raises(ConfigError, match=culprit):
    resolved(**override)


def test_muon_ns_dtype_auto_follows_the_backend():
  c = small_config()
  assert resolve(c, num_devices=1, backend='cpu').train.muon_ns_dtype == 'float32'
  assert resolve(c, num_devices=1, backend='gpu').train.muon_ns_dtype == 'bfloat16'


def test_the_update_names_each_group_for_the_profile():
  """The `optimizer` scope's table splits by group: each part of the update carries its name
  in the lowered program's locations (what the trace's kernels inherit)."""
  cfg = resolved(**EVERY_GROUP)
  params = _params(cfg)
  tx = make_optimizer(cfg.train)
  lowered = jax.jit(tx.update).lower(random_like(params, 0), tx.init(params), params)
  text = lowered.as_text(debug_info=True)
  for scope in ('clip', 'muon/momentum', 'muon/newton_schulz', 'sinkhorn/momentum',
                'sinkhorn/balance', 'adamw'):
    assert f'{scope}/' in text or f'"{scope}"' in text, scope
