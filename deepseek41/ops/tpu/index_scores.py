"""Lightning-indexer scores on the TPU: one Pallas (Mosaic) kernel, the TPU twin of
ops/gpu/index_scores.py (the contract, the jnp reference and the dispatch: ops/index_scores.py).

    I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) * (H * C)^-1/2        fp32 [B, T, N]

Each grid step scores a [bq, bn] tile: H [bq, C] x [C, bn] MXU matmuls, relu and the weighted
head sum kept in VMEM, so the [T, H, N] dot products of the jnp reference never reach HBM. Key
tiles wholly past the causal limit of the tile's query rows are written as 0 without computing;
their key block is not even fetched (its index is clamped to the last needed one, which Pallas
does not copy again). The per-tile limits travel as scalar-prefetch operands (SMEM).

Like the GPU kernel: no gradient (selection stops it; the indexer's loss reads the selected
entries' scores only), entries at or past limit_bt may hold 0 instead of the score.
It launches through ops/launch.py: in the Pallas interpreter on the CPU (the tests; `interpret`
overrides); deviceless it compiles for v5p and v6e (tests/kernels/test_tpu_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from deepseek41.ops import launch


def _kernel(lim_ref, q_ref, w_ref, k_ref, o_ref, *, heads, dim, bn, scale):
  # lim: SMEM [B, T/bq] entries the tile's rows may see; q: [bq, H*C]; w: [bq, H] f32;
  # k: [bn, C]; o: [bq, bn] f32.
  needed = pl.program_id(2) * bn < lim_ref[pl.program_id(0), pl.program_id(1)]

  @pl.when(needed)
  def _():
    k_nc = k_ref[...]
    acc_qn = jnp.zeros(o_ref.shape, jnp.float32)
    for h in range(heads):  # static: H lane-aligned slices of q and of w
      dots_qn = jax.lax.dot_general(q_ref[:, h * dim:(h + 1) * dim], k_nc,
                                    (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      acc_qn += jnp.maximum(dots_qn, 0.0) * w_ref[:, h:h + 1]
    o_ref[...] = acc_qn * scale

  @pl.when(jnp.logical_not(needed))
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)


@functools.partial(jax.jit, static_argnames=('block_q', 'block_n', 'interpret'))
def index_scores_tpu(q_bthc, w_bth, k_bnc, limit_bt, *, block_q: int = 128, block_n: int = 512,
                     interpret: bool | None = None):
  """fp32 [B, T, N] indexer scores; entries j >= limit_bt[b, t] may be 0 instead of the score.

  q_bthc, k_bnc in the compute dtype; C a multiple of 128 (the lane width: each head's slice of
  q starts on a lane boundary) and at most 256 heads' worth of unrolled matmuls.
  """
  b, t, h, c = q_bthc.shape
  n = k_bnc.shape[1]
  if c % 128:
    raise ValueError(f'index_scores_tpu needs the indexer head width (model.index_head_dim) '
                     f'to be a multiple of 128, got {c}')
  bq = min(block_q, -(-t // 8) * 8)
  bn = min(block_n, -(-n // 128) * 128)
  q_btf = launch.pad_axis(q_bthc.reshape(b, t, h * c), 1, bq)
  w_bth = launch.pad_axis(w_bth.astype(jnp.float32), 1, bq)
  lim_bt = launch.pad_axis(limit_bt.astype(jnp.int32), 1, bq)
  k_bnc = launch.pad_axis(k_bnc.astype(q_bthc.dtype), 1, bn)
  tp, np_ = q_btf.shape[1], k_bnc.shape[1]
  lim_bi = jnp.max(lim_bt.reshape(b, tp // bq, bq), axis=-1)  # per query tile

  def k_block(bi, i, j, lim):  # past the limit: stay on the last needed block (no new copy)
    # lax.div: a non-negative truncating division (`//` lowers through sign, which Mosaic
    # resolves against the attached chip: none when compiling deviceless).
    return bi, jnp.minimum(j, jax.lax.div(jnp.maximum(lim[bi, i] - 1, 0), bn)), 0

  kernel = functools.partial(_kernel, heads=h, dim=c, bn=bn, scale=(h * c) ** -0.5)
  out = launch.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((b, tp, np_), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, tp // bq, np_ // bn),
          in_specs=[pl.BlockSpec((None, bq, h * c), lambda bi, i, j, lim: (bi, i, 0)),
                    pl.BlockSpec((None, bq, h), lambda bi, i, j, lim: (bi, i, 0)),
                    pl.BlockSpec((None, bn, c), k_block)],
          out_specs=pl.BlockSpec((None, bq, bn), lambda bi, i, j, lim: (bi, i, j))),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      # What the compiler's cost_analysis (tools/topology_plan.py) counts for the kernel: every
      # tile's matmuls (the causal skip is data-dependent), q and w once, k once per query tile.
      cost_estimate=pl.CostEstimate(
          flops=2 * b * tp * np_ * h * c, transcendentals=0,
          bytes_accessed=(q_btf.size * q_btf.dtype.itemsize + w_bth.size * 4 +
                          k_bnc.size * k_bnc.dtype.itemsize * (tp // bq) + b * tp * np_ * 4)),
      interpret=interpret,
      name='csa2_index_scores_tpu',
  )(lim_bi, q_btf, w_bth, k_bnc)
  return out[:, :t, :n]
