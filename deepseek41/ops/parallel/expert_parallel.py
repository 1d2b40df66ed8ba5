"""Routed experts across devices (docs/design.md "Parallelism").

`routed_experts` runs the MoE's routed experts inside a `shard_map` over the mesh in context:
each device takes its own tokens (the batch split over `data`, `fsdp` and `expert`), the experts
are split over `expert` (each shard holds E/S contiguous experts), the expert FFN width over
`tensor` (each tensor shard computes a slice of F; the outputs are summed with a psum). Inside,
everything is local, so the Pallas grouped-GEMM kernels, which GSPMD cannot partition, see only
their own rows and their own experts.

Over S > 1 expert shards the tokens travel to the shards that hold their experts and back:

  * dropless backends (grouped, ragged_dot, reference), `allgather` exchange (the default off
    the TPU): every shard's N tokens, with their expert ids and router weights, are gathered on
    every expert shard (all_gather), each shard runs its own experts on the assignments to them
    among those S*N tokens, combines them with the router weights into one partial output per
    token (float32, or the compute dtype: model.expert_partials), and psum_scatter sums the S
    partials of each token on its own shard. A token crosses to a peer once, whatever its K
    (the other exchanges send each of its K assignments, padded or ragged). By default nothing
    is dropped: a shard may compute all S*N*K assignments of its gathered tokens;
    `expert_buffer_factor` bounds that to buffer_factor * N*K (its expert-sorted rows, so the
    grouped backend's layout, shrink with it) and drops the rest, counted.
    The backward is the same two collectives transposed. Per device it sends (S-1) N rows each
    way, against about N K (S-1)/S ragged: the better exchange while S < K.
  * dropless backends, `ragged` and `padded` exchanges: each device sorts its N*K assignments by
    expert, so each destination's rows are contiguous, and sends them with a ragged all-to-all
    (`jax.lax.ragged_all_to_all`, or a dense all_to_all that carries each chunk padded to the
    largest possible one: model.expert_exchange says which runs where). The receiver runs
    the local backend on what arrived (one assignment per row, weight 1), the outputs go back
    along the same route, and the sender combines them with the router weights in float32.
    The receive buffer holds `expert_buffer_factor * N * K` rows (default S: every assignment
    of every sender, so nothing can overflow); rows past it are dropped and counted.
  * capacity_einsum (GShard): each sequence's [E, C, D] capacity buffer is filled where its tokens
    are, and a dense all_to_all over the expert dimension takes each shard its experts' slots.
    The drops are exactly those of one device.

With one expert shard there is nothing to exchange and the local backend takes the assignments
as they are. Without a mesh in context (the model called outside the trainer) the same local
function runs on the whole input.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepseek41.ops import expert_gemm
from deepseek41.ops.contracts import default_expert_exchange
from deepseek41.ops.grouped_gemm import sort_by_expert
from deepseek41.ops.parallel.per_device import axis_size as _size, token_split

# The mesh axes of the expert layout (sharding.py builds the mesh with these names).
EXPERT_AXIS = 'expert'
WIDTH_AXIS = 'tensor'
EXCHANGES = ('auto', 'allgather', 'ragged', 'padded')
PARTIALS = ('float32', 'compute')


def routed_experts(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf,
                   w_down_efd, *, swiglu_limit, backend: str, capacity_factor: float,
                   fp8: str = 'off', buffer_factor: float = 0.0, exchange: str = 'auto',
                   grouped_tiles=None, partials: str = 'float32', gather_small: bool = False):
  """The routed experts' output [B, T, D] and the count of dropped assignments (int32 []).

  partials (model.expert_partials): the dtype of the allgather exchange's reduce-scattered
  partial outputs, 'float32' or 'compute' (x's dtype).
  gather_small (model.moe_gather_small_calls): a device holding every expert computes a call of
  at most E (token, expert) assignments with a dropless backend by gathering each assignment's
  expert weights (expert_gemm's 'gathered'): the same products without the expert-sorted layout.
  """
  if partials not in PARTIALS:
    raise ValueError(f'unknown expert partials {partials!r}; expected one of {PARTIALS}')
  mesh = jax.sharding.get_abstract_mesh()
  kw = dict(swiglu_limit=swiglu_limit, backend=backend, capacity_factor=capacity_factor, fp8=fp8,
            buffer_factor=buffer_factor, exchange=exchange, grouped_tiles=grouped_tiles,
            partials=partials, gather_small=gather_small)
  if mesh.empty:
    return _local(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf, w_down_efd,
                  experts_axis=None, width_axis=None, **kw)

  b, t, _ = x_btd.shape
  n_experts, _, f = w_gate_edf.shape
  token_axes, seq_axis = token_split(mesh, b, t)
  experts_axis = EXPERT_AXIS if _size(mesh, EXPERT_AXIS) > 1 else None
  if experts_axis and n_experts % mesh.shape[EXPERT_AXIS]:
    raise ValueError(f'{n_experts} experts do not split over {mesh.shape[EXPERT_AXIS]} expert '
                     'shards (model.n_routed_experts must be a multiple of mesh.expert)')
  width_axis = WIDTH_AXIS if _size(mesh, WIDTH_AXIS) > 1 and f % mesh.shape[WIDTH_AXIS] == 0 \
      else None

  tok = P(token_axes or None, seq_axis)
  w_in = P(experts_axis, None, width_axis)
  w_out = P(experts_axis, width_axis, None)

  split = token_axes + ((seq_axis,) if seq_axis else ())

  def local(x, idx, wt, valid, wg, wu, wd):
    y, dropped = _local(x, idx, wt, valid, wg, wu, wd, experts_axis=experts_axis,
                        width_axis=width_axis, **kw)
    # Devices that share tokens (tensor shards) computed the same count: sum over the splits.
    return y, jax.lax.psum(dropped, split) if split else dropped

  # check_vma=False: pallas_call (the grouped kernels) has no replication rule; the weights'
  # gradients are then summed over the token axes by shard_map's transpose, as data parallelism
  # needs.
  return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, tok, w_in, w_in, w_out),
                       out_specs=(tok, P()), check_vma=False)(
      x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf, w_down_efd)


def _local(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf, w_down_efd, *,
           experts_axis, width_axis, swiglu_limit, backend, capacity_factor, fp8, buffer_factor,
           exchange, grouped_tiles, partials, gather_small):
  """One device's tokens against its experts (all of them when experts_axis is None)."""
  dtype = x_btd.dtype
  w_gate_edf, w_up_edf, w_down_efd = (w.astype(dtype) for w in (w_gate_edf, w_up_edf, w_down_efd))
  shards = 1 if experts_axis is None else jax.lax.axis_size(experts_axis)
  if shards == 1:  # the exchange would be the identity
    assignments = expert_idx_btk.size
    if (gather_small and fp8 == 'off' and backend in expert_gemm.DROPLESS_BACKENDS
        and assignments <= w_gate_edf.shape[0]):
      backend = 'gathered'
    y_btd, dropped = expert_gemm.expert_ffn_batched(
        x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf, w_down_efd,
        swiglu_limit=swiglu_limit, backend=backend, capacity_factor=capacity_factor, fp8=fp8,
        grouped_tiles=grouped_tiles)
    return _sum_width(y_btd, width_axis, dtype), dropped
  if backend == 'capacity_einsum':
    return _capacity_exchange(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf,
                              w_down_efd, experts_axis, width_axis, swiglu_limit,
                              capacity_factor, fp8)
  exchange = exchange_kind(exchange)
  if exchange == 'allgather':
    return _allgather_exchange(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf,
                               w_up_edf, w_down_efd, experts_axis, width_axis, swiglu_limit,
                               backend, fp8, grouped_tiles, partials, buffer_factor)
  return _dropless_exchange(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf,
                            w_down_efd, experts_axis, width_axis, swiglu_limit, backend, fp8,
                            buffer_factor, exchange, grouped_tiles)


def _sum_width(y, width_axis, dtype):
  """Partial outputs of F slices summed over the tensor shards (float32), in the compute dtype."""
  if width_axis is None:
    return y.astype(dtype)
  return jax.lax.psum(y.astype(jnp.float32), width_axis).astype(dtype)


# ---- capacity_einsum over expert shards (dense all-to-all) ------------------------------------


def _capacity_exchange(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf,
                       w_down_efd, axis, width_axis, limit, capacity_factor, fp8):
  b, t, d = x_btd.shape
  k = expert_idx_btk.shape[-1]
  shards = jax.lax.axis_size(axis)
  n_experts = w_gate_edf.shape[0] * shards
  cap = expert_gemm.expert_capacity(t, k, n_experts, capacity_factor)

  def dispatch(x_nd, idx_nk, valid_n):
    route = expert_gemm.capacity_route(idx_nk, valid_n, n_experts, cap)
    return expert_gemm.capacity_dispatch(x_nd, route, k).reshape(n_experts, cap, d), route
  buf_becd, route = jax.vmap(dispatch)(x_btd, expert_idx_btk, valid_bt.astype(bool))

  # [B, S*El, C, D] -> [S, B, El, C, D], exchanged over S: this shard's experts, each source's
  # slots. (Tiled all_to_all over the leading axis: the untiled form's transpose mishandles
  # split != concat axes in jax 0.11.2.)
  local_e = n_experts // shards
  buf = jnp.moveaxis(buf_becd.reshape(b, shards, local_e, cap, d), 1, 0)
  recv = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)
  rows = jnp.moveaxis(recv, 2, 0).reshape(local_e, shards * b * cap, d)
  out = expert_gemm.experts_on_buffer(rows, w_gate_edf, w_up_edf, w_down_efd, limit, fp8)
  out = jnp.moveaxis(out.reshape(local_e, shards, b, cap, d), 0, 2)   # [S (source), B, El, C, D]
  back = jnp.moveaxis(jax.lax.all_to_all(out, axis, 0, 0, tiled=True), 0, 1)
  back = back.reshape(b, n_experts * cap, d)

  def combine(out_sd, route_b, weight_nk):
    return expert_gemm.capacity_combine(out_sd, route_b, weight_nk, jnp.float32)
  y_btd = jax.vmap(combine)(back, route, weight_btk)
  return _sum_width(y_btd, width_axis, x_btd.dtype), jnp.sum(route.dropped)


# ---- dropless over expert shards: tokens gathered, partial outputs reduce-scattered -------------


def _allgather_exchange(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf,
                        w_down_efd, axis, width_axis, limit, backend, fp8, grouped_tiles,
                        partials, buffer_factor):
  b, t, d = x_btd.shape
  k = expert_idx_btk.shape[-1]
  n = b * t
  local_e = w_gate_edf.shape[0]
  shards = jax.lax.axis_size(axis)
  bound = receive_rows(n * k, shards, buffer_factor)  # assignments this shard may compute
  gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=0, tiled=True)
  # [S*N, ...]: every expert shard's tokens, source shards in order.
  x_md = gather(x_btd.reshape(n, d))
  weight_mk = gather(weight_btk.reshape(n, k))
  # Padding tokens travel as expert -1, which no shard holds.
  idx_nk = jnp.where(valid_bt.reshape(n, 1), expert_idx_btk.reshape(n, k).astype(jnp.int32), -1)
  local_idx_mk = gather(idx_nk) - jax.lax.axis_index(axis) * local_e
  mine_mk = (local_idx_mk >= 0) & (local_idx_mk < local_e)
  local_idx_mk = jnp.clip(local_idx_mk, 0, local_e - 1)
  mine_mk, dropped = first_assignments(local_idx_mk, mine_mk, local_e, bound)
  partial_md, _ = expert_gemm.expert_ffn(
      x_md, local_idx_mk, weight_mk, mine_mk, w_gate_edf, w_up_edf, w_down_efd,
      swiglu_limit=limit, backend=backend, fp8=fp8, grouped_tiles=grouped_tiles,
      out_dtype=jnp.float32 if partials == 'float32' else x_btd.dtype, max_valid=bound)
  y_nd = jax.lax.psum_scatter(partial_md, axis, scatter_dimension=0, tiled=True)
  return _sum_width(y_nd.reshape(b, t, d), width_axis, x_btd.dtype), dropped


