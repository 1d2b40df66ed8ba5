"""Routed-expert compute of the MoE layer (docs/architecture.md 3.11), three backends.

Each expert is the clipped SwiGLU `y = (silu(min(x Wg, L)) * clip(x Wu, -L, L)) Wd`, and a token's
output is `sum_k weight_nk * Expert_{idx_nk}(x_n)`, combined in float32. The router (scores, top-k,
bias) lives elsewhere; these functions take its decisions as `expert_idx_nk` and `weight_nk`.

Backends (docs/performance.md says why there are several):
  * `reference`: every expert on every token, combined with a dense [N, E] weight matrix. Obviously
    right, E/K times the useful FLOPs; the ground truth for tests.
  * `capacity_einsum`: sort assignments by expert, gather them into a capacity-padded [E, C, D]
    buffer, batched einsums. Fast on GPU (batched matmuls run near the matmul ceiling) but drops
    assignments past capacity, earliest tokens first served. Dispatch and combine are gathers in
    both directions (a custom VJP through the inverse map): with XLA's scatter-add transposes,
    forward+backward at the 1B ablation shape took 2.9 ms on the H200 instead of 2.0 ms.
  * `ragged_dot`: dropless, sorted rows through `jax.lax.ragged_dot`. Exact, but XLA computes every
    group densely on CPU and CUDA (about E times the useful FLOPs); worth it only where a real
    grouped-GEMM kernel exists (TPU).
  * `grouped`: dropless, sorted rows with each expert's group padded to whole row tiles, through
    the Pallas grouped-GEMM kernels of ops/gpu/grouped_gemm.py (Triton lowering; forward and
    backward are kernels, the useful FLOPs plus < block_m padding rows per expert). On the CPU
    the kernels run in the Pallas interpreter.
  * `grouped_fused`: `grouped`'s layout and FLOPs, its GEMMs gathering their own rows
    (ops/gpu/fused_experts.py): the gate and up projections in one kernel that loads each
    row tile by token index from x and writes only SwiGLU's output h (no [M, D] copy of the
    tokens, no [M, F] gate and up in HBM), the down projection's epilogue weighting each row by
    its router weight and the combine summing a token's K rows (through the inverse map, or
    scatter-added with float32 atomics: `fused_combine`); its backward recomputes gate and up
    (or the forward saves them: `fused_recompute`).
    Opt-in (model.moe_backend) until measured on the GPU; no FP8.

FP8 (`fp8='rowwise'`, model.fp8; ops/fp8_matmul.py): `reference` and `capacity_einsum` run
each expert's three GEMMs as row-wise scaled e4m3 GEMMs, forward, dgrad and wgrad (a vmap of
fp8_matmul over the experts). `grouped` runs the forward and dgrad in e4m3 inside the Pallas
kernels and keeps the weight gradient in the compute dtype (ops/gpu/grouped_gemm.py).
`ragged_dot` cannot take per-(expert, column) scales, so it reproduces the grouped numerics by
quantize-dequantize: the same e4m3 values and scales, a compute-dtype ragged_dot.

Padding tokens (`valid` false) take no capacity, are never counted as dropped, and output 0.
`valid` may also be given per assignment ([N, K]): an expert shard computes only the assignments
to its own experts of tokens gathered from every shard (ops/parallel/expert_parallel.py).
All backends are jit-able and differentiable in x, weight_nk and the three expert tensors; all but
`grouped` and `grouped_fused` are plain jnp and indifferent to how the weights are sharded (those
two compute the experts of the weight tensor they are given: shard it by expert under shard_map,
not by D or F).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepseek41.ops import launch
from deepseek41.ops.fp8_matmul import batched_fp8_matmul, check_fp8, qdq_rowwise
from deepseek41.ops.gpu.fused_experts import COMBINES, fused_expert_block
from deepseek41.ops.gpu.grouped_gemm import Tiles, default_tiles, projection
from deepseek41.ops.grouped_gemm import make_layout, per_assignment
from deepseek41.ops.grouped_gemm import sort_by_expert as _sort_by_expert
from deepseek41.ops.swiglu import clipped_swiglu

BACKENDS = ('reference', 'capacity_einsum', 'ragged_dot', 'grouped', 'grouped_fused')
# 'gathered' is no config choice (model.moe_backend): the small-call path of the dropless ones
# (ops/parallel/expert_parallel.py `routed_experts`, model.moe_gather_small_calls).
ALL_BACKENDS = (*BACKENDS, 'gathered')
DROPLESS_BACKENDS = ('ragged_dot', 'grouped', 'grouped_fused', 'gathered')
# The backends that compute on the padded expert-sorted layout with the Pallas kernels, and so
# take kernel tiles (grouped_tiles).
GROUPED_BACKENDS = ('grouped', 'grouped_fused')


def expert_capacity(n_tokens: int, k: int, e: int, factor: float) -> int:
  """Slots per expert per group: ceil(factor * N * K / E), at least 1.

  Capped at N: a token picks K distinct experts, so no expert can receive more than N assignments
  and larger buffers would only hold padding.
  """
  return max(1, min(n_tokens, math.ceil(factor * n_tokens * k / e)))


def combine(y_nkd, weight_nk, dtype):
  """sum_k weight_nk * y_nkd, accumulated in float32 so small router weights are not rounded away.

  A multiply and a sum, which is what XLA's GPU compiler makes of the equivalent einsum (a
  vector per token) in training anyway; generation's programs turn that rewrite off
  (model.decode_vector_dots=gemm), where the einsum was a GEMM launch of its own a layer and the
  sum fuses with what follows: 24 kernels fewer in a 1B decode step (docs/performance.md 67)."""
  y_nd = jnp.sum(weight_nk.astype(jnp.float32)[..., None] * y_nkd.astype(jnp.float32), axis=1)
  return y_nd.astype(dtype)


# ---- reference ---------------------------------------------------------------------------------


def _reference(x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd,
               limit, fp8='off', out_dtype=None):
  """Every expert on every token; a dense [N, E] combine matrix picks and weights the chosen ones."""
  n_experts = w_gate_edf.shape[0]
  onehot_nke = jax.nn.one_hot(expert_idx_nk, n_experts, dtype=jnp.float32)
  weight_nk = jnp.where(valid_nk, weight_nk.astype(jnp.float32), 0.0)
  combine_ne = jnp.einsum('nke,nk->ne', onehot_nke, weight_nk)
  if fp8 == 'off':
    h_gate_nef = jnp.einsum('nd,edf->nef', x_nd, w_gate_edf)
    h_up_nef = jnp.einsum('nd,edf->nef', x_nd, w_up_edf)
    out_ned = jnp.einsum('nef,efd->ned', clipped_swiglu(h_gate_nef, h_up_nef, limit), w_down_efd)
  else:
    x_end = jnp.broadcast_to(x_nd, (n_experts, *x_nd.shape))
    h_enf = clipped_swiglu(batched_fp8_matmul(x_end, w_gate_edf),
                           batched_fp8_matmul(x_end, w_up_edf), limit)
    out_ned = jnp.swapaxes(batched_fp8_matmul(h_enf, w_down_efd), 0, 1)
  y_nd = jnp.einsum('ne,ned->nd', combine_ne, out_ned.astype(jnp.float32))
  return y_nd.astype(out_dtype or x_nd.dtype), jnp.zeros((), jnp.int32)


def _row_times_rows(x_nki, w_nkio):
  """[N, K, I] x [N, K, I, O] -> [N, K, O]: each row times its own gathered matrix, as a
  multiply and an fp32 sum. A one-row product is what XLA's GPU compiler turns an einsum into
  anyway (its dot strength reduction), keeping the weights' gather inside the one reduction;
  written out, it stays so when generation turns that pass off (model.decode_vector_dots='gemm'),
  where the einsum would become a gather written to memory and a GEMM reading it back."""
  y_nko = jnp.sum(x_nki[..., None].astype(jnp.float32) * w_nkio.astype(jnp.float32), axis=2)
  return y_nko.astype(jnp.result_type(x_nki, w_nkio))


def _gathered(x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd,
              limit, out_dtype=None):
  """Each assignment's expert weights gathered and applied to its token: N*K experts' weights
  read, no expert-sorted layout. For calls of a few tokens (decoding), where the grouped layout
  would pad every expert's group to a whole tile (8,192 rows for one token of 64 experts)."""
  h_gate_nkf = _row_times_rows(x_nd[:, None, :], w_gate_edf[expert_idx_nk])
  h_up_nkf = _row_times_rows(x_nd[:, None, :], w_up_edf[expert_idx_nk])
  y_nkd = _row_times_rows(clipped_swiglu(h_gate_nkf, h_up_nkf, limit),
                          w_down_efd[expert_idx_nk])
  weight_nk = jnp.where(valid_nk, weight_nk.astype(jnp.float32), 0.0)
  y_nkd = jnp.where(valid_nk[..., None], y_nkd, 0)  # an invalid row's expert index may be junk
  return combine(y_nkd, weight_nk, out_dtype or x_nd.dtype), jnp.zeros((), jnp.int32)


