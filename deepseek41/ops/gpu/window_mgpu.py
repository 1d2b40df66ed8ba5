"""Sliding-window attention forward over the shared latent: a Mosaic GPU (Hopper) kernel.

The forward of `window_kernel.window_partial_fused` (Pallas on Triton) ported to Mosaic GPU, with
the contract of `swa_attention.swa_partial` minus image spans: query t sees key u iff
`t - window < u <= t` in the same nonzero segment; one latent row is the key and the value of
every head (MQA). Returns `(o_bthd in kv's dtype, lse_bth fp32)`, lse -inf and o 0 where nothing
is visible. Forward only: the backward stays on the Triton kernels (`window_partial_fused`).

Blocks: q is viewed as [B, T*H, d]; a block is 64 rows = 64/H queries x H heads (4 at H = 16, 1
at H = 64), one wgmma M = 64 tile, and one CTA per (block, batch row). The block's rows see keys
[t0 - window + 1, t0 + 64/H); it walks `nk = ceil((window - 1 + 64/H + 7) / block_k)` blocks of
`block_k` = 64 keys from that first key rounded down to 8 (`KEY_ALIGN`), clamped into T: at
window 128, 192 keys for the 131 (H = 16) or 128 (H = 64) visible. Masks are built on chip from
iotas and the rows' and keys' segment ids.

Two warpgroups, no producer warpgroup. The fp32 [64, d] accumulator (128 KB at d = 512) does not
fit one warpgroup's registers, so warpgroup w owns the d half w: it loads (TMA) only its halves
of the q block and of each key block and runs both products on them, S_w = q_w k_w^T (a partial
over d; k from shared memory, transposed) and o_w += P v_w (P from registers; o_w is 128 fp32
registers per thread). The partials meet in shared memory behind two barriers (`s_ready`: both
written; `s_free`: both read, before the next step overwrites them) and both warpgroups read
S = S_0 + S_1 in one order, so their softmax statistics are bit-identical. Key blocks are
multi-buffered (`stages`, default 2); a warpgroup prefetches its own halves (and the keys' ids)
into a slot as soon as its own PV wgmma on it retired, so no cross-warpgroup "consumed" barrier.
Hopper features: TMA loads and stores through 128-byte swizzled tiles, mbarriers, wgmma.

Shared memory at d = 512 (every buffer rounds up to 1 KB): q 64 KB + 2 key stages 128 KB +
partial scores 32 KB + ids 2 KB (which also stage lse, as int32 bits) = 226 KB of the 227 KB, so
one CTA per SM; hence `reduction_scratch_bytes=0` (WGMMA row reductions stay within a warp).

Limits: bf16 / fp16 (q is cast to kv's dtype); H a power of two dividing 64; d a multiple of 128
(halves of whole 64-column tiles); no image spans (ValueError); T padded with segment 0.
Measured on an H100 (docs/performance.md section 52): 1.32-1.35x the Triton forward at 16 heads,
1.61-1.63x at 64, at 4K and 64K; the default forward of the merged window branch
(`model.window_forward`).
Costs, the next steps: 192 keys walked for <= 131 visible (a 16-key tail block would
make it 144); the two warpgroups meet every step; no overlap across query blocks (one CTA per SM
and each CTA loads q and its first keys cold: a persistent kernel keeping a ring of key blocks,
which neighbouring query blocks share, is the bigger win, above all at H = 64).

Mosaic GPU in jax 0.11.2: what this kernel works around.
- Interpreter (jax/_src/pallas/mosaic_gpu/interpret): (1) no rule for `pl.run_state` with a
  wgmma accumulator (`pl.run_state(lambda r: plgpu.wgmma(r, a_smem, b_smem))(plgpu.ACC.init(x))`
  fails with "MLIR translation rule for primitive 'wgmma' not found for platform cpu"; within this
  kernel "Cannot lower jaxpr with effects: {IOEffect, _WGMMAPipelineEffect}"); (2) no wgmma with
  its A operand in registers (`plgpu.wgmma(acc_ref, p_bf16, b_smem)` in a `run_scoped` ACC:
  "ValueError: Expected shape (6,) but got (64, 64)": the array is taken for a ref's key). So
  interpreted, the PV product is `acc + jnp.dot(p, v_smem[...])` (mgpu_common.py
  `accumulate`); TMA, barriers, the QK^T wgmma, the score exchange and the masks are
  interpreted as compiled. (3) A barrier phase that some warpgroup never waits for fails the
  kernel at deallocation ("had only observed barrier up to phase ..."): hence the last `s_free`
  wait.
- Lowering: a TMA's dynamic start must be provably a multiple of the 8-row smem tile
  (`pl.multiple_of`). Without it this kernel's lowering dies in layout inference on a bare
  `assert len(op.indices) == len(multiple)` (layout_inference.py,
  `_check_unsatisfiable_divisibility_constraints`) instead of its "prove the divisibility ...
  using pl.multiple_of" message (which a 2-D toy kernel does get): delete the `pl.multiple_of`
  line to reproduce. The lowering also checks the shared memory budget; ptxas (registers) runs
  only on a GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deepseek41.ops.gpu.mgpu_common import (LOG2E, ROWS, accumulate, interpret_params,
                                             launch_kernel, softmax_start, store_o_and_lse)
from deepseek41.ops.launch import name_outputs, pad_axis

KEY_ALIGN = 8      # a key walk starts at a multiple of the smem tile's 8 rows (TMA indexing)


def _geometry(t: int, h: int, window: int, block_k: int):
  """(queries per block, key blocks per query block, padded T)."""
  q_per_block = ROWS // h
  window = min(window, t)
  nk = -(-(window - 1 + q_per_block + KEY_ALIGN - 1) // block_k)
  t_pad = -(-t // max(q_per_block, block_k)) * max(q_per_block, block_k)
  t_pad = max(t_pad, nk * block_k)
  return q_per_block, window, nk, t_pad


def _kernel(q_ref, kv_ref, segr_ref, segk_ref, o_ref, lse_ref, scratch, *, heads, window,
            scale, nk, block_k, stages, interpret):
  # q: [B, T*H, d]; kv: [B, T, d]; segr: [B, T*H] (the rows' query segment); segk: [B, T];
  # o: [B, T*H, d]; lse: [B, T*H]. Warpgroup w works on the d half w (module docstring).
  (q_smem, kv_smem, ids_smem, s_smem, q_bar, segq_bar, kv_bar, segk_bar, s_ready,
   s_free) = scratch
  # lse_ref holds the fp32 bits as int32: it is staged in warpgroup 0's row-segment slot.
  blk, b, w = lax.axis_index('q'), lax.axis_index('b'), lax.axis_index('wg')
  dh = q_smem.shape[-1]
  dt = kv_ref.dtype
  t_pad = kv_ref.shape[1]
  qpb = ROWS // heads
  t0 = blk * qpb
  rows = pl.ds(blk * ROWS, ROWS)
  half = pl.ds(w * dh, dh)
  # First key of the walk: the earliest visible key rounded down to the smem tile (Mosaic's TMA
  # must see the index divisible by it), clamped so that the nk blocks fit in T.
  k0 = jnp.clip(t0 - window + 1, 0, t_pad - nk * block_k)
  k0 = pl.multiple_of(lax.div(k0, KEY_ALIGN) * KEY_ALIGN, KEY_ALIGN)

  def fetch(j, slot):
    keys = pl.ds(k0 + j * block_k, block_k)
    plgpu.copy_gmem_to_smem(kv_ref.at[b, keys, half], kv_smem.at[slot, w],
                            kv_bar.at[slot * 2 + w])
    plgpu.copy_gmem_to_smem(segk_ref.at[b, keys], ids_smem.at[1 + slot, w, pl.ds(0, block_k)],
                            segk_bar.at[slot * 2 + w])

  plgpu.copy_gmem_to_smem(q_ref.at[b, rows, half], q_smem.at[w], q_bar.at[w])
  plgpu.copy_gmem_to_smem(segr_ref.at[b, rows], ids_smem.at[0, w, pl.ds(0, ROWS)],
                          segq_bar.at[w])
  for j in range(min(stages, nk)):
    fetch(j, j)
  plgpu.barrier_arrive(s_free)  # step 0 finds the partial-score buffers free

  plgpu.barrier_wait(segq_bar.at[w])
  seg_r = plgpu.load(ids_smem.at[0, w, pl.ds(0, ROWS)], layout=plgpu.Layout.WGMMA.reduce(1))
  plgpu.barrier_wait(q_bar.at[w])

  def visible(j, slot):
    """[rows, keys] bool of step j. Built in the step (iotas are a few integer ops) rather than
    hoisted: [64, 64] int32 loop invariants would hold 32 registers each beside the 128 of acc."""
    plgpu.barrier_wait(segk_bar.at[slot * 2 + w])
    seg_k = plgpu.load(ids_smem.at[1 + slot, w, pl.ds(0, block_k)],
                       layout=plgpu.Layout.WGMMA.reduce(0))
    row = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)
    # query (row // H) minus key: visible from 0 to window - 1
    lag_rk = (t0 - k0 - j * block_k) + lax.shift_right_logical(row, int(math.log2(heads))) - col
    seg_rk = lax.broadcast_in_dim(seg_r, (ROWS, block_k), [0])
    return ((lag_rk >= 0) & (lag_rk < window) & (seg_rk != 0) &
            (lax.broadcast_in_dim(seg_k, (ROWS, block_k), [1]) == seg_rk))

  def step(j, carry):
    m_r, l_r, acc = carry
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(kv_bar.at[slot * 2 + w])
    k_smem = kv_smem.at[slot, w]

    def partial_scores(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[w], k_smem.transpose((1, 0)))
      return acc_ref[...]
    s_own = pl.run_scoped(partial_scores, plgpu.ACC((ROWS, block_k), jnp.float32))
    # Sum the two d halves' partials through shared memory, both read back in one order (both
    # warpgroups get bit-identical scores; the own partial is not held across the wait).
    plgpu.barrier_wait(s_free)
    s_smem[w] = s_own
    plgpu.barrier_arrive(s_ready)
    plgpu.barrier_wait(s_ready)
    s_rk = (plgpu.load(s_smem.at[0], layout=plgpu.Layout.WGMMA) +
            plgpu.load(s_smem.at[1], layout=plgpu.Layout.WGMMA))
    plgpu.barrier_arrive(s_free)
    # Scores in log2 units (exp2 is the fast path); m_r is kept scaled by log2(e) too.
    s_rk = jnp.where(visible(j, slot), s_rk * (scale * LOG2E), -jnp.inf)
    m_new_r = jnp.maximum(m_r, s_rk.max(axis=1))
    shift_r = jnp.where(m_new_r == -jnp.inf, 0.0, m_new_r)  # nothing seen yet: any finite shift
    alpha_r = jnp.exp2(m_r - shift_r)
    p_rk = jnp.exp2(s_rk - lax.broadcast_in_dim(shift_r, s_rk.shape, [0]))
    l_r = l_r * alpha_r + p_rk.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha_r, acc.shape, [0])
    acc = accumulate(acc, p_rk.astype(dt), k_smem, interpret)  # its wgmma retired: slot free

    @pl.when(j + stages < nk)
    def _():
      fetch(j + stages, slot)
    return m_new_r, l_r, acc

  m_r, l_r, acc = softmax_start(dh)
  m_r, l_r, acc = lax.fori_loop(0, nk, step, (m_r, l_r, acc))

  seen_r = l_r > 0
  l_r = jnp.where(seen_r, l_r, 1.0)
  acc = acc * lax.broadcast_in_dim(1.0 / l_r, acc.shape, [0])
  q_smem[w] = acc.astype(dt)  # the q half is no longer read: it stages the output
  # Both warpgroups hold the same statistics: warpgroup 0 stages lse (as int32 bits) in its own
  # row-segment slot, read once before the loop. The last `s_free` phase is waited for by both:
  # a phase that nobody observes would outlive the kernel (the interpreter checks).
  plgpu.barrier_wait(s_free)
  lse_smem = ids_smem.at[0, 0, pl.ds(0, ROWS)]
  store_o_and_lse(w, q_smem.at[w], o_ref.at[b, rows, half],
                  jnp.where(seen_r, m_r / LOG2E + jnp.log(l_r), -jnp.inf), lse_smem,
                  lse_ref.at[b, rows], lse_as_int32=True)


@functools.partial(jax.jit, static_argnames=('window', 'scale', 'interpret', 'block_k',
                                             'stages'))
def window_forward_mgpu(q_bthd, kv_btd, segment_ids_bt, *, window: int,
                        scale: float | None = None,
                        interpret: bool | plgpu.InterpretGPUParams | None = None,
                        span_ids_bt=None, block_k: int = 64, stages: int = 2):
  """The window branch's partial `(o_bthd in kv's dtype, lse_bth fp32)`, forward only.

  q_bthd [B, T, H, d], kv_btd [B, T, d] (one dtype, bf16 or fp16), segment_ids_bt [B, T] (0 =
  padding). `block_k` keys per step (a multiple of 64), `stages` key blocks in flight.
  interpret: the Mosaic GPU interpreter or not (None: ops/launch.py's rule, the interpreter where
  the platform is not a GPU), or the interpreter's parameters (tests: `detect_races=True`).
  """
  if span_ids_bt is not None:
    raise ValueError('window_forward_mgpu has no image spans: use window_partial_fused')
  b, t, h, d = q_bthd.shape
  if kv_btd.shape != (b, t, d) or segment_ids_bt.shape != (b, t):
    raise ValueError(f'expected q [B,T,H,d], kv [B,T,d], segment ids [B,T]; got {q_bthd.shape}, '
                     f'{kv_btd.shape}, {segment_ids_bt.shape}')
  if window < 1:
    raise ValueError(f'window must be >= 1, got {window}')
  if h & (h - 1) or ROWS % h:
    raise ValueError(f'H must be a power of two dividing {ROWS}, got {h}')
  if d % 128:
    raise ValueError(f'd must be a multiple of 128 (two halves of whole 64-column tiles), got {d}')
  if block_k % 64 or stages < 1:
    raise ValueError(f'block_k must be a multiple of 64 and stages >= 1; got {block_k}, {stages}')
  dt = kv_btd.dtype
  if dt not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f'kv must be bf16 or fp16, got {dt}')
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  qpb, window, nk, t_pad = _geometry(t, h, window, block_k)
  stages = min(stages, nk)

  q_brd = pad_axis(q_bthd.astype(dt), 1, t_pad).reshape(b, t_pad * h, d)
  kv_btd = pad_axis(kv_btd, 1, t_pad)
  segk_bt = pad_axis(segment_ids_bt.astype(jnp.int32), 1, t_pad)
  segr_br = jnp.repeat(segk_bt, h, axis=1)  # the query segment of each (query, head) row
  n_blocks = t_pad * h // ROWS

  dh = d // 2
  swizzle = 128
  tiles = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dt).itemsize)),
           plgpu.SwizzleTransform(swizzle))
  scratch = (
      plgpu.SMEM((2, ROWS, dh), dt, transforms=tiles),             # q halves, then o halves
      plgpu.SMEM((stages, 2, block_k, dh), dt, transforms=tiles),  # key blocks (halves)
      # segment ids per wg: [0] the rows' (queries'), [1 + slot] the keys' of a key block
      plgpu.SMEM((1 + stages, 2, max(ROWS, block_k)), jnp.int32),
      # partial scores, swizzled like the tiles (a row-major [64, 64] fp32 store of the WGMMA
      # layout would hit each bank 8 times)
      plgpu.SMEM((2, ROWS, block_k), jnp.float32, transforms=(
          plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))),
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=2),
      plgpu.Barrier(num_barriers=2 * stages),
      plgpu.Barrier(num_barriers=2 * stages),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=2),
  )
  interpret = interpret_params(interpret)
  kernel = functools.partial(_kernel, heads=h, window=window, scale=scale, nk=nk,
                             block_k=block_k, stages=stages, interpret=bool(interpret))
  o_brd, lse_br = launch_kernel(
      lambda *refs: kernel(*refs[:6], refs[6:]),
      out_type=[jax.ShapeDtypeStruct((b, t_pad * h, d), dt),
                jax.ShapeDtypeStruct((b, t_pad * h), jnp.int32)],  # lse's fp32 bits
      scratch_types=scratch,
      # Mosaic reverses the grid into CUDA's (x, y, z): the query blocks last, so they land on x,
      # the one dimension not capped at 65,535 (V4.1 at 64K has 65,536 blocks a row; as y that
      # launch failed with CUDA_ERROR_INVALID_VALUE), and neighbouring blocks, which share most
      # of their keys, run side by side.
      grid=(b, n_blocks),
      grid_names=('b', 'q'),
      num_threads=2,
      thread_name='wg',
      # Row reductions of the WGMMA layout stay within a warp: no cross-warp scratch needed,
      # and its default 2 KB would not fit beside the tiles.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=interpret,
      kernel_name='swa_window_fwd_mgpu',
  )(q_brd, kv_btd, segr_br, segk_bt)
  # named as the Triton forward's (train.remat=block_keep_attention keeps them)
  o_brd, lse_br = name_outputs(o_brd, lax.bitcast_convert_type(lse_br, jnp.float32))
  return o_brd.reshape(b, t_pad, h, d)[:, :t], lse_br.reshape(b, t_pad, h)[:, :t]
