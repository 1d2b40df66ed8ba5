"""What one forward hands from layer to layer (docs/design.md, "Layer caches").

    kv              KV source l       -> its compressed entries and index keys (csa2.py)
    selections      index source l    -> its top-k entries per query
    pools           candidate source  -> its best candidate blocks per query (Reindex reads them)
    sinks           index source l    -> zero-valued sinks, one per later reader of its selection,
                                         through which their backward hands it the key/value
                                         gradient's coefficients (model.sparse_group_dkv)
    indexer_totals  index sources     -> [sum of per-query KL, queries counted, sum of recall]
    decode          generation        -> the chunk's rows and the layers' caches (`Decoding`)
    probe           diagnostics       -> each CSA2 layer's selection against dense attention
                                         (`Probe`, model/diagnostics.py); None otherwise

`Shared` is an immutable pytree: a layer returns an updated copy, and the whole of it flows
through block remat (`jax.checkpoint`, model/transformer.py) and CED prefill (model/ced.py) like
any activation. Training passes `Shared()` to the first layer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from deepseek41.model.compressor import CompressedKV


class SourceEntries(NamedTuple):
  """What a KV source publishes: its entries and their indexer keys [B, N, c] (in generation,
  as its cache stores them: model.index_quant's format)."""
  comp: CompressedKV
  keys_bnc: jax.Array


class Selection(NamedTuple):
  """An index source's choice: entry indices int32 [B, T, K] and which are real."""
  idx_btk: jax.Array
  valid_btk: jax.Array


@struct.dataclass
class Decoding:
  """Generation's chunk: every row's chunk runs over positions [start_b, end_b), and `caches`
  holds each layer's cache ({layer: its `init_cache()` value}), updated as the layers run."""
  start_b: jax.Array   # int32 [B]: the chunk's first position per row
  end_b: jax.Array     # int32 [B]: one past its last valid position
  caches: dict
  # False in bounded replay: the stored entries are exact, only the windows are rebuilt.
  write_entries: bool = struct.field(pytree_node=False, default=True)


@struct.dataclass
class Probe:
  """Diagnostics of a forward (model/diagnostics.py `selection_diagnostics`): the CSA2 layers
  measure their selection against the dense attention over every visible entry."""
  answer_rows_bt: Any = None   # int32 [B, T]: the row each query should retrieve; -1 none
  rows_bm: Any = None          # int32 [B, M]: measure only these query rows (-1 padding)
  stats: dict = struct.field(default_factory=dict)  # {layer: diagnostics.SelectionStats}
  chunk: int = struct.field(pytree_node=False, default=256)  # queries per chunk


def _merged(d: dict, layer: int, value) -> dict:
  return {**d, layer: value}


@struct.dataclass
class Shared:
  """What earlier layers of this forward hand to later ones (module docstring)."""
  kv: dict = struct.field(default_factory=dict)          # {layer: SourceEntries}
  selections: dict = struct.field(default_factory=dict)  # {layer: Selection}
  pools: dict = struct.field(default_factory=dict)       # {layer: (blk_idx_btk, blk_valid_btk)}
  sinks: dict = struct.field(default_factory=dict)       # {layer: tuple of sinks}
  indexer_totals: Any = None                              # fp32 [3] once an index source ran
  decode: Decoding | None = None
  probe: Probe | None = None

  def with_kv(self, layer: int, entries: SourceEntries) -> Shared:
    return self.replace(kv=_merged(self.kv, layer, entries))

  def with_selection(self, layer: int, selection: Selection) -> Shared:
    return self.replace(selections=_merged(self.selections, layer, selection))

  def with_pool(self, layer: int, blocks) -> Shared:
    return self.replace(pools=_merged(self.pools, layer, blocks))

  def with_sinks(self, sinks: dict) -> Shared:
    """{index source: its sinks} added (a sparse `Branch`'s handoffs)."""
    return self.replace(sinks={**self.sinks, **sinks})

  def without_sinks(self, layer: int) -> Shared:
    return self.replace(sinks={k: v for k, v in self.sinks.items() if k != layer})

  def add_indexer_totals(self, kl_sum, counted, recall_sum) -> Shared:
    totals = jnp.zeros(3, jnp.float32) if self.indexer_totals is None else self.indexer_totals
    return self.replace(indexer_totals=totals + jnp.stack([kl_sum, counted, recall_sum]))

  def with_cache(self, layer: int, cache) -> Shared:
    """Generation: layer `layer`'s updated cache."""
    return self.replace(decode=self.decode.replace(caches=_merged(self.decode.caches, layer,
                                                                  cache)))

  def with_probe_stats(self, layer: int, stats) -> Shared:
    """Diagnostics: layer `layer`'s `diagnostics.SelectionStats`."""
    return self.replace(probe=self.probe.replace(stats=_merged(self.probe.stats, layer, stats)))

  def added_since(self, before: Shared) -> Shared:
    """What was published after `before` (and the indexer totals): one layer's outputs."""
    def new(now: dict, then: dict) -> dict:
      return {k: v for k, v in now.items() if k not in then}
    return Shared(kv=new(self.kv, before.kv), selections=new(self.selections, before.selections),
                  pools=new(self.pools, before.pools), sinks=new(self.sinks, before.sinks),
                  indexer_totals=self.indexer_totals)
