"""RMSNorm (weighted), computed in fp32 and cast back to the input dtype."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from deepseek41.model.params import const_param


def rms_normalize(x, eps: float):
  """Unweighted RMS normalisation over the last axis, fp32 inside."""
  x32 = x.astype(jnp.float32)
  return x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, axis_name: str = 'norm',
               kind: type[nnx.Param] = nnx.Param):
    self.eps = eps
    self.scale = const_param(1.0, (dim,), (axis_name,), kind)

  def __call__(self, x):
    return (rms_normalize(x, self.eps) * self.scale[...].astype(jnp.float32)).astype(x.dtype)
