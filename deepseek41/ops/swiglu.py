"""The clipped SwiGLU of every expert (docs/architecture.md 3.11) and its derivative.

One definition for the jnp paths and the kernels: ops/expert_gemm.py's backends and the shared
experts call `clipped_swiglu` on whole arrays, the fused expert kernel (ops/gpu/fused_experts.py)
on its float32 tiles in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def clipped_swiglu(h_gate, h_up, limit: float | None):
  """silu(min(g, L)) * clip(u, -L, L) in float32, cast back to the input dtype.

  The one activation of every expert, routed (each backend) and shared (model/moe.py): float32
  so that silu and the product round once, to the compute dtype, not at every step in bf16.
  """
  g = h_gate.astype(jnp.float32)
  u = h_up.astype(jnp.float32)
  if limit is not None:
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
  return (jax.nn.silu(g) * u).astype(h_gate.dtype)


def clipped_swiglu_grads(h_gate, h_up, dh, limit: float | None):
  """(d h_gate, d h_up): the cotangents of `clipped_swiglu` at (h_gate, h_up) for dh.

  Autodiff's own derivative (its float32 arithmetic, its choice at the clamp's ties), so a kernel
  that applies it to a tile computes what differentiating `clipped_swiglu` does; dh is taken in
  h_gate's dtype, as the output's cotangent is.
  """
  _, vjp = jax.vjp(functools.partial(clipped_swiglu, limit=limit), h_gate, h_up)
  return vjp(dh.astype(h_gate.dtype))