# ---- capacity_einsum ---------------------------------------------------------------------------


@jax.custom_vjp
def take_rows(src_md, idx_r, ok_r, inv_idx_mj, inv_ok_mj):
  """out_rd = src_md[idx_r] where ok_r, else 0; a gather whose transpose is a gather too.

  Requires that (inv_idx_mj, inv_ok_mj) lists, for each source row m, the ok output rows that
  read it (at most J of them). The plain gather's transpose is a scatter-add, slow on GPU; with
  the inverse map known the backward is a gather plus a sum over J.
  """
  return jnp.where(ok_r[:, None], src_md[idx_r], 0).astype(src_md.dtype)


def _take_rows_fwd(src_md, idx_r, ok_r, inv_idx_mj, inv_ok_mj):
  return take_rows(src_md, idx_r, ok_r, inv_idx_mj, inv_ok_mj), (inv_idx_mj, inv_ok_mj)


def _take_rows_bwd(res, d_out_rd):
  inv_idx_mj, inv_ok_mj = res
  d_mjd = jnp.where(inv_ok_mj[..., None], d_out_rd[inv_idx_mj].astype(jnp.float32), 0.0)
  return d_mjd.sum(axis=1).astype(d_out_rd.dtype), None, None, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


class CapacityRoute(NamedTuple):
  """Where each (token, expert) assignment sits in the [E, C] capacity buffer, and back."""
  assign_s: jax.Array   # int32 [E*C] slot -> assignment a = n*K + k (meaningful where filled)
  filled_s: jax.Array   # bool [E*C] the slot holds an assignment
  slot_a: jax.Array     # int32 [N*K] assignment -> slot (meaningful where kept)
  kept_a: jax.Array     # bool [N*K] the assignment got a slot (valid token, within capacity)
  dropped: jax.Array    # int32 [] valid assignments past capacity


