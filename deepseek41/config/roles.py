"""The layer-role table (docs/design.md "Layer roles"): the model never tests layer numbers, it
reads this table, derived from the model section. Also which layers run under remat."""

from __future__ import annotations

import dataclasses

from deepseek41.config.schema import ModelConfig, TrainConfig

SWA, FULL, REINDEX, REUSE = 'SWA', 'Full', 'Reindex', 'Reuse'


@dataclasses.dataclass(frozen=True)
class LayerRole:
  layer: int
  block: str                # encoder | decoder
  ratio: int                # 0 = SWA only
  mode: str                 # SWA | Full | Reindex | Reuse
  kv_source: int            # -1 for SWA-only layers
  index_source: int         # -1 for SWA-only layers
  publishes_candidates: bool
  uses_candidates: bool     # Reindex layers after the candidate source select inside its pool
  engram: bool
  rope: str                 # main | compress


def latest_at_or_below(sources: tuple[int, ...], layer: int) -> int:
  below = [s for s in sources if s <= layer]
  return max(below) if below else -1


def layer_roles(m: ModelConfig) -> tuple[LayerRole, ...]:
  roles = []
  for l in range(m.num_layers):
    r = m.compress_ratios[l]
    engram = l in m.engram_layer_ids
    block = 'encoder' if l < m.num_encoder_layers else 'decoder'
    if r == 0:
      roles.append(LayerRole(l, block, 0, SWA, -1, -1, False, False, engram, 'main'))
      continue
    kv_src = latest_at_or_below(m.kv_source_layer_ids, l)
    idx_src = latest_at_or_below(m.index_source_layer_ids, l)
    if idx_src != l:
      mode = REUSE
    elif kv_src == l:
      mode = FULL
    else:
      mode = REINDEX
    cand = m.candidate_source_layer_id
    roles.append(LayerRole(
        layer=l, block=block, ratio=r, mode=mode, kv_source=kv_src, index_source=idx_src,
        publishes_candidates=(l == cand),
        uses_candidates=(mode == REINDEX and cand >= 0 and kv_src == cand and l > cand),
        engram=engram, rope='compress'))
  return tuple(roles)


def format_role_table(m: ModelConfig) -> str:
  head = f"{'layer':>5} {'block':<8} {'ratio':>5} {'mode':<8} {'kv_src':>6} {'idx_src':>7} " \
         f"{'cand':<9} {'engram':<6} {'rope':<8}"
  lines = [head]
  for r in layer_roles(m):
    cand = 'publish' if r.publishes_candidates else ('restrict' if r.uses_candidates else '-')
    lines.append(
        f'{r.layer:>5} {r.block:<8} {r.ratio:>5} {r.mode:<8} {r.kv_source:>6} {r.index_source:>7} '
        f"{cand:<9} {'yes' if r.engram else '-':<6} {r.rope:<8}")
  if not m.csa2:  # the CSA2 columns describe the wiring only; nothing runs them
    lines.append(f'model.attention_variant={m.attention_variant!r}: every ratio > 0 layer '
                 + ('attends to every earlier token of its document'
                    if m.dense else 'attends over its sliding window only')
                 + '; no compressor, indexer or candidate pool runs')
  return '\n'.join(lines)


def remats_layer(remat: str, remat_layers: int, layer: int) -> bool:
  """Whether backbone layer `layer` runs under remat (`train.remat`, `train.remat_layers`)."""
  return remat != 'none' and (remat_layers == 0 or layer < remat_layers)


def remat_label(t: TrainConfig) -> str:
  """train.remat as the plans print it: 'block', or 'block (layers 0-5)' with remat_layers."""
  if t.remat == 'none' or t.remat_layers == 0:
    return t.remat
  return f'{t.remat} (layers 0-{t.remat_layers - 1})'
