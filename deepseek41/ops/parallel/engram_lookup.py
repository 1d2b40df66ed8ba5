"""Engram table rows for each device's own tokens (docs/design.md "Parallelism").

The tables are the largest tensors of the model, so their rows are split over the mesh axes of
the `engram_rows` rule (fsdp and expert: the table group). Left to GSPMD, `jnp.take` of a
row-split table with batch-split ids gathers the ids of the whole group onto every device and
builds the looked-up rows for the group's whole batch (a [group batch, T, J, H] buffer per
device: 24 GiB at the released plan's batch 256). Here each device instead sends the row ids
it needs to the shard that owns them and gets the rows back:

  ids    = unique(row ids of my tokens)          repeats (frequent n-grams, padding) sent once
  chunk  = ids owned by shard s, rows local to s (sorted ids: each owner's ids are contiguous)
  recv   = all_to_all(chunks)                    [G (source), C] row ids into my table slice
  rows   = all_to_all(table_slice[recv])         [G (owner), C, H] back in the order sent
  out    = rows[owner(id), rank(id)] for each lookup

Each chunk travels padded to C = min(L, max(ceil(capacity * L / G), MIN_CHUNK)) ids, L the
device's lookups: the buffers are capacity x the device's own rows, not G x. Hashed distinct
ids spread evenly over the owners, so C holds them with a wide margin; ids past it are
dropped (their rows read as zeros) and counted (`engram_dropped` in the step metrics). With
capacity <= 0 every chunk is L ids: exact under any skew, G x the bytes.

The gradient needs no rule of its own: all_to_all transposes to the trip back, and the table
slice's gradient is the scatter-add of the rows that reached it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepseek41.ops.parallel.per_device import dividing_axes, token_split

# config.DEFAULT_RULES' `engram_rows`; a table split another way is resharded to this by GSPMD.
TABLE_AXES = ('fsdp', 'expert')
# Small exchanges are sent whole: at a few hundred ids per chunk, counts vary too much for a
# capacity and the bytes do not matter.
MIN_CHUNK = 256


def lookup_reference(table_rh, row_ids_btj):
  """rows [B, T, J, H]: the plain gather."""
  return jnp.take(table_rh, row_ids_btj, axis=0)


def lookup_rows(table_rh, row_ids_btj, *, capacity: float):
  """(rows [B, T, J, H] in the table's dtype, dropped lookups int32 []) on the mesh in context."""
  mesh = jax.sharding.get_abstract_mesh()
  group = () if mesh.empty else dividing_axes(mesh, TABLE_AXES, table_rh.shape[0])
  if not group:  # the table is whole on every device: the gather is local
    return lookup_reference(table_rh, row_ids_btj), jnp.zeros((), jnp.int32)
  b, t, _ = row_ids_btj.shape
  token_axes, ctx = token_split(mesh, b, t)
  split = token_axes + ((ctx,) if ctx else ())
  tok = P(token_axes or None, ctx)

  def local(table_rh, ids_btj):
    rows, dropped = exchange_lookup(table_rh, ids_btj, group, capacity)
    return rows, jax.lax.psum(dropped, split) if split else dropped

  return jax.shard_map(local, mesh=mesh, in_specs=(P(group, None), tok), out_specs=(tok, P()),
                       check_vma=False)(table_rh, row_ids_btj)


def chunk_ids(lookups: int, shards: int, capacity: float) -> int:
  """Ids per (source, owner) chunk of the exchange."""
  if capacity <= 0:
    return lookups
  return min(lookups, max(math.ceil(capacity * lookups / shards), MIN_CHUNK))


def exchange_lookup(table_rh, ids_btj, axes, capacity: float):
  """Inside shard_map: this device's lookups from the table split over `axes` (rows in order)."""
  shards = math.prod(jax.lax.axis_size(a) for a in axes)
  local_rows, h = table_rh.shape
  lookups = ids_btj.size
  width = chunk_ids(lookups, shards, capacity)
  past_end = shards * local_rows  # sorts last, owned by no shard

  ids_l = ids_btj.reshape(-1)
  uniq_u, inverse_l = jnp.unique(ids_l, size=lookups, fill_value=past_end, return_inverse=True)
  inverse_l = inverse_l.reshape(-1)
  # Sorted ids: shard s owns the contiguous run [start_s, start_s + count_s).
  bounds = jnp.arange(shards + 1, dtype=uniq_u.dtype) * local_rows
  edge = jnp.searchsorted(uniq_u, bounds, side='left').astype(jnp.int32)
  start_s, count_s = edge[:-1], edge[1:] - edge[:-1]
  c = jnp.arange(width, dtype=jnp.int32)
  sent_sc = c[None, :] < count_s[:, None]
  at_sc = jnp.clip(start_s[:, None] + c[None, :], 0, lookups - 1)
  local_sc = uniq_u[at_sc] - bounds[:-1, None]
  request_sc = jnp.where(sent_sc, local_sc, -1).astype(jnp.int32)

  asked_sc = jax.lax.all_to_all(request_sc, axes, 0, 0, tiled=True)     # [source, C]
  found_sch = jnp.where((asked_sc >= 0)[..., None],
                        table_rh[jnp.clip(asked_sc, 0, local_rows - 1)], 0)
  rows_sch = jax.lax.all_to_all(found_sch, axes, 0, 0, tiled=True)      # [owner, C, H]

  owner_l = jnp.clip(ids_l // local_rows, 0, shards - 1).astype(jnp.int32)
  rank_l = inverse_l.astype(jnp.int32) - start_s[owner_l]
  kept_l = rank_l < width
  at_l = owner_l * width + jnp.clip(rank_l, 0, width - 1)
  rows_lh = jnp.where(kept_l[:, None], rows_sch.reshape(shards * width, h)[at_l], 0)
  dropped = jnp.sum(~kept_l).astype(jnp.int32)
  return rows_lh.reshape(*ids_btj.shape, h), dropped