def capacity_route(expert_idx_nk, valid, n_experts: int, capacity: int) -> CapacityRoute:
  """GShard-style slots: expert e's c-th assignment (in token order) takes slot (e, c) if c < C."""
  n, k = expert_idx_nk.shape
  order_a, rank_a, counts_e = _sort_by_expert(expert_idx_nk, valid, n_experts)
  start_e = jnp.cumsum(counts_e) - counts_e
  # Stability of the sort makes the served assignments the earliest tokens.
  slot_c = jnp.arange(capacity, dtype=jnp.int32)
  filled_s = (slot_c[None, :] < counts_e[:, None]).reshape(n_experts * capacity)
  assign_s = order_a[jnp.minimum(start_e[:, None] + slot_c[None, :], n * k - 1)].reshape(-1)
  e_a = expert_idx_nk.reshape(n * k)
  pos_a = rank_a - start_e[e_a]
  kept_a = per_assignment(valid, k).reshape(n * k) & (pos_a < capacity)
  slot_a = e_a * capacity + jnp.minimum(pos_a, capacity - 1)
  dropped = jnp.sum(jnp.maximum(counts_e - capacity, 0)).astype(jnp.int32)
  return CapacityRoute(assign_s, filled_s, slot_a, kept_a, dropped)


def capacity_dispatch(x_nd, route: CapacityRoute, k: int):
  """[E*C, D] buffer of the tokens in their slots (empty slots 0)."""
  n = x_nd.shape[0]
  # Kept assignments and filled slots are in bijection, so dispatch and combine are both gathers
  # whose transposes are gathers through the other map (no scatter in the backward either).
  return take_rows(x_nd, route.assign_s // k, route.filled_s, route.slot_a.reshape(n, k),
                    route.kept_a.reshape(n, k))


