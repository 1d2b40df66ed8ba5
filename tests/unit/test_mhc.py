"""mHC: Sinkhorn, collapse/expand direction, and both orders against a direct transcription."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.mhc import collapse, expand, sinkhorn
from deepseek41.model.shared import Shared
from deepseek41.model.transformer import Transformer
from tests.helpers import packed_batch, resolved


def test_sinkhorn_is_doubly_stochastic():
  logits = jax.random.normal(jax.random.key(0), (64, 4, 4))
  c = np.asarray(sinkhorn(logits, 20, 1e-6))  # the released 20 rounds
  assert (c > 0).all()
  np.testing.assert_allclose(c.sum(-2), 1.0, atol=1e-5)   # the last step normalises columns
  np.testing.assert_allclose(c.sum(-1), 1.0, atol=1e-4)
  one_round = np.asarray(sinkhorn(logits, 1, 1e-6))
  assert np.abs(one_round.sum(-1) - 1).max() > 1e-2       # the iterations do the work


def test_expand_mixes_with_the_first_index_of_c():
  """X'[k] = post_k F + sum_j C[j, k] X[j] (C^T X); C is not symmetric."""
  x = np.random.default_rng(0).standard_normal((1, 1, 3, 2)).astype(np.float32)
  f = np.array([[[1.0, -1.0]]], np.float32)
  post = np.array([[[0.5, 1.0, 2.0]]], np.float32)
  c = np.zeros((1, 1, 3, 3), np.float32)
  c[0, 0, 0, 2] = 1.0  # stream 0 feeds stream 2
  c[0, 0, 2, 1] = 1.0
  c[0, 0, 1, 0] = 1.0
  got = np.asarray(expand(jnp.asarray(x), jnp.asarray(f), jnp.asarray(post), jnp.asarray(c)))
  want = np.stack([x[0, 0, 1], x[0, 0, 2], x[0, 0, 0]]) + post[0, 0, :, None] * f[0, 0]
  np.testing.assert_allclose(got[0, 0], want, rtol=1e-6)
  pre = np.array([[[1.0, 0.0, 2.0]]], np.float32)
  np.testing.assert_allclose(np.asarray(collapse(jnp.asarray(x), jnp.asarray(pre)))[0, 0],
                             x[0, 0, 0] + 2 * x[0, 0, 2], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The orders, transcribed from docs/architecture.md section 3.2 in numpy


def _np_coefficients(site, x_tnd, eps_norm, n, iters, eps):
  fn = np.asarray(site.fn[...], np.float64)
  base = np.asarray(site.base[...], np.float64)
  scale = np.asarray(site.scale[...], np.float64)
  flat = x_tnd.reshape(x_tnd.shape[0], -1).astype(np.float64)
  flat = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + eps_norm)
  m = flat @ fn.T
  sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
  pre = sig(scale[0] * m[:, :n] + base[:n]) + eps
  post = 2 * sig(scale[1] * m[:, n:2 * n] + base[n:2 * n])
  logits = (scale[2] * m[:, 2 * n:] + base[2 * n:]).reshape(-1, n, n)
  c = np.exp(logits - logits.max(-1, keepdims=True))
  c = c / c.sum(-1, keepdims=True) + eps
  c = c / (c.sum(-2, keepdims=True) + eps)
  for _ in range(iters - 1):
    c = c / (c.sum(-1, keepdims=True) + eps)
    c = c / (c.sum(-2, keepdims=True) + eps)
  return pre, post, c


def _transcription(model, batch, order):
  """Logits of row 0 computed by the pseudo-code of section 3.2, calling the model's sublayers."""
  cfg = model.cfg
  n = cfg.hc_mult
  coef = lambda site, x: _np_coefficients(site, x, cfg.rms_norm_eps, n,  # noqa: E731
                                          cfg.hc_sinkhorn_iters, cfg.hc_eps)
  row = {k: v[:1] for k, v in batch.items()}
  e = np.asarray(model.embed[...])[row['tokens'][0]].astype(np.float64)   # [T, D]
  x = np.repeat(e[:, None, :], n, axis=1)                                 # [T, n, D]
  pre_prev = np.tile(np.eye(n)[0], (x.shape[0], 1))
  shared = Shared()
  valid = jnp.asarray(row['segment_ids'] > 0)

  def attn(block, u):
    nonlocal shared
    y, shared = block.attn(block.attn_norm(jnp.asarray(u[None], jnp.float32)), row, shared)
    return np.asarray(y[0], np.float64)

  def moe(block, u):
    y, _ = block.moe(block.ffn_norm(jnp.asarray(u[None], jnp.float32)), row['modality'], valid)
    return np.asarray(y[0], np.float64)

  read = lambda x, pre: np.einsum('tnd,tn->td', x, pre)  # noqa: E731
  write = lambda x, f, post, c: post[..., None] * f[:, None, :] + np.einsum('tjk,tjd->tkd', c, x)  # noqa: E731,E501
  for block in model.blocks:
    pre_a, post_a, c_a = coef(block.attn_site, x)
    x = write(x, attn(block, read(x, pre_prev if order == 'single' else pre_a)), post_a, c_a)
    pre_f, post_f, c_f = coef(block.ffn_site, x)
    x = write(x, moe(block, read(x, pre_a if order == 'single' else pre_f)), post_f, c_f)
    pre_prev = pre_f
  if order == 'single':
    h = read(x, pre_prev)
  else:
    head = model.hc_head
    flat = x.reshape(x.shape[0], -1)
    flat = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    m = flat @ np.asarray(head.fn[...], np.float64).T
    pre = 1 / (1 + np.exp(-(np.asarray(head.scale[...])[0] * m + np.asarray(head.base[...])))) \
        + cfg.hc_eps
    h = read(x, pre)
  h = np.asarray(model.final_norm(jnp.asarray(h, jnp.float32)), np.float64)
  return h @ np.asarray(model.head[...], np.float64)


@pytest.mark.parametrize('residual,order', [('mhc_single_pass', 'single'),
                                            ('mhc_multi_pass', 'multi')])
def test_orders_match_their_transcription(residual, order):
  cfg = resolved(**{'model.residual': residual, 'model.hc_init_std': 0.5,
                    'model.num_layers': 2, 'model.num_encoder_layers': 0,
                    'model.compress_ratios': (0, 0), 'model.kv_source_layer_ids': (),
                    'model.index_source_layer_ids': (), 'model.candidate_source_layer_id': -1,
                    'model.engram_layer_ids': ()})
  model = Transformer(cfg.model, nnx.Rngs(params=3))
  batch = packed_batch(seed=1, docs_per_row=2)
  logits, _ = nnx.jit(lambda m, b: m(b))(model, batch)
  want = _transcription(model, batch, order)
  np.testing.assert_allclose(np.asarray(logits[0]), want, rtol=2e-4, atol=2e-4)


def test_the_three_residuals_differ():
  batch = packed_batch(seed=2, docs_per_row=1)
  outs = {}
  for residual in ('mhc_single_pass', 'mhc_multi_pass', 'plain'):
    cfg = resolved(**{'model.residual': residual, 'model.hc_init_std': 0.5})
    outs[residual] = np.asarray(Transformer(cfg.model, nnx.Rngs(params=0))(batch)[0])
  assert np.abs(outs['mhc_single_pass'] - outs['mhc_multi_pass']).max() > 1e-3
  assert np.abs(outs['mhc_single_pass'] - outs['plain']).max() > 1e-3
