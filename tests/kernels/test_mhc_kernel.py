"""The fused mHC kernels (Pallas interpreter) against the jnp site, collapse and expand of mhc.py:
outputs and gradients (X, F, the coefficients, fn, base, scale), fp32 and bf16 streams."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.mhc import (MHCSite, collapse, expand, fused_site_collapse, sinkhorn,
                                  site_coefficients)
from deepseek41.ops.gpu import mhc_kernel as K
from tests.helpers import resolved, triton_lowering_for_h200

N = 4
KNOBS = dict(block_t=16, block_d=16, block_t_bwd=32, block_d_bwd=32, interpret=True)


def test_coefficient_math_and_its_vjp_match_sinkhorn():
  """The per-token list form (what the kernels run) against mhc.sinkhorn and its autodiff."""
  iters, eps = 20, 1e-6
  a = 2 * jax.random.normal(jax.random.key(0), (32, (2 + N) * N))

  def ref(a):
    pre = jax.nn.sigmoid(a[:, :N]) + eps
    post = 2 * jax.nn.sigmoid(a[:, N:2 * N])
    return pre, post, sinkhorn(a[:, 2 * N:].reshape(-1, N, N), iters, eps).reshape(-1, N * N)

  cols = lambda m: [m[:, i] for i in range(m.shape[1])]  # noqa: E731
  got = [jnp.stack(v, 1) for v in K.coefficients_flat(cols(a), N, iters, eps)]
  want, vjp = jax.vjp(ref, a)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  cts = tuple(jax.random.normal(jax.random.key(i + 1), w.shape) for i, w in enumerate(want))
  da = jnp.stack(K.coefficients_flat_vjp(cols(a), *map(cols, cts), N, iters, eps), 1)
  np.testing.assert_allclose(da, vjp(cts)[0], rtol=1e-4, atol=1e-5)


def _inputs(dtype, d=64, b=2, t=20):
  ks = jax.random.split(jax.random.key(7), 9)
  x = jax.random.normal(ks[0], (b, t, N, d)).astype(dtype)
  f = jax.random.normal(ks[1], (b, t, d)).astype(dtype)
  post = 2 * jax.nn.sigmoid(jax.random.normal(ks[2], (b, t, N)))
  comb = jax.nn.softmax(jax.random.normal(ks[3], (b, t, N, N)), -1)
  pre = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, N)))
  fn = 0.5 * jax.random.normal(ks[5], ((2 + N) * N, N * d))
  base = 0.3 * jax.random.normal(ks[6], ((2 + N) * N,))
  scale = 1 + 0.2 * jax.random.normal(ks[7], (3,))
  return dict(x=x, f=f, post=post, comb=comb, pre=pre, fn=fn, base=base, scale=scale), ks[8]


def _reference(kind, given, iters, eps, norm_eps):
  def site(x, fn, base, scale):
    return site_coefficients(x, fn, base, scale, iters, eps, norm_eps)

  def run(p):
    if kind == 'expand':
      return (expand(p['x'], p['f'], p['post'], p['comb']),)
    if kind == 'collapse':
      return (collapse(p['x'], p['pre']),)
    x = expand(p['x'], p['f'], p['post'], p['comb']) if kind == 'expand_site_collapse' else p['x']
    pre, post, comb = site(x, p['fn'], p['base'], p['scale'])
    u = collapse(x, p['pre'] if given else pre)
    return ((x,) if kind == 'expand_site_collapse' else ()) + (u, pre, post, comb)
  return run


def _fused(kind, given, iters, eps, norm_eps, **knobs):
  kw = dict(KNOBS, iters=iters, eps=eps, norm_eps=norm_eps, **knobs)

  def run(p):
    pre = p.get('pre') if given else None
    if kind == 'expand':
      return (K.expand_fused(p['x'], p['f'], p['post'], p['comb'], **kw),)
    if kind == 'collapse':
      return (K.collapse_fused(p['x'], p['pre'], **kw),)
    if kind == 'site_collapse':
      return K.site_collapse(p['x'], p['fn'], p['base'], p['scale'], pre, **kw)
    return K.expand_site_collapse(p['x'], p['f'], p['post'], p['comb'], p['fn'], p['base'],
                                  p['scale'], pre, **kw)
  return run


USES = {'expand': ('x', 'f', 'post', 'comb'), 'collapse': ('x', 'pre'),
        'site_collapse': ('x', 'fn', 'base', 'scale'),
        'expand_site_collapse': ('x', 'f', 'post', 'comb', 'fn', 'base', 'scale')}


def _check(kind, given, dtype, iters=5, eps=1e-6, norm_eps=1e-6, d=64, b=2, t=20, **knobs):
  p, key = _inputs(dtype, d=d, b=b, t=t)
  names = USES[kind] + (('pre',) if given and 'site' in kind else ())
  p = {k: p[k] for k in names}
  ref, fused = _reference(kind, given, iters, eps, norm_eps), _fused(kind, given, iters, eps,
                                                                       norm_eps, **knobs)
  want = ref(p)
  got = fused(p)
  assert len(got) == len(want)
  bf16 = dtype == jnp.bfloat16
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    tol = 2e-2 if bf16 and w.dtype == jnp.bfloat16 else (2e-3 if bf16 else 2e-5)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                               atol=tol)
  cts = [jax.random.normal(jax.random.fold_in(key, i), w.shape).astype(w.dtype)
         for i, w in enumerate(want)]
  def loss(run):
    return lambda p: sum(jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))
                         for o, c in zip(run(p), cts))
  g_want = jax.grad(loss(ref))(p)
  g_got = jax.grad(loss(fused))(p)
  for k in names:
    w, g = np.asarray(g_want[k], np.float32), np.asarray(g_got[k], np.float32)
    assert g_got[k].dtype == g_want[k].dtype, k
    # bf16: the reference sums each use's cotangent in bf16, the kernel in fp32 once.
    tol = (3e-2 if bf16 else 1e-4) * max(1.0, np.abs(w).max())
    np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=f'd{k}')


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('given', [True, False])
def test_site_collapse(given, dtype):
  _check('site_collapse', given, dtype)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('given', [True, False])
def test_expand_site_collapse(given, dtype):
  _check('expand_site_collapse', given, dtype)


@pytest.mark.parametrize('kind', ['expand', 'collapse'])
def test_expand_and_collapse(kind):
  _check(kind, True, jnp.float32)
  _check(kind, True, jnp.bfloat16)


@pytest.mark.parametrize('kind', ['site_collapse', 'expand_site_collapse', 'expand'])
def test_prefetched_walks(kind):
  """The walks that load the next D chunk ahead give the same values and gradients (four
  chunks forward, two backward: the last chunk's look-ahead stays in bounds)."""
  for given in (True, False) if 'site' in kind else (True,):
    _check(kind, given, jnp.bfloat16, prefetch=True)


@pytest.mark.parametrize('kind', ['site_collapse', 'expand_site_collapse', 'expand'])
def test_decode_rows(kind):
  """One token (a decode step) and three: fewer rows than one block, nothing padded, with
  gradients. (Every other case has 40 rows in blocks of 16: a partial last block.)"""
  for b, t in ((1, 1), (3, 1)):
    _check(kind, True, jnp.bfloat16, b=b, t=t)


@pytest.mark.parametrize('kind', ['site_collapse', 'expand_site_collapse', 'expand'])
def test_decode_splits(kind):
  """A call of one token block walks D in `decode_splits` programs (the site's coefficients
  from their partial sums in a second kernel): the same values and gradients, fp32 and bf16,
  at 1, 3 and 10 rows; the multi-pass own collapse keeps one program."""
  for b, t in ((1, 1), (3, 1), (2, 5)):
    _check(kind, True, jnp.float32, b=b, t=t, block_t=16, decode_splits=2)
    _check(kind, True, jnp.bfloat16, b=b, t=t, block_t=16, decode_splits=4)
  p, _ = _inputs(jnp.float32, b=1, t=1)
  kw = dict(KNOBS, decode_splits=4)
  grids = lambda f: re.findall(r'grid=\(([\d, ]*)\)', str(jax.make_jaxpr(f)(p)))  # noqa: E731
  split = grids(lambda p: _fused(kind, True, 5, 1e-6, 1e-6, **kw)(p))
  assert split == (['1, 4', '1,'] if 'site' in kind else ['1, 4'])
  assert grids(lambda p: K.site_collapse(p['x'], p['fn'], p['base'], p['scale'], **kw)) == ['1,']
  assert K._splits(4, rows=17, tb=16, d=64, bd=16, collapse='given') == 1  # two row blocks
  assert K._splits(8, rows=1, tb=16, d=64, bd=16, collapse='given') == 4  # whole chunks


def test_block_d_narrows_to_divide_d_model():
  """d_model 48 with the default 32-wide chunks (and a 64-wide backward) walks 16 at a time."""
  _check('expand_site_collapse', True, jnp.float32, d=48, block_d=32, block_d_bwd=64)
  with pytest.raises(ValueError, match='d_model 40'):
    _check('expand', True, jnp.float32, d=40)


def test_released_sinkhorn_iterations():
  _check('expand_site_collapse', True, jnp.float32, iters=20)


def test_model_site_wrapper_matches_mhc_site():
  """fused_site_collapse reads the site's parameters and constants as MHCSite does."""
  cfg = resolved(**{'model.residual': 'mhc_single_pass', 'model.hc_init_std': 0.5})
  site = MHCSite(cfg.model, nnx.Rngs(params=0))
  d = cfg.model.d_model
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.model.hc_mult, d))
  pre_prev = jax.nn.sigmoid(jax.random.normal(jax.random.key(2), (2, 16, cfg.model.hc_mult)))
  u, pre, post, comb = fused_site_collapse(site, x, pre_prev, block_t=16, block_d=min(32, d),
                                           interpret=True)
  want = site(x)
  for g, w in zip((pre, post, comb), want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(u, collapse(x, pre_prev), rtol=1e-5, atol=1e-5)


def test_kernels_lower_for_triton():
  """Every kernel (forward and backward, each op) lowers to Triton IR for an H200 on the CPU.

  The interpreter runs jnp semantics, so it cannot see what the Triton lowering refuses (slices
  of register arrays, say); lowering needs no GPU once the GPU query is answered for it.
  """
  for t, splits in ((64, 0), (5, 0), (5, 2)):  # whole blocks, one partial block, split over D
    _lower_every_kernel(t, splits)


def _lower_every_kernel(t, splits):
  p, _ = _inputs(jnp.bfloat16, d=64, b=1, t=t)
  kw = dict(decode_splits=splits, block_t=32, block_d=16, block_t_bwd=16, block_d_bwd=32, interpret=False, iters=3)
  s = (p['fn'], p['base'], p['scale'])
  ops = [lambda x, f: K.site_collapse(x, *s, p['pre'], **kw),
         lambda x, f: K.site_collapse(x, *s, None, **kw),
         lambda x, f: K.expand_site_collapse(x, f, p['post'], p['comb'], *s, p['pre'], **kw),
         lambda x, f: K.expand_site_collapse(x, f, p['post'], p['comb'], *s, None, **kw),
         lambda x, f: (K.expand_fused(x, f, p['post'], p['comb'], **kw),),
         lambda x, f: (K.collapse_fused(x, p['pre'], **kw),)]
  with triton_lowering_for_h200():
    for op, prefetch in itertools.product(ops, (False, True)):
      kw.update(prefetch=prefetch)

      def loss(x, f, op=op):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in op(x, f))
      text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(p['x'], p['f']).lower(
          lowering_platforms=('cuda',)).as_text()
      assert 'triton' in text