# ---- dropless over expert shards (ragged all-to-all) -------------------------------------------


def _dropless_exchange(x_btd, expert_idx_btk, weight_btk, valid_bt, w_gate_edf, w_up_edf,
                       w_down_efd, axis, width_axis, limit, backend, fp8, buffer_factor,
                       exchange, grouped_tiles=None):
  """Assignments to their experts' shards and back; exchange: 'ragged' or 'padded'."""
  b, t, d = x_btd.shape
  k = expert_idx_btk.shape[-1]
  n, a = b * t, b * t * k
  shards = jax.lax.axis_size(axis)
  local_e = w_gate_edf.shape[0]
  n_experts = local_e * shards
  me = jax.lax.axis_index(axis)
  rows = receive_rows(a, shards, buffer_factor)

  valid_n = valid_bt.reshape(n).astype(bool)
  sorted_rows = expert_gemm.sort_rows(expert_idx_btk.reshape(n, k).astype(jnp.int32), valid_n,
                                      n_experts)
  # Rows in expert order: each destination shard's rows are one contiguous chunk.
  x_ad = expert_gemm.to_sorted_rows(x_btd.reshape(n, d), sorted_rows, k)

  plan = exchange_plan(sorted_rows.counts_e, shards, local_e, rows, axis, me)
  move = _ragged_exchange if exchange == 'ragged' else padded_exchange
  x_rd = move(x_ad, rows, plan.send_offset_s, plan.send_s, plan.dest_offset_s, plan.recv_s, axis)

  y_rd, _ = expert_gemm.expert_ffn(
      x_rd, plan.expert_r[:, None], jnp.ones((rows, 1), jnp.float32), plan.valid_r, w_gate_edf,
      w_up_edf, w_down_efd, swiglu_limit=limit, backend=backend, fp8=fp8,
      grouped_tiles=grouped_tiles)

  # Back along the same route: each source's rows from where they sit here to where they left.
  y_ad = move(y_rd, a, plan.recv_offset_s, plan.recv_s, plan.source_offset_s, plan.send_s, axis)
  y_nkd = expert_gemm.from_sorted_rows(y_ad, sorted_rows, k)
  weight_nk = jnp.where(valid_n[:, None], weight_btk.reshape(n, k).astype(jnp.float32), 0.0)
  y_nd = expert_gemm.combine(y_nkd, weight_nk, jnp.float32)
  return _sum_width(y_nd.reshape(b, t, d), width_axis, x_btd.dtype), plan.dropped


