"""The expert exchanges on the devices at hand (ops/parallel/expert_parallel.py).

Runs each dropless exchange (`allgather`, `ragged`, `padded`) in a shard_map over all local
devices on the `expert` axis against the experts without any exchange, forward and backward;
prints one JSON line per case. On one GPU the axis has size 1: this checks that XLA lowers and
runs the collectives there.

With --emulate S (one device) it also times what one device of an S-way expert split computes
under `allgather`, without the collectives: its E/S experts on the S x N gathered tokens, only
the assignments to them valid, partial outputs in f32 (and bf16, and with a bounded
expert_buffer_factor); against one device's E experts on its N tokens. The difference is the
exchange's local overhead; the collectives' bytes are printed for an estimate at a given link
speed.

    python benchmarks/check_expert_exchange.py [--backend grouped] [--tokens 8192] [--emulate 2]
"""

import argparse
import json
import time
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from deepseek41.ops import expert_gemm
from deepseek41.ops.parallel import expert_parallel as ep

sys.path.insert(0, str(Path(__file__).parent))
from timing import time_fn  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--backend', default='grouped')
  ap.add_argument('--tokens', type=int, default=8192)
  ap.add_argument('--d', type=int, default=1024)
  ap.add_argument('--f', type=int, default=384)
  ap.add_argument('--experts', type=int, default=64)
  ap.add_argument('--k', type=int, default=6)
  ap.add_argument('--exchanges', nargs='*', default=['allgather', 'ragged', 'padded'],
                  choices=['allgather', 'ragged', 'padded'])
  ap.add_argument('--emulate', type=int, default=0, help='S: one device of an S-way split')
  ap.add_argument('--buffer_factors', type=float, nargs='*', default=[1.25],
                  help='--emulate: also the shard with model.expert_buffer_factor at these')
  ap.add_argument('--reps', type=int, default=10)
  ap.add_argument('--profile', default='', help='a directory: trace 3 calls of each exchange')
  args = ap.parse_args()
  n_dev = jax.device_count()
  mesh = jax.make_mesh((n_dev,), ('expert',), axis_types=(AxisType.Auto,))
  ks = jax.random.split(jax.random.key(0), 6)
  b = n_dev
  t = args.tokens // b
  x = jax.random.normal(ks[0], (b, t, args.d), jnp.bfloat16)
  _, idx = jax.lax.top_k(jax.random.normal(ks[1], (b, t, args.experts)), args.k)
  wt = jax.nn.softmax(jax.random.normal(ks[2], (b, t, args.k)), -1)
  valid = jnp.ones((b, t), bool)
  w = [jax.random.normal(k, s, jnp.bfloat16) * 0.05 for k, s in zip(
      ks[3:], ((args.experts, args.d, args.f),) * 2 + ((args.experts, args.f, args.d),))]

  want = jax.jit(lambda *a: expert_gemm.expert_ffn_batched(
      *a, swiglu_limit=10.0, backend=args.backend)[0])(x, idx, wt, valid, *w)

  for exchange in args.exchanges:
    def local(x, idx, wt, valid, wg, wu, wd):
      if exchange == 'allgather':
        y, dropped = ep._allgather_exchange(x, idx, wt, valid, wg, wu, wd, 'expert', None,
                                            10.0, args.backend, 'off', None, 'float32', 0.0)
      else:
        y, dropped = ep._dropless_exchange(x, idx, wt, valid, wg, wu, wd, 'expert', None,
                                           10.0, args.backend, 'off', 0.0, exchange)
      return y, dropped[None]
    tok, wsp = P('expert'), P('expert')
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(tok,) * 4 + (wsp,) * 3,
                               out_specs=(tok, P('expert')), check_vma=False))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) ** 2),
                            argnums=(0, 4, 5, 6)))
    rec = {'exchange': exchange, 'devices': n_dev, 'backend': args.backend,
           'tokens': args.tokens}
    try:
      with jax.set_mesh(mesh):
        y, dropped = fn(x, idx, wt, valid, *w)
        jax.block_until_ready(grad(x, idx, wt, valid, *w))
        t0 = time.perf_counter()
        for _ in range(10):
          out = grad(x, idx, wt, valid, *w)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t0) * 100
        if args.profile:
          with jax.profiler.trace(f'{args.profile}/{exchange}'):
            for _ in range(3):
              out = grad(x, idx, wt, valid, *w)
            jax.block_until_ready(out)
      rec.update(ok=True, max_err=float(jnp.max(jnp.abs(y.astype(jnp.float32) -
                                                        want.astype(jnp.float32)))),
                 scale=float(jnp.max(jnp.abs(want.astype(jnp.float32)))),
                 dropped=int(np.sum(dropped)), fwd_bwd_ms=ms)
    except Exception as e:  # noqa: BLE001 - the point is to report it
      rec.update(ok=False, error=f'{type(e).__name__}: {str(e)[:300]}')
    print(json.dumps(rec), flush=True)
  if args.emulate > 1:
    emulate(args)


