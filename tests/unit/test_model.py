"""Model behaviour: causality and document isolation by perturbation, backend equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.transformer import Transformer, head_logits
from deepseek41.train.step import cross_entropy_sum
from tests.helpers import packed_batch, resolved, token_ce

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)


def _model(**overrides):
  cfg = resolved(**overrides)
  return Transformer(cfg.model, nnx.Rngs(params=0)), cfg


_token_ce = nnx.jit(token_ce)


@pytest.fixture(scope='module', params=['capacity_einsum', 'reference'])
def model(request):
  return _model(**{'model.moe_backend': request.param})[0]


def test_later_tokens_do_not_change_earlier_losses(model):
  batch = packed_batch(seed=1)
  base = np.asarray(_token_ce(model, batch))
  rng = np.random.default_rng(2)
  for t_change in (5, 17, 30):
    pert = {k: v.copy() for k, v in batch.items()}
    pert['tokens'][:, t_change:] = rng.integers(3, 96, pert['tokens'][:, t_change:].shape)
    out = np.asarray(_token_ce(model, pert))
    np.testing.assert_array_equal(out[:, :t_change], base[:, :t_change])
    assert np.abs(out[:, t_change:] - base[:, t_change:]).max() > 1e-3  # the change is seen


def test_documents_do_not_see_each_other(model):
  batch = packed_batch(seed=3, docs_per_row=3)
  base = np.asarray(_token_ce(model, batch))
  seg = batch['segment_ids']
  rng = np.random.default_rng(4)
  for doc in (1, 2, 3):
    pert = {k: v.copy() for k, v in batch.items()}
    sel = seg == doc
    pert['tokens'][sel] = rng.integers(3, 96, sel.sum())
    out = np.asarray(_token_ce(model, pert))
    others = (seg != doc) & (seg > 0)
    np.testing.assert_array_equal(out[others], base[others])
    assert np.abs(out[sel] - base[sel]).max() > 1e-3


def test_padding_contributes_nothing(model):
  batch = packed_batch(seed=5)
  pert = {k: v.copy() for k, v in batch.items()}
  pad = batch['segment_ids'] == 0
  pert['tokens'][pad] = 7
  pert['targets'][pad] = 9
  np.testing.assert_array_equal(np.asarray(_token_ce(model, pert)),
                                np.asarray(_token_ce(model, batch)))


def _loss_and_grads(model, batch):
  def loss(m):
    logits, aux = m(batch)
    ce, n = cross_entropy_sum(logits, batch['targets'], batch['loss_mask'])
    return ce / n + 1e-2 * aux['balance']
  return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)


@pytest.mark.parametrize('overrides', [
    {'model.moe_backend': 'capacity_einsum'},
    {'model.moe_backend': 'ragged_dot'},
    {'model.attention_impl': 'reference'},
])
def test_fast_paths_match_reference(overrides):
  batch = packed_batch(seed=6)
  ref_model, _ = _model(**{'model.moe_backend': 'reference', 'model.attention_impl': 'reference'})
  l_ref, g_ref = _loss_and_grads(ref_model, batch)
  fast = {'model.moe_backend': 'reference', 'model.attention_impl': 'chunked', **overrides}
  l_fast, g_fast = _loss_and_grads(_model(**fast)[0], batch)
  np.testing.assert_allclose(l_fast, l_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_q_head_norm_switch_changes_the_model():
  batch = packed_batch(seed=7)
  on = np.asarray(_token_ce(_model()[0], batch))
  off = np.asarray(_token_ce(_model(**{'model.q_head_norm': False})[0], batch))
  assert np.abs(on - off).max() > 1e-4


def test_logical_axes_on_every_parameter():
  model, _ = _model()
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert leaves
  for v in leaves:
    axes = v.get_metadata().get('logical_axes')
    assert axes is not None and len(axes) == v.get_value().ndim


def test_output_depends_on_relative_positions_only(model, monkeypatch):
  # Scores see RoPE(q_t).RoPE(k_u) (relative), and the values carried RoPE too; rotating the
  # output back by the query's angle makes every layer invariant to a shift of all positions.
  batch = packed_batch(seed=8)
  shifted = dict(batch, positions=batch['positions'] + 977)
  base = np.asarray(_token_ce(model, batch))
  np.testing.assert_allclose(np.asarray(_token_ce(model, shifted)), base, rtol=2e-4, atol=2e-4)
  # Without the inverse rotation the shift changes the losses by O(1e-2): the test can fail.
  from deepseek41.model import attention
  rope = attention.apply_rope
  monkeypatch.setattr(attention, 'apply_rope',
                      lambda x, positions, inv_freq, inverse=False:
                      x if inverse else rope(x, positions, inv_freq))
  ce = nnx.jit(lambda m, b: token_ce(m, b))
  assert np.abs(np.asarray(ce(model, shifted)) - np.asarray(ce(model, batch))).max() > 1e-3


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_head_backward_runs_in_the_compute_dtype(dtype):
  """The LM head's gradients are those of its fp32-output product with the logits' cotangent
  rounded to the compute dtype, and its backward holds no fp32 product over the vocabulary."""
  dt = jnp.dtype(dtype)
  x = jax.random.normal(jax.random.key(0), (2, 8, 16)).astype(dt)
  w = jax.random.normal(jax.random.key(1), (16, 64)).astype(dt)
  g = jax.random.normal(jax.random.key(2), (2, 8, 64), jnp.float32)
  plain = lambda x, w: jnp.einsum('btd,dv->btv', x, w, preferred_element_type=jnp.float32)
  logits, vjp = jax.vjp(head_logits, x, w)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain(x, w)))
  dx, dw = vjp(g)
  assert dx.dtype == dt and dw.dtype == dt
  # the reference: autodiff of the plain product, fed the cotangent as the compute dtype rounds it
  want_dx, want_dw = jax.vjp(plain, x.astype(jnp.float32), w.astype(jnp.float32))[1](
      g.astype(dt).astype(jnp.float32))
  tol = 1e-6 if dtype == 'float32' else 1e-2
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want_dw), rtol=tol, atol=tol)
  bwd = jax.make_jaxpr(lambda x, w, g: jax.vjp(head_logits, x, w)[1](g))(x, w, g)
  dots = [e for e in bwd.eqns if e.primitive.name == 'dot_general']
  assert len(dots) == 2 and all(v.aval.dtype == dt for e in dots for v in e.invars)  # dx, dW
