"""The indexer's scores of the selected entries only: the student side of its distillation.

    S[t, k] = sum_h w[t, h] * relu(q[t, h] . k[idx[t, k]]) * (H * C)^-1/2     fp32 [B, T, K]

Unlike the selection's scores (ops/index_scores.py, no gradient), these carry the indexer's
training gradient into q, w and the index keys. Invalid slots score 0 and pass no gradient.

- `selected_scores_reference` (jnp): per query chunk, gathers the [C, K, d_I] selected keys,
  scores them with batched [H, d_I] x [d_I, K] products and recomputes all of it in the backward
  pass, whose key gradient is a scatter-add. At configs/ablation_1b.py's 8 x 4,096 tokens a chunk's
  gathered keys are 1 GB, gathered three times per step with block remat (docs/performance.md
  section 21).
- 'fused': the GPU kernels (ops/gpu/selected_scores.py) on each device's queries: the selected
  keys are gathered on chip, so nothing of size [T, K, d_I] or [T, H, K] reaches HBM, forward
  and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepseek41.ops.chunking import map_query_chunks
from deepseek41.ops.gpu.selected_scores import selected_scores_fused
from deepseek41.ops.parallel.per_device import batch_local
from deepseek41.ops.sparse_attention import gather_rows

IMPLS = ('reference', 'fused')


def selected_scores_reference(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, chunk: int):
  """fp32 [B, T, K] in jnp, `chunk` queries at a time (gathered keys recomputed backward)."""
  def per_chunk(c, offset):
    del offset
    k_bqke = gather_rows(k_bnc, c['idx'], c['valid'])
    logits_bqhk = jnp.einsum('bqhe,bqke->bqhk', c['q'], k_bqke,
                             preferred_element_type=jnp.float32)
    h, dim = c['q'].shape[-2:]
    s_bqk = jnp.einsum('bqh,bqhk->bqk', c['w'], jax.nn.relu(logits_bqhk)) * (h * dim) ** -0.5
    return jnp.where(c['valid'], s_bqk, 0.0)
  # Recomputed in the backward pass: saving each chunk's gathered keys would cost
  # [T, K, d_I] per index source, the very size chunking avoids.
  xs = {'q': q_bthc, 'w': w_bth, 'idx': idx_btk, 'valid': valid_btk}
  return map_query_chunks(jax.checkpoint(per_chunk), xs, chunk)



def selected_scores(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, *, impl: str = 'reference',
                    chunk: int = 1024):
  """fp32 [B, T, K]: the indexer scores of the selected slots (0 at invalid slots).

  q_bthc [B, T, H, d_I] and w_bth [B, T, H] of the index source's queries; k_bnc [B, N, d_I] the
  KV source's index keys; idx_btk / valid_btk the selection. impl: `IMPLS` ('fused' runs on each
  device's own queries, the keys whole; on the CPU in the Pallas interpreter, for tests).
  """
  if impl == 'reference':
    return selected_scores_reference(q_bthc, w_bth, k_bnc, idx_btk, valid_btk, chunk)
  if impl == 'fused':
    return batch_local(selected_scores_fused, q_bthc, w_bth, k_bnc, idx_btk, valid_btk,
                       whole_seq=(2,))
  raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')
