"""A packed document computes what it computes alone: its result does not depend on its offset.

The candidate pool partitions a document's compressed entries into blocks counted from the
document's first entry (docs/architecture.md section 3.7), so a document at any offset the packer
produces (multiples of data.document_align) gets the same pool, selection and logits as the same
document alone in a row.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.shared import Shared
from deepseek41.model.transformer import Transformer
from tests.helpers import packed_layout, resolved

T, DOC = 48, 32
# Blocks of 8 at ratio 1 (the shipped configs' shape): a pool of 2 blocks (16 entries) binds on a
# 32-token document, and top-8 is smaller than the pool.
POOL = {'model.attention_variant': 'csa2', 'model.index_n_heads': 2, 'model.index_head_dim': 8,
        'model.sparse_chunk': 16, 'model.index_topk_block': 2, 'model.index_topk': 8,
        'model.candidate_block_size': 8, 'model.candidate_topk_blocks': 2}


def _offset_batch(align: int):
  """Row i: a filler document of offsets[i] tokens, then the same DOC-token document, padding."""
  offsets = list(range(0, T - DOC + 1, align))
  rng = np.random.default_rng(0)
  doc = rng.integers(3, 96, DOC)
  seg, pos = packed_layout([[o, DOC] if o else [DOC] for o in offsets], T)
  tokens = rng.integers(3, 96, (len(offsets), T)).astype(np.int32)
  for i, o in enumerate(offsets):
    tokens[i, o:o + DOC] = doc
  batch = {'tokens': tokens, 'targets': tokens, 'segment_ids': seg, 'positions': pos,
           'loss_mask': (seg > 0).astype(np.int32), 'modality': np.zeros_like(seg)}
  return offsets, {k: jnp.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize('sparse_impl', ['gathered', 'reference'])
def test_document_logits_do_not_depend_on_its_offset(sparse_impl):
  cfg = resolved(**{**POOL, 'model.sparse_impl': sparse_impl})
  model = Transformer(cfg.model, nnx.Rngs(params=0))
  offsets, batch = _offset_batch(cfg.data.document_align)
  assert len(offsets) > 2 and any(o % cfg.model.candidate_block_size for o in offsets)
  logits = np.asarray(nnx.jit(lambda m, b: m(b)[0])(model, batch))
  alone = logits[0, :DOC]
  for i, o in enumerate(offsets):
    np.testing.assert_allclose(logits[i, o:o + DOC], alone, rtol=1e-4, atol=1e-5,
                               err_msg=f'document at row offset {o}')


def test_the_pool_binds_in_this_setting():
  """The test above would prove nothing if the pool held every visible entry."""
  from deepseek41.model.compressor import visible_btn
  cfg = resolved(**POOL)
  model = Transformer(cfg.model, nnx.Rngs(params=0))
  _, batch = _offset_batch(cfg.data.document_align)
  x, pre = model.residual_input(batch)
  shared = Shared()
  for block in model.blocks:
    x, pre, _, shared = block(x, pre, batch, shared)
  comp, _ = shared.kv[cfg.model.candidate_source_layer_id]
  most_visible = int(np.asarray(visible_btn(batch['segment_ids'], comp)).sum(-1).max())
  pool = cfg.model.candidate_block_size * cfg.model.candidate_topk_blocks
  assert cfg.model.index_topk < pool < most_visible
