"""The dropless grouped GEMM of the routed experts: its padded layout and its plain jnp references.

Layout (docs/architecture.md 3.11, the `grouped` backend of ops/expert_gemm.py): the N*K
(token, expert) assignments are sorted by expert and each expert's group is padded up to a
multiple of the row tile `block_m`, so every row tile of the [M_pad, D] operand belongs to exactly
one expert. M_pad = N*K + E*(block_m - 1) rounded up to block_m is a static bound on the padded
rows. `tile_expert_t` maps a row tile to its expert (-1 for the tiles past the last used one),
`group_tiles_e1` holds the tile offsets of the groups (group e is tiles [g[e], g[e+1])). Padding
rows are zero; the kernels rely on it (a zero row adds nothing to a weight gradient).

The kernels on this layout (gmm, tgmm and the differentiable projections, in the compute dtype
and in fp8) are ops/gpu/grouped_gemm.py's; `grouped_matmul_reference` and
`grouped_matmul_fp8_reference` are their plain jnp ground truth (per-row gather of the expert
weight).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepseek41.ops.fp8_matmul import qdq_rowwise


def per_assignment(valid, k: int):
  """bool [N, K] from a validity per token [N] or per assignment [N, K]."""
  n = valid.shape[0]
  return jnp.broadcast_to(valid.reshape(n, -1), (n, k)).astype(bool)


def sort_by_expert(expert_idx_nk, valid, n_experts):
  """Stable order of the N*K assignments (a = n*K + k) by expert, invalid ones last.

  valid: bool [N] (padding tokens) or [N, K] (single assignments, e.g. another shard's experts).

  Returns order_a (sorted position -> a), rank_a (a -> sorted position) and counts_e (valid
  assignments per expert). Stability is what makes capacity first-come-first-served: within an
  expert, assignments keep token order.
  """
  n, k = expert_idx_nk.shape
  # Padding gets the key E, one past the last expert, so it sorts after every real group.
  key_a = jnp.where(per_assignment(valid, k), expert_idx_nk, n_experts).reshape(n * k)
  order_a = jnp.argsort(key_a, stable=True).astype(jnp.int32)
  # Inverting a permutation is a scatter of indices (integers, no gradient), not of token data.
  rank_a = jnp.zeros_like(order_a).at[order_a].set(jnp.arange(n * k, dtype=jnp.int32))
  counts_e = jnp.bincount(key_a, length=n_experts + 1)[:n_experts].astype(jnp.int32)
  return order_a, rank_a, counts_e


def padded_rows(n_assignments: int, n_experts: int, block_m: int) -> int:
  """Static row bound M_pad: every group rounded up to block_m fits, whatever the routing."""
  rows = n_assignments + n_experts * (block_m - 1)
  return -(-rows // block_m) * block_m


class GroupLayout(NamedTuple):
  """Where each assignment sits in the padded expert-sorted layout, and the maps back.

  row_a: int32 [N*K] assignment -> padded row (meaningful where valid_a).
  valid_a: bool [N*K] the assignment is computed (its token is not padding).
  assign_m: int32 [M_pad] padded row -> assignment (meaningful where used_m).
  used_m: bool [M_pad] the row holds an assignment (false: group padding or unused tile).
  tile_expert_t: int32 [M_pad / block_m] tile -> expert, -1 past the last used tile.
  group_tiles_e1: int32 [E + 1] group e covers tiles [g[e], g[e + 1]).
  """
  row_a: jax.Array
  valid_a: jax.Array
  assign_m: jax.Array
  used_m: jax.Array
  tile_expert_t: jax.Array
  group_tiles_e1: jax.Array


def make_layout(expert_idx_nk, valid, n_experts: int, block_m: int,
                max_valid: int | None = None) -> GroupLayout:
  """The padded layout of the valid assignments (integers only: no gradient flows here).

  max_valid: a static bound on the valid assignments that the caller guarantees (default N*K);
  the layout's rows M_pad are sized by it.
  """
  n, k = expert_idx_nk.shape
  m_pad = padded_rows(min(n * k, max_valid or n * k), n_experts, block_m)
  order_a, rank_a, counts_e = sort_by_expert(expert_idx_nk, valid, n_experts)
  start_e = jnp.cumsum(counts_e) - counts_e
  tiles_e = (counts_e + block_m - 1) // block_m
  tile_end_e = jnp.cumsum(tiles_e).astype(jnp.int32)
  row_start_e = (tile_end_e - tiles_e) * block_m

  valid_a = per_assignment(valid, k).reshape(n * k)
  e_a = expert_idx_nk.reshape(n * k)
  row_a = jnp.where(valid_a, row_start_e[e_a] + rank_a - start_e[e_a], 0).astype(jnp.int32)

  # Tile t belongs to the first expert whose groups end past it; E (no such expert) is unused.
  tile_t = jnp.arange(m_pad // block_m, dtype=jnp.int32)
  # All comparisons at once (E per tile): the default binary search is an XLA while loop of
  # log2(E) steps, a few launches each, in every MoE layer of every decode step.
  expert_t = jnp.searchsorted(tile_end_e, tile_t, side='right',
                              method='compare_all').astype(jnp.int32)
  tile_expert_t = jnp.where(expert_t < n_experts, expert_t, -1)
  e_m = jnp.minimum(jnp.repeat(expert_t, block_m), n_experts - 1)
  j_m = jnp.arange(m_pad, dtype=jnp.int32) - row_start_e[e_m]
  used_m = (jnp.repeat(expert_t, block_m) < n_experts) & (j_m < counts_e[e_m])
  assign_m = order_a[jnp.clip(start_e[e_m] + j_m, 0, n * k - 1)]
  assign_m = jnp.where(used_m, assign_m, 0).astype(jnp.int32)
  group_tiles_e1 = jnp.concatenate([jnp.zeros(1, jnp.int32), tile_end_e])
  return GroupLayout(row_a, valid_a, assign_m, used_m, tile_expert_t, group_tiles_e1)


# ---- references ---------------------------------------------------------------------------------


def grouped_matmul_fp8_reference(x_md, w_edf, tile_expert_t, transpose_rhs: bool = False):
  """Plain jnp numerics of the fp8 gmm: float32 quantize-dequantize, then the reference GEMM."""
  if transpose_rhs:
    w_edf = jnp.swapaxes(qdq_rowwise(w_edf, 2), 1, 2)
  else:
    w_edf = qdq_rowwise(w_edf, 1)
  y = grouped_matmul_reference(qdq_rowwise(x_md, 1), w_edf, tile_expert_t)
  return y.astype(x_md.dtype)


def grouped_matmul_reference(x_md, w_edf, tile_expert_t, group_tiles_e1=None):
  """Plain jnp: each row times its tile's expert weight (gathered per row), float32 accumulate.

  Rows of unused tiles (-1) are 0. Materialises [M, D, F]: test shapes only.
  """
  del group_tiles_e1
  bm = x_md.shape[0] // tile_expert_t.shape[0]
  e_m = jnp.repeat(tile_expert_t, bm)
  w_mdf = w_edf.astype(x_md.dtype)[jnp.maximum(e_m, 0)]
  y = jnp.einsum('md,mdf->mf', x_md, w_mdf, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  return jnp.where((e_m >= 0)[:, None], y, 0.0).astype(x_md.dtype)
