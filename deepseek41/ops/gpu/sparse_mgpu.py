"""Sparse attention forward over selected latent rows: a Mosaic GPU (Hopper) kernel.

The forward of `sparse_kernel.sparse_partial_fused` (Pallas on Triton) ported to Mosaic GPU, with
the contract of `sparse_attention.compressed_partial`: query t attends to the entries
`idx_btk[b, t, k]` of the shared latent `kv_bnd` where `valid_btk[b, t, k]` (anywhere in the row,
not a prefix; what an invalid slot holds does not matter), one latent row being the key and the
value of every head (MQA). Returns `(o_bthd in kv's dtype, lse_bth fp32)`, lse -inf and o 0 for a
query with no valid slot. Forward only and no slot mass: the backward and the mass stay on the
Triton kernels (`sparse_partial_fused`, `sparse_backward_fused`).

Blocks: one CTA per (query, 64-head tile, batch row): the 64 heads of one query are one wgmma
M = 64 tile and share every gathered row. H = 128 takes two CTAs per query (each gathers the
same rows, the second mostly from L2); H < 64 is padded with zero heads to 64, which wastes
64 / H of the MMA work: at the 1B model's 16 heads the Triton kernel stays the choice. The walk
goes over the query's slots in blocks of 64 and stops after the last block holding a valid slot
(the wrapper's `slot_metadata`, the Triton kernel's `nblk`). Invalid slots are masked to -inf on
chip (the wrapper folds `valid` into the slot, -1 = invalid, and loads it with the indices).

Three warpgroups (warp specialisation, `num_threads=3`):
- producer (warpgroup 2, 40 registers): loads the query's slot row and its q tile, then per block
  GATHERS the 64 selected rows: Hopper's TMA cannot gather (Mosaic's TMA gather is Blackwell's
  `gather4`), so it issues one TMA per row (the row as a [d/64, 64] box, its index read from the
  slot row in shared memory; invalid slots load row 0, since P = 0 times a NaN left in shared
  memory would be NaN) into a row-major staging buffer, all on one barrier of 64 arrivals. A
  single row cannot land in wgmma's 8-row swizzled tiles from Pallas (next section), so once a
  block has landed and the consumers are done with the previous one, the producer REPACKS the
  staging buffer into the tiled, swizzled tile through registers (64 columns at a time, in the
  SMEM<->GMEM copy layout) and fences it for the async proxy; then it starts the next block's
  gather, which so overlaps the consumers' compute.
- consumers (warpgroups 0 and 1, 232 registers): the fp32 [64, d] accumulator does not fit one
  warpgroup (128 KB at d = 512), so warpgroup w owns the d half w of o. For the scores they split
  the block's slots instead: w scores slots [32w, 32w + 32) over all of d (S = q k^T, two
  wgmmas over the d halves of q and of the rows, A and B from shared memory), masks them, and
  the two exchange their 64 row maxima through shared memory (both read them in one order, so
  their statistics are bit-identical); each writes its P half (bf16) into one [64, 64] tile and,
  once both halves are there, accumulates o_w += P v_w (wgmma, P and v from shared memory). Row
  sums are per slot half and meet once at the end. This is FlashMLA's split on Hopper: the
  exchange is 256 bytes of maxima and 4 KB of P per warpgroup and step, not fp32 scores.
Barriers per step: `raw_full` (the 64 row copies landed), `kv_full` / `kv_free` (the repacked tile,
producer <-> consumers), `m_ready`, `p_ready`, `p_free` (between the consumers). Hopper features:
TMA loads and stores, mbarriers with transaction counts, wgmma, 64-byte swizzled tiles (P's two
32-slot halves must each be whole tiles, and wgmma wants one swizzle for both operands), register
reallocation (`setmaxnreg`), the async-proxy fence.

Shared memory at d = 512 (each buffer rounded up to 1 KB): q halves 64 KB (they stage o at the
end) + the tile 64 KB + the staging rows 64 KB + P 8 KB + slots (K/32 + 1) x 128 bytes (3 KB
at K = 512, 9 KB at K = 2048) + maxima 1 KB + lse 1 KB: about 205 to 211 KB of the 227 KB, so
one CTA per SM. The lowering checks it (tests/kernels/test_sparse_mgpu.py, K = 512 and 2048).

Limits: bf16 / fp16 (q is cast to kv's dtype); d a multiple of 128 up to 512 (halves of whole
64-column chunks; a row is one TMA box, at most 256 elements a dimension); H at most 64 (padded)
or a multiple of 64; any K (padded to 64 with invalid slots), N, T.
On an H100 (docs/performance.md section 52) the compiled kernel's outputs were WRONG (o off by up
to 5.4, lse by 4.3, against the Triton forward) while every interpreter test passes, and it ran at
0.93x the Triton forward's speed at 64 heads, 0.29x at 16: no model path or config selects it.
Costs, the next steps: (1) the repack: 64 KB read and
64 KB written in shared memory per block, beside the ~270 KB that the wgmmas read (q is read
again for every 32 slots), so shared memory bandwidth, not the tensor cores, may bound it; a
gather straight into the swizzled tile removes it (next section); (2) the gather is 64 TMAs
issued by one thread, each after a scalar shared-memory read (unrolled by `GATHER_UNROLL`);
spreading them over the producer's 4 warps is the next step if it shows; (3) one repacked tile:
the producer's repack of block j + 1 waits for both consumers to finish block j (only the
gather overlaps); a second tile does not fit beside the staging rows; (4) not persistent: each
CTA loads its q and first rows cold.

Mosaic GPU in jax 0.11.2: what is missing or broken, and what this kernel does about it.
- No gather into wgmma's layout on Hopper. (a) `copy_gmem_to_smem(kv_ref.at[b, idx_vector])`
  is TMA gather4, which is sm_100 only; (b) the cp.async path (per-thread addresses, FlashMLA's
  gather on Hopper) is chosen only for arch < 9, and it refuses gathers anyway ("Gather/scatter
  unsupported for the CP_ASYNC implementation"); (c) one row can't be the TMA destination in a
  tiled ref: `plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(row, 1)], kv_smem.at[pl.ds(r, 1)], bar)`
  with `kv_smem` tiled (8, 32) fails at trace time, "Expected slice start (...) and slice size
  (1) to be divisible by the tile size (8)" (Hopper's TMA can write one 128-byte swizzled row,
  so this is Pallas's restriction); (d) a `plgpu.RefUnion` of a row-major and a tiled view of
  one buffer (repacking in place) would save the 64 KB staging buffer, but the interpreter keeps
  union members as independent buffers, so such a kernel can't be checked there. Hence the
  row-major staging buffer and the repack.
- Layout inference: loading the staging rows with `layout=plgpu.Layout.WGMMA` (a strided
  [64, 64] view of an untiled buffer) to store them into the tiled tile makes layout inference
  give up ("Layout inference failed to find a solution. Consider adding layout annotations")
  after exhausting its search instead of naming the load; `Layout.SMEM_GMEM_COPY((64, 64), dt,
  64)` lowers. Reproducer: use `plgpu.Layout.WGMMA` as `copy_layout` in `_kernel`.
- TMA needs a contiguous shared-memory side: a column half of a tiled [64, d] buffer is refused
  ("async_copy needs the SMEM reference to be contiguous, but got strides [4096, 256, 32, 1]"),
  so q and o live as two [64, d/2] halves and S takes two wgmmas.
- Interpreter (jax/_src/pallas/mosaic_gpu/interpret): no rule for `pl.run_state` with a wgmma
  accumulator (as in window_mgpu.py's docstring), so interpreted, the PV product is
  `acc + jnp.dot(p_smem[...], v_smem[...])` (mgpu_common.py `accumulate`); the TMAs, the
  barriers, the repack, the score wgmmas, the exchanges and the masks are interpreted as
  compiled. `set_max_registers` is a no-op there. Every barrier phase is waited for by some
  warpgroup (the interpreter checks at deallocation): hence the producer's last `kv_free` wait
  and the consumers' last `p_free`.
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
from deepseek41.ops.launch import pad_axis

BLOCK_K = 64       # selected slots per step; each consumer warpgroup scores half of them
HALF_K = BLOCK_K // 2
META_W = 32        # the slot metadata's row width: one consumer's slots of one step
GATHER_UNROLL = 8  # row copies issued per producer loop iteration
CHUNK = 64         # columns repacked per register round trip (16 registers per thread)
SWIZZLE = 64       # bytes: P's two 32-slot halves must be whole tiles (module docstring)


def _kernel(q_ref, kv_ref, meta_ref, o_ref, lse_ref, scratch, *, d, k_rows, scale, interpret):
  # q: [B, T*Hp, d] (Hp = padded heads, a multiple of 64); kv: [B, N, d/64, 64] (the latent
  # rows, viewed so that one TMA box per row stays within 256 elements a dimension); meta:
  # [B, T, k_rows + 1, 32] int32: slots (-1 = invalid) and, in the last row, the step count;
  # o: [B, T*Hp, d]; lse: [B, T*Hp]. Warpgroups 0 and 1 compute, 2 gathers (module docstring).
  (q_smem, kv_smem, raw_smem, p_smem, meta_smem, stat_smem, lse_smem, meta_bar, q_bar, raw_full,
   kv_full, kv_free, m_ready, p_ready, p_free) = scratch
  t, g, b, w = (lax.axis_index('t'), lax.axis_index('g'), lax.axis_index('b'),
                lax.axis_index('wg'))
  dt = q_smem.dtype
  dh = d // 2
  heads_pad = q_ref.shape[1] // meta_ref.shape[1]
  rows = pl.ds(pl.multiple_of(t * heads_pad + g * ROWS, ROWS), ROWS)

  @pl.when(w == 2)
  def _producer():
    plgpu.set_max_registers(40, action='decrease')
    plgpu.copy_gmem_to_smem(meta_ref.at[b, t], meta_smem, meta_bar)
    for i in range(2):
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, pl.ds(i * dh, dh)], q_smem.at[i], q_bar)
    plgpu.barrier_wait(meta_bar)
    nblk = meta_smem[k_rows, 0]
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((BLOCK_K, CHUNK), dt, SWIZZLE)

    def gather(j):
      """One TMA per selected row into the row-major staging buffer (Hopper's TMA has no
      gather; a row of d/64 x 64 is one box). Invalid slots load row 0: the staging buffer must
      hold finite values, since P = 0 times a NaN left in shared memory is NaN."""
      @pl.loop(0, BLOCK_K // GATHER_UNROLL)
      def _(i):
        # Unrolled: the slot reads of a group are independent and overlap their latency.
        for u in range(GATHER_UNROLL):
          r = i * GATHER_UNROLL + u
          row = jnp.maximum(meta_smem[2 * j + r // META_W, r % META_W], 0)
          plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(row, 1)], raw_smem.at[pl.ds(r, 1)],
                                  raw_full)

    @pl.when(nblk > 0)
    def _():
      gather(0)

    @pl.loop(0, nblk)
    def _(j):
      plgpu.barrier_wait(raw_full)

      @pl.when(j > 0)
      def _():
        plgpu.barrier_wait(kv_free)  # both consumers are done with block j - 1
      # Repack into wgmma's tiled, swizzled layout through registers, CHUNK columns at a time.
      for c in range(d // CHUNK):
        kv_smem[:, pl.ds(c * CHUNK, CHUNK)] = plgpu.load(raw_smem.at[:, c], layout=copy_layout)
      plgpu.commit_smem()  # the generic-proxy stores become visible to wgmma (async proxy)
      plgpu.barrier_arrive(kv_full)

      @pl.when(j + 1 < nblk)
      def _():
        gather(j + 1)  # the staging buffer was read into registers above: free

    @pl.when(nblk > 0)
    def _():
      plgpu.barrier_wait(kv_free)  # observe the last phase (the interpreter checks)

  @pl.when(w < 2)
  def _consumer():
    plgpu.set_max_registers(232, action='increase')
    half = pl.ds(w * dh, dh)
    plgpu.barrier_arrive(p_free)  # step 0 finds P and the row maxima free
    plgpu.barrier_wait(meta_bar)
    nblk = meta_smem[k_rows, 0]
    plgpu.barrier_wait(q_bar)

    def step(j, carry):
      m_r, l_r, acc = carry
      plgpu.barrier_wait(kv_full)

      def scores(acc_ref):
        # This warpgroup's 32 slots of the block, over all of d (q and the rows are shared).
        k_smem = kv_smem.at[pl.ds(w * HALF_K, HALF_K)]
        for i in range(2):
          plgpu.wgmma(acc_ref, q_smem.at[i], k_smem.at[:, pl.ds(i * dh, dh)].transpose((1, 0)))
        return acc_ref[...]
      s_rk = pl.run_scoped(scores, plgpu.ACC((ROWS, HALF_K), jnp.float32))
      slot_k = plgpu.load(meta_smem.at[2 * j + w], layout=plgpu.Layout.WGMMA.reduce(0))
      valid_rk = lax.broadcast_in_dim(slot_k >= 0, s_rk.shape, [1])
      # Scores in log2 units (exp2 is the fast path); m_r is kept scaled by log2(e) too.
      s_rk = jnp.where(valid_rk, s_rk * (scale * LOG2E), -jnp.inf)
      plgpu.barrier_wait(p_free)
      stat_smem[w] = s_rk.max(axis=1)
      plgpu.barrier_arrive(m_ready)
      plgpu.barrier_wait(m_ready)
      # Both warpgroups read the two maxima in one order: bit-identical statistics.
      m_new_r = jnp.maximum(m_r, jnp.maximum(
          plgpu.load(stat_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1)),
          plgpu.load(stat_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))))
      shift_r = jnp.where(m_new_r == -jnp.inf, 0.0, m_new_r)  # nothing seen yet: any finite shift
      alpha_r = jnp.exp2(m_r - shift_r)
      p_rk = jnp.exp2(s_rk - lax.broadcast_in_dim(shift_r, s_rk.shape, [0]))
      l_r = l_r * alpha_r + p_rk.sum(axis=1)  # this warpgroup's slots only: summed at the end
      p_smem[:, pl.ds(w * HALF_K, HALF_K)] = p_rk.astype(dt)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      plgpu.barrier_wait(p_ready)
      acc = acc * lax.broadcast_in_dim(alpha_r, acc.shape, [0])
      # its wgmma retired: the slot is free
      acc = accumulate(acc, p_smem, kv_smem.at[:, half], interpret, a_in_smem=True)
      plgpu.barrier_arrive(kv_free)
      plgpu.barrier_arrive(p_free)
      return m_new_r, l_r, acc

    m_r, l_r, acc = softmax_start(dh)
    m_r, l_r, acc = lax.fori_loop(0, nblk, step, (m_r, l_r, acc))

    # The row sums of the two slot halves meet like the maxima (the last `p_free` phase is
    # waited for by both: a phase that nobody observes would outlive the kernel).
    plgpu.barrier_wait(p_free)
    stat_smem[w] = l_r
    plgpu.barrier_arrive(m_ready)
    plgpu.barrier_wait(m_ready)
    l_r = (plgpu.load(stat_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1)) +
           plgpu.load(stat_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1)))
    seen_r = l_r > 0
    l_r = jnp.where(seen_r, l_r, 1.0)
    acc = acc * lax.broadcast_in_dim(1.0 / l_r, acc.shape, [0])
    # q is no longer read (both warpgroups passed the last `p_ready`): it stages the output.
    q_smem[w] = acc.astype(dt)
    store_o_and_lse(w, q_smem.at[w], o_ref.at[b, rows, half],
                    jnp.where(seen_r, m_r / LOG2E + jnp.log(l_r), -jnp.inf), lse_smem,
                    lse_ref.at[b, rows])


def slot_metadata(idx_btk, valid_btk):
  """int32 [B, T, K'/32 + 1, 32]: the slots (-1 where invalid; K padded with -1 to whole
  64-slot blocks, K' slots) and, in the last row's first entry, the blocks up to the last valid
  slot (the Triton kernel's `nblk`: the walk stops there)."""
  b, t, k = idx_btk.shape
  k_pad = -(-k // BLOCK_K) * BLOCK_K
  slot_btk = jnp.where(valid_btk, idx_btk.astype(jnp.int32), -1)
  slot_btk = jnp.pad(slot_btk, ((0, 0), (0, 0), (0, k_pad - k)), constant_values=-1)
  last_bt = jnp.max(jnp.where(valid_btk, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=-1)
  nblk_bt = -(-last_bt // BLOCK_K)
  tail_btw = jnp.zeros((b, t, META_W), jnp.int32).at[..., 0].set(nblk_bt)
  return jnp.concatenate([slot_btk, tail_btw], axis=-1).reshape(b, t, k_pad // META_W + 1,
                                                                META_W)


@functools.partial(jax.jit, static_argnames=('scale', 'interpret'))
def sparse_forward_mgpu(q_bthd, kv_bnd, idx_btk, valid_btk, *, scale: float | None = None,
                        interpret: bool | plgpu.InterpretGPUParams | None = None):
  """The compressed branch's partial `(o_bthd in kv's dtype, lse_bth fp32)`, forward only.

  q_bthd [B, T, H, d], kv_bnd [B, N, d] (bf16 or fp16; q is cast to kv's dtype), idx_btk int
  [B, T, K] entries of kv, valid_btk bool [B, T, K]: as `sparse_attention.compressed_partial`.
  interpret: the Mosaic GPU interpreter or not (None: ops/launch.py's rule, the interpreter where
  the platform is not a GPU), or the interpreter's parameters (tests: `detect_races=True`).
  """
  if q_bthd.ndim != 4 or kv_bnd.ndim != 3:
    raise ValueError(f'q_bthd must be [B,T,H,d] and kv_bnd [B,N,d]; got {q_bthd.shape}, '
                     f'{kv_bnd.shape}')
  b, t, h, d = q_bthd.shape
  if kv_bnd.shape[0] != b or kv_bnd.shape[2] != d:
    raise ValueError(f'kv_bnd {kv_bnd.shape} does not match q_bthd {q_bthd.shape} in B or d')
  if idx_btk.ndim != 3 or idx_btk.shape[:2] != (b, t):
    raise ValueError(f'idx_btk must be [B,T,K] = [{b},{t},K]; got {idx_btk.shape}')
  if valid_btk.shape != idx_btk.shape:
    raise ValueError(f'valid_btk {valid_btk.shape} must match idx_btk {idx_btk.shape}')
  if d % 128 or d > 512:
    raise ValueError(f'd must be a multiple of 128 up to 512 (two halves of whole 64-column '
                     f'chunks; one TMA box per row), got {d}')
  if h > ROWS and h % ROWS:
    raise ValueError(f'H must be at most {ROWS} or a multiple of it, got {h}')
  dt = kv_bnd.dtype
  if dt not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f'kv_bnd must be bf16 or fp16, got {dt}')
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

  n = kv_bnd.shape[1]
  heads_pad = -(-h // ROWS) * ROWS
  q_brd = pad_axis(q_bthd.astype(dt), 2, heads_pad).reshape(b, t * heads_pad, d)
  kv_bncw = kv_bnd.reshape(b, n, d // CHUNK, CHUNK)
  meta = slot_metadata(idx_btk, valid_btk)
  k_rows = meta.shape[2] - 1

  tiles = (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dt).itemsize)),
           plgpu.SwizzleTransform(SWIZZLE))
  scratch = (
      plgpu.SMEM((2, ROWS, d // 2), dt, transforms=tiles),     # q halves, then o halves
      plgpu.SMEM((BLOCK_K, d), dt, transforms=tiles),          # the block's rows, wgmma's layout
      plgpu.SMEM((BLOCK_K, d // CHUNK, CHUNK), dt),            # the rows as gathered (row-major)
      plgpu.SMEM((ROWS, BLOCK_K), dt, transforms=tiles),       # P, a 32-slot half per consumer
      plgpu.SMEM((k_rows + 1, META_W), jnp.int32),             # slots and step count
      plgpu.SMEM((2, ROWS), jnp.float32),                      # row maxima / sums per consumer
      plgpu.SMEM((ROWS,), jnp.float32),                        # lse staging
      plgpu.Barrier(),                                         # meta_bar
      plgpu.Barrier(num_arrivals=2),                           # q_bar: two halves
      plgpu.Barrier(num_arrivals=BLOCK_K),                     # raw_full: one TMA per row
      plgpu.Barrier(),                                         # kv_full (producer)
      plgpu.Barrier(num_arrivals=2),                           # kv_free (consumers)
      plgpu.Barrier(num_arrivals=2),                           # m_ready
      plgpu.Barrier(num_arrivals=2),                           # p_ready
      plgpu.Barrier(num_arrivals=2),                           # p_free
  )
  interpret = interpret_params(interpret)
  kernel = functools.partial(_kernel, d=d, k_rows=k_rows, scale=scale,
                             interpret=bool(interpret))
  o_brd, lse_br = launch_kernel(
      lambda *refs: kernel(*refs[:5], refs[5:]),
      out_type=[jax.ShapeDtypeStruct((b, t * heads_pad, d), dt),
                jax.ShapeDtypeStruct((b, t * heads_pad), jnp.float32)],
      scratch_types=scratch,
      # Mosaic reverses the grid into CUDA's (x, y, z): T last lands on x, the one dimension not
      # capped at 65,535 (as z, 65,536 queries failed to launch, CUDA_ERROR_INVALID_VALUE).
      grid=(b, heads_pad // ROWS, t),
      grid_names=('b', 'g', 't'),
      num_threads=3,
      thread_name='wg',
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
      kernel_name='csa2_sparse_fwd_mgpu',
  )(q_brd, kv_bncw, meta)
  o_bthd = o_brd.reshape(b, t, heads_pad, d)[:, :, :h]
  return o_bthd, lse_br.reshape(b, t, heads_pad)[:, :, :h]
