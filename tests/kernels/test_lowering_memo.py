"""A program that calls one kernel from several layers lowers it to Triton once, to the same module
a lone call gets; kernels that differ in any static value are lowered apart."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from deepseek41.ops import launch
from deepseek41.ops.gpu import lowering_memo
from tests.helpers import triton_lowering_for_h200


def _scale_kernel(x_ref, o_ref, *, scale, call_site):
  del call_site
  o_ref[...] = x_ref[...] * scale


def _scaled(x, scale):
  """A launch of its own at every call (`call_site` differs, so launch.pallas_call shares no
  trace between them, as for launches it cannot key): each call site is lowered, the memo
  answers all but the first."""
  spec = pl.BlockSpec((16, 16), lambda i: (i, 0))
  return launch.pallas_call(functools.partial(_scale_kernel, scale=scale, call_site=object()),
                            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 16,),
                            in_specs=[spec], out_specs=spec, interpret=False)(x)


def _lowered(fn, x):
  with triton_lowering_for_h200():
    return jax.jit(fn).trace(x).lower(lowering_platforms=('cuda',)).as_text()


def _triton_modules(text):
  return re.findall(r'ir = "([^"]*)"', text)


@pytest.fixture
def memo():
  memo = lowering_memo.install()
  if memo is None:
    pytest.skip('this jax lowers Pallas Triton kernels through another function')
  memo.modules.clear()
  memo.hits = memo.misses = 0
  return memo


def test_layers_share_one_lowering_equal_to_a_lone_call(memo):
  x = jax.ShapeDtypeStruct((64, 16), jnp.float32)
  four_layers = _lowered(lambda x: functools.reduce(lambda h, _: _scaled(h, 0.5), range(4), x), x)
  assert (memo.misses, memo.hits) == (1, 3)
  modules = _triton_modules(four_layers)
  assert len(modules) == 4 and len(set(modules)) == 1
  memo.modules.clear()
  alone = _triton_modules(_lowered(lambda x: _scaled(x, 0.5), x))
  assert alone == modules[:1]


def test_a_different_static_value_or_shape_is_lowered_apart(memo):
  x = jax.ShapeDtypeStruct((64, 16), jnp.float32)
  text = _lowered(lambda x: _scaled(_scaled(x, 0.5), 0.25), x)
  _lowered(lambda x: _scaled(x, 0.5), jax.ShapeDtypeStruct((32, 16), jnp.float32))
  assert memo.misses == 3 and memo.hits == 0
  assert len(set(_triton_modules(text))) == 2
