"""Lightning-indexer scores: the jnp reference and the dispatch to the kernels (model.index_impl).

    I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) * (H * C)^-1/2        fp32 [B, T, N]

All take `limit_bt`, the number of leading entries each query row can see; entries at or past
it may hold 0 instead of the score (the caller masks everything invisible anyway).

`index_scores_reference` writes the [T, H, N] dot products to memory and reads them back to
apply relu and the head weights: at 64K tokens and 32 heads that round trip is most of the
indexer's time. The kernels keep each tile's head loop on chip: 'fused' the GPU's
(ops/gpu/index_scores.py), 'mosaic' the TPU's (ops/tpu/index_scores.py), each on its device's
batch rows (ops/parallel/per_device.py) and in the Pallas interpreter on the CPU
(ops/launch.py; the tests).

No gradient: selection stops gradients, and the indexer's training signal uses the scores of
the selected entries only (ops/selected_scores.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepseek41.ops.gpu.index_scores import index_scores_fused
from deepseek41.ops.parallel.per_device import batch_local
from deepseek41.ops.tpu.index_scores import index_scores_tpu


def index_scores_reference(q_bthc, w_bth, k_bnc, limit_bt=None):
  """fp32 [B, T, N] indexer scores in jnp, every entry scored (`limit_bt` is not needed).

  Materialises [B, T, H, N]: pass query chunks in the scalable path.
  """
  del limit_bt
  h, c = q_bthc.shape[-2], q_bthc.shape[-1]
  dots_bthn = jnp.einsum('bthc,bnc->bthn', q_bthc, k_bnc, preferred_element_type=jnp.float32)
  w_bth = w_bth.astype(jnp.float32) * (h ** -0.5 * c ** -0.5)
  return jnp.einsum('bthn,bth->btn', jax.nn.relu(dots_bthn), w_bth)


def index_scores_gathered(q_bthc, w_bth, k_btpc):
  """fp32 [B, T, P]: `index_scores_reference`'s score of each query's own P entries (keys
  gathered per query, [B, T, P, c]): a Reindex layer's candidate pool in generation, where one
  query's pool is far smaller than the history."""
  h, c = q_bthc.shape[-2], q_bthc.shape[-1]
  dots_bthp = jnp.einsum('bthc,btpc->bthp', q_bthc, k_btpc, preferred_element_type=jnp.float32)
  w_bth = w_bth.astype(jnp.float32) * (h ** -0.5 * c ** -0.5)
  return jnp.einsum('bthp,bth->btp', jax.nn.relu(dots_bthp), w_bth)


def index_scores_stored(q_bthc, w_bth, stored_bn, load_keys, block: int):
  """fp32 [B, T, N]: `index_scores_reference` of keys kept in a cache's stored format
  (`stored_bn`, a pytree of [B, N, ...] arrays; `load_keys` turns rows of it into [..., c]
  values), `block` entries at a time: generation scores the whole history without a
  dequantized copy of it, one block's at a time."""
  leaves = jax.tree.leaves(stored_bn)
  b, n = leaves[0].shape[:2]
  block = max(1, min(block, n))
  n_blocks = -(-n // block)

  def split(x):  # [B, N, ...] -> [blocks, B, block, ...], zero rows past N
    x = jnp.pad(x, [(0, 0), (0, n_blocks * block - n)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n_blocks, block, *x.shape[2:]), 1, 0)

  def one_block(rows):
    return index_scores_reference(q_bthc, w_bth, load_keys(rows).astype(q_bthc.dtype))
  scores_kbtn = jax.lax.map(one_block, jax.tree.map(split, stored_bn))
  t = q_bthc.shape[1]
  return jnp.moveaxis(scores_kbtn, 0, 2).reshape(b, t, n_blocks * block)[..., :n]


def index_scores_per_device(q_bthc, w_bth, k_bnc, limit_bt):
  """The GPU kernel (ops/gpu/index_scores.py) on each device's batch rows."""
  return batch_local(index_scores_fused, q_bthc, w_bth, k_bnc, limit_bt, whole_seq=(2,))


def index_scores_mosaic_per_device(q_bthc, w_bth, k_bnc, limit_bt):
  """The TPU (Mosaic) kernel (ops/tpu/index_scores.py) on each device's batch rows."""
  return batch_local(index_scores_tpu, q_bthc, w_bth, k_bnc, limit_bt, whole_seq=(2,))


SCORERS = {'reference': index_scores_reference, 'fused': index_scores_per_device,
           'mosaic': index_scores_mosaic_per_device}  # model.index_impl
