"""The sparse branch's key/value gradient with the adds of neighbouring queries merged first.

`sparse_kernel.dkv_from_coefficients` adds each query's `[K, d]` fp32 key/value gradient into
the entries' rows with atomics: `T x K x d` fp32 adds a layer, 69 GB at 65,536 queries x 512
slots x 512 channels, whatever the selection. Neighbouring queries pick overlapping entries
(a query chunk shares one candidate pool; recent entries are everyone's), so this version
works on tiles of `tile` consecutive queries: the tile's distinct entries (its *union*, built
once per key/value gradient, so once for all the layers of a `model.sparse_group_dkv` group)
are walked in blocks of `block_u` rows,
each block's gradient is summed on chip over the tile's queries, then added once:

    dkv[u] += sum_{i in tile} sum_h dS[i, slot_i(u), h] q[i, h] + P[i, slot_i(u), h] dO[i, h]

where `slot_i(u)` is the slot of query i that selected entry u (none: no term). The adds fall
from `T x K` rows to the unions' total size, `T x K / overlap`. The price: each query's
coefficients are read once per union block (gathered by slot) instead of once, and the union
costs a sort of each tile's `tile x K` picks. Which is faster depends on the overlap, so it is
an option (`model.sparse_dkv_tile`, 0 = off). Measured against the atomics per query on an
H100 (docs/performance.md section 49) it lost at every overlap trained selections show and
barely tied where every query picks the same recent entries, so it stays off by default.

The union (`query_tile_union`) is plain jnp; the kernel is Pallas on Triton like its neighbours.
`dkv_reference` is the plain jnp sum both versions are held to.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepseek41.ops import launch
from deepseek41.ops.gpu.row_adds import add_rows, compiler_params, padded_rows


def dkv_reference(n, idx_btk, valid_btk, parts):
  """kv's fp32 gradient [B, n, d] from `parts` = [(dS * scale, P [B, T, K', H], q, dO
  [B, T, H, d]), ...]: the same sum as the kernels, as one scatter-add."""
  k = idx_btk.shape[-1]
  total = 0.0
  for ds_btkh, p_btkh, q_bthd, do_bthd in parts:
    f32 = jnp.float32
    total = total + (jnp.einsum('btkh,bthd->btkd', ds_btkh[:, :, :k].astype(f32),
                                q_bthd.astype(f32)) +
                     jnp.einsum('btkh,bthd->btkd', p_btkh[:, :, :k].astype(f32),
                                do_bthd.astype(f32)))
  total = jnp.where(valid_btk[..., None], total, 0.0)
  b, _, _, d = total.shape
  rows = jnp.where(valid_btk, idx_btk, n).reshape(b, -1)
  out = jnp.zeros((b, n + 1, d), jnp.float32)
  out = jax.vmap(lambda o, r, v: o.at[r].add(v))(out, rows, total.reshape(b, -1, d))
  return out[:, :n]


def query_tile_union(idx_btk, valid_btk, n: int, tile: int):
  """Each tile of `tile` consecutive queries' distinct selected entries, and who picked them.

  Returns (rows_bgu, slots_bgui, count_bg): per tile g, its distinct valid entries ascending
  then the dummy row n (U = tile x K places, the most it can need); for each place u and query i
  of the tile, the slot of i that holds rows_bgu[u], or -1; the number of distinct entries.
  T is padded with queries that pick nothing up to whole tiles.
  """
  b, t, k = idx_btk.shape
  g = -(-t // tile)
  picks = jnp.where(valid_btk, idx_btk, n).astype(jnp.int32)
  picks_bgp = jnp.pad(picks, ((0, 0), (0, g * tile - t), (0, 0)),
                      constant_values=n).reshape(b, g, tile * k)
  place_bgp = jnp.broadcast_to(jnp.arange(tile * k, dtype=jnp.int32), picks_bgp.shape)
  sorted_bgp, origin_bgp = jax.lax.sort((picks_bgp, place_bgp), dimension=2, num_keys=1)
  real = sorted_bgp < n
  first = jnp.concatenate([jnp.ones_like(real[..., :1]),
                           sorted_bgp[..., 1:] != sorted_bgp[..., :-1]], axis=-1) & real
  u_bgp = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1
  u_bgp = jnp.where(real, u_bgp, tile * k)  # the dummy picks fall off the end (mode='drop')
  bi = jnp.arange(b)[:, None, None]
  gi = jnp.arange(g)[None, :, None]
  rows_bgu = jnp.full((b, g, tile * k), n, jnp.int32).at[bi, gi, u_bgp].set(
      sorted_bgp, mode='drop')
  # A query picks an entry at most once, so each (place, query) is written at most once.
  slots_bgui = jnp.full((b, g, tile * k, tile), -1, jnp.int32).at[
      bi, gi, u_bgp, origin_bgp // k].set(origin_bgp % k, mode='drop')
  return rows_bgu, slots_bgui, jnp.sum(first, axis=-1, dtype=jnp.int32)


def _merged_dkv_kernel(nblk_ref, rows_ref, slots_ref, *refs, n, bu, tile, uses, dkv_chunk,
                       interpret):
  part_refs, dkv_ref = refs[:4 * uses], refs[-1]
  d = dkv_ref.shape[-1]
  h = part_refs[0].shape[-1]

  def block(j, carry):
    places = pl.ds(j * bu, bu)
    rows_u = rows_ref[places]
    for c in range(0, d, dkv_chunk):
      cols = pl.ds(c, dkv_chunk)
      acc_uc = jnp.zeros((bu, dkv_chunk), jnp.float32)
      for i in range(tile):
        slot_u = slots_ref[places, i]
        picked_u = slot_u >= 0
        slot_u = jnp.where(picked_u, slot_u, 0)
        for ds_ref, p_ref, q_ref, do_ref in zip(*[iter(part_refs)] * 4):
          # Unwritten slots hold anything (NaN included): select, never multiply, them away.
          ds_uh = jnp.where(picked_u[:, None], ds_ref[i, slot_u, pl.ds(0, h)], 0)
          p_uh = jnp.where(picked_u[:, None], p_ref[i, slot_u, pl.ds(0, h)], 0)
          acc_uc += jax.lax.dot_general(ds_uh.astype(q_ref.dtype), q_ref[i, :, cols],
                                        (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
          acc_uc += jax.lax.dot_general(p_uh.astype(do_ref.dtype), do_ref[i, :, cols],
                                        (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
      add_rows(dkv_ref, rows_u, c, acc_uc, n=n, interpret=interpret)
    return carry

  jax.lax.fori_loop(0, nblk_ref[0], block, 0)


def merged_dkv(kv_bnd, idx_btk, valid_btk, parts, *, tile: int, block_u: int, num_warps: int,
               dkv_chunk: int, interpret: bool):
  """kv's gradient (kv's dtype), as `sparse_kernel.dkv_from_coefficients`, from the same
  `parts`, with each tile of `tile` queries' adds merged (module docstring)."""
  if tile < 1 or tile & (tile - 1):
    raise ValueError(f'the merged key/value gradient takes a power-of-two query tile, got {tile}')
  b, n, d = kv_bnd.shape
  t, k = idx_btk.shape[1:]
  h = parts[0][2].shape[2]
  k_pad = parts[0][0].shape[2]  # a power of two: so is the union's tile x k_pad places
  pad_slots = ((0, 0), (0, 0), (0, k_pad - k))
  rows_bgu, slots_bgui, count_bg = query_tile_union(
      jnp.pad(idx_btk, pad_slots), jnp.pad(valid_btk, pad_slots), n, tile)
  g, u = rows_bgu.shape[1:]
  bu = min(block_u, u)
  nblk_bg1 = (-(-count_bg // bu))[..., None]
  t_pad = g * tile

  def pad_queries(x):
    return jnp.pad(x, ((0, 0), (0, t_pad - t)) + ((0, 0),) * (x.ndim - 2))
  ins = [pad_queries(x) for part in parts for x in part]
  rows = padded_rows(n)
  per_tile = lambda *shape: pl.BlockSpec((None, None) + shape,  # noqa: E731
                                         lambda gi, bi: (bi, gi) + (0,) * len(shape))
  per_tile_queries = lambda *shape: pl.BlockSpec((None, tile) + shape,  # noqa: E731
                                                 lambda gi, bi: (bi, gi) + (0,) * len(shape))
  dkv_spec = pl.BlockSpec((None, rows, d), lambda gi, bi: (bi, 0, 0))
  dkv_bmd = launch.pallas_call(
      functools.partial(_merged_dkv_kernel, n=n, bu=bu, tile=tile, uses=len(parts),
                        dkv_chunk=min(dkv_chunk, d), interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((b, rows, d), jnp.float32),
      grid=(g, b),
      in_specs=[per_tile(1), per_tile(u), per_tile(u, tile)] +
      [per_tile_queries(k_pad, h), per_tile_queries(k_pad, h), per_tile_queries(h, d),
       per_tile_queries(h, d)] * len(parts) + [dkv_spec],
      out_specs=dkv_spec,
      input_output_aliases={3 + len(ins): 0},
      compiler_params=None if interpret else compiler_params(num_warps, 1),
      interpret=interpret,
      name='csa2_sparse_dkv_merged',
  )(nblk_bg1, rows_bgu, slots_bgui, *ins, jnp.zeros((b, rows, d), jnp.float32))
  return dkv_bmd[:, :n].astype(kv_bnd.dtype)
