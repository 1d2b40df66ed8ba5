"""Bidirectional attention inside image spans, one more softmax partial (docs/architecture.md 3.15).

Image-span positions see every position of their own span, earlier and later, and are causal to
everything else. The window branch (`swa_attention`) drops same-span keys (`span_ids_bt`), and
this branch supplies all of them, so the union is exactly "window, or same span" with no key
counted twice. Text positions (span id 0) see nothing here: their partial has lse = -inf.
The compressed CSA2 branch stays causal for span positions too [I: vLLM widens only the window
rows of a span in prefill; compressed entries of later span positions do not exist yet there].

Two implementations, same signature, same results:
- `reference`: dense [B, T, H, T] scores masked to same-span pairs;
- `gathered`: each row's spans (ids 1..num_spans, contiguous) are gathered into
  [B, num_spans, max_span] blocks, attended densely per span and scattered back, so the cost is
  num_spans * max_span^2 per row instead of T^2. The span's queries go `chunk` at a time, each
  chunk under `jax.checkpoint` (flash-attention style): the backward recomputes a chunk's scores
  instead of keeping every span's [max_span, H, max_span] probabilities, which at the released
  model's longest image (2,051 positions) were the largest buffer of a multimodal layer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from deepseek41.ops.chunking import map_query_chunks
from deepseek41.ops.parallel.per_device import batch_local
from deepseek41.ops.swa_attention import _masked_softmax_partial, same_span_mask_btu

IMPLS = ('reference', 'gathered')


def _span_partial_reference(q_bthd, kv_btd, span_ids_bt, scale):
  scores_bthu = jnp.einsum('bthd,bud->bthu', q_bthd, kv_btd,
                           preferred_element_type=jnp.float32) * scale
  mask_bthu = same_span_mask_btu(span_ids_bt)[:, :, None, :]
  probs_bthu, lse_bth = _masked_softmax_partial(scores_bthu, mask_bthu)
  o_bthd = jnp.einsum('bthu,bud->bthd', probs_bthu.astype(kv_btd.dtype), kv_btd,
                      preferred_element_type=jnp.float32)
  return o_bthd.astype(kv_btd.dtype), lse_bth


def span_extents(span_ids_bt, num_spans: int):
  """(start_bn, length_bn) of spans 1..num_spans in each row (length 0 = absent)."""
  t = span_ids_bt.shape[1]
  ids_n = jnp.arange(1, num_spans + 1)
  in_span_bnt = span_ids_bt[:, None, :] == ids_n[None, :, None]
  length_bn = jnp.sum(in_span_bnt, axis=-1)
  start_bn = jnp.where(length_bn > 0, jnp.argmax(in_span_bnt, axis=-1), t)
  return start_bn, length_bn


def _span_block_partial(q_mchd, kv_msd, valid_mc, valid_ms, scale):
  """Dense attention of a chunk of each span block's queries over the whole block: [M, C, ...]."""
  scores_mchs = jnp.einsum('mchd,msd->mchs', q_mchd, kv_msd,
                           preferred_element_type=jnp.float32) * scale
  mask_mcs = valid_mc[:, :, None] & valid_ms[:, None, :]
  probs_mchs, lse_mch = _masked_softmax_partial(scores_mchs, mask_mcs[:, :, None, :])
  o_mchd = jnp.einsum('mchs,msd->mchd', probs_mchs.astype(kv_msd.dtype), kv_msd,
                      preferred_element_type=jnp.float32).astype(kv_msd.dtype)
  return o_mchd, lse_mch


def _span_partial_gathered(q_bthd, kv_btd, span_ids_bt, scale, num_spans, max_span, chunk):
  b, t, h, d = q_bthd.shape
  start_bn, length_bn = span_extents(span_ids_bt, num_spans)
  j_s = jnp.arange(max_span)
  valid_bns = j_s[None, None, :] < length_bn[..., None]
  pos_bns = jnp.where(valid_bns, start_bn[..., None] + j_s, 0)
  rows_b11 = jnp.arange(b)[:, None, None]
  m = b * num_spans  # one block per (row, span slot)
  q_mshd = q_bthd[rows_b11, pos_bns].reshape(m, max_span, h, d)
  kv_msd = kv_btd[rows_b11, pos_bns].reshape(m, max_span, d)
  valid_ms = valid_bns.reshape(m, max_span)

  def per_chunk(c, offset):
    del offset
    return _span_block_partial(c['q'], kv_msd, c['valid'], valid_ms, scale)
  if chunk:
    o_mshd, lse_msh = map_query_chunks(jax.checkpoint(per_chunk),
                                       {'q': q_mshd, 'valid': valid_ms}, chunk)
  else:  # whole spans, probabilities kept for the backward
    o_mshd, lse_msh = per_chunk({'q': q_mshd, 'valid': valid_ms}, 0)
  # Scatter back; padding slots go to index t, which mode='drop' discards.
  dest_bns = jnp.where(valid_bns, pos_bns, t)
  o_bthd = jnp.zeros((b, t, h, d), kv_btd.dtype).at[rows_b11, dest_bns].set(
      o_mshd.reshape(b, num_spans, max_span, h, d), mode='drop')
  lse_bth = jnp.full((b, t, h), -jnp.inf, jnp.float32).at[rows_b11, dest_bns].set(
      lse_msh.reshape(b, num_spans, max_span, h), mode='drop')
  return o_bthd, lse_bth


def span_partial(q_bthd, kv_btd, span_ids_bt, *, num_spans: int, max_span: int,
                 impl: str = 'gathered', scale: float | None = None, chunk: int = 256):
  """Same-span keys as a partial: (o_bthd normalised over them, lse_bth; -inf outside spans).

  span_ids_bt: int [B, T], 1..num_spans per image span (contiguous), 0 elsewhere; max_span
  bounds a span's length (`ModelConfig.image_span_max_len`). Output in kv's dtype.
  chunk: span queries per recomputed chunk (`gathered`; `ModelConfig.span_chunk`); 0 = whole
  spans at once, their probabilities kept for the backward (no recomputation, more memory).
  """
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  if impl == 'reference':
    return _span_partial_reference(q_bthd, kv_btd, span_ids_bt, scale)
  if impl == 'gathered':
    # Per device and whole rows: GSPMD cannot split the row-indexed gathers and scatters by
    # batch (it would run them over the global batch on every device), and a span's queries
    # need the whole span, wherever context parallelism cuts the row.
    max_span = min(max_span, q_bthd.shape[1])
    gathered = functools.partial(_span_partial_gathered, scale=scale, num_spans=num_spans,
                                 max_span=max_span, chunk=chunk)
    return batch_local(gathered, q_bthd, kv_btd, span_ids_bt, split_seq=False)
  raise ValueError(f'span attention impl must be one of {IMPLS}, got {impl!r}')