def first_assignments(local_idx_mk, mine_mk, local_e: int, bound: int):
  """(kept_mk, dropped): the first `bound` of a shard's assignments (mine_mk) in (local expert,
  token) order, and the int32 count of the others. Under overload the shard's highest-numbered
  experts lose theirs, as in the ragged exchange's buffer."""
  if bound >= mine_mk.size:
    return mine_mk, jnp.zeros((), jnp.int32)
  _, rank_a, _ = sort_by_expert(local_idx_mk, mine_mk, local_e)
  kept_mk = mine_mk & (rank_a.reshape(mine_mk.shape) < bound)
  return kept_mk, jnp.sum(mine_mk & ~kept_mk).astype(jnp.int32)


def receive_rows(assignments: int, shards: int, buffer_factor: float) -> int:
  """Rows of the receive buffer: buffer_factor x the local assignments, capped at (and by
  default equal to) every assignment of every shard, which can never overflow."""
  worst = assignments * shards
  if buffer_factor <= 0:
    return worst
  return max(1, min(worst, math.ceil(buffer_factor * assignments)))


class ExchangePlan(NamedTuple):
  """Sizes and offsets of one shard's ragged exchange (int32; s indexes shards, r buffer rows)."""
  send_s: jax.Array           # rows sent to shard s (what fits in its buffer)
  send_offset_s: jax.Array    # where they start in this shard's sorted rows
  dest_offset_s: jax.Array    # where they land in shard s's buffer
  recv_s: jax.Array           # rows received from shard s
  recv_offset_s: jax.Array    # where they land here
  source_offset_s: jax.Array  # where they started in shard s's sorted rows
  expert_r: jax.Array         # local expert of buffer row r (0 where unused)
  valid_r: jax.Array          # bool: buffer row r holds an assignment
  dropped: jax.Array          # this shard's assignments that did not fit


