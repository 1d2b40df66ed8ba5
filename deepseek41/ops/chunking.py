"""Query chunking: run a function over fixed-size slices of the sequence axis, in sequence.

The scalable sparse paths must never hold a [T, N] (or [T, K, d]) array for a whole sequence:
they process `chunk` queries at a time under `lax.map`, so memory is bounded by one chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def map_query_chunks(fn, xs: dict, chunk: int):
  """fn(chunk_xs, offset) over slices of axis 1 of every [B, T, ...] array in `xs`.

  T is padded with zeros to a multiple of `chunk` (callers make zero rows harmless: invalid
  selections, segment id 0) and the padding is cut off again. `offset` is the chunk's first row.
  Returns fn's pytree of [B, Tq, ...] outputs stitched back to [B, T, ...].
  """
  b, t = next(iter(xs.values())).shape[:2]
  chunk = max(1, min(chunk or t, t))
  t_pad = -(-t // chunk) * chunk
  n = t_pad // chunk

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

  offsets = jnp.arange(n, dtype=jnp.int32) * chunk
  out = jax.lax.map(lambda a: fn(a[0], a[1]), ({k: split(v) for k, v in xs.items()}, offsets))
  return jax.tree.map(
      lambda y: jnp.moveaxis(y, 0, 1).reshape(b, t_pad, *y.shape[3:])[:, :t], out)
