"""Model FLOPs per token and per image, and the device peak, for TFLOP/s and MFU.

Counted, not credited: only matmuls the model actually performs for a token (active experts,
the attention keys inside the window), times 3 for forward + backward. The attention keys follow
`model.attention_variant` (docs/architecture.md 3.8.1): a ratio > 0 layer's window plus its
selected entries and its indexer's scoring (csa2), every earlier key of the row (dense: a causal
square, (T + 1) / 2 keys per query on average, one document per row), or its window (window). Embedding lookups,
norms, softmax and the router's top-k are not counted. The weights come from the model's own
(abstract) parameters through deepseek41/model/inventory.py, the walk tools.info uses too.

Images run the vision tower once each: `vision_per_image` is the training FLOPs of one image at
the largest configured size (`model.vision_max_image_tokens` merged tokens), so the trainer's
model FLOPs are `tokens x total + images x vision_per_image`.
"""

from __future__ import annotations

import dataclasses

from deepseek41.config import ModelConfig, layer_roles
from deepseek41.model import inventory

# Dense bf16 peak per device, TFLOP/s (datasheets).
PEAK_TFLOPS = (
    ('H200', 989.0), ('H100', 989.0), ('H800', 989.0), ('A100', 312.0), ('L40S', 362.0),
    ('TPU v6', 918.0), ('TPU v5p', 459.0), ('TPU v5', 197.0), ('TPU v4', 275.0),
)


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
  matmul_params: int       # active weights used in matmuls per token
  attention: float         # score + value FLOPs per token (forward)
  total: float             # training FLOPs per token (forward + backward)
  formula: str
  vision_per_image: float = 0.0  # training FLOPs of one largest image through ViT + aligner


def active_matmul_params(m: ModelConfig) -> int:
  """Weights one token is multiplied with (inventory.matmul_params_per_token of the model)."""
  return inventory.matmul_params_per_token(m, inventory.model_leaves(m))


def vision_flops_per_image(m: ModelConfig) -> float:
  """Training FLOPs (3 x forward) of one image of `vision_max_image_tokens` merged tokens:
  the ViT's weights on each of its merge^2 x M patches, its attention over them per layer, the
  aligner's weights on each merged token. 0 without `model.vision`."""
  if not m.vision:
    return 0.0
  encoder, aligner = inventory.vision_matmul_params(inventory.model_leaves(m))
  tokens = m.vision_max_image_tokens
  patches = m.vision_merge * m.vision_merge * tokens
  attention = 4.0 * m.vision_layers * patches * patches * m.vision_dim
  return 3.0 * (2.0 * (encoder * patches + aligner * tokens) + attention)


def mean_window_keys(window: int, seq_len: int) -> float:
  return sum(min(t + 1, window) for t in range(seq_len)) / seq_len


def mean_visible_entries(ratio: int, seq_len: int) -> float:
  return sum((t + 1) // ratio for t in range(seq_len)) / seq_len


def attention_flops_per_layer(m: ModelConfig, seq_len: int) -> list[float]:
  """Forward score + value FLOPs per token of each layer: window keys (a dense layer: every
  earlier key), selected compressed entries, and the indexer's scoring of every visible entry
  at index sources."""
  per_key = 4.0 * m.num_heads * m.head_dim
  window = per_key * mean_window_keys(m.sliding_window, seq_len)
  out = []
  for role in layer_roles(m):
    flops = window
    if m.dense and role.mode != 'SWA':
      flops = per_key * mean_window_keys(seq_len, seq_len)
    if m.csa2 and role.mode != 'SWA':
      visible = mean_visible_entries(role.ratio, seq_len)
      flops += 4.0 * m.num_heads * m.head_dim * min(m.index_topk, visible)
      if role.index_source == role.layer:  # Reindex scores its whole chunk too; the pool masks
        flops += 2.0 * m.index_n_heads * m.index_head_dim * visible
    out.append(flops)
  return out


def decode_attention_flops(m: ModelConfig, context: int) -> list[float]:
  """Forward score + value FLOPs of one decoded token after `context` tokens, per layer: its
  window (a dense layer: every earlier key), its selected entries, and the indexer's scoring where the layer owns an index (over
  every visible entry; a candidate user only inside the pool of candidate_topk_blocks x
  candidate_block_size entries). Every layer runs: the encoder's too (CED saves only prefill)."""
  t = context + 1  # the new token sees itself
  pool = m.candidate_topk_blocks * m.candidate_block_size
  out = []
  for role in layer_roles(m):
    keys = t if m.dense and role.mode != 'SWA' else min(t, m.sliding_window)
    flops = 4.0 * m.num_heads * m.head_dim * keys
    if m.csa2 and role.mode != 'SWA':
      visible = t // role.ratio
      flops += 4.0 * m.num_heads * m.head_dim * min(m.index_topk, visible)
      if role.index_source == role.layer:
        scored = min(visible, pool) if role.uses_candidates else visible
        flops += 2.0 * m.index_n_heads * m.index_head_dim * scored
    out.append(flops)
  return out


def flops_per_token(m: ModelConfig, seq_len: int) -> FlopsPerToken:
  """Matmul FLOPs per token; with CSA2, the selected keys and the indexer's scoring too; with
  dense layers, their keys."""
  p = active_matmul_params(m)
  keys = mean_window_keys(m.sliding_window, seq_len)
  attn = sum(attention_flops_per_layer(m, seq_len))
  dense_layers = sum(r.mode != 'SWA' for r in layer_roles(m)) if m.dense else 0
  window_layers = m.num_layers - dense_layers
  formula = (f'train FLOPs/token = 3 x (2 x N_active_matmul + 4 x layers x heads x head_dim x '
             f'mean_keys) = 3 x (2 x {p:,} + 4 x {window_layers} x {m.num_heads} x '
             f'{m.head_dim} x {keys:.1f}')
  if dense_layers:
    formula += (f' + 4 x {dense_layers} dense x {m.num_heads} x {m.head_dim} x '
                f'{mean_window_keys(seq_len, seq_len):.1f}')
  if m.csa2:
    selected = scored = 0.0
    for role in layer_roles(m):
      if role.mode == 'SWA':
        continue
      visible = mean_visible_entries(role.ratio, seq_len)
      selected += min(m.index_topk, visible)
      scored += visible if role.index_source == role.layer else 0.0
    formula += (f' + 4 x {m.num_heads} x {m.head_dim} x {selected:.1f} selected'
                f' + 2 x {m.index_n_heads} x {m.index_head_dim} x {scored:.1f} scored')
  total = 3.0 * (2.0 * p + attn)
  formula += f') = {total:.4g}'
  vision = vision_flops_per_image(m)
  if vision:
    formula += f'; vision train FLOPs/image (ViT + aligner, largest image) = {vision:.4g}'
  return FlopsPerToken(p, attn, total, formula, vision)


def device_peak_tflops(device_kind: str, override: float = 0.0) -> float:
  """0.0 when unknown (e.g. CPU): MFU is then not reported."""
  if override > 0:
    return override
  for name, peak in PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return 0.0
