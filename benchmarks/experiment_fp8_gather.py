"""Experiment: the sparse forward gathering FP4-format kv rows stored as 8-bit codes + scales.

The compressed kv is fake-quantized to `fp4_e4m3_16` (an e2m1 code times an e4m3 scale per 16
values; configs/ablation_1b.py), so each value is exactly code * scale, and both are e4m3
values: a row can be stored as 512 e4m3 codes and 32 e4m3 scales (544 bytes against 1,024 in
bf16) and decoded on chip without changing one bit of the bf16 value the kernel multiplies.
The sparse kernels gather ~512 such rows per query and are bound by those bytes
(docs/performance.md 22). Timed: the shipped forward (bf16 rows) against the same kernel
gathering 8-bit rows (a) without scales (the floor), (b) with one scale per row, (c) with the
per-16 scales (the real decode), at configs/ablation_1b.py's shapes.

    python benchmarks/experiment_fp8_gather.py [--t 65536] [--out f.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from timing import jsonl_emitter, time_queued  # noqa: E402
from bench_sparse_kernel import make_inputs  # noqa: E402
from deepseek41.ops import sparse_kernel as S  # noqa: E402
from deepseek41.ops import stand_in  # noqa: E402

F8 = jnp.float8_e4m3fn
BLOCK = 16


def _decoder(mode, d):
  """A `_gather(kv_ref, rows_k, d)` reading 8-bit rows [codes (d) | scales (d / 16)]."""
  def gather(kv_ref, rows_k, _d):
    codes = kv_ref[rows_k, pl.ds(0, d)]
    if mode == 'codes':
      return codes.astype(jnp.bfloat16)
    if mode == 'row_scale':
      sc = kv_ref[rows_k, pl.ds(d, 1)].astype(jnp.float32)
      return (codes.astype(jnp.float32) * sc).astype(jnp.bfloat16)
    sc = kv_ref[rows_k, pl.ds(d, d // BLOCK)]
    bk = codes.shape[0]
    if mode == 'block_scale_bf16':
      v = codes.astype(jnp.bfloat16).reshape(bk, d // BLOCK, BLOCK) * \
          sc.astype(jnp.bfloat16)[:, :, None]
      return v.reshape(bk, d)
    v = codes.astype(jnp.float32).reshape(bk, d // BLOCK, BLOCK) * \
        sc.astype(jnp.float32)[:, :, None]
    return v.reshape(bk, d).astype(jnp.bfloat16)
  return gather


def forward(q, kv_rows, idx, valid, *, scale, out_dtype, interpret=False, block_k=64,
            num_warps=4):
  """`sparse_kernel._forward` with o in `out_dtype` (kv_rows may be wider than q: codes+scales)."""
  b, t, h, d = q.shape
  n = kv_rows.shape[1]
  kv_bmw, idx_btk, nblk_bt1, bk = S.prepare_rows(kv_rows, idx, valid, block_k)
  rows, k_pad, w = kv_bmw.shape[1], idx_btk.shape[-1], kv_bmw.shape[2]
  spec = S.per_query_specs(h, d, rows, k_pad)
  return stand_in.pallas_call(
      functools.partial(S._fwd_kernel, n=n, bk=bk, scale=scale, heads=h),
      out_shape=[jax.ShapeDtypeStruct((b, t, h, d), out_dtype),
                 jax.ShapeDtypeStruct((b, t, h), jnp.float32)],
      grid=(t, b),
      in_specs=[spec['nblk'], spec['q'], pl.BlockSpec((None, rows, w), lambda i, j: (j, 0, 0)),
                spec['idx']],
      out_specs=[spec['q'], spec['h']],
      compiler_params=None if interpret else S.compiler_params(num_warps, 2),
      interpret=interpret, name='csa2_sparse_fwd_f8')(nblk_bt1, q, kv_bmw, idx_btk)


def pack(kv_bnd):
  """(rows [B, N, d + d/16] e4m3, the bf16 values they decode to): fp4_e4m3_16-like values."""
  b, n, d = kv_bnd.shape
  x = kv_bnd.astype(jnp.float32).reshape(b, n, d // BLOCK, BLOCK)
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  sc = jnp.maximum(amax / 6.0, 2.0**-9).astype(F8).astype(jnp.float32)
  grid = jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], jnp.float32)
  mag = jnp.abs(x / sc)
  code = grid[jnp.argmin(jnp.abs(mag[..., None] - grid), axis=-1)] * jnp.sign(x)
  values = (code * sc).reshape(b, n, d).astype(jnp.bfloat16)
  rows = jnp.concatenate([code.reshape(b, n, d).astype(F8), sc[..., 0].astype(F8)], axis=-1)
  return rows, values


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--t', type=int, default=65536)
  ap.add_argument('--reps', type=int, default=5)
  ap.add_argument('--modes', default='codes,row_scale,block_scale,block_scale_bf16')
  ap.add_argument('--out')
  ap.add_argument('--interpret', action='store_true')
  args = ap.parse_args(argv)
  emit = jsonl_emitter(args.out)
  common = dict(date=datetime.datetime.now().isoformat(timespec='seconds'),
                device=str(jax.devices()[0].device_kind), command=' '.join(sys.argv))
  h, d, ratio, k = 16, 512, 2, 512
  q, kv, idx, valid, _ = make_inputs(0, args.t, h, d, ratio, k, jnp.bfloat16)
  rows, values = pack(kv)
  scale = d ** -0.5
  base = jax.jit(functools.partial(forward, scale=scale, out_dtype=jnp.bfloat16,
                                   interpret=args.interpret))
  want = base(q, values, idx, valid)
  ms = time_queued(base, (q, values, idx, valid), args.reps)
  emit(dict(variant='bf16 rows (shipped kernel)', ms=ms, t=args.t, **common))
  original = S._gather
  try:
    for mode in args.modes.split(','):
      S._gather = _decoder(mode, d)
      fn = jax.jit(functools.partial(forward, scale=scale, out_dtype=jnp.bfloat16,
                                     interpret=args.interpret))
      rec = dict(variant=mode, t=args.t)
      try:
        r = rows if mode != 'row_scale' else jnp.concatenate(
            [rows[..., :d], jnp.ones(rows.shape[:2] + (d // BLOCK,), F8)], -1)
        got = fn(q, r, idx, valid)
        if mode.startswith('block_scale'):
          rec['max_err'] = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) -
                                                 want[0].astype(jnp.float32))))
          rec['lse_err'] = float(jnp.max(jnp.abs(got[1] - want[1])))
        rec['ms'] = time_queued(fn, (q, r, idx, valid), args.reps)
      except Exception as e:  # noqa: BLE001
        rec['error'] = f'{type(e).__name__}: {str(e)[:300]}'
      emit({**rec, **common})
  finally:
    S._gather = original


if __name__ == '__main__':
  main()
