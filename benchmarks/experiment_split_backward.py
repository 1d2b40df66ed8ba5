"""Experiment (not library code): where the split sparse backward of commit d0b2f77 loses.

Times, alone, at configs/ablation_1b.py's sparse shapes (65,536 queries, 16 heads x 512, top-512,
ratio 2), each kernel of the split backward and its variants against the shipped fused backward:
  dq_nostore   dq only (dS, P not written): the floor of the first kernel
  dq_hk        dq + dS, P written as [H, K] per query (d0b2f77)
  dq_kh        dq + dS, P written as [K, H] per query
  dkv_U        the key/value kernel over U calls' coefficients (one atomic add for all U)
  fused        the shipped backward (ops/sparse_kernel.py)
    python benchmarks/experiment_split_backward.py --out split.jsonl
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from timing import jsonl_emitter, time_fn  # noqa: E402
from bench_sparse_kernel import make_inputs  # noqa: E402
from deepseek41.ops import sparse_kernel as sk  # noqa: E402


def _setup(q_ref, o_ref, do_ref, lse_ref, dlse_ref):
  q_hd, do_hd = q_ref[...], do_ref[...]
  lse_h = lse_ref[...]
  lse_safe_h = jnp.where(lse_h == -jnp.inf, 0.0, lse_h)
  delta_h = jnp.sum(do_hd.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1) - \
      dlse_ref[...]
  return q_hd, do_hd, lse_safe_h, delta_h


def _dq_kernel(nblk_ref, q_ref, kv_ref, idx_ref, o_ref, do_ref, lse_ref, dlse_ref, dq_ref,
               *coef_refs, n, bk, scale, layout):
  h, d = q_ref.shape
  q_hd, do_hd, lse_safe_h, delta_h = _setup(q_ref, o_ref, do_ref, lse_ref, dlse_ref)
  dt = q_hd.dtype

  def block(j, dq_hd):
    slots = pl.ds(j * bk, bk)
    rows_k = idx_ref[slots]
    kv_kd = sk._gather(kv_ref, rows_k, d)
    p_hk = jnp.exp(sk._masked_scores(q_hd, kv_kd, rows_k, n, scale) - lse_safe_h[:, None])
    dp_hk = jax.lax.dot_general(do_hd, kv_kd, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    ds_hk = p_hk * (dp_hk - delta_h[:, None])
    if layout == 'hk':
      coef_refs[0][:, slots] = (ds_hk * scale).astype(dt)
      coef_refs[1][:, slots] = p_hk.astype(dt)
    elif layout == 'kh':
      coef_refs[0][slots, :] = (ds_hk * scale).astype(dt).T
      coef_refs[1][slots, :] = p_hk.astype(dt).T
    return dq_hd + jax.lax.dot_general(ds_hk.astype(dt), kv_kd, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)

  dq_hd = jax.lax.fori_loop(0, nblk_ref[0], block, jnp.zeros((h, d), jnp.float32))
  dq_ref[...] = (dq_hd * scale).astype(dq_ref.dtype)


def dq_call(q, kv, idx, valid, o, lse, do, layout, scale):
  b, t, h, d = q.shape
  n = kv.shape[1]
  kv_bmd, idx_btk, nblk, bk = sk.prepare_rows(kv, idx, valid, 32)
  rows, k_pad = kv_bmd.shape[1], idx_btk.shape[-1]
  spec = sk.per_query_specs(h, d, rows, k_pad)
  shape = (h, k_pad) if layout == 'hk' else (k_pad, h)
  coef_spec = pl.BlockSpec((None, None) + shape, lambda i, j: (j, i, 0, 0))
  coef = jax.ShapeDtypeStruct((b, t) + shape, q.dtype)
  n_coef = 0 if layout == 'none' else 2
  return pl.pallas_call(
      functools.partial(_dq_kernel, n=n, bk=bk, scale=scale, layout=layout),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] + [coef] * n_coef,
      grid=(t, b),
      in_specs=[spec['nblk'], spec['q'], spec['kv'], spec['idx'], spec['q'], spec['q'],
                spec['h'], spec['h']],
      out_specs=[spec['q']] + [coef_spec] * n_coef,
      compiler_params=sk.compiler_params(4, 1),
      name=f'dq_{layout}',
  )(nblk, q, kv_bmd, idx_btk, o, do, lse, jnp.zeros_like(lse))


def _dkv_kernel(nblk_ref, idx_ref, *refs, n, bk, uses, chunk, layout):
  part_refs, dkv_ref = refs[:4 * uses], refs[-1]
  d = dkv_ref.shape[-1]
  contract = 0 if layout == 'hk' else 1

  def block(j, carry):
    slots = pl.ds(j * bk, bk)
    rows_k = idx_ref[slots]
    for c in range(0, d, chunk):
      cols = pl.ds(c, chunk)
      acc = None
      for ds_ref, p_ref, q_ref, do_ref in zip(*[iter(part_refs)] * 4):
        ds = ds_ref[:, slots] if layout == 'hk' else ds_ref[slots, :]
        p = p_ref[:, slots] if layout == 'hk' else p_ref[slots, :]
        term = (jax.lax.dot_general(ds, q_ref[:, cols], (((contract,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32) +
                jax.lax.dot_general(p, do_ref[:, cols], (((contract,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32))
        acc = term if acc is None else acc + term
      sk.add_rows(dkv_ref, rows_k, c, acc, n=n, interpret=False)
    return carry

  jax.lax.fori_loop(0, nblk_ref[0], block, 0)


def dkv_call(kv, idx, valid, parts, layout):
  b, n, d = kv.shape
  h = parts[0][2].shape[2]
  kv_bmd, idx_btk, nblk, bk = sk.prepare_rows(kv, idx, valid, 32)
  rows, k_pad = kv_bmd.shape[1], idx_btk.shape[-1]
  spec = sk.per_query_specs(h, d, rows, k_pad)
  shape = (h, k_pad) if layout == 'hk' else (k_pad, h)
  coef_spec = pl.BlockSpec((None, None) + shape, lambda i, j: (j, i, 0, 0))
  dkv_spec = pl.BlockSpec((None, rows, d), lambda i, j: (j, 0, 0))
  ins = [x for part in parts for x in part]
  return pl.pallas_call(
      functools.partial(_dkv_kernel, n=n, bk=bk, uses=len(parts), chunk=256, layout=layout),
      out_shape=jax.ShapeDtypeStruct((b, rows, d), jnp.float32),
      grid=(idx_btk.shape[1], b),
      in_specs=[spec['nblk'], spec['idx']] + [coef_spec, coef_spec, spec['q'], spec['q']] *
      len(parts) + [dkv_spec],
      out_specs=dkv_spec,
      input_output_aliases={2 + len(ins): 0},
      compiler_params=sk.compiler_params(4, 1),
      name=f'dkv_{layout}',
  )(nblk, idx_btk, *ins, jnp.zeros((b, rows, d), jnp.float32))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--seq_len', type=int, default=65536)
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--out')
  args = p.parse_args(argv)
  emit = jsonl_emitter(args.out)
  t, h, d, ratio, k = args.seq_len, 16, 512, 2, 512
  scale = d ** -0.5

  def inputs(seed):
    q, kv, idx, valid, ct = make_inputs(seed, t, h, d, ratio, k, jnp.bfloat16)
    o, lse, _ = sk._forward(q, kv, idx, valid, scale, False, h, 64, 4, False)
    return q, kv, idx, valid, o, lse, ct.astype(jnp.bfloat16)

  zeros = lambda lse: jnp.zeros_like(lse)  # noqa: E731
  runs = {
      'fused': lambda q, kv, idx, valid, o, lse, do: sk._backward(
          q, kv, idx, valid, o, lse, do, zeros(lse), scale, 32, 4, 32, 256, False),
      **{f'dq_{lay}': (lambda q, kv, idx, valid, o, lse, do, lay=lay: dq_call(
          q, kv, idx, valid, o, lse, do, lay, scale)) for lay in ('none', 'hk', 'kh')},
  }
  for name, fn in runs.items():
    try:
      ms, _ = time_fn(jax.jit(fn), inputs, args.reps)
      emit({'kernel': name, 'ms': round(ms, 3)})
    except Exception as e:  # noqa: BLE001
      emit({'kernel': name, 'error': f'{type(e).__name__}: {str(e)[:400]}'})
  for lay in ('hk', 'kh'):
    for uses in (1, 4):
      def coef_inputs(seed, lay=lay, uses=uses):
        q, kv, idx, valid, o, lse, do = inputs(seed)
        _, ds, pp = dq_call(q, kv, idx, valid, o, lse, do, lay, scale)
        return kv, idx, valid, tuple((ds, pp, q, do) for _ in range(uses))
      try:
        ms, _ = time_fn(jax.jit(lambda kv, idx, valid, parts, lay=lay: dkv_call(
            kv, idx, valid, list(parts), lay)), coef_inputs, args.reps)
        emit({'kernel': f'dkv_{lay}', 'uses': uses, 'ms': round(ms, 3)})
      except Exception as e:  # noqa: BLE001
        emit({'kernel': f'dkv_{lay}', 'uses': uses, 'error': f'{type(e).__name__}: {str(e)[:400]}'})


if __name__ == '__main__':
  main()
