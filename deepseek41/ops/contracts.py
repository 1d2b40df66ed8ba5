"""What each kernel takes, and each platform's default collective: plain Python, no jax.

The config's `auto` policy (config/auto.py) and its checks read these to choose a kernel only
where it can run; the kernels assert the same contracts. Keep this module free of jax imports:
validating a config must not start a backend.
"""

from __future__ import annotations

MIN_DOT = 16  # Triton's smallest matrix-product dimension: the GPU kernels pad up to it


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def index_scores_supported(heads: int, dim: int) -> bool:
  """Shapes the fused GPU indexer kernels take (ops/gpu/index_scores.py,
  ops/gpu/selected_scores.py): powers of two, width >= MIN_DOT."""
  return _pow2(heads) and _pow2(dim) and dim >= MIN_DOT


def attention_kernel_supported(heads: int, dim: int) -> bool:
  """Shapes the fused window kernel takes (ops/gpu/window_kernel.py): heads and head width powers
  of two, both >= MIN_DOT."""
  return index_scores_supported(heads, dim) and heads >= MIN_DOT


def mosaic_window_supported(heads: int, dim: int) -> bool:
  """Shapes the Mosaic GPU window forward takes (ops/gpu/window_mgpu.py): a power of two of heads
  dividing its 64-row tile, and a head width of whole 128-column halves."""
  return _pow2(heads) and 64 % heads == 0 and dim % 128 == 0


def mosaic_index_supported(dim: int) -> bool:
  """The TPU indexer kernel (ops/tpu/index_scores.py) takes head widths of whole lanes."""
  return dim % 128 == 0


def mhc_kernel_supported(hc_mult: int, d_model: int) -> bool:
  """Shapes the fused mHC kernels take (ops/gpu/mhc_kernel.py): a power-of-two stream count and
  a width of whole 16-lane tiles."""
  return _pow2(hc_mult) and d_model % MIN_DOT == 0


def default_expert_exchange(backend: str) -> str:
  """model.expert_exchange=auto: ragged on the TPU (its expert axis is large); elsewhere
  allgather (the CPU has no ragged collective; on the H200 XLA's ragged_all_to_all was 50 times
  slower than a padded exchange: docs/performance.md 11.1)."""
  return 'ragged' if backend == 'tpu' else 'allgather'
