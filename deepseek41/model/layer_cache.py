"""What the layers' generation caches are built from (docs/design.md, "Layer caches").

A cache holds positions 0..length-1 of one sequence per batch row (row index = position). Its
static sizes are a `CacheSpec`; a layer keeps its recent rows in a ring of `capacity` slots,
slot pos % capacity (`ring_slots`), and writes a chunk's rows with `scatter_rows`. Each layer
builds and updates its own cache (model/attention.py, model/csa2.py, model/compressor.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepseek41.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Static sizes of one cache: rows, the longest sequence, the longest chunk after prefill.

  A verification chunk of `max_chunk` tokens whose tail is rejected overwrites only ring slots
  no later query needs, so a rollback is just a shorter length (stale slots are masked by
  position)."""
  batch: int
  max_len: int
  max_chunk: int

  def ring(self, cfg: ModelConfig) -> int:
    """Slots of a window ring: the window, plus the slack a chunk needs."""
    return cfg.sliding_window + self.max_chunk - 1

  def entries(self, ratio: int) -> int:
    """Compressed entries of a whole sequence at `ratio` tokens each."""
    return -(-self.max_len // ratio)

  def raw(self, ratio: int) -> int:
    """Slots of a ring of projected rows, from which a chunk pools the groups it completes."""
    return ratio - 1 + self.max_chunk


def ring_slots(pos_bq, valid_bq, end_b, capacity: int):
  """Ring slot (pos % capacity) of each valid position among a row's last `capacity` (end_b:
  one past the row's last); out of range (dropped by the scatter) for the others, so no two
  positions of a chunk land in one slot."""
  keep_bq = valid_bq & (pos_bq >= end_b[:, None] - capacity)
  return jnp.where(keep_bq, pos_bq % capacity, capacity)


def scatter_rows(dest, slot_bq, new):
  """dest[b, slot] = new[b, q] for every (b, q) whose slot is in range (others dropped); `dest`
  and `new` may be pytrees of the same structure (a packed format's codes and scales)."""
  b_idx = jnp.arange(slot_bq.shape[0])[:, None]
  return jax.tree.map(lambda d, n: d.at[b_idx, slot_bq].set(n.astype(d.dtype), mode='drop'),
                      dest, new)
