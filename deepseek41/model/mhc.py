"""mHC: manifold-constrained hyper-connections over `hc_mult` residual streams
(docs/architecture.md 3.2).

Per sublayer site, from the streams X [B, T, n, D] (fp32 inside):
    x~   = X.reshape(n*D) / rms(X)                       one RMS over all n*D values
    m    = fn . x~   -> [m_pre (n), m_post (n), m_comb (n*n)]
    pre  = sigmoid(s0 * m_pre + b_pre) + eps              how much of each stream the sublayer reads
    post = 2 * sigmoid(s1 * m_post + b_post)              how much of the output each stream gets
    C    = sinkhorn(softmax_k(s2 * m_comb[j, k] + b_comb)) doubly stochastic stream mixing
    collapse(X, pre)        = sum_k pre_k X[k]
    expand(X, F, post, C)   = X'[k] = post_k F + sum_j C[j, k] X[j]      (C^T X: C's first index)

The orders in which sites consume their coefficients (V4 multi-pass, V4.1 single-pass) live in
`transformer.py`; this module holds the site and the head of the multi-pass order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import ModelConfig
from deepseek41.model.norms import rms_normalize
from deepseek41.model.params import const_param, normal_param
from deepseek41.ops.gpu.mhc_kernel import expand_site_collapse, site_collapse


def sinkhorn(logits_bjk, iters: int, eps: float):
  """Doubly stochastic [.., n, n] from logits: softmax over k, then alternate normalisations.

  Released recipe [C]: softmax along the last axis + eps, divide columns by (sum + eps), then
  iters - 1 rounds of rows-then-columns, `iters` column normalisations in all.
  """
  c = jax.nn.softmax(logits_bjk, axis=-1) + eps
  c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

  def round_(_, c):
    c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
    return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
  # A loop, not 19 unrolled rounds: unrolled, the 2 sites x layers x (forward + backward) copies
  # tripled the 1B model's HLO and its GPU compile time; XLA's GPU compiler fuses 24 chained
  # unrolled Sinkhorns of one token into one kernel and takes 162 s over it, against 2 s for
  # the loops (docs/performance.md section 54).
  return jax.lax.fori_loop(0, iters - 1, round_, c)


def collapse(x_btnd, pre_btn):
  """The sublayer input: sum_k pre_k X[k], accumulated in fp32, in X's dtype."""
  u = jnp.einsum('btnd,btn->btd', x_btnd.astype(jnp.float32), pre_btn.astype(jnp.float32))
  return u.astype(x_btnd.dtype)


def expand(x_btnd, f_btd, post_btn, comb_btjk):
  """X'[k] = post_k F + sum_j C[j, k] X[j]: write the output, mix the streams (fp32 inside)."""
  mixed = jnp.einsum('btjk,btjd->btkd', comb_btjk, x_btnd.astype(jnp.float32))
  out = mixed + post_btn[..., None] * f_btd.astype(jnp.float32)[:, :, None, :]
  return out.astype(x_btnd.dtype)


def _flat_rms(x_btnd, eps):
  b, t, n, d = x_btnd.shape
  return rms_normalize(x_btnd.reshape(b, t, n * d), eps)


class MHCSite(nnx.Module):
  """The coefficient generator of one sublayer site: (pre, post, comb) from the streams."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    n = cfg.hc_mult
    self.n, self.eps, self.norm_eps, self.iters = n, cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters
    self.fn = normal_param(rngs, ((2 + n) * n, n * cfg.d_model), ('hc_coef', 'hc_embed'),
                           cfg.hc_init_std)
    self.base = const_param(0.0, ((2 + n) * n,), ('hc_coef',))
    self.scale = const_param(1.0, (3,), (None,))

  def __call__(self, x_btnd):
    """(pre_btn, post_btn, comb_btjk), fp32."""
    n = self.n
    m = jnp.einsum('btf,cf->btc', _flat_rms(x_btnd, self.norm_eps), self.fn[...].astype(jnp.float32))
    base, scale = self.base[...], self.scale[...]
    pre = jax.nn.sigmoid(scale[0] * m[..., :n] + base[:n]) + self.eps
    post = 2.0 * jax.nn.sigmoid(scale[1] * m[..., n:2 * n] + base[n:2 * n])
    comb_logits = scale[2] * m[..., 2 * n:] + base[2 * n:]
    comb = sinkhorn(comb_logits.reshape(comb_logits.shape[:-1] + (n, n)), self.iters, self.eps)
    return pre, post, comb


class MHCHead(nnx.Module):
  """The V4 (multi-pass) final read-out: pre = sigmoid(s * fn . x~ + base) + eps over the streams."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    n = cfg.hc_mult
    self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
    self.fn = normal_param(rngs, (n, n * cfg.d_model), ('hc_coef', 'hc_embed'), cfg.hc_init_std)
    self.base = const_param(0.0, (n,), ('hc_coef',))
    self.scale = const_param(1.0, (1,), (None,))

  def __call__(self, x_btnd):
    m = jnp.einsum('btf,cf->btc', _flat_rms(x_btnd, self.norm_eps), self.fn[...].astype(jnp.float32))
    return jax.nn.sigmoid(self.scale[...][0] * m + self.base[...]) + self.eps


def site_coefficients(x_btnd, fn, base, scale, iters: int, eps: float, norm_eps: float):
  """`MHCSite.__call__` as a function of its parameters: (pre_btn, post_btn, comb_btjk), fp32.

  The jnp reference the fused kernels (deepseek41/ops/gpu/mhc_kernel.py) are held equal to.
  """
  n = x_btnd.shape[2]
  m = jnp.einsum('btf,cf->btc', _flat_rms(x_btnd, norm_eps), fn.astype(jnp.float32))
  pre = jax.nn.sigmoid(scale[0] * m[..., :n] + base[:n]) + eps
  post = 2.0 * jax.nn.sigmoid(scale[1] * m[..., n:2 * n] + base[n:2 * n])
  comb_logits = scale[2] * m[..., 2 * n:] + base[2 * n:]
  comb = sinkhorn(comb_logits.reshape(comb_logits.shape[:-1] + (n, n)), iters, eps)
  return pre, post, comb


def _site_args(site: MHCSite):
  return (site.fn[...], site.base[...], site.scale[...]), dict(
      iters=site.iters, eps=site.eps, norm_eps=site.norm_eps)


def fused_site_collapse(site: MHCSite, x_btnd, pre_btn=None, **knobs):
  """(u_btd, pre, post, comb) = (collapse(X, pre_btn or the site's pre), *site(X)), fused."""
  params, kw = _site_args(site)
  return site_collapse(x_btnd, *params, pre_btn, **kw, **knobs)


def fused_expand_site_collapse(site: MHCSite, x_btnd, f_btd, post_btn, comb_btjk, pre_btn=None,
                               **knobs):
  """(x', u, pre, post, comb): x' = expand(X, F, post, comb), then `fused_site_collapse(site, x',
  pre_btn)`, in one pass (X' written once, never read back)."""
  params, kw = _site_args(site)
  return expand_site_collapse(x_btnd, f_btd, post_btn, comb_btjk, *params, pre_btn, **kw,
                              **knobs)
