"""One AdamW step of one parameter in a single pass (Pallas, Triton backend).

The reference is `adamw_leaf_reference`: optax's clip-by-global-norm, Adam moments, bias
correction, decoupled weight decay, learning rate and group multiplier, op for op (the chain is
`train/optimizer.py`'s `reference_optimizer`). XLA turns the chain over a model's ~300 leaves
into several passes over the fp32 weights, moments and gradients (docs/performance.md section
23); this kernel reads g, p, mu, nu once and writes p', mu', nu' in place (aliased), the
bandwidth bound of the update: 28 bytes a parameter in fp32.

A leaf runs here when its size is a multiple of `MIN_BLOCK` (every matrix of the models we
train); the others (norm scales, small vectors) take the reference, which is as fast for them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MIN_BLOCK = 1024   # elements; a leaf whose size this does not divide takes the jnp reference
MAX_BLOCK = 8192   # 32 KB of fp32 per operand per program


class Hyper(NamedTuple):
  """The step's static settings (Python floats: they shape the compiled kernel)."""
  b1: float
  b2: float
  eps: float
  clip_norm: float      # 0: no clipping
  weight_decay: float   # 0 for the leaves weight decay skips
  multiplier: float     # the leaf's group learning-rate multiplier (1.0 for most)


def step_scalars(g_norm, bc1, bc2, step_size):
  """The step's traced scalars as the kernels' f32[8]: the global gradient norm (None without
  clipping), both bias corrections and the signed step size (-lr)."""
  vals = [1.0 if g_norm is None else g_norm, bc1, bc2, step_size, 0.0, 0.0, 0.0, 0.0]
  return jnp.stack([jnp.asarray(v, jnp.float32) for v in vals])


def adamw_leaf_reference(g, p, mu, nu, scalars_8, h: Hyper):
  """(p', mu', nu'): optax's arithmetic for one leaf (see `train/optimizer.py`)."""
  return _adamw(g, p, mu, nu, *(scalars_8[i] for i in range(4)), h)


def _adamw(g, p, mu, nu, g_norm, bc1, bc2, step_size, h: Hyper):
  if h.clip_norm > 0:
    g = jax.lax.select(g_norm < h.clip_norm, g, (g / g_norm.astype(g.dtype)) * h.clip_norm)
  mu = (1 - h.b1) * g + h.b1 * mu
  nu = (1 - h.b2) * (g ** 2) + h.b2 * nu
  u = (mu / bc1.astype(mu.dtype)) / (jnp.sqrt(nu / bc2.astype(nu.dtype)) + h.eps)
  if h.weight_decay != 0.0:
    u = u + h.weight_decay * p
  u = step_size.astype(u.dtype) * u
  if h.multiplier != 1.0:
    u = h.multiplier * u
  return (p + u).astype(p.dtype), mu, nu


def _kernel(s_ref, g_ref, p_ref, mu_ref, nu_ref, p_out, mu_out, nu_out, *, h: Hyper):
  # scalars loaded one by one: Triton cannot slice a register array
  p_new, mu_new, nu_new = _adamw(g_ref[...], p_ref[...], mu_ref[...], nu_ref[...],
                                 *(s_ref[i] for i in range(4)), h)
  p_out[...] = p_new
  mu_out[...] = mu_new
  nu_out[...] = nu_new


def block_size(n: int) -> int:
  """The largest power-of-two block <= MAX_BLOCK dividing n, or 0 when MIN_BLOCK does not."""
  if n % MIN_BLOCK:
    return 0
  b = MAX_BLOCK
  while n % b:
    b //= 2
  return b


@functools.partial(jax.jit, static_argnames=('h', 'interpret'))
def adamw_leaf(g, p, mu, nu, scalars_8, h: Hyper, interpret: bool = False):
  """(p', mu', nu') of one leaf whose size `block_size` accepts, written over p, mu, nu."""
  shape, n = p.shape, p.size
  blk = block_size(n)
  if not blk:
    raise ValueError(f'adamw_leaf: {n} elements is not a multiple of {MIN_BLOCK}')
  flat = [x.reshape(n) for x in (g, p, mu, nu)]
  spec = pl.BlockSpec((blk,), lambda i: (i,))
  if interpret:
    params = None
  else:
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415 (GPU module, lazy)
    params = plt.CompilerParams(num_warps=8, num_stages=1)
  outs = pl.pallas_call(
      functools.partial(_kernel, h=h),
      grid=(n // blk,),
      in_specs=[pl.BlockSpec((8,), lambda i: (0,)), spec, spec, spec, spec],
      out_specs=[spec, spec, spec],
      out_shape=[jax.ShapeDtypeStruct((n,), x.dtype) for x in flat[1:]],
      input_output_aliases={2: 0, 3: 1, 4: 2},
      compiler_params=params,
      interpret=interpret,
      name='adamw_step',
  )(scalars_8, *flat)
  return tuple(o.reshape(shape) for o in outs)