def exchange_plan(counts_e, shards: int, local_e: int, rows: int, axis, me):
  """Who sends how many rows where, from every shard's expert counts (one small all_gather).

  sent[j, r]: rows shard j sends shard r (its assignments to r's experts); they land in r's
  buffer after those of shards < j; the rows that do not fit in `rows` are dropped at the
  source, from the end of the chunk (the highest expert ids of that shard).
  """
  counts_se = jax.lax.all_gather(counts_e, axis)                     # [S (source), E]
  cnt_sre = counts_se.reshape(shards, shards, local_e)               # [source, dest, local e]
  sent_sr = jnp.sum(cnt_sre, axis=-1)
  land_sr = jnp.cumsum(sent_sr, axis=0) - sent_sr                    # offset in dest's buffer
  kept_sr = jnp.clip(rows - land_sr, 0, sent_sr)
  leave_sr = jnp.cumsum(sent_sr, axis=1) - sent_sr                   # offset in source's rows
  # What arrives here: each source's chunk, in source order, sorted by local expert inside.
  cnt_se = cnt_sre[:, me, :]
  start_se = land_sr[:, me][:, None] + jnp.cumsum(cnt_se, axis=1) - cnt_se
  r = jnp.arange(rows, dtype=jnp.int32)
  g_r = jnp.clip(jnp.searchsorted(start_se.reshape(-1), r, side='right') - 1, 0,
                 shards * local_e - 1)
  src_r = g_r // local_e
  valid_r = r < land_sr[src_r, me] + kept_sr[src_r, me]
  return ExchangePlan(
      send_s=kept_sr[me], send_offset_s=leave_sr[me], dest_offset_s=land_sr[me],
      recv_s=kept_sr[:, me], recv_offset_s=land_sr[:, me], source_offset_s=leave_sr[:, me],
      expert_r=jnp.where(valid_r, g_r % local_e, 0).astype(jnp.int32), valid_r=valid_r,
      dropped=jnp.sum(sent_sr[me] - kept_sr[me]).astype(jnp.int32))


