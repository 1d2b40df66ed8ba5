"""The expert exchange's two implementations on the devices at hand (ops/expert_parallel.py).

Runs the dropless exchange path (sort, ragged all-to-all out, local experts, back, combine) in
a shard_map over all local devices on the `expert` axis, with `ragged` (ragged_all_to_all) and
`padded`, against the experts without any exchange; prints one JSON line per case. On one GPU
the axis has size 1: this checks that XLA lowers and runs ragged_all_to_all there.

    python benchmarks/check_expert_exchange.py [--backend grouped] [--tokens 8192]
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from deepseek41.ops import expert_gemm, expert_parallel as ep


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--backend', default='grouped')
  ap.add_argument('--tokens', type=int, default=8192)
  ap.add_argument('--d', type=int, default=1024)
  ap.add_argument('--f', type=int, default=384)
  ap.add_argument('--experts', type=int, default=64)
  ap.add_argument('--k', type=int, default=6)
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

  for exchange in ('ragged', 'padded'):
    def local(x, idx, wt, valid, wg, wu, wd):
      y, dropped = ep._dropless_exchange(x, idx, wt, valid, wg, wu, wd, 'expert', None, 10.0,
                                         args.backend, 'off', 0.0, exchange)
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
      rec.update(ok=True, max_err=float(jnp.max(jnp.abs(y.astype(jnp.float32) -
                                                        want.astype(jnp.float32)))),
                 scale=float(jnp.max(jnp.abs(want.astype(jnp.float32)))),
                 dropped=int(np.sum(dropped)), fwd_bwd_ms=(time.perf_counter() - t0) * 100)
    except Exception as e:  # noqa: BLE001 - the point is to report it
      rec.update(ok=False, error=f'{type(e).__name__}: {str(e)[:300]}')
    print(json.dumps(rec), flush=True)


if __name__ == '__main__':
  main()
