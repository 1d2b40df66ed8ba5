"""Lightning-indexer scores on the GPU: one fused kernel (Pallas, Triton backend).

    I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) * (H * C)^-1/2        fp32 [B, T, N]

The contract and the jnp reference are ops/index_scores.py's. The kernel keeps each [bq, bn]
tile's head loop on chip (one [bq, C] x [C, bn] matmul per head, relu and the weighted sum in
registers), so the reference's [T, H, N] dot products never reach HBM, and skips key tiles past
the causal limit of its query rows (written as 0). No gradient, as the reference's dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT, index_scores_supported


def _kernel(lim_ref, q_ref, w_ref, k_ref, o_ref, *, heads, dim, bq, bn, scale):
  # lim: [bq] entries each query row may see; q: [bq, H*C]; w: [bq, H]; k: [bn, C]; o: [bq, bn]
  needed = pl.program_id(2) * bn < jnp.max(lim_ref[...])

  @pl.when(needed)
  def _():
    k_nc = k_ref[...]

    def head(h, acc_qn):
      q_qc = q_ref[:, pl.ds(h * dim, dim)]
      dots_qn = jax.lax.dot_general(q_qc, k_nc, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
      return acc_qn + jnp.maximum(dots_qn, 0.0) * w_ref[:, pl.ds(h, 1)]
    acc_qn = jax.lax.fori_loop(0, heads, head, jnp.zeros((bq, bn), jnp.float32))
    o_ref[...] = acc_qn * scale

  @pl.when(jnp.logical_not(needed))
  def _():
    o_ref[...] = jnp.zeros((bq, bn), jnp.float32)


@functools.partial(jax.jit, static_argnames=('block_q', 'block_n', 'num_warps', 'interpret'))
def index_scores_fused(q_bthc, w_bth, k_bnc, limit_bt, *, block_q: int = 64, block_n: int = 128,
                       num_warps: int = 4, interpret: bool | None = None):
  """fp32 [B, T, N] indexer scores; entries j >= limit_bt[t] may be 0 instead of the score.

  limit_bt: int32 [B, T], how many leading entries row t can see (causality); tiles wholly past
  the limit are not computed. `interpret`: the Pallas interpreter or not (None: ops/launch.py's
  rule).
  """

  b, t, h, c = q_bthc.shape
  n = k_bnc.shape[1]
  if not index_scores_supported(h, c):
    raise ValueError(f'index_scores_fused needs power-of-two heads and head width >= {MIN_DOT}; '
                     f'got {h} heads x {c}')
  bq = min(block_q, max(MIN_DOT, pl.next_power_of_2(t)))
  bn = min(block_n, max(MIN_DOT, pl.next_power_of_2(n)))
  dt = q_bthc.dtype
  q_btf = launch.pad_axis(q_bthc.reshape(b, t, h * c), 1, bq)
  w_bth = launch.pad_axis(w_bth.astype(jnp.float32), 1, bq)
  lim_bt = launch.pad_axis(limit_bt.astype(jnp.int32), 1, bq)
  k_bnc = launch.pad_axis(k_bnc.astype(dt), 1, bn)
  tp, np_ = q_btf.shape[1], k_bnc.shape[1]
  kernel = functools.partial(_kernel, heads=h, dim=c, bq=bq, bn=bn, scale=(h * c) ** -0.5)
  out = launch.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, tp, np_), jnp.float32),
      grid=(b, tp // bq, np_ // bn),
      in_specs=[pl.BlockSpec((None, bq), lambda i, j, k: (i, j)),
                pl.BlockSpec((None, bq, h * c), lambda i, j, k: (i, j, 0)),
                pl.BlockSpec((None, bq, h), lambda i, j, k: (i, j, 0)),
                pl.BlockSpec((None, bn, c), lambda i, j, k: (i, k, 0))],
      out_specs=pl.BlockSpec((None, bq, bn), lambda i, j, k: (i, j, k)),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name='csa2_index_scores',
  )(lim_bt, q_btf, w_bth, k_bnc)
  return out[:, :t, :n]