def exchange_kind(exchange: str) -> str:
  """The exchange that `exchange` names here (auto: model.expert_exchange says why)."""
  if exchange not in EXCHANGES:
    raise ValueError(f'unknown expert exchange {exchange!r}; expected one of {EXCHANGES}')
  if exchange == 'auto':
    return default_expert_exchange(jax.default_backend())
  return exchange


def _ragged_exchange(x_ad, out_rows, send_offset_s, send_s, dest_offset_s, recv_s, axis):
  out = jnp.zeros((out_rows, x_ad.shape[1]), x_ad.dtype)
  return jax.lax.ragged_all_to_all(x_ad, out, send_offset_s, send_s, dest_offset_s, recv_s,
                                   axis_name=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 6))
def padded_exchange(x_ad, out_rows, send_offset_s, send_s, dest_offset_s, recv_s, axis):
  """ragged_all_to_all's result through a dense all_to_all (the CPU's and GPU's exchange).

  Chunk s (send_s[s] rows from send_offset_s[s]) lands at dest_offset_s[s] in shard s's buffer
  of out_rows rows, zeros elsewhere. Each chunk travels padded to min(rows, out_rows) rows.
  The map is linear and its transpose is the trip back (each chunk from where it landed to where
  it left), so the backward is this exchange again: gathers both ways, never the scatter-add
  that differentiating the gathers would give (slow on GPU).
  """
  return _padded_move(x_ad, out_rows, send_offset_s, send_s, dest_offset_s, recv_s, axis)


def _padded_exchange_fwd(x_ad, out_rows, send_offset_s, send_s, dest_offset_s, recv_s, axis):
  y = _padded_move(x_ad, out_rows, send_offset_s, send_s, dest_offset_s, recv_s, axis)
  return y, (x_ad.shape[0], send_offset_s, send_s, dest_offset_s, recv_s)


def _padded_exchange_bwd(out_rows, axis, res, dy_rd):
  rows, send_offset_s, send_s, dest_offset_s, recv_s = res
  landed_at_s = jax.lax.all_to_all(dest_offset_s, axis, 0, 0, tiled=True)  # per source, here
  left_from_s = jax.lax.all_to_all(send_offset_s, axis, 0, 0, tiled=True)  # in the source's rows
  dx_ad = _padded_move(dy_rd, rows, landed_at_s, recv_s, left_from_s, send_s, axis)
  return dx_ad, None, None, None, None


padded_exchange.defvjp(_padded_exchange_fwd, _padded_exchange_bwd)


def _padded_move(x_ad, out_rows, send_offset_s, send_s, dest_offset_s, recv_s, axis):
  rows, d = x_ad.shape
  shards = send_s.shape[0]
  width = min(rows, out_rows)
  c = jnp.arange(width, dtype=jnp.int32)
  ok_sc = c[None, :] < send_s[:, None]
  src_sc = jnp.clip(send_offset_s[:, None] + c[None, :], 0, rows - 1)
  blocks = jnp.where(ok_sc[..., None], x_ad[src_sc], 0)                  # [S (dest), W, D]
  got_cd = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=True).reshape(shards * width, d)
  # Each source's rows land contiguously, sources in order: out row r reads row r - land[s] of
  # the last source s landing at or before r, if that source sent that many (a gather, where
  # writing the chunks would be a scatter).
  land_s = jax.lax.all_to_all(dest_offset_s, axis, 0, 0, tiled=True)   # per source
  r = jnp.arange(out_rows, dtype=jnp.int32)
  src_r = jnp.clip(jnp.searchsorted(land_s, r, side='right') - 1, 0, shards - 1)
  c_r = r - land_s[src_r]
  ok_r = (c_r >= 0) & (c_r < recv_s[src_r])
  at_r = src_r * width + jnp.clip(c_r, 0, width - 1)
  return jnp.where(ok_r[:, None], got_cd[at_r], 0).astype(x_ad.dtype)
