"""The jaxpr walk that decides which weights generation may hold in the compute dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from deepseek41.generate.weight_reads import (CAST_ONLY, OTHER, UNREAD, cast_where,
                                              read_only_as, read_only_as_mask)

BF16 = jnp.bfloat16
X = jnp.ones((2, 4), jnp.float32)
W = jax.ShapeDtypeStruct((4, 4), jnp.float32)


def _verdict(fn):
  return read_only_as(lambda ws: fn(ws[0]), [W], (), BF16)[0]


def _dot(w):
  return X.astype(BF16) @ w.astype(BF16)


def _scan_const(w):
  return jax.lax.scan(lambda c, _: (c + _dot(w).sum(), None), 0.0, None, length=3)[0]


def _scan_carry(w):
  # (a carry returned unchanged is hoisted to a constant by scan itself)
  return jax.lax.scan(lambda c, _: (c[::-1], _dot(c).sum()), w, None, length=2)[1]


def _while_body_const(w):
  return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + _dot(w)),
                            (0, jnp.zeros((2, 4), BF16)))[1]


def _cond(w):
  return jax.lax.cond(X[0, 0] > 0, lambda v: _dot(v), lambda v: _dot(v.T), w)


def _pallas(w):
  def kernel(w_ref, o_ref):
    o_ref[...] = w_ref[...] * 2
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
                        interpret=True)(w)


@pytest.mark.parametrize('fn, verdict', [
    (_dot, CAST_ONLY),
    (lambda w: _dot(w.T.reshape(2, 8).reshape(4, 4)[:, ::1]), CAST_ONLY),  # layout ops commute
    (lambda w: _dot(jax.lax.dynamic_slice(w, (0, 0), (4, 4))), CAST_ONLY),
    (lambda w: jax.jit(_dot)(w), CAST_ONLY),
    (lambda w: jax.checkpoint(_dot)(w), CAST_ONLY),
    (_scan_const, CAST_ONLY),
    (_while_body_const, CAST_ONLY),
    (_cond, CAST_ONLY),
    (lambda w: X, UNREAD),
    (lambda w: X @ w, OTHER),  # an fp32 product
    (lambda w: X.astype(jnp.float16) @ w.astype(jnp.float16), OTHER),  # another dtype
    (lambda w: (_dot(w), (X @ w).sum()), OTHER),  # one cast read, one fp32 read
    (lambda w: w, OTHER),  # an output keeps its dtype
    (lambda w: jnp.exp(w).astype(BF16), OTHER),  # computed on before the cast
    (_scan_carry, OTHER),  # a carry flows back into the loop
    (_pallas, OTHER),  # a kernel reads the stored bytes
])
def test_a_weight_is_cast_only_if_every_read_is_a_cast(fn, verdict):
  assert _verdict(fn) == verdict


def test_the_mask_needs_every_probe_to_agree_and_one_to_read():
  state = {'a': W, 'b': W, 'c': W, 'd': W, 'n': jax.ShapeDtypeStruct((4,), jnp.int32),
           'h': jax.ShapeDtypeStruct((4, 4), BF16)}
  probes = [lambda s: (_dot(s['a']), _dot(s['b']), s['n'] + 1, _dot(s['h'])),
            lambda s: (_dot(s['a']), X @ s['b'], _dot(s['c']))]
  mask = read_only_as_mask(state, probes, BF16)
  assert mask == {'a': True, 'b': False, 'c': True, 'd': False, 'n': False, 'h': False}


def test_cast_where_casts_concrete_and_abstract_leaves():
  w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
  out = cast_where({'a': w, 'b': w, 's': W}, {'a': True, 'b': False, 's': True}, BF16)
  assert out['a'].dtype == BF16 and out['b'].dtype == jnp.float32
  np.testing.assert_array_equal(out['a'], w.astype(BF16))
  assert out['s'] == jax.ShapeDtypeStruct((4, 4), BF16)
