"""Fused sparse attention over selected latent rows: the GPU kernel of CSA2's compressed branch.

Same contract as `sparse_attention.compressed_partial` (docs/architecture.md section 3.8): query
t attends to the entries `idx_btk[t]` (valid slots only) of the shared latent `kv_bnd`, which is
the key and the value of every head, and returns the partial `(o_bthd, lse_bth)` plus, for the
indexer's distillation, the head-averaged probability of each slot (`mass_btk`).

One program per query (Pallas on the Triton backend). It walks the query's selected slots in
blocks of `block_k`: the block's rows are gathered from HBM (mostly L2: neighbouring queries
pick overlapping entries) straight into on-chip memory, and all H heads use the gathered tile
(one [H, d] x [d, block_k] product), with an online softmax. Nothing of size [T, K, d] or
[T, H, K] is written to HBM; the loop stops after the query's last valid slot.

- mass: the exact per-head normalisation is only known at the end, so every head's scores of
  every slot stay in registers through the walk and become masses once the log-sum-exp is
  known (`MASS_SCORES_PER_WARP`: 16 heads x 512 slots at one warp group); wider programs take
  a second walk over the blocks that recomputes the scores (no PV product). A query's heads can
  be split over programs (`ForwardTiles.head_group`: V4.1's 64 heads as two programs of 32),
  each with its group's share of the mass, so that the scores fit; the programs then gather
  the same rows, mostly from L2. Only where it is asked for (index sources).
- backward: one program per query recomputes P from the saved log-sum-exp, accumulates dq in
  registers and adds each block's key/value gradient (key = value: dS^T q + P^T dO) into an fp32
  [B, N, d] buffer with atomics; invalid slots are masked out of the atomics, so unused slots do
  not serialise on one row. The log-sum-exp's own cotangent enters as
  dS = P * (dP - delta + dlse), since the caller merges partials by their log-sum-exp.
- deferred backward, for calls over the same kv rows and selection (CSA2's index source and
  its Reuse layers; `later` / `sink`): each call's first kernel writes dq and its slots' dS and
  P; the first call's backward, which runs last, forms the key/value gradient of all of them in
  one kernel and adds it once per element instead of once per call (docs/performance.md 25).

Any number of heads and head width: the wrapper pads both with zeros to powers of two >= 16
(Triton's smallest matrix product), which changes no score, output or gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT
from deepseek41.ops.gpu.merged_dkv import merged_dkv
from deepseek41.ops.gpu.row_adds import add_rows, compiler_params, padded_rows
from deepseek41.ops.launch import droppable, name_outputs

# The slot mass needs every head's score of every slot against the final log-sum-exp. Up to
# this many fp32 scores per warp of a program (16 heads x 512 slots at 4 warps: 64 registers a
# thread, beside as many for the output accumulator) stay in registers through the walk, so
# the mass costs no second pass over the keys. 64 heads x 512 at 8 warps (twice this) spilled:
# 132 ms against the second walk's 29.6 (docs/performance.md section 9.1).
MASS_SCORES_PER_WARP = 16 * 512 // 4




def _masked_scores(q_hd, kv_kd, rows_k, n, scale):
  s_hk = jax.lax.dot_general(q_hd, kv_kd, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * scale
  return jnp.where((rows_k < n)[None, :], s_hk, -jnp.inf)


def _gather(kv_ref, rows_k, d):
  return kv_ref[rows_k, pl.ds(0, d)]


def _fwd_kernel(nblk_ref, q_ref, kv_ref, idx_ref, o_ref, lse_ref, *mass_ref, n, bk, scale,
                heads, num_warps):
  h, d = q_ref.shape  # this program's heads; zero heads pad all to Triton's smallest product
  k_pad = idx_ref.shape[0]
  q_hd = q_ref[...]
  nblk = nblk_ref[0]
  keep_scores = bool(mass_ref) and h * k_pad <= MASS_SCORES_PER_WARP * num_warps
  slot_block_k = jax.lax.div(jnp.arange(k_pad, dtype=jnp.int32), jnp.int32(bk))

  def block(j, carry):
    m_h, l_h, acc_hd, *s_hk_all = carry
    rows_k = idx_ref[pl.ds(j * bk, bk)]
    kv_kd = _gather(kv_ref, rows_k, d)
    s_hk = _masked_scores(q_hd, kv_kd, rows_k, n, scale)
    m_new_h = jnp.maximum(m_h, jnp.max(s_hk, axis=1))
    shift_h = jnp.where(m_new_h == -jnp.inf, 0.0, m_new_h)
    alpha_h = jnp.exp(m_h - shift_h)
    p_hk = jnp.exp(s_hk - shift_h[:, None])
    pv_hd = jax.lax.dot_general(p_hk.astype(kv_kd.dtype), kv_kd, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
    carry = (m_new_h, l_h * alpha_h + jnp.sum(p_hk, axis=1), acc_hd * alpha_h[:, None] + pv_hd)
    if keep_scores:  # registers cannot be indexed: the block's scores go in by a select
      tiled_hk = jnp.broadcast_to(s_hk[:, None, :], (h, k_pad // bk, bk)).reshape(h, k_pad)
      carry += (jnp.where((slot_block_k == j)[None, :], tiled_hk, s_hk_all[0]),)
    return carry

  init = (jnp.full((h,), -jnp.inf, jnp.float32), jnp.zeros((h,), jnp.float32),
          jnp.zeros((h, d), jnp.float32))
  if keep_scores:
    init += (jnp.full((h, k_pad), -jnp.inf, jnp.float32),)
  m_h, l_h, acc_hd, *s_hk_all = jax.lax.fori_loop(0, nblk, block, init)
  seen_h = l_h > 0
  o_ref[...] = (acc_hd / jnp.where(seen_h, l_h, 1.0)[:, None]).astype(o_ref.dtype)
  lse_h = jnp.where(seen_h, m_h + jnp.log(jnp.where(seen_h, l_h, 1.0)), -jnp.inf)
  lse_ref[...] = lse_h
  if not mass_ref:
    return

  mass_ref, = mass_ref
  lse_safe_h = jnp.where(seen_h, lse_h, 0.0)
  # (outside the loops: the interpreter lowers no program_id inside one)
  real_h = pl.program_id(2) * h + jnp.arange(h, dtype=jnp.int32) < heads

  def head_mean(s_hk):
    """This program's heads' share of the mean over all `heads`."""
    p_hk = jnp.where(real_h[:, None], jnp.exp(s_hk - lse_safe_h[:, None]), 0.0)  # padding: 0
    return jnp.sum(p_hk, axis=0) / heads

  if keep_scores:
    mass_ref[...] = head_mean(s_hk_all[0])
    return
  # Too many scores to keep on chip: a second walk recomputes them against the final lse.
  mass_ref[...] = jnp.zeros(mass_ref.shape, jnp.float32)

  def mass_block(j, carry):
    rows_k = idx_ref[pl.ds(j * bk, bk)]
    mass_ref[pl.ds(j * bk, bk)] = head_mean(
        _masked_scores(q_hd, _gather(kv_ref, rows_k, d), rows_k, n, scale))
    return carry
  jax.lax.fori_loop(0, nblk, mass_block, 0)


def _bwd_query(q_ref, o_ref, do_ref, lse_ref, dlse_ref):
  """(q_hd, dO_hd, lse_h with -inf -> 0, delta_h - dlse_h): one query's backward constants.
  o_ref None: dlse_ref holds delta itself (the merged softmax's D, `sparse_backward_fused`)."""
  q_hd, do_hd = q_ref[...], do_ref[...]
  lse_h = lse_ref[...]
  lse_safe_h = jnp.where(lse_h == -jnp.inf, 0.0, lse_h)  # such a query has no visible slot
  if o_ref is None:
    return q_hd, do_hd, lse_safe_h, dlse_ref[...]
  delta_h = jnp.sum(do_hd.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1) - \
      dlse_ref[...]
  return q_hd, do_hd, lse_safe_h, delta_h


# The backward kernels' o input: (nblk, q, kv, idx, o, ...) here, (seg, span, q, kv, o, ...) in
# the window kernel's dq program.
O_REF = 4


def with_o(kernel, given_delta: bool):
  """`kernel`, whose refs hold o at `O_REF`; with given_delta its caller passes no o (the
  merged softmax's D takes the dlse input) and the kernel gets None in its place."""
  if not given_delta:
    return kernel

  def without_o(*refs, **kw):
    return kernel(*refs[:O_REF], None, *refs[O_REF:], **kw)
  return without_o


def _bwd_block(q_hd, do_hd, lse_safe_h, delta_h, kv_kd, rows_k, n, scale, dq_hd):
  """One block of slots: (P_hk, dS_hk) fp32, P recomputed from the saved log-sum-exp, and dq
  with the block's dS kv added."""
  p_hk = jnp.exp(_masked_scores(q_hd, kv_kd, rows_k, n, scale) - lse_safe_h[:, None])
  dp_hk = jax.lax.dot_general(do_hd, kv_kd, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
  ds_hk = p_hk * (dp_hk - delta_h[:, None])
  dq_hd = dq_hd + jax.lax.dot_general(ds_hk.astype(q_hd.dtype), kv_kd, (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
  return p_hk, ds_hk, dq_hd


def _bwd_kernel(nblk_ref, q_ref, kv_ref, idx_ref, o_ref, do_ref, lse_ref, dlse_ref, _dkv_in_ref,
                dq_ref, dkv_ref, *, n, bk, scale, dkv_chunk, interpret):
  h, d = q_ref.shape
  q_hd, do_hd, lse_safe_h, delta_h = _bwd_query(q_ref, o_ref, do_ref, lse_ref, dlse_ref)
  dt = q_hd.dtype

  def block(j, dq_hd):
    rows_k = idx_ref[pl.ds(j * bk, bk)]
    kv_kd = _gather(kv_ref, rows_k, d)
    p_hk, ds_hk, dq_hd = _bwd_block(q_hd, do_hd, lse_safe_h, delta_h, kv_kd, rows_k, n, scale,
                                    dq_hd)
    # The key/value gradient dS^T q + P^T dO, `dkv_chunk` columns at a time: a [bk, d] fp32
    # tile and its layout change for the atomics would crowd the program's registers.
    for c in range(0, d, dkv_chunk):
      cols = pl.ds(c, dkv_chunk)
      dkv_kc = (jax.lax.dot_general(ds_hk.astype(dt), q_ref[:, cols], (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale +
                jax.lax.dot_general(p_hk.astype(dt), do_ref[:, cols], (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32))
      add_rows(dkv_ref, rows_k, c, dkv_kc, n=n, interpret=interpret)
    return dq_hd

  dq_hd = jax.lax.fori_loop(0, nblk_ref[0], block, jnp.zeros((h, d), jnp.float32))
  dq_ref[...] = (dq_hd * scale).astype(dq_ref.dtype)


def _bwd_dq_kernel(nblk_ref, q_ref, kv_ref, idx_ref, o_ref, do_ref, lse_ref, dlse_ref,
                   dq_ref, ds_ref, p_ref, *, n, bk, scale):
  """The deferred backward's first half: dq, and each slot's dS * scale and P ([K', h] per
  query, in q's dtype: what `_bwd_kernel` rounds them to for its key/value products)."""
  h, d = q_ref.shape
  q_hd, do_hd, lse_safe_h, delta_h = _bwd_query(q_ref, o_ref, do_ref, lse_ref, dlse_ref)

  def block(j, dq_hd):
    slots = pl.ds(j * bk, bk)
    rows_k = idx_ref[slots]
    kv_kd = _gather(kv_ref, rows_k, d)
    p_hk, ds_hk, dq_hd = _bwd_block(q_hd, do_hd, lse_safe_h, delta_h, kv_kd, rows_k, n, scale,
                                    dq_hd)
    ds_ref[slots, :] = (ds_hk * scale).astype(ds_ref.dtype).T
    p_ref[slots, :] = p_hk.astype(p_ref.dtype).T
    return dq_hd

  dq_hd = jax.lax.fori_loop(0, nblk_ref[0], block, jnp.zeros((h, d), jnp.float32))
  dq_ref[...] = (dq_hd * scale).astype(dq_ref.dtype)


def _dkv_kernel(nblk_ref, idx_ref, *refs, n, bk, uses, dkv_chunk, interpret):
  """The deferred backward's second half, for `uses` calls over the same kv rows and selection:
  each slot's row gets the sum over the calls of dS^T q + P^T dO, added once."""
  part_refs, dkv_ref = refs[:4 * uses], refs[-1]
  d = dkv_ref.shape[-1]

  def block(j, carry):
    slots = pl.ds(j * bk, bk)
    rows_k = idx_ref[slots]
    for c in range(0, d, dkv_chunk):
      cols = pl.ds(c, dkv_chunk)
      acc = None
      for ds_ref, p_ref, q_ref, do_ref in zip(*[iter(part_refs)] * 4):
        term = (jax.lax.dot_general(ds_ref[slots, :], q_ref[:, cols], (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32) +
                jax.lax.dot_general(p_ref[slots, :], do_ref[:, cols], (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32))
        acc = term if acc is None else acc + term
      add_rows(dkv_ref, rows_k, c, acc, n=n, interpret=interpret)
    return carry

  jax.lax.fori_loop(0, nblk_ref[0], block, 0)


def prepare_slots(idx_btk, valid_btk, n, block_k):
  """(idx_btk int32 with invalid -> n and K padded to whole blocks, nblk_bt1 blocks up to the
  last valid slot, bk)."""
  k = idx_btk.shape[-1]
  k_pad = max(MIN_DOT, pl.next_power_of_2(k))
  bk = min(block_k, k_pad)
  idx_btk = jnp.where(valid_btk, idx_btk, n).astype(jnp.int32)
  idx_btk = jnp.pad(idx_btk, ((0, 0), (0, 0), (0, k_pad - k)), constant_values=n)
  last_bt = jnp.max(jnp.where(valid_btk, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=-1)
  nblk_bt1 = (-(-last_bt // bk))[..., None].astype(jnp.int32)
  return idx_btk, nblk_bt1, bk


def prepare_rows(kv_bnd, idx_btk, valid_btk, block_k):
  """Pad kv with a zero dummy row n (invalid slots point there) and K to whole blocks.

  Returns (kv_bmd, idx_btk int32 with invalid -> n, nblk_bt1 blocks up to the last valid slot, bk).
  """
  n = kv_bnd.shape[1]
  kv_bmd = jnp.pad(kv_bnd, ((0, 0), (0, padded_rows(n) - n), (0, 0)))
  return (kv_bmd, *prepare_slots(idx_btk, valid_btk, n, block_k))


def per_query_specs(h, d, rows, k_pad):
  """BlockSpecs of a grid (query, batch[, head group]); `h` is the heads of one program."""
  def per_query(shape, by_head=False):
    def index(i, j, g=0):
      return (j, i) + ((g,) if by_head else (0,)) + (0,) * (len(shape) - 1)
    return pl.BlockSpec((None, None) + shape, index)
  return {
      'nblk': per_query((1,)),
      'q': per_query((h, d), by_head=True),
      'kv': pl.BlockSpec((None, rows, d), lambda i, j, g=0: (j, 0, 0)),
      'idx': per_query((k_pad,)),
      'h': per_query((h,), by_head=True),
  }


class ForwardTiles(NamedTuple):
  """The forward kernel's blocks: selected rows gathered per step, warps, pipeline depth, and
  heads per program (0: all; fewer split a query's heads over programs, which lets a one-pass
  slot mass fit, `MASS_SCORES_PER_WARP`, at the cost of gathering each row once per group)."""
  block_k: int
  num_warps: int
  num_stages: int
  head_group: int = 0


class BackwardTiles(NamedTuple):
  """The backward kernels' blocks (a plain tuple of the leading fields takes the rest from
  `default_tiles`).

  The fused backward (`_bwd_kernel`): `block_k` rows per step, `num_warps`, `head_group` heads
  per program, the key/value gradient `dkv_chunk` columns per product, `num_stages`. The
  deferred backward's first kernel (`_bwd_dq_kernel`) has its own `dq_block_k`, `dq_warps` and
  `dq_stages` (it holds no key/value tile, so it takes wider pipelined steps); its second
  (`_dkv_kernel`) takes `block_k`, `num_warps` and no pipelining. `dkv_tile` > 0 forms every
  key/value gradient that way, through `dkv_from_coefficients`, with the adds of each tile of
  that many queries merged (ops/gpu/merged_dkv.py; `block_k` union rows a step); 0 adds each
  query's own.
  """
  block_k: int
  num_warps: int
  head_group: int
  dkv_chunk: int
  num_stages: int
  dq_block_k: int
  dq_warps: int
  dq_stages: int
  dkv_tile: int


def _forward(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads, block_k, num_warps,
             num_stages, head_group, interpret):
  b, t, h, d = q_bthd.shape
  k = idx_btk.shape[-1]
  n = kv_bnd.shape[1]
  hg = min(head_group or h, h)
  if h % hg:
    raise ValueError(f'ForwardTiles.head_group {head_group} does not divide the kernel\'s '
                     f'{h} heads (padded to a power of two)')
  groups = h // hg
  kv_bmd, idx_btk, nblk_bt1, bk = prepare_rows(kv_bnd, idx_btk, valid_btk, block_k)
  rows, k_pad = kv_bmd.shape[1], idx_btk.shape[-1]
  spec = per_query_specs(hg, d, rows, k_pad)
  out_shape = [jax.ShapeDtypeStruct((b, t, h, d), kv_bnd.dtype),
               jax.ShapeDtypeStruct((b, t, h), jnp.float32)]
  out_specs = [spec['q'], spec['h']]
  if with_mass and groups == 1:
    out_shape.append(jax.ShapeDtypeStruct((b, t, k_pad), jnp.float32))
    out_specs.append(spec['idx'])
  elif with_mass:  # each head group's share, summed below
    out_shape.append(jax.ShapeDtypeStruct((b, t, groups, k_pad), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, None, k_pad), lambda i, j, g: (j, i, g, 0)))
  outs = droppable(launch.pallas_call(
      functools.partial(_fwd_kernel, n=n, bk=bk, scale=scale, heads=heads, num_warps=num_warps),
      out_shape=out_shape,
      grid=(t, b, groups),  # queries fastest: neighbours share selected rows in L2
      in_specs=[spec['nblk'], spec['q'], spec['kv'], spec['idx']],
      out_specs=out_specs,
      compiler_params=None if interpret else compiler_params(num_warps, num_stages),
      interpret=interpret,
      name='csa2_sparse_fwd',
  ))(nblk_bt1, q_bthd, kv_bmd, idx_btk)
  mass_btk = None
  if with_mass:
    mass_btk = (outs[2] if groups == 1 else jnp.sum(outs[2], axis=2))[..., :k]
  return outs[0], outs[1], mass_btk


def _backward_operands(q_bthd, kv_bnd, idx_btk, valid_btk, block_k, head_group):
  """(heads per program, padded kv, slots, blocks per query, bk, BlockSpecs) of a backward
  kernel over a grid (query, batch, head group)."""
  hg = min(head_group, q_bthd.shape[2])
  kv_bmd, idx_btk, nblk_bt1, bk = prepare_rows(kv_bnd, idx_btk, valid_btk, block_k)
  spec = per_query_specs(hg, q_bthd.shape[3], kv_bmd.shape[1], idx_btk.shape[-1])
  return hg, kv_bmd, idx_btk, nblk_bt1, bk, spec


def _backward(q_bthd, kv_bnd, idx_btk, valid_btk, o_bthd, lse_bth, do_bthd, dlse_bth, scale,
              block_k, num_warps, head_group, dkv_chunk, num_stages, interpret):
  """(dq, dkv). o_bthd None: dlse_bth is delta itself (`sparse_backward_fused`)."""
  b, t, h, d = q_bthd.shape
  n = kv_bnd.shape[1]
  hg, kv_bmd, idx_btk, nblk_bt1, bk, spec = _backward_operands(q_bthd, kv_bnd, idx_btk,
                                                               valid_btk, block_k, head_group)
  rows = kv_bmd.shape[1]
  dkv_spec = spec['kv']
  outputs = () if o_bthd is None else (o_bthd,)
  dq_bthd, dkv_bmd = launch.pallas_call(
      with_o(functools.partial(_bwd_kernel, n=n, bk=bk, scale=scale,
                                dkv_chunk=min(dkv_chunk, d), interpret=interpret), not outputs),
      out_shape=[jax.ShapeDtypeStruct((b, t, h, d), q_bthd.dtype),
                 jax.ShapeDtypeStruct((b, rows, d), jnp.float32)],
      grid=(t, b, h // hg),  # head groups add into the same rows: fewer heads, more atomics
      in_specs=[spec['nblk'], spec['q'], spec['kv'], spec['idx']] +
      [spec['q']] * (len(outputs) + 1) + [spec['h'], spec['h'], dkv_spec],
      out_specs=[spec['q'], dkv_spec],
      input_output_aliases={7 + len(outputs): 1},
      compiler_params=None if interpret else compiler_params(num_warps, num_stages),
      interpret=interpret,
      name='csa2_sparse_bwd',
  )(nblk_bt1, q_bthd, kv_bmd, idx_btk, *outputs, do_bthd.astype(q_bthd.dtype),
    lse_bth.astype(jnp.float32), dlse_bth.astype(jnp.float32),
    jnp.zeros((b, rows, d), jnp.float32))
  return dq_bthd, dkv_bmd[:, :n].astype(kv_bnd.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _sparse_partial(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads, fwd_tiles,
                    bwd_tiles, interpret):
  del bwd_tiles
  return _forward(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads, *fwd_tiles,
                  interpret)


def _sparse_partial_fwd(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads, fwd_tiles,
                        bwd_tiles, interpret):
  del bwd_tiles
  o, lse, mass = _forward(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads,
                          *fwd_tiles, interpret)
  return (o, lse, mass), (q_bthd, kv_bnd, idx_btk, valid_btk, *name_outputs(o, lse))


def _sparse_partial_bwd(scale, with_mass, heads, fwd_tiles, bwd_tiles, interpret, res, cts):
  # The slot mass is a stop-gradient target: no cotangent. Padding heads get a zero dO (their
  # outputs are cut off), so they add nothing to dkv.
  del with_mass, heads, fwd_tiles
  q_bthd, kv_bnd, idx_btk, valid_btk, o, lse = res
  do_bthd, dlse_bth, _ = cts
  t = bwd_tiles
  if t.dkv_tile:  # merged adds: the coefficients first, as a deferred backward's
    dq, part = _coefficients(res, cts, scale, t, interpret)
    return dq, dkv_from_coefficients(kv_bnd, idx_btk, valid_btk, [part], t.block_k,
                                     t.num_warps, t.dkv_chunk, interpret, t.dkv_tile), None, None
  dq, dkv = _backward(q_bthd, kv_bnd, idx_btk, valid_btk, o, lse, do_bthd, dlse_bth, scale,
                      t.block_k, t.num_warps, t.head_group, t.dkv_chunk, t.num_stages, interpret)
  return dq, dkv, None, None


_sparse_partial.defvjp(_sparse_partial_fwd, _sparse_partial_bwd)


def dq_and_coefficients(q_bthd, kv_bnd, idx_btk, valid_btk, o_bthd, lse_bth, do_bthd, dlse_bth,
                        scale, block_k, num_warps, head_group, num_stages, interpret):
  """The deferred backward's first kernel: (dq_bthd, dS * scale [B, T, K', H], P [B, T, K', H]).

  K' is K padded to a power of two; slots after a query's last valid block are not written.
  `dkv_from_coefficients` may walk in other blocks: the slots it reads past a query's last
  valid one point at the dummy row n, whose adds are masked out (cut off in the interpreter),
  so whatever those slots hold reaches no row."""
  b, t, h, d = q_bthd.shape
  hg, kv_bmd, idx_btk, nblk_bt1, bk, spec = _backward_operands(q_bthd, kv_bnd, idx_btk,
                                                               valid_btk, block_k, head_group)
  k_pad = idx_btk.shape[-1]
  coef_spec = pl.BlockSpec((None, None, k_pad, hg), lambda i, j, g=0: (j, i, 0, g))
  coef_shape = jax.ShapeDtypeStruct((b, t, k_pad, h), q_bthd.dtype)
  outputs = () if o_bthd is None else (o_bthd,)
  return launch.pallas_call(
      with_o(functools.partial(_bwd_dq_kernel, n=kv_bnd.shape[1], bk=bk, scale=scale),
              not outputs),
      out_shape=[jax.ShapeDtypeStruct((b, t, h, d), q_bthd.dtype), coef_shape, coef_shape],
      grid=(t, b, h // hg),
      in_specs=[spec['nblk'], spec['q'], spec['kv'], spec['idx']] +
      [spec['q']] * (len(outputs) + 1) + [spec['h'], spec['h']],
      out_specs=[spec['q'], coef_spec, coef_spec],
      compiler_params=None if interpret else compiler_params(num_warps, num_stages),
      interpret=interpret,
      name='csa2_sparse_bwd_dq',
  )(nblk_bt1, q_bthd, kv_bmd, idx_btk, *outputs, do_bthd.astype(q_bthd.dtype),
    lse_bth.astype(jnp.float32), dlse_bth.astype(jnp.float32))


def dkv_from_coefficients(kv_bnd, idx_btk, valid_btk, parts, block_k, num_warps, dkv_chunk,
                          interpret, tile=0):
  """The deferred backward's second kernel: kv's gradient (kv's dtype) from every call in
  `parts` = [(ds_btkh, p_btkh, q_bthd, do_bthd), ...] (all in q's dtype) over these kv rows and
  this selection, summed on chip and added once per element (where one backward per call adds
  once per call). `tile` > 0: each tile of that many queries' adds merged first
  (ops/gpu/merged_dkv.py)."""
  if tile:
    return merged_dkv(kv_bnd, idx_btk, valid_btk, parts, tile=tile, block_u=block_k,
                      num_warps=num_warps, dkv_chunk=dkv_chunk, interpret=interpret)
  b, n, d = kv_bnd.shape
  h = parts[0][2].shape[2]
  idx_btk, nblk_bt1, bk = prepare_slots(idx_btk, valid_btk, n, block_k)
  rows, k_pad = padded_rows(n), idx_btk.shape[-1]
  spec = per_query_specs(h, d, rows, k_pad)
  coef_spec = pl.BlockSpec((None, None, k_pad, h), lambda i, j: (j, i, 0, 0))
  dkv_spec = pl.BlockSpec((None, rows, d), lambda i, j: (j, 0, 0))
  ins = [x for part in parts for x in part]
  dkv_bmd = launch.pallas_call(
      functools.partial(_dkv_kernel, n=n, bk=bk, uses=len(parts), dkv_chunk=min(dkv_chunk, d),
                        interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((b, rows, d), jnp.float32),
      grid=(idx_btk.shape[1], b),
      in_specs=[spec['nblk'], spec['idx']] + [coef_spec, coef_spec, spec['q'], spec['q']] *
      len(parts) + [dkv_spec],
      out_specs=dkv_spec,
      input_output_aliases={2 + len(ins): 0},
      compiler_params=None if interpret else compiler_params(num_warps, 1),
      interpret=interpret,
      name='csa2_sparse_dkv',
  )(nblk_bt1, idx_btk, *ins, jnp.zeros((b, rows, d), jnp.float32))
  return dkv_bmd[:, :n].astype(kv_bnd.dtype)


def _coefficients(res, cts, scale, bwd_tiles, interpret):
  """(dq, this call's part for `dkv_from_coefficients`) of a deferred backward."""
  q_bthd, kv_bnd, idx_btk, valid_btk, o, lse = res
  do_bthd, dlse_bth = cts[:2]
  t = bwd_tiles
  dq, ds, p = dq_and_coefficients(q_bthd, kv_bnd, idx_btk, valid_btk, o, lse, do_bthd, dlse_bth,
                                  scale, t.dq_block_k, t.dq_warps, t.head_group, t.dq_stages,
                                  interpret)
  return dq, (ds, p, q_bthd, do_bthd.astype(q_bthd.dtype))


def sink_shapes(q_bthd, k):
  """Shapes and dtypes of one later call's hand-off: (dS, P [B, T, K', H], q, dO [B, T, H, d])."""
  b, t, h, d = q_bthd.shape
  k_pad = max(MIN_DOT, pl.next_power_of_2(k))
  coef = jax.ShapeDtypeStruct((b, t, k_pad, h), q_bthd.dtype)
  row = jax.ShapeDtypeStruct((b, t, h, d), q_bthd.dtype)
  return (coef, coef, row, row)


# Calls that share kv rows and a selection (CSA2's index source and its Reuse layers) can defer
# their key/value gradient to the first call, which runs one `dkv_from_coefficients` for all of
# them (docs/performance.md section 25). The first call publishes zero-valued "sinks", one per
# later call; a later call takes its sink as an input it does not read, returns no kv gradient
# and hands its coefficients back as the sink's cotangent; the first call's backward, which
# runs after all of theirs, receives them as its sinks' cotangents.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _sparse_partial_first(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads,
                          fwd_tiles, bwd_tiles, interpret, later):
  return _sparse_partial_first_fwd(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads,
                                   fwd_tiles, bwd_tiles, interpret, later)[0]


def _sparse_partial_first_fwd(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads,
                              fwd_tiles, bwd_tiles, interpret, later):
  del bwd_tiles
  o, lse, mass = _forward(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads,
                          *fwd_tiles, interpret)
  sinks = tuple(tuple(jnp.zeros(a.shape, a.dtype) for a in sink_shapes(q_bthd,
                                                                          idx_btk.shape[-1]))
                for _ in range(later))
  return (o, lse, mass, sinks), (q_bthd, kv_bnd, idx_btk, valid_btk, *name_outputs(o, lse))


def _sparse_partial_first_bwd(scale, with_mass, heads, fwd_tiles, bwd_tiles, interpret, later,
                              res, cts):
  del with_mass, heads, fwd_tiles, later
  dq, part = _coefficients(res, cts, scale, bwd_tiles, interpret)
  kv_bnd, idx_btk, valid_btk = res[1:4]
  parts = [part] + [tuple(x.astype(y.dtype) for x, y in zip(ct, part)) for ct in cts[3]]
  t = bwd_tiles
  dkv = dkv_from_coefficients(kv_bnd, idx_btk, valid_btk, parts, t.block_k, t.num_warps,
                              t.dkv_chunk, interpret, t.dkv_tile)
  return dq, dkv, None, None


_sparse_partial_first.defvjp(_sparse_partial_first_fwd, _sparse_partial_first_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _sparse_partial_later(q_bthd, kv_bnd, idx_btk, valid_btk, sink, scale, with_mass, heads,
                          fwd_tiles, bwd_tiles, interpret):
  del sink, bwd_tiles
  return _forward(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads, *fwd_tiles,
                  interpret)


def _sparse_partial_later_fwd(q_bthd, kv_bnd, idx_btk, valid_btk, sink, scale, with_mass, heads,
                              fwd_tiles, bwd_tiles, interpret):
  del sink
  return _sparse_partial_fwd(q_bthd, kv_bnd, idx_btk, valid_btk, scale, with_mass, heads,
                             fwd_tiles, bwd_tiles, interpret)


def _sparse_partial_later_bwd(scale, with_mass, heads, fwd_tiles, bwd_tiles, interpret, res,
                              cts):
  del with_mass, heads, fwd_tiles
  dq, part = _coefficients(res, cts, scale, bwd_tiles, interpret)
  return dq, None, None, None, part


_sparse_partial_later.defvjp(_sparse_partial_later_fwd, _sparse_partial_later_bwd)


FULL_WIDTH = 1 << 30  # dkv_chunk: the whole head width at once


def default_tiles(heads: int) -> tuple[ForwardTiles, BackwardTiles]:
  """The forward's and the backward's tiles, measured on the H200 (docs/performance.md
  sections 9, 22 and 26).

  The forward gathers 64 rows per step. The fused backward holds q, dO, the dq accumulator and a
  [block_k, d] fp32 key/value gradient at once, so it takes 32-row steps and at most 32 heads
  per program (64 heads x 512 overflow shared memory). Up to 16 heads one warp group (4 warps)
  is faster in both passes; wider programs need 8 warps. At 16 heads the key/value gradient goes
  out 256 columns at a time (9% faster than 512 at once), at 64 heads whole. Every kernel that
  walks gathered rows pipelines its gathers (one step's rows load while the last one's products
  run); alone at 65,536 queries the dq kernel took 8.1 ms at 64 rows x 3 stages against 15.9 ms
  at 32 x 1, the fused backward 26.8 against 33.7 ms at 2 stages (64 heads: dq 43.0 against
  78.5, fused 111.3 against 127.4). The deferred key/value kernel was fastest unpipelined.
  """
  if heads <= 16:
    return ForwardTiles(64, 4, 3), BackwardTiles(32, 4, 32, 256, 2, 64, 4, 3, 0)
  # A third forward stage measured 3% faster without the slot mass and was not run with it
  # (64 heads' q plus three 64 x 512 row tiles is near the shared memory's limit): two stay.
  return ForwardTiles(64, 8, 2), BackwardTiles(32, 8, 32, FULL_WIDTH, 2, 64, 8, 2, 0)


def _complete(name, given, default, dkv_tile=None):
  """`given`'s leading fields, the rest from `default` (a ForwardTiles or BackwardTiles);
  `dkv_tile`, where given, replaces a BackwardTiles' own."""
  given = tuple(map(int, given or ()))
  if len(given) > len(default):
    raise ValueError(f'{name} has {len(given)} fields; {type(default).__name__} has '
                     f'{len(default)}: {", ".join(default._fields)}')
  tiles = type(default)(*given, *default[len(given):])
  return tiles if dkv_tile is None else tiles._replace(dkv_tile=int(dkv_tile))


def _kernel_size(x: int) -> int:
  return max(MIN_DOT, pl.next_power_of_2(x))


def _pad_heads(x_bthd):
  """Zero heads and channels up to the kernels' sizes: they change no score, output or gradient
  (a zero query head scores 0 everywhere, and its zero dO sends nothing back)."""
  h, d = x_bthd.shape[-2:]
  h_pad, d_pad = _kernel_size(h), _kernel_size(d)
  if (h_pad, d_pad) == (h, d):
    return x_bthd
  return jnp.pad(x_bthd, ((0, 0), (0, 0), (0, h_pad - h), (0, d_pad - d)))


def _pad_channels(kv_bnd):
  """The entries' zero channels matching `_pad_heads`' (they add 0 to every score)."""
  d = kv_bnd.shape[-1]
  return jnp.pad(kv_bnd, ((0, 0), (0, 0), (0, _kernel_size(d) - d)))


def sparse_partial_fused(q_bthd, kv_bnd, idx_btk, valid_btk, *, scale: float,
                         with_mass: bool = False, fwd_tiles: tuple[int, ...] | None = None,
                         bwd_tiles: tuple[int, ...] | None = None,
                         interpret: bool | None = None, later: int = 0, sink=None,
                         dkv_tile: int | None = None):
  """(o_bthd in kv's dtype, lse_bth fp32, mass_btk fp32 or None), as `compressed_partial`.

  The slot mass carries no gradient (it is the indexer's stop-gradient target).
  fwd_tiles: `ForwardTiles` or its leading fields (selected rows gathered per step, warps per
  program, pipeline depth); bwd_tiles: `BackwardTiles` or its leading fields; the missing ones
  from `default_tiles`.
  interpret: the Pallas interpreter or not (None: ops/launch.py's rule; the CPU tests'
  interpreter).

  Deferred key/value gradient for calls sharing kv and selection (see above): `later` > 0 makes
  this the first call and appends its sinks (a tuple of `later` tuples of arrays) to the
  outputs; `sink`, one of them, makes this a later call, whose kv gets no gradient of its own.
  dkv_tile: `BackwardTiles.dkv_tile` (model.sparse_dkv_tile), over bwd_tiles' where given.
  """
  h, d = q_bthd.shape[-2:]
  q_bthd, kv_bnd = _pad_heads(q_bthd), _pad_channels(kv_bnd)
  fwd_default, bwd_default = default_tiles(q_bthd.shape[2])
  fwd_tiles = _complete('fwd_tiles', fwd_tiles, fwd_default)
  bwd_tiles = _complete('bwd_tiles', bwd_tiles, bwd_default, dkv_tile)
  args = (q_bthd, kv_bnd.astype(q_bthd.dtype), idx_btk, valid_btk)
  static = (float(scale), bool(with_mass), h, fwd_tiles, bwd_tiles, launch.interpreted(interpret))
  sinks = None
  if later:
    o, lse, mass, sinks = _sparse_partial_first(*args, *static, int(later))
  elif sink is not None:
    o, lse, mass = _sparse_partial_later(*args, tuple(sink), *static)
  else:
    o, lse, mass = _sparse_partial(*args, *static)
  o, lse, mass = name_outputs(o, lse, mass)
  o, lse = o[..., :h, :d], lse[..., :h]
  out = (o, lse, None if mass is None else jax.lax.stop_gradient(mass))
  return out + (sinks,) if later else out


@functools.partial(jax.jit, static_argnames=('scale', 'bwd_tiles', 'interpret', 'defer',
                                             'dkv_tile'))
def sparse_backward_fused(q_bthd, kv_bnd, idx_btk, valid_btk, delta_bth, lse_bth, do_bthd, *,
                          scale: float, bwd_tiles: tuple[int, ...] | None = None,
                          interpret: bool | None = None, defer: bool = False, later_parts=(),
                          dkv_tile: int | None = None):
  """The sparse branch's gradients given D = sum_d dO * O, the log-sum-exp and the output
  cotangent of the softmax it is part of, with no log-sum-exp cotangent: the merged softmax's
  (D, L, dO) give its exact share of the merged gradient (ops/softmax_merge.py).

  Returns (dq_bthd, dkv_bnd); with `defer` (a later call over a shared selection) (dq_bthd, its
  part) instead, the part being what `later_parts` of the first call's backward holds: that
  call's dkv adds them all once (`dkv_from_coefficients`). Tiles and `interpret` as
  `sparse_partial_fused`.
  """
  interpret = launch.interpreted(interpret)
  h, d = q_bthd.shape[-2:]
  q_p, kv_p = _pad_heads(q_bthd), _pad_channels(kv_bnd).astype(q_bthd.dtype)
  do_p = _pad_heads(do_bthd.astype(q_bthd.dtype))
  heads = ((0, 0), (0, 0), (0, q_p.shape[2] - h))
  lse_p = jnp.pad(lse_bth.astype(jnp.float32), heads)
  delta_p = jnp.pad(delta_bth.astype(jnp.float32), heads)  # padded heads: dO 0, so D 0
  t = _complete('bwd_tiles', bwd_tiles, default_tiles(q_p.shape[2])[1], dkv_tile)
  res, cts = (q_p, kv_p, idx_btk, valid_btk, None, lse_p), (do_p, delta_p)
  if defer or later_parts or t.dkv_tile:
    dq_p, part = _coefficients(res, cts, scale, t, interpret)
    if defer:
      return dq_p[..., :h, :d], part
    dkv = dkv_from_coefficients(kv_p, idx_btk, valid_btk, [part, *later_parts], t.block_k,
                                t.num_warps, t.dkv_chunk, interpret, t.dkv_tile)
  else:
    dq_p, dkv = _backward(*res, *cts, scale, t.block_k, t.num_warps, t.head_group, t.dkv_chunk,
                          t.num_stages, interpret)
  return dq_p[..., :h, :d], dkv[..., :d]
