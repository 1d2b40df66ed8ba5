"""Model FLOPs per token and the device peak, for TFLOP/s and MFU.

Counted, not credited: only matmuls the model actually performs for a token (active experts,
the attention keys inside the window), times 3 for forward + backward. Embedding lookups,
norms, softmax and the router's top-k are not counted.
"""

from __future__ import annotations

import dataclasses

from deepseek41.config import ModelConfig, layer_roles

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


def active_matmul_params(m: ModelConfig) -> int:
  d, h, hd = m.d_model, m.num_heads, m.head_dim
  attn = (d * m.q_lora_rank + m.q_lora_rank * h * hd + d * hd + h * hd * m.o_lora_rank
          + m.o_groups * m.o_lora_rank * d)
  moe = d * m.n_routed_experts + (m.num_experts_per_tok + m.n_shared_experts) * 3 * d * m.moe_intermediate_size
  total = m.num_layers * (attn + moe) + d * m.vocab_size  # + LM head
  if m.residual != 'plain':  # two coefficient projections per layer, one head (multi-pass)
    n = m.hc_mult
    total += 2 * m.num_layers * (2 + n) * n * n * d
    total += n * n * d if m.residual == 'mhc_multi_pass' else 0
  if m.engram:
    streams = m.hc_mult if m.residual != 'plain' else 1
    total += len(m.engram_layer_ids) * ((m.engram_max_ngram - 1) * m.engram_n_heads *
                                        m.engram_head_dim * (streams + 1) * d)
  if m.csa2:
    for role in layer_roles(m):
      if role.mode != 'SWA' and role.kv_source == role.layer:  # compressor + index keys per entry
        total += (2 if role.ratio == 2 else 1) * d * hd + hd * m.index_head_dim // role.ratio
      if role.mode != 'SWA' and role.index_source == role.layer:  # index query and head weights
        total += m.q_lora_rank * m.index_n_heads * m.index_head_dim + d * m.index_n_heads
  return total


def mean_window_keys(window: int, seq_len: int) -> float:
  return sum(min(t + 1, window) for t in range(seq_len)) / seq_len


def mean_visible_entries(ratio: int, seq_len: int) -> float:
  return sum((t + 1) // ratio for t in range(seq_len)) / seq_len


def attention_flops_per_layer(m: ModelConfig, seq_len: int) -> list[float]:
  """Forward score + value FLOPs per token of each layer: window keys, selected compressed
  entries, and the indexer's scoring of every visible entry at index sources."""
  window = 4.0 * m.num_heads * m.head_dim * mean_window_keys(m.sliding_window, seq_len)
  out = []
  for role in layer_roles(m):
    flops = window
    if m.csa2 and role.mode != 'SWA':
      visible = mean_visible_entries(role.ratio, seq_len)
      flops += 4.0 * m.num_heads * m.head_dim * min(m.index_topk, visible)
      if role.index_source == role.layer:  # Reindex scores its whole chunk too; the pool masks
        flops += 2.0 * m.index_n_heads * m.index_head_dim * visible
    out.append(flops)
  return out


def flops_per_token(m: ModelConfig, seq_len: int) -> FlopsPerToken:
  """Matmul FLOPs per token; with CSA2, the selected keys and the indexer's scoring too."""
  p = active_matmul_params(m)
  keys = mean_window_keys(m.sliding_window, seq_len)
  attn = sum(attention_flops_per_layer(m, seq_len))
  formula = (f'train FLOPs/token = 3 x (2 x N_active_matmul + 4 x layers x heads x head_dim x '
             f'mean_keys) = 3 x (2 x {p:,} + 4 x {m.num_layers} x {m.num_heads} x {m.head_dim} x '
             f'{keys:.1f}')
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
  return FlopsPerToken(p, attn, total, formula)


def device_peak_tflops(device_kind: str, override: float = 0.0) -> float:
  """0.0 when unknown (e.g. CPU): MFU is then not reported."""
  if override > 0:
    return override
  for name, peak in PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return 0.0
