"""The sparse branch's key/value gradient: per-query atomics against tile-merged adds (issue 46.1).

Usage (GPU; `--smoke` runs a small case in the Pallas interpreter on the CPU):
    python benchmarks/bench_merged_dkv.py --out dkv.jsonl
    python benchmarks/bench_merged_dkv.py --cases 1b --seq_lens 4096 --tiles 4,8 --block_u 32

Times only the key/value kernel (`sparse_kernel.dkv_from_coefficients`, tile 0 = today's
atomics per query, tile > 0 = ops/gpu/merged_dkv.py), from the coefficients the dq kernel
leaves, and the merged form's union (a sort of each tile's picks, once per selection) on its
own. The merged form wins only where neighbouring queries pick the same entries, so each
selection reports its overlap (valid picks / the tiles' distinct entries):
- `spread`: each query's 512 picks evenly spread over its visible prefix with jitter, as
  bench_sparse_kernel.py: neighbours share almost nothing, the merged form's worst case;
- `pooled`: each chunk of 64 queries shares a pool (the hierarchical indexer's candidate blocks:
  16 blocks of 128 entries) and each query takes the top 512 of the pool under its own scores
  mixed with the chunk's (`--rho`, the correlation of neighbours' scores);
- `recent`: every query's picks are the 512 entries just before it (a local-attention limit:
  the most overlap there can be).
How alike a trained model's neighbours pick, the task evaluation's `neighbour_shared` says
(model/diagnostics.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from bench_sparse_kernel import selection  # noqa: E402
from timing import jsonl_emitter, time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.ops.gpu import merged_dkv, sparse_kernel  # noqa: E402

CASES = {'1b': dict(h=16, d=512, ratio=2), 'v41': dict(h=64, d=512, ratio=4)}


def spread(key, t, n, k, ratio, rho):
  del rho
  idx, valid = selection(key, t, n, k, ratio)  # bench_sparse_kernel.py's
  return idx[0], valid[0]


def pooled(key, t, n, k, ratio, rho, chunk=64, blocks=16, block=128):
  limit_t = (jnp.arange(t) + 1) // ratio
  kc, kq, kb = jax.random.split(key, 3)
  # The chunk's candidate blocks: `blocks` distinct blocks of its last query's visible prefix.
  last_c = limit_t[chunk - 1::chunk]
  nblk_c = jnp.maximum(-(-last_c // block), 1)
  pick_cb = jnp.argsort(jax.random.uniform(kb, (t // chunk, -(-n // block))), axis=-1)[:, :blocks]
  pick_cb = jnp.where(pick_cb < nblk_c[:, None], pick_cb,
                      pick_cb % nblk_c[:, None])  # short prefixes: blocks repeat
  pool_cp = (pick_cb[:, :, None] * block + jnp.arange(block)).reshape(t // chunk, -1)
  chunk_cp = jax.random.normal(kc, pool_cp.shape)
  own_tp = jax.random.normal(kq, (t, pool_cp.shape[1]))
  score_tp = rho * jnp.repeat(chunk_cp, chunk, axis=0) + jnp.sqrt(1 - rho ** 2) * own_tp
  pool_tp = jnp.repeat(pool_cp, chunk, axis=0)
  pool_tp, score_tp = jax.lax.sort((pool_tp, score_tp), dimension=1, num_keys=1)
  # a repeated block would pick an entry twice: keep one copy
  first = jnp.concatenate([jnp.ones_like(pool_tp[:, :1], bool),
                           pool_tp[:, 1:] != pool_tp[:, :-1]], -1)
  score_tp = jnp.where((pool_tp < limit_t[:, None]) & first, score_tp, -jnp.inf)
  top, at = jax.lax.top_k(score_tp, k)
  return jnp.take_along_axis(pool_tp, at, -1).astype(jnp.int32), jnp.isfinite(top)


def recent(key, t, n, k, ratio, rho):
  del key, rho
  limit_t = (jnp.arange(t) + 1) // ratio
  idx = limit_t[:, None] - 1 - jnp.arange(k)[None, :]
  return jnp.clip(idx, 0, n - 1).astype(jnp.int32), idx >= 0


SELECTIONS = {'spread': spread, 'pooled': pooled, 'recent': recent}


def tile_overlap(idx_btk, valid_btk, n, tile):
  """Valid picks per distinct entry of each tile of `tile` queries: how many adds merging
  saves (1 = none)."""
  _, _, count = merged_dkv.query_tile_union(idx_btk, valid_btk, n, tile)
  return float(jnp.sum(valid_btk) / jnp.maximum(jnp.sum(count), 1))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--cases', default='1b,v41')
  p.add_argument('--seq_lens', default='4096,65536')
  p.add_argument('--topk', type=int, default=512)
  p.add_argument('--selections', default='spread,pooled,recent')
  p.add_argument('--rho', type=float, default=0.8)
  p.add_argument('--tiles', default='4,8,16', help='merged query tiles (0, the atomics, always)')
  p.add_argument('--block_u', default='32')
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--smoke', action='store_true', help='tiny shapes in the interpreter (CPU)')
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  interpret = args.smoke
  k = 32 if args.smoke else args.topk
  seq_lens = [256] if args.smoke else [int(v) for v in args.seq_lens.split(',')]
  for case in args.cases.split(','):
    h, d, ratio = CASES[case]['h'], 64 if args.smoke else CASES[case]['d'], CASES[case]['ratio']
    for t in seq_lens:
      n = t // ratio
      for sel_name in args.selections.split(','):
        idx, valid = SELECTIONS[sel_name](jax.random.key(0), t, n, k, ratio, args.rho)
        idx, valid = idx[None], valid[None]
        k_pad = max(16, pl.next_power_of_2(k))
        ks = jax.random.split(jax.random.key(1), 4)
        ds = jax.random.normal(ks[0], (1, t, k_pad, h), jnp.bfloat16)
        pr = jax.random.uniform(ks[1], (1, t, k_pad, h)).astype(jnp.bfloat16)
        q = jax.random.normal(ks[2], (1, t, h, d), jnp.bfloat16)
        do = jax.random.normal(ks[3], (1, t, h, d), jnp.bfloat16)
        kv = jnp.zeros((1, n, d), jnp.bfloat16)
        parts = [(ds, pr, q, do)]
        nw = 4 if h <= 16 else 8
        base = None
        for tile in [0] + [int(v) for v in args.tiles.split(',') if v]:
          for bu in ([32] if tile == 0 else [int(v) for v in args.block_u.split(',')]):
            fn = jax.jit(lambda kv, idx, valid, parts, tile=tile, bu=bu:
                         sparse_kernel.dkv_from_coefficients(
                             kv, idx, valid, parts, bu, nw, 256 if h <= 16 else 512,
                             interpret, tile))
            out = jax.block_until_ready(fn(kv, idx, valid, parts))
            ms, compile_s = time_fn(fn, lambda rep: (kv, idx, valid, parts), args.reps)
            rec = {'case': case, 'seq_len': t, 'selection': sel_name, 'tile': tile,
                   'block_u': bu, 'ms': round(ms, 3), 'compile_s': round(compile_s, 1)}
            if tile:
              rec['overlap'] = round(tile_overlap(idx, valid, n, tile), 2)
              union = jax.jit(lambda idx, valid, tile=tile: merged_dkv.query_tile_union(
                  idx, valid, n, tile))
              rec['union_ms'] = round(time_fn(union, lambda rep: (idx, valid), args.reps)[0], 3)
              err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - base)) /
                          jnp.maximum(jnp.max(jnp.abs(base)), 1e-30))
              rec['max_rel_diff_vs_atomics'] = err
            else:
              base = out.astype(jnp.float32)
            emit(rec)


if __name__ == '__main__':
  main()
