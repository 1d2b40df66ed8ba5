"""The indexer's scores of the selected entries on the GPU: fused kernels (Pallas, Triton
backend), forward and backward.

    S[t, k] = sum_h w[t, h] * relu(q[t, h] . k[idx[t, k]]) * (H * C)^-1/2     fp32 [B, T, K]

The contract and the jnp reference are ops/selected_scores.py's. One program per query walks
its selected slots in blocks, gathering each block's keys on chip (as ops/gpu/sparse_kernel.py
gathers latents), so nothing of size [T, K, d_I] or [T, H, K] reaches HBM; the backward
recomputes the block's dot products, keeps dq and dw in registers and adds the keys' gradient
into an fp32 [B, N, d_I] buffer with atomics. Invalid slots score 0 and pass no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT
from deepseek41.ops.gpu.row_adds import add_rows, compiler_params
from deepseek41.ops.gpu.sparse_kernel import per_query_specs, prepare_rows
from deepseek41.ops.launch import droppable, name_outputs


def _dots(q_hc, k_kc):
  return jax.lax.dot_general(q_hc, k_kc, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _fwd_kernel(nblk_ref, q_ref, w_ref, k_ref, idx_ref, s_ref, *, bk, scale):
  c = q_ref.shape[1]
  q_hc, w_h = q_ref[...], w_ref[...]
  nblk = nblk_ref[0]

  def block(j, carry):
    rows_k = idx_ref[pl.ds(j * bk, bk)]  # invalid slots hold the zero row: they score 0
    dots_hk = _dots(q_hc, k_ref[rows_k, pl.ds(0, c)])
    s_ref[pl.ds(j * bk, bk)] = jnp.sum(jnp.maximum(dots_hk, 0.0) * w_h[:, None], axis=0) * scale
    return carry
  jax.lax.fori_loop(0, nblk, block, 0)

  def empty(j, carry):  # the blocks past the last valid slot (disjoint stores: no ordering)
    s_ref[pl.ds(j * bk, bk)] = jnp.zeros((bk,), jnp.float32)
    return carry
  jax.lax.fori_loop(nblk, idx_ref.shape[0] // bk, empty, 0)


def _bwd_kernel(nblk_ref, q_ref, w_ref, k_ref, idx_ref, ds_ref, _dk_in_ref, dq_ref, dw_ref,
                dk_ref, *, n, bk, scale, interpret):
  h, c = q_ref.shape
  q_hc, w_h = q_ref[...], w_ref[...]
  dt = q_hc.dtype

  def block(j, carry):
    dq_hc, dw_h = carry
    rows_k = idx_ref[pl.ds(j * bk, bk)]
    k_kc = k_ref[rows_k, pl.ds(0, c)]
    dots_hk = _dots(q_hc, k_kc)
    ds_k = ds_ref[pl.ds(j * bk, bk)] * scale
    dw_h = dw_h + jnp.sum(jnp.maximum(dots_hk, 0.0) * ds_k[None, :], axis=1)
    ddots_hk = jnp.where(dots_hk > 0.0, w_h[:, None] * ds_k[None, :], 0.0).astype(dt)
    dq_hc = dq_hc + jax.lax.dot_general(ddots_hk, k_kc, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
    dk_kc = jax.lax.dot_general(ddots_hk, q_hc, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
    add_rows(dk_ref, rows_k, 0, dk_kc, n=n, interpret=interpret)
    return dq_hc, dw_h

  dq_hc, dw_h = jax.lax.fori_loop(0, nblk_ref[0], block, (jnp.zeros((h, c), jnp.float32),
                                                           jnp.zeros((h,), jnp.float32)))
  dq_ref[...] = dq_hc.astype(dq_ref.dtype)
  dw_ref[...] = dw_h


def _forward(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, scale, block_k, num_warps, interpret):
  b, t, h, c = q_bthc.shape
  k_bmc, idx_btk, nblk_bt1, bk = prepare_rows(k_bnc, idx_btk, valid_btk, block_k)
  rows, k_pad = k_bmc.shape[1], idx_btk.shape[-1]
  spec = per_query_specs(h, c, rows, k_pad)
  s_btk = droppable(launch.pallas_call(
      functools.partial(_fwd_kernel, bk=bk, scale=scale),
      out_shape=jax.ShapeDtypeStruct((b, t, k_pad), jnp.float32),
      grid=(t, b),  # queries fastest: neighbours share selected keys in L2
      in_specs=[spec['nblk'], spec['q'], spec['h'], spec['kv'], spec['idx']],
      out_specs=spec['idx'],
      compiler_params=None if interpret else compiler_params(num_warps, 2),
      interpret=interpret,
      name='csa2_selected_scores',
  ))(nblk_bt1, q_bthc, w_bth.astype(jnp.float32), k_bmc, idx_btk)
  return s_btk[..., :valid_btk.shape[-1]]


def _backward(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, ds_btk, scale, block_k, num_warps,
              interpret):
  b, t, h, c = q_bthc.shape
  n, k = k_bnc.shape[1], idx_btk.shape[-1]
  k_bmc, idx_btk, nblk_bt1, bk = prepare_rows(k_bnc, idx_btk, valid_btk, block_k)
  rows, k_pad = k_bmc.shape[1], idx_btk.shape[-1]
  spec = per_query_specs(h, c, rows, k_pad)
  ds_btk = jnp.pad(jnp.where(valid_btk, ds_btk, 0.0).astype(jnp.float32),
                   ((0, 0), (0, 0), (0, k_pad - k)))
  dq_bthc, dw_bth, dk_bmc = launch.pallas_call(
      functools.partial(_bwd_kernel, n=n, bk=bk, scale=scale, interpret=interpret),
      out_shape=[jax.ShapeDtypeStruct((b, t, h, c), q_bthc.dtype),
                 jax.ShapeDtypeStruct((b, t, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, rows, c), jnp.float32)],
      grid=(t, b),
      in_specs=[spec['nblk'], spec['q'], spec['h'], spec['kv'], spec['idx'], spec['idx'],
                spec['kv']],
      out_specs=[spec['q'], spec['h'], spec['kv']],
      input_output_aliases={6: 2},
      compiler_params=None if interpret else compiler_params(num_warps, 2),
      interpret=interpret,
      name='csa2_selected_scores_bwd',
  )(nblk_bt1, q_bthc, w_bth.astype(jnp.float32), k_bmc, idx_btk, ds_btk,
    jnp.zeros((b, rows, c), jnp.float32))
  return dq_bthc, dw_bth.astype(w_bth.dtype), dk_bmc[:, :n].astype(k_bnc.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _selected_scores(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, scale, block_k, num_warps,
                     interpret):
  return _forward(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, scale, block_k, num_warps, interpret)


def _selected_scores_fwd(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, scale, block_k, num_warps,
                         interpret):
  s_btk = _forward(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, scale, block_k, num_warps,
                   interpret)
  return s_btk, (q_bthc, w_bth, k_bnc, idx_btk, valid_btk)


def _selected_scores_bwd(scale, block_k, num_warps, interpret, res, ds_btk):
  dq, dw, dk = _backward(*res, ds_btk, scale, block_k, num_warps, interpret)
  return dq, dw, dk, None, None


_selected_scores.defvjp(_selected_scores_fwd, _selected_scores_bwd)


def selected_scores_fused(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, *, block_k: int = 64,
                          num_warps: int = 4, interpret: bool | None = None):
  """fp32 [B, T, K] by the kernels; differentiable in q, w and k.

  H and d_I powers of two, d_I >= 16 (`index_scores_supported`); fewer than 16 heads are padded
  with zero heads (Triton's smallest product), which score and move nothing. block_k selected
  keys are gathered per step. interpret: the Pallas interpreter or not (None: ops/launch.py's
  rule).
  """
  h, c = q_bthc.shape[2:]
  h_pad = max(MIN_DOT, h)
  if h_pad != h:
    q_bthc = jnp.pad(q_bthc, ((0, 0), (0, 0), (0, h_pad - h), (0, 0)))
    w_bth = jnp.pad(w_bth, ((0, 0), (0, 0), (0, h_pad - h)))
  scores_btk, = name_outputs(_selected_scores(
      q_bthc, w_bth, k_bnc.astype(q_bthc.dtype), idx_btk, valid_btk, (h * c) ** -0.5,
      int(block_k), int(num_warps), launch.interpreted(interpret)))
  return scores_btk
