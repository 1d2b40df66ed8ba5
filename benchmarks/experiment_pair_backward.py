"""Experiment: the sparse backward with neighbouring queries' key/value gradients merged.

    python benchmarks/experiment_pair_backward.py [--seq_len 65536] [--out pairs.jsonl]
    python benchmarks/experiment_pair_backward.py --interpret --seq_len 64   # CPU check only

docs/performance.md section 22: the sparse backward (ops/gpu/sparse_kernel.py) is bound by the bytes
of its key/value-gradient adds, T * K * d fp32 values a layer. Here one program takes a pair of
neighbouring queries (2p, 2p + 1): it walks the first query's selection, computes both queries'
contributions to each row (the second's masked to the rows it also selected) and adds their sum
once; then it walks the rows only the second query selected. Rows both selected are added once
instead of twice; rows only the first selected cost the second query's products for nothing.
So it pays where neighbours' selections overlap. Which rows the second query shares and which
are its own are found before the kernel (a search of each sorted list in the other).

Reports the backward alone (both kernels take the same forward's o and log-sum-exp), the
neighbour overlap of each selection, and the pair kernel's gradients against the shipped
kernel's. Benchmark only: nothing in the library uses it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from timing import jsonl_emitter, time_fn  # noqa: E402  (benchmarks/timing.py)
from bench_sparse_kernel import make_inputs  # noqa: E402
from deepseek41.ops.contracts import MIN_DOT  # noqa: E402
from deepseek41.ops.gpu import sparse_kernel  # noqa: E402


def pair_lists(idx_btk, valid_btk, n, bk):
  """Per pair: the first query's sorted rows, whether the second also selected each, and the
  second query's own rows (sorted, dummy n after them); block counts of both walks."""
  rows_btk = jnp.sort(jnp.where(valid_btk, idx_btk, n).astype(jnp.int32), axis=-1)
  a_bpk, b_bpk = rows_btk[:, 0::2], rows_btk[:, 1::2]
  search = jax.vmap(jax.vmap(jnp.searchsorted))

  def member(x_bpk, y_bpk):  # x's rows that are also in y (both sorted)
    pos = jnp.minimum(search(y_bpk, x_bpk), y_bpk.shape[-1] - 1)
    return (jnp.take_along_axis(y_bpk, pos, -1) == x_bpk) & (x_bpk < n)
  shared_bpk = member(a_bpk, b_bpk).astype(jnp.int32)
  own_bpk = jnp.sort(jnp.where((b_bpk < n) & ~member(b_bpk, a_bpk), b_bpk, n), axis=-1)
  k = rows_btk.shape[-1]
  k_pad = max(MIN_DOT, pl.next_power_of_2(k))
  pad = ((0, 0), (0, 0), (0, k_pad - k))
  blocks = lambda x: (-(-jnp.sum(x < n, -1) // bk))[..., None].astype(jnp.int32)
  return (jnp.pad(a_bpk, pad, constant_values=n), jnp.pad(shared_bpk, pad),
          jnp.pad(own_bpk, pad, constant_values=n), blocks(a_bpk), blocks(own_bpk))


def _pair_kernel(nblk_a_ref, nblk_c_ref, a_ref, shared_ref, c_ref, q_ref, kv_ref, o_ref, do_ref,
                 lse_ref, dkv_in_ref, dq_ref, dkv_ref, *, n, bk, scale, chunk, interpret):
  del dkv_in_ref
  _, h, d = q_ref.shape  # [2, H, d]: the pair's two queries
  q = [q_ref[i] for i in range(2)]
  do = [do_ref[i] for i in range(2)]
  dt = q[0].dtype
  lse = [jnp.where(lse_ref[i] == -jnp.inf, 0.0, lse_ref[i]) for i in range(2)]
  delta = [jnp.sum(do_ref[i].astype(jnp.float32) * o_ref[i].astype(jnp.float32), axis=1)
           for i in range(2)]

  def probs(i, kv_kd, keep_k):
    s = jax.lax.dot_general(q[i], kv_kd, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
    p = jnp.where(keep_k[None, :], jnp.exp(s - lse[i][:, None]), 0.0)
    dp = jax.lax.dot_general(do[i], kv_kd, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return p, p * (dp - delta[i][:, None])

  def add_rows(rows_k, terms):  # sum of the queries' dS^T q + P^T dO, chunk columns at a time
    for c in range(0, d, chunk):
      cols = pl.ds(c, chunk)
      acc = None
      for i, p, ds in terms:
        part = (jax.lax.dot_general(ds.astype(dt), q_ref[i, :, cols], (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale +
                jax.lax.dot_general(p.astype(dt), do_ref[i, :, cols], (((0,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32))
        acc = part if acc is None else acc + part
      sparse_kernel.add_rows(dkv_ref, rows_k, c, acc, n=n, interpret=interpret)

  def walk_first(j, carry):
    dq0, dq1 = carry
    rows_k = a_ref[pl.ds(j * bk, bk)]
    kv_kd = kv_ref[rows_k, pl.ds(0, d)]
    p0, ds0 = probs(0, kv_kd, rows_k < n)
    p1, ds1 = probs(1, kv_kd, shared_ref[pl.ds(j * bk, bk)] != 0)
    add_rows(rows_k, [(0, p0, ds0), (1, p1, ds1)])
    dq0 = dq0 + jax.lax.dot_general(ds0.astype(dt), kv_kd, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
    dq1 = dq1 + jax.lax.dot_general(ds1.astype(dt), kv_kd, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
    return dq0, dq1

  def walk_own(j, dq1):
    rows_k = c_ref[pl.ds(j * bk, bk)]
    kv_kd = kv_ref[rows_k, pl.ds(0, d)]
    p1, ds1 = probs(1, kv_kd, rows_k < n)
    add_rows(rows_k, [(1, p1, ds1)])
    return dq1 + jax.lax.dot_general(ds1.astype(dt), kv_kd, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  zero = jnp.zeros((h, d), jnp.float32)
  dq0, dq1 = jax.lax.fori_loop(0, nblk_a_ref[0], walk_first, (zero, zero))
  dq1 = jax.lax.fori_loop(0, nblk_c_ref[0], walk_own, dq1)
  dq_ref[0] = (dq0 * scale).astype(dq_ref.dtype)
  dq_ref[1] = (dq1 * scale).astype(dq_ref.dtype)


def pair_backward(q_bthd, kv_bnd, idx_btk, valid_btk, o_bthd, lse_bth, do_bthd, *, scale,
                  block_k=32, num_warps=4, chunk=256, interpret=False):
  """(dq, dkv) of the sparse partial for a cotangent on o only (lse's cotangent 0)."""
  b, t, h, d = q_bthd.shape
  n = kv_bnd.shape[1]
  assert t % 2 == 0, t
  block_k = min(block_k, max(MIN_DOT, pl.next_power_of_2(idx_btk.shape[-1])))
  a, shared, own, nblk_a, nblk_c = pair_lists(idx_btk, valid_btk, n, block_k)
  rows = -(-(n + 1) // MIN_DOT) * MIN_DOT
  kv_bmd = jnp.pad(kv_bnd, ((0, 0), (0, rows - n), (0, 0)))
  k_pad = a.shape[-1]
  pair = lambda x: x.reshape(b, t // 2, 2, *x.shape[2:])
  per_pair = lambda shape: pl.BlockSpec((None, None) + shape,
                                        lambda i, j: (j, i) + (0,) * len(shape))
  kv_spec = pl.BlockSpec((None, rows, d), lambda i, j: (j, 0, 0))
  kernel = functools.partial(_pair_kernel, n=n, bk=block_k, scale=scale,
                             chunk=min(chunk, d), interpret=interpret)
  dq, dkv = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((b, t // 2, 2, h, d), q_bthd.dtype),
                 jax.ShapeDtypeStruct((b, rows, d), jnp.float32)],
      grid=(t // 2, b),
      in_specs=[per_pair((1,)), per_pair((1,)), per_pair((k_pad,)), per_pair((k_pad,)),
                per_pair((k_pad,)), per_pair((2, h, d)), kv_spec, per_pair((2, h, d)),
                per_pair((2, h, d)), per_pair((2, h)), kv_spec],
      out_specs=[per_pair((2, h, d)), kv_spec],
      input_output_aliases={10: 1},
      compiler_params=None if interpret else sparse_kernel.compiler_params(num_warps, 1),
      interpret=interpret,
      name='csa2_sparse_bwd_pairs',
  )(nblk_a, nblk_c, a, shared, own, pair(q_bthd), kv_bmd, pair(o_bthd), pair(do_bthd),
    pair(lse_bth.astype(jnp.float32)), jnp.zeros((b, rows, d), jnp.float32))
  return dq.reshape(b, t, h, d), dkv[:, :n].astype(kv_bnd.dtype)


def shipped_backward(q, kv, idx, valid, o, lse, do, *, scale, interpret=False):
  t = sparse_kernel.default_tiles(q.shape[2])[1]
  return sparse_kernel._backward(q, kv, idx, valid, o, lse, do, jnp.zeros_like(lse), scale,
                                 t.block_k, t.num_warps, t.head_group, t.dkv_chunk, t.num_stages,
                                 interpret)


def local_selection(key, t, n, k, ratio, share):
  """One pick in each of k disjoint bins of the visible prefix (distinct, sorted, as a top-k's
  set), shared by 16 neighbouring queries with probability `share` and the query's own
  otherwise. With share=0 neighbours rarely pick the same row once the bins are a few rows wide
  (bench_sparse_kernel.selection is alike)."""
  limit_t = (jnp.arange(t) + 1) // ratio
  k1, k2, k3 = jax.random.split(key, 3)
  u_group = jax.random.uniform(k1, (t // 16 + 1, k))[jnp.arange(t) // 16]
  u_tk = jnp.where(jax.random.uniform(k2, (t, k)) < share, u_group,
                   jax.random.uniform(k3, (t, k)))
  start_tk = (jnp.arange(k)[None, :] * limit_t[:, None]) // k  # bin j: [start, start + width)
  width_t1 = jnp.maximum(limit_t // k, 1)[:, None]
  idx_tk = start_tk + jnp.floor(u_tk * width_t1).astype(jnp.int32)
  small = limit_t[:, None] <= k
  idx_tk = jnp.where(small, jnp.arange(k)[None, :], idx_tk)
  valid_tk = jnp.where(small, jnp.arange(k)[None, :] < limit_t[:, None], True)
  return jnp.minimum(idx_tk, n - 1)[None], valid_tk[None]


def overlap(idx, valid, n):
  a, shared, own, _, _ = pair_lists(idx, valid, n, 32)
  counted = jnp.sum(a < n) + jnp.sum(own < n)
  return float(jnp.sum(shared)) / max(float(jnp.sum(a < n)), 1.0), int(counted)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--seq_len', type=int, default=65536)
  p.add_argument('--heads', type=int, default=16)
  p.add_argument('--ratio', type=int, default=2)
  p.add_argument('--topk', type=int, default=512)
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--shares', default='0,0.5,0.8,0.95',
                 help="selections whose picks neighbours share with these probabilities")
  p.add_argument('--interpret', action='store_true', help='CPU: check only, small shapes')
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  t, h, d, k, ratio = args.seq_len, args.heads, 512, args.topk, args.ratio
  if args.interpret:
    d, k = 32, 16
  n = t // ratio
  scale = d ** -0.5
  fwd = jax.jit(lambda q, kv, i, v: sparse_kernel._forward(
      q, kv, i, v, scale, False, h, *sparse_kernel.default_tiles(h)[0], args.interpret)[:2])
  for share in map(float, args.shares.split(',')):
    def inputs(seed, share=share):
      q, kv, _, _, do = make_inputs(seed, t, h, d, ratio, k, jnp.bfloat16)
      idx, valid = local_selection(jax.random.key(seed + 100), t, n, k, ratio, share)
      o, lse = fwd(q, kv, idx, valid)
      return q, kv, idx, valid, o, lse, do
    args0 = inputs(0)
    neighbours, rows = overlap(args0[2], args0[3], n)
    runs = {'shipped': jax.jit(functools.partial(shipped_backward, scale=scale,
                                                 interpret=args.interpret)),
            'pairs': jax.jit(functools.partial(pair_backward, scale=scale,
                                               interpret=args.interpret))}
    got = {key: [np.asarray(x, np.float32) for x in fn(*args0)] for key, fn in runs.items()}
    err = {g: float(np.linalg.norm(got['pairs'][i] - got['shipped'][i]) /
                    np.linalg.norm(got['shipped'][i])) for i, g in enumerate(('dq', 'dkv'))}
    rec = {'shared_picks': share, 't': t, 'heads': h, 'neighbour_overlap': round(neighbours, 3),
           'rows_added_vs_shipped': round(rows / float(jnp.sum(args0[3])), 3), 'rel_err': err}
    if not args.interpret:
      for key, fn in runs.items():
        rec[f'{key}_ms'] = round(time_fn(fn, inputs, args.reps)[0], 3)
      lists = jax.jit(lambda i, v: pair_lists(i, v, n, 32))
      rec['pair_lists_ms'] = round(time_fn(lists, lambda s: inputs(s)[2:4], args.reps)[0], 3)
    emit(rec)


if __name__ == '__main__':
  main()
