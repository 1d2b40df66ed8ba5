"""The whole model with every GPU kernel (interpreted on the CPU) equals it on the jnp paths.

Fused sparse attention, fused window attention and the threshold top-k against gathered /
chunked / top_k: loss and every parameter gradient, with documents packed and the released fake
quantization on, and with image spans present; the kernels' backward from the merged softmax
(the default) and through autodiff of the merge.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.transformer import Transformer
from deepseek41.ops.gpu import mhc_kernel
from tests.helpers import (KERNEL_SHAPES, RELEASED_QUANT, VISION, image_batch, packed_batch,
                           resolved, token_ce)

JNP = dict(sparse_impl='gathered', attention_impl='chunked', select_impl='top_k')
KERNELS = dict(sparse_impl='fused', attention_impl='fused', select_impl='threshold')


def _loss_and_grads(cfg, impls, batch):
  model = Transformer(dataclasses.replace(cfg, **impls), nnx.Rngs(params=0))

  def loss(m):
    return jnp.sum(token_ce(m, batch)) / batch['loss_mask'].sum()
  return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)


@pytest.mark.parametrize('case', ['documents_released_quant', 'image_spans', 'unmerged',
                                  'dense'])
def test_kernels_equal_the_jnp_paths(case):
  # 'unmerged': the kernels' backward through autodiff of the softmax merge
  # (model.merged_backward=False) instead of from the merged statistics. 'dense': the dense
  # variant (model.attention_variant), its layers on the window kernel over the whole row.
  if case in ('documents_released_quant', 'unmerged', 'dense'):
    cfg = resolved(**{**KERNEL_SHAPES, **RELEASED_QUANT,
                      'model.merged_backward': case != 'unmerged',
                      'model.attention_variant': 'dense' if case == 'dense' else 'csa2'}).model
    batch = packed_batch(seed=5, docs_per_row=2, pad=4)
  else:
    cfg = resolved(**KERNEL_SHAPES, **VISION).model
    batch = image_batch(seed=2)
  batch = {k: jnp.asarray(v)[:2] for k, v in batch.items()}
  l_ref, g_ref = _loss_and_grads(cfg, JNP, batch)
  l_k, g_k = _loss_and_grads(cfg, KERNELS, batch)
  np.testing.assert_allclose(l_k, l_ref, rtol=1e-5)
  leaves_ref, leaves_k = jax.tree.leaves(g_ref), jax.tree.leaves(g_k)
  assert len(leaves_ref) == len(leaves_k)
  for a, b in zip(leaves_k, leaves_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize('residual', ['mhc_single_pass', 'mhc_multi_pass'])
def test_fused_mhc_equals_the_jnp_sites(residual):
  # The whole model (CSA2, Engram, CED) with the fused mHC kernels against model/mhc.py.
  cfg = resolved(**{'model.residual': residual, 'model.engram': True}).model
  batch = {k: jnp.asarray(v)[:2] for k, v in packed_batch(seed=3, docs_per_row=2, pad=4).items()}
  l_ref, g_ref = _loss_and_grads(cfg, dict(mhc_impl='reference'), batch)
  l_k, g_k = _loss_and_grads(cfg, dict(mhc_impl='fused'), batch)
  np.testing.assert_allclose(l_k, l_ref, rtol=1e-5)
  leaves_ref, leaves_k = jax.tree.leaves(g_ref), jax.tree.leaves(g_k)
  assert len(leaves_ref) == len(leaves_k)
  for a, b in zip(leaves_k, leaves_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_decode_sized_calls_walk_wider_chunks(monkeypatch):
  # model.mhc_decode_block_d and model.mhc_decode_splits: a call of less than one token block (a
  # decode step) runs the fused sites with D chunks that wide, split over that many programs;
  # larger calls keep the training chunks in one program; the loss is the same.
  cfg = resolved(**{'model.residual': 'mhc_single_pass'}).model
  batch = {k: jnp.asarray(v)[:1, :48]
           for k, v in packed_batch(seed=3, docs_per_row=2, pad=4).items()}
  calls = []
  run_local = mhc_kernel._run_local

  def recording(*args, **kw):
    calls.append((kw['block_d'], kw['decode_splits']))
    return run_local(*args, **kw)
  monkeypatch.setattr(mhc_kernel, '_run_local', recording)

  def loss(batch, decode_block_d=0, decode_splits=0):
    model = Transformer(dataclasses.replace(cfg, mhc_impl='fused',
                                            mhc_decode_block_d=decode_block_d,
                                            mhc_decode_splits=decode_splits),
                        nnx.Rngs(params=0))
    return jnp.sum(token_ce(model, batch))

  wide = loss(batch, decode_block_d=64)
  assert calls and set(calls) == {(64, 0)}
  calls.clear()
  split = loss(batch, decode_splits=2)
  assert calls and set(calls) == {(32, 2)}
  calls.clear()
  default = loss(batch)
  assert set(calls) == {(32, 0)}
  np.testing.assert_allclose(wide, default, rtol=1e-5)
  np.testing.assert_allclose(split, default, rtol=1e-5)
  calls.clear()
  long = {k: jnp.concatenate([v] * 3, axis=1) for k, v in batch.items()}  # 144 tokens
  loss(long, decode_block_d=64, decode_splits=2)
  assert set(calls) == {(32, 0)}