def capacity_combine(out_sd, route: CapacityRoute, weight_nk, dtype):
  """sum_k weight_nk * out[slot(n, k)] over the kept assignments."""
  n, k = weight_nk.shape
  y_nkd = take_rows(out_sd, route.slot_a, route.kept_a, route.assign_s[:, None],
                     route.filled_s[:, None]).reshape(n, k, -1)
  weight_nk = jnp.where(route.kept_a.reshape(n, k), weight_nk.astype(jnp.float32), 0.0)
  return combine(y_nkd, weight_nk, dtype)


def experts_on_buffer(buf_ecd, w_gate_edf, w_up_edf, w_down_efd, limit, fp8='off'):
  """Each expert's SwiGLU on its [C, D] rows: batched matmuls over E (empty rows stay 0)."""
  if fp8 == 'off':
    h_gate_ecf = jnp.einsum('ecd,edf->ecf', buf_ecd, w_gate_edf)
    h_up_ecf = jnp.einsum('ecd,edf->ecf', buf_ecd, w_up_edf)
    return jnp.einsum('ecf,efd->ecd', clipped_swiglu(h_gate_ecf, h_up_ecf, limit), w_down_efd)
  # empty slots are zero rows: they quantize to zeros
  h_ecf = clipped_swiglu(batched_fp8_matmul(buf_ecd, w_gate_edf),
                         batched_fp8_matmul(buf_ecd, w_up_edf), limit)
  return batched_fp8_matmul(h_ecf, w_down_efd)


def _capacity_einsum(x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd,
                     limit, capacity_factor, fp8='off', out_dtype=None):
  """GShard-style capacity buffer filled by gathers, then batched matmuls over experts."""
  n, k = expert_idx_nk.shape
  n_experts, d, _ = w_gate_edf.shape
  cap = expert_capacity(n, k, n_experts, capacity_factor)
  route = capacity_route(expert_idx_nk, valid_nk, n_experts, cap)
  buf_ecd = capacity_dispatch(x_nd, route, k).reshape(n_experts, cap, d)
  out_ecd = experts_on_buffer(buf_ecd, w_gate_edf, w_up_edf, w_down_efd, limit, fp8)
  return capacity_combine(out_ecd.reshape(n_experts * cap, d), route, weight_nk,
                          out_dtype or x_nd.dtype), route.dropped


# ---- ragged_dot --------------------------------------------------------------------------------


@jax.custom_vjp
def _ragged_dot_qdq(x_ad, w_edf, counts_e):
  """ragged_dot with the grouped backend's fp8 numerics as quantize-dequantize (float32 math):
  x per row and W per (expert, output column) in the forward, dy per row and W per (expert,
  input row) in the dgrad; the weight gradient unquantized, as in the grouped kernels."""
  return _ragged_qdq_dot(x_ad, w_edf, counts_e, 1)


def _ragged_qdq_dot(a_ak, w_edf, counts_e, w_axis):
  a_ak_q = qdq_rowwise(a_ak, 1).astype(a_ak.dtype)  # e4m3 times a power of two: exact in bf16
  w_q = qdq_rowwise(w_edf, w_axis).astype(w_edf.dtype)
  if w_axis == 2:
    w_q = jnp.swapaxes(w_q, 1, 2)
  return jax.lax.ragged_dot(a_ak_q, w_q, counts_e,
                            preferred_element_type=jnp.float32).astype(a_ak.dtype)


def _ragged_dot_qdq_fwd(x_ad, w_edf, counts_e):
  return _ragged_dot_qdq(x_ad, w_edf, counts_e), (x_ad, w_edf, counts_e)


def _ragged_dot_qdq_bwd(res, dy_af):
  x_ad, w_edf, counts_e = res
  dy_af = dy_af.astype(x_ad.dtype)
  dx_ad = _ragged_qdq_dot(dy_af, w_edf, counts_e, 2)
  _, w_vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x_ad, w, counts_e), w_edf)
  return dx_ad, w_vjp(dy_af)[0], None


_ragged_dot_qdq.defvjp(_ragged_dot_qdq_fwd, _ragged_dot_qdq_bwd)


