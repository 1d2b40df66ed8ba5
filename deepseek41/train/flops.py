"""Model FLOPs per token and the device peak, for TFLOP/s and MFU.

Counted, not credited: only matmuls the model actually performs for a token (active experts,
the attention keys inside the window), times 3 for forward + backward. Embedding lookups,
norms, softmax and the router's top-k are not counted.
"""

from __future__ import annotations

import dataclasses

from deepseek41.config import ModelConfig

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
  return m.num_layers * (attn + moe) + d * m.vocab_size  # + LM head


def mean_window_keys(window: int, seq_len: int) -> float:
  return sum(min(t + 1, window) for t in range(seq_len)) / seq_len


def flops_per_token(m: ModelConfig, seq_len: int) -> FlopsPerToken:
  p = active_matmul_params(m)
  keys = mean_window_keys(m.sliding_window, seq_len)
  attn = 4.0 * m.num_heads * m.head_dim * keys * m.num_layers
  total = 3.0 * (2.0 * p + attn)
  formula = (f'train FLOPs/token = 3 x (2 x N_active_matmul + 4 x layers x heads x head_dim x '
             f'mean_keys) = 3 x (2 x {p:,} + 4 x {m.num_layers} x {m.num_heads} x {m.head_dim} x '
             f'{keys:.1f}) = {total:.4g}')
  return FlopsPerToken(p, attn, total, formula)


def device_peak_tflops(device_kind: str, override: float = 0.0) -> float:
  """0.0 when unknown (e.g. CPU): MFU is then not reported."""
  if override > 0:
    return override
  for name, peak in PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return 0.0