def emulate(args):
  """One device's share of an S-way expert split under allgather, against one whole device."""
  s, n, k, e = args.emulate, args.tokens, args.k, args.experts
  local_e = e // s

  def one_device(x, idx, wt, w):
    y, _ = expert_gemm.expert_ffn(x, idx, wt, jnp.ones(n, bool), *w, swiglu_limit=10.0,
                                  backend=args.backend)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  def shard_of_s(partial_dtype, buffer_factor=0.0):
    bound = ep.receive_rows(n * k, s, buffer_factor)

    def loss(x, idx, wt, w):
      # Shard 0 of S: the gathered S*N tokens, its experts [0, E/S) valid (at most `bound`).
      local = jnp.where(idx < local_e, idx, 0)
      mine, _ = ep.first_assignments(local, idx < local_e, local_e, bound)
      y, _ = expert_gemm.expert_ffn(x, local, wt, mine, *w, swiglu_limit=10.0,
                                    backend=args.backend, out_dtype=partial_dtype,
                                    max_valid=bound)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    return loss

  def make(rows, experts):
    def args_of(rep):
      ks = jax.random.split(jax.random.key(rep), 6)
      x = jax.random.normal(ks[0], (rows, args.d), jnp.bfloat16)
      _, idx = jax.lax.top_k(jax.random.normal(ks[1], (rows, e)), k)
      wt = jax.nn.softmax(jax.random.normal(ks[2], (rows, k)), -1)
      w = [jax.random.normal(kk, sh, jnp.bfloat16) * 0.05 for kk, sh in zip(
          ks[3:], ((experts, args.d, args.f),) * 2 + ((experts, args.f, args.d),))]
      return x, idx.astype(jnp.int32), wt, w
    return args_of

  cases = [('one_device', one_device, n, e)] + [
      (f'allgather_shard_of_{s}_{dt}', shard_of_s(dt), s * n, local_e)
      for dt in ('float32', 'bfloat16')] + [
      (f'allgather_shard_of_{s}_float32_buffer_{bf}', shard_of_s('float32', bf), s * n, local_e)
      for bf in args.buffer_factors]
  for name, fn, rows, experts in cases:
    grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 2, 3)))
    ms, compile_s = time_fn(grad, make(rows, experts), args.reps)
    if args.profile:
      inputs = make(rows, experts)(0)
      with jax.profiler.trace(f'{args.profile}/{name}'):
        jax.block_until_ready([grad(*inputs) for _ in range(3)])
    print(json.dumps({'case': name, 'backend': args.backend, 'tokens_per_device': n,
                      'rows': rows, 'experts': experts, 'fwd_bwd_ms': round(ms, 3),
                      'compile_s': round(compile_s, 1)}), flush=True)
  # Per device and MoE layer, forward + backward: the tokens out and the f32 partials back,
  # each transposed in the backward.
  row_bytes = args.d * (2 + 4)
  print(json.dumps({'case': f'allgather_bytes_per_layer_{s}', 'fwd_bwd_bytes_sent':
                    2 * (s - 1) * n * row_bytes,
                    'padded_fwd_bwd_bytes_sent': 4 * (s - 1) * n * k * args.d * 2}), flush=True)


if __name__ == '__main__':
  main()
