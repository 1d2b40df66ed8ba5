"""The `auto` policy: how, not what, the model computes on each backend (docs/architecture.md
section 2). Each rule takes the section's values read so far and the backend ('cpu', 'gpu',
'tpu') and returns a concrete choice; a kernel is chosen only where its shape contract
(ops/contracts.py) takes the configured shapes."""

from __future__ import annotations

from typing import Any

from deepseek41.ops.contracts import (attention_kernel_supported, default_expert_exchange,
                                      index_scores_supported, mhc_kernel_supported,
                                      mosaic_index_supported, mosaic_window_supported)

Values = dict[str, Any]

# The fastest dropless expert path of each platform (ops/expert_gemm.py): `auto` never drops.
# GPU: the grouped Pallas GEMM, dropless at about the capacity einsum's speed (measured on the
# H200, docs/performance.md 9.7). CPU: `reference`, every expert on every token (E/K times the
# useful FLOPs; the README's tiny quick start took 7m24s against 4m36s with the dropping
# capacity einsum, setup included), since ragged_dot computes every group densely there (E
# times). TPU: ragged_dot's real grouped GEMM.
DROPLESS_MOE_BACKENDS = {'tpu': 'ragged_dot', 'gpu': 'grouped', 'cpu': 'reference'}


def moe_backend(m: Values, backend: str) -> str:
  return DROPLESS_MOE_BACKENDS.get(backend, 'reference')


def grouped_wgrad(m: Values, backend: str) -> str:
  return 'mosaic' if backend == 'gpu' and m['d_model'] >= 4096 else 'triton'


def eval_moe_backend(m: Values, backend: str) -> str:
  # Evaluation is dropless whatever the training backend (a capacity drop moves a toy model's
  # logits by up to 5.7): a dropless training backend is kept, the capacity einsum replaced by
  # the fastest dropless path here. On the CPU ragged_dot, at the tiny config's expert shapes,
  # compiles in 0.8 s against reference's 0.4 s and runs slower (E=64, K=6: 630 ms against 235
  # ms per call).
  if m['moe_backend'] != 'capacity_einsum':
    return m['moe_backend']
  return DROPLESS_MOE_BACKENDS.get(backend, 'reference')


def expert_exchange(m: Values, backend: str) -> str:
  return default_expert_exchange(backend)


def index_impl(m: Values, backend: str) -> str:
  if backend == 'tpu' and mosaic_index_supported(m['index_head_dim']):
    return 'mosaic'
  return selected_scores_impl(m, backend)


def selected_scores_impl(m: Values, backend: str) -> str:
  fused_ok = index_scores_supported(m['index_n_heads'], m['index_head_dim'])
  return 'fused' if backend == 'gpu' and fused_ok else 'reference'


def attention_impl(m: Values, backend: str) -> str:
  fused_ok = attention_kernel_supported(m['num_heads'], m['head_dim'])
  return 'fused' if backend == 'gpu' and fused_ok else 'chunked'


def window_forward(m: Values, backend: str) -> str:
  # The Mosaic GPU forward ran 1.32-1.63x the Triton forward's speed at the 1B and V4.1 shapes,
  # 4K and 64K, on an H100 (docs/performance.md section 52).
  mosaic_ok = mosaic_window_supported(m['num_heads'], m['head_dim'])
  return 'mosaic' if m['attention_impl'] == 'fused' and mosaic_ok else 'triton'


def mhc_impl(m: Values, backend: str) -> str:
  fused_ok = m['residual'] != 'plain' and mhc_kernel_supported(m['hc_mult'], m['d_model'])
  return 'fused' if backend == 'gpu' and fused_ok else 'reference'


def _gpu_else(on_gpu: str, elsewhere: str):
  """The rule of a choice that depends on the backend alone: one value on the GPU."""
  return lambda values, backend: on_gpu if backend == 'gpu' else elsewhere


def _cpu_else(on_cpu: str, elsewhere: str):
  """The rule of a choice that depends on the backend alone: one value on the CPU."""
  return lambda values, backend: on_cpu if backend == 'cpu' else elsewhere


sparse_impl = _gpu_else('fused', 'gathered')
select_impl = _gpu_else('threshold', 'top_k')
compute_dtype = _cpu_else('float32', 'bfloat16')
vision_attention_impl = _cpu_else('reference', 'fused')
# bf16 matmuls run at full tensor-core rate on the GPU and TPU; XLA's CPU runs them slower than
# fp32 ones.
muon_ns_dtype = _cpu_else('float32', 'bfloat16')