class SortedRows(NamedTuple):
  """The N*K assignments as rows in expert order (padding tokens' assignments last, unused)."""
  order_a: jax.Array     # int32 [N*K] sorted position -> assignment a = n*K + k
  rank_a: jax.Array      # int32 [N*K] assignment -> sorted position
  counts_e: jax.Array    # int32 [E] valid assignments per expert
  valid_a: jax.Array     # bool [N*K] the assignment is computed (its token is not padding)
  in_group_a: jax.Array  # bool [N*K] sorted position holds a valid assignment


def sort_rows(expert_idx_nk, valid, n_experts: int) -> SortedRows:
  n, k = expert_idx_nk.shape
  order_a, rank_a, counts_e = _sort_by_expert(expert_idx_nk, valid, n_experts)
  return SortedRows(order_a, rank_a, counts_e, per_assignment(valid, k).reshape(n * k),
                    jnp.arange(n * k) < jnp.sum(counts_e))


def to_sorted_rows(x_nd, rows: SortedRows, k: int):
  """[N*K, D]: token rows in expert order, padding assignments' rows 0.

  Sorted rows and valid assignments are in bijection, so this move and `from_sorted_rows` are
  gathers with gather transposes, as in capacity_einsum.
  """
  n = x_nd.shape[0]
  return take_rows(x_nd, rows.order_a // k, rows.in_group_a, rows.rank_a.reshape(n, k),
                   rows.valid_a.reshape(n, k))


def from_sorted_rows(y_ad, rows: SortedRows, k: int):
  """[N, K, D]: each assignment's output row back in token order (padding 0)."""
  y_nkd = take_rows(y_ad, rows.rank_a, rows.valid_a, rows.order_a[:, None],
                    rows.in_group_a[:, None])
  return y_nkd.reshape(-1, k, y_ad.shape[-1])


def _ragged_dot(x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd, limit,
                fp8='off', out_dtype=None):
  """Dropless: expert-sorted rows through lax.ragged_dot with per-expert group sizes."""
  k = expert_idx_nk.shape[1]
  rows = sort_rows(expert_idx_nk, valid_nk, w_gate_edf.shape[0])
  # Padding assignments sort past sum(counts_e): they are neither dispatched (their rows stay 0,
  # and ragged_dot leaves rows past the groups at 0) nor combined.
  x_ad = to_sorted_rows(x_nd, rows, k)
  dot = jax.lax.ragged_dot if fp8 == 'off' else _ragged_dot_qdq
  h_gate_af = dot(x_ad, w_gate_edf, rows.counts_e)
  h_up_af = dot(x_ad, w_up_edf, rows.counts_e)
  out_ad = dot(clipped_swiglu(h_gate_af, h_up_af, limit), w_down_efd, rows.counts_e)
  y_nkd = from_sorted_rows(out_ad, rows, k)

  weight_nk = jnp.where(valid_nk, weight_nk.astype(jnp.float32), 0.0)
  return combine(y_nkd, weight_nk, out_dtype or x_nd.dtype), jnp.zeros((), jnp.int32)


# ---- grouped -----------------------------------------------------------------------------------


def _grouped(x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd, limit,
             tiles, fp8='off', out_dtype=None, max_valid=None):
  """Dropless: rows sorted by expert, each group padded to whole row tiles, Pallas grouped GEMMs.

  The layout is ops/grouped_gemm.py's, the kernels ops/gpu/grouped_gemm.py's. On the CPU the
  kernels run in the Pallas interpreter (tests) with small tiles.
  """
  n, k = expert_idx_nk.shape
  n_experts = w_gate_edf.shape[0]
  interpret = launch.interpreted()
  tiles = tiles or default_tiles()
  lay = make_layout(expert_idx_nk, valid_nk, n_experts, tiles.block_m, max_valid)

  # Used rows and valid assignments are in bijection, so dispatch and combine are gathers whose
  # transposes are gathers through the other map (no scatter-add in the backward). Group padding
  # rows stay 0 through all three projections (swiglu(0, 0) = 0), as the kernels require.
  x_md = take_rows(x_nd, lay.assign_m // k, lay.used_m, lay.row_a.reshape(n, k),
                    lay.valid_a.reshape(n, k))

  matmul = projection(fp8)

  def proj(a_md, w_edf):
    return matmul(a_md, w_edf, lay.tile_expert_t, lay.group_tiles_e1, tiles, interpret)
  h_md = clipped_swiglu(proj(x_md, w_gate_edf), proj(x_md, w_up_edf), limit)
  out_md = proj(h_md, w_down_efd)
  y_nkd = take_rows(out_md, lay.row_a, lay.valid_a, lay.assign_m[:, None], lay.used_m[:, None])
  y_nkd = y_nkd.reshape(n, k, -1)

  weight_nk = jnp.where(valid_nk, weight_nk.astype(jnp.float32), 0.0)
  return combine(y_nkd, weight_nk, out_dtype or x_nd.dtype), jnp.zeros((), jnp.int32)


# ---- grouped_fused -----------------------------------------------------------------------------


def _grouped_fused(x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd,
                   limit, tiles, out_dtype=None, max_valid=None, combine='gather',
                   recompute=True):
  """`grouped`'s padded layout, without its dispatch and combine buffers: the kernels gather
  each padded row's token row (src_m) themselves and weight and sum the rows in the down
  projection's epilogue (ops/gpu/fused_experts.py)."""
  n, k = expert_idx_nk.shape
  tiles = tiles or default_tiles()
  lay = make_layout(expert_idx_nk, valid_nk, w_gate_edf.shape[0], tiles.block_m, max_valid)
  src_m = jnp.where(lay.used_m, lay.assign_m // k, -1).astype(jnp.int32)
  # Each row's router weight: a gather whose transpose is a gather (take_rows), as grouped's rows.
  weight_a1 = jnp.where(valid_nk, weight_nk.astype(jnp.float32), 0.0).reshape(n * k, 1)
  weight_m = take_rows(weight_a1, lay.assign_m, lay.used_m, lay.row_a[:, None],
                       lay.valid_a[:, None])[:, 0]
  y_nd = fused_expert_block(x_nd, weight_m, w_gate_edf, w_up_edf, w_down_efd, src_m,
                            lay.tile_expert_t, lay.group_tiles_e1, lay.row_a.reshape(n, k),
                            lay.valid_a.reshape(n, k), limit, combine,
                            jnp.dtype(out_dtype or x_nd.dtype), tiles, launch.interpreted(),
                            recompute)
  return y_nd, jnp.zeros((), jnp.int32)


# ---- public API --------------------------------------------------------------------------------


def expert_ffn(x_nd, expert_idx_nk, weight_nk, valid, w_gate_edf, w_up_edf, w_down_efd, *,
               swiglu_limit: float | None, backend: str, capacity_factor: float = 1.25,
               grouped_tiles: Tiles | None = None, fp8: str = 'off',
               out_dtype=None, max_valid: int | None = None, fused_combine: str = 'gather',
               fused_recompute: bool = True):
  """Routed experts for one group of N tokens.

  Args:
    x_nd: [N, D] tokens in the compute dtype (the expert weights are cast to it).
    expert_idx_nk: int32 [N, K] chosen experts, distinct per token.
    weight_nk: [N, K] combine weights (normalised and scaled by the router), used in float32.
    valid: bool [N], false for padding, which takes no capacity and outputs 0; or bool [N, K],
      per assignment (an invalid assignment is neither computed nor counted as dropped).
    w_gate_edf, w_up_edf: [E, D, F]; w_down_efd: [E, F, D].
    swiglu_limit: the clamp L of the SwiGLU (None: no clamp).
    backend: one of ALL_BACKENDS; a Python string, static under jit.
    capacity_factor: capacity_einsum only; C = expert_capacity(N, K, E, capacity_factor).
    grouped_tiles: grouped and grouped_fused only; kernel tiling (None: grouped_gemm's default
      for the platform).
    fp8: 'off' or 'rowwise' (model.fp8): the expert GEMMs in e4m3 (module docstring);
      grouped_fused takes 'off' only.
    out_dtype: the dtype of y_nd (None: x's); float32 keeps the combined sum unrounded.
    max_valid: grouped and grouped_fused only; a static bound the caller guarantees on the
      valid assignments (None: N*K), which sizes the expert-sorted layout
      (ops/parallel/expert_parallel.py's bounded allgather exchange).
    fused_combine: grouped_fused only; 'gather' or 'atomic', how the down projection's weighted
      rows reach their tokens (ops/gpu/fused_experts.py `fused_expert_block`).
    fused_recompute: grouped_fused only; the backward recomputes gate and up (True) or the
      differentiated forward saves them (False); the same numbers.

  Returns:
    (y_nd in out_dtype, dropped): dropped is the int32 count of (valid token, expert) assignments
    left uncomputed, always 0 except for capacity_einsum.
  """
  if backend not in ALL_BACKENDS:
    raise ValueError(f'unknown expert backend {backend!r}; expected one of {ALL_BACKENDS}')
  check_fp8(fp8)
  if backend == 'grouped_fused' and fp8 != 'off':
    raise ValueError(f"the grouped_fused expert backend has no FP8 path (fp8={fp8!r}); use "
                     "backend 'grouped' for FP8 expert GEMMs")
  if fused_combine not in COMBINES:
    raise ValueError(f'unknown fused_combine {fused_combine!r}; expected one of {COMBINES}')
  dtype = x_nd.dtype
  w_gate_edf, w_up_edf, w_down_efd = (w.astype(dtype) for w in (w_gate_edf, w_up_edf, w_down_efd))
  expert_idx_nk = expert_idx_nk.astype(jnp.int32)
  valid_nk = per_assignment(valid, expert_idx_nk.shape[1])
  args = (x_nd, expert_idx_nk, weight_nk, valid_nk, w_gate_edf, w_up_edf, w_down_efd, swiglu_limit)
  if backend == 'reference':
    return _reference(*args, fp8=fp8, out_dtype=out_dtype)
  if backend == 'capacity_einsum':
    return _capacity_einsum(*args, capacity_factor, fp8=fp8, out_dtype=out_dtype)
  if backend == 'ragged_dot':
    return _ragged_dot(*args, fp8=fp8, out_dtype=out_dtype)
  if backend == 'gathered':
    if fp8 != 'off':
      raise ValueError(f"the gathered expert backend has no FP8 path (fp8={fp8!r})")
    return _gathered(*args, out_dtype=out_dtype)
  if backend == 'grouped_fused':
    return _grouped_fused(*args, grouped_tiles, out_dtype=out_dtype, max_valid=max_valid,
                          combine=fused_combine, recompute=fused_recompute)
  return _grouped(*args, grouped_tiles, fp8=fp8, out_dtype=out_dtype, max_valid=max_valid)


def expert_ffn_batched(x_bnd, expert_idx_bnk, weight_bnk, valid_bn, w_gate_edf, w_up_edf,
                       w_down_efd, *, swiglu_limit: float | None, backend: str,
                       capacity_factor: float = 1.25,
                       grouped_tiles: Tiles | None = None, fp8: str = 'off',
                       fused_combine: str = 'gather', fused_recompute: bool = True):
  """expert_ffn over a leading batch of groups; returns (y_bnd, dropped summed over groups).

  reference and capacity_einsum run per group under vmap: capacity is per sequence (GShard), so
  the sort stays local to a group when the batch is sharded. The others are dropless,
  so all groups go through as one and the group boundary does not matter.
  """
  kw = dict(swiglu_limit=swiglu_limit, backend=backend, capacity_factor=capacity_factor,
            grouped_tiles=grouped_tiles, fp8=fp8, fused_combine=fused_combine,
            fused_recompute=fused_recompute)
  if backend in DROPLESS_BACKENDS:
    b, n, d = x_bnd.shape
    k = expert_idx_bnk.shape[-1]
    y_nd, dropped = expert_ffn(x_bnd.reshape(b * n, d), expert_idx_bnk.reshape(b * n, k),
                               weight_bnk.reshape(b * n, k), valid_bn.reshape(b * n),
                               w_gate_edf, w_up_edf, w_down_efd, **kw)
    return y_nd.reshape(b, n, d), dropped
  per_group = functools.partial(expert_ffn, **kw)
  y_bnd, dropped_b = jax.vmap(per_group, in_axes=(0, 0, 0, 0, None, None, None))(
      x_bnd, expert_idx_bnk, weight_bnk, valid_bn, w_gate_edf, w_up_edf, w_down_efd)
  return y_bnd, jnp.sum(dropped_b)
