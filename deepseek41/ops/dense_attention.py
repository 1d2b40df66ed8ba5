"""Exact causal attention over every earlier token of the document (docs/architecture.md 3.8.1).

The attention of a ratio > 0 layer under `model.attention_variant='dense'`: the window branch
of ops/swa_attention.py with no window. Query t sees key u iff `u <= t`, both in the same
non-padding document and, with span ids given, not both in one image span (span_attention.py
supplies those keys). One latent row is the key and the value of every head. The partial
contract is the window's: (o_bthd, lse_bth fp32), lse -inf and o 0 where nothing is visible;
the layer merges it with the sink (ops/softmax_merge.py).

Three implementations, same signature, same results:
- `reference`: dense [B, T, H, T] scores, the ground truth for tests and tiny shapes;
- `chunked`: `chunk` queries at a time, each chunk against the keys up to the last row of its
  run (`causal_runs`: the chunks in up to `runs` runs, so about (runs + 1) / (2 runs) of the
  [T, T] square is scored), each chunk recomputed in the backward (`jax.checkpoint`): nothing
  of size T x T lives, a chunk's [chunk, H, T] scores at a time. The CPU's and generation's path.
- `fused`: the GPU window kernel (ops/gpu/window_kernel.py) with the window the whole row. Its
  programs walk only the key blocks at or before their queries, so it is a causal flash
  attention with the masks on chip, forward and backward, and joins the merged backward
  (`dense_branch`) like the window kernel.

cuDNN (`jax.nn.dot_product_attention(implementation='cudnn')`) is not a path of the model: it
takes head widths up to 256 (the shipped configs have 512), packed documents only through
jax's private segment-offset interface, and it gives the log-sum-exp (which the sink's merge
differentiates) no gradient. benchmarks/bench_variants.py times it beside this op as the
yardstick of what dense attention of the same FLOPs costs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepseek41.ops.chunking import map_query_chunks
from deepseek41.ops.softmax_merge import Branch
from deepseek41.ops.swa_attention import keyset_partial, swa_partial, window_branch, window_mask_btu

IMPLS = ('reference', 'chunked', 'fused')
RUNS = 4  # the chunked path's causal runs: 5/8 of the square scored


def causal_runs(t: int, chunk: int, runs: int) -> list[tuple[int, int]]:
  """[(first row, end row)]: the query chunks of a T-row sequence in up to `runs` runs of whole
  chunks; a run's queries see no key at or past its end row."""
  n_chunks = -(-t // chunk)
  runs = max(1, min(runs, n_chunks))
  bounds = [g * n_chunks // runs * chunk for g in range(runs)] + [t]
  return [(r0, min(r1, t)) for r0, r1 in zip(bounds[:-1], bounds[1:])]


def dense_mask_btu(segment_ids_bt, span_ids_bt=None):
  """[B, T, T] bool: query t sees key u (u <= t, same non-padding document, not the query's own
  image span)."""
  return window_mask_btu(segment_ids_bt, segment_ids_bt.shape[1], span_ids_bt)


def _dense_partial_reference(q_bthd, kv_btd, segment_ids_bt, scale, span_ids_bt=None):
  return keyset_partial(q_bthd, kv_btd, dense_mask_btu(segment_ids_bt, span_ids_bt), scale)


def _sees_bcu(rows_c, seg_q_bc, span_q_bc, seg_k_bu, span_k_bu):
  """[B, C, U] bool: chunk query c (at row rows_c[c]) sees key u of the run's prefix."""
  u = jnp.arange(seg_k_bu.shape[1], dtype=jnp.int32)
  sees = ((u[None, None, :] <= rows_c[None, :, None]) &
          (seg_q_bc[:, :, None] == seg_k_bu[:, None, :]) & (seg_q_bc != 0)[:, :, None])
  if span_q_bc is not None:  # the query's own span is span_attention's branch
    sees = sees & ~((span_q_bc[:, :, None] == span_k_bu[:, None, :]) &
                    (span_q_bc != 0)[:, :, None])
  return sees


def _dense_partial_chunked(q_bthd, kv_btd, segment_ids_bt, scale, chunk, span_ids_bt=None,
                           runs: int = RUNS):
  t = q_bthd.shape[1]
  chunk = max(1, min(chunk or t, t))
  outs = []
  for r0, r1 in causal_runs(t, chunk, runs):
    kv_bud, seg_k_bu = kv_btd[:, :r1], segment_ids_bt[:, :r1]
    span_k_bu = None if span_ids_bt is None else span_ids_bt[:, :r1]

    def per_chunk(c, offset, r0=r0, kv_bud=kv_bud, seg_k_bu=seg_k_bu, span_k_bu=span_k_bu):
      rows_c = r0 + offset + jnp.arange(c['q'].shape[1], dtype=jnp.int32)
      sees_bcu = _sees_bcu(rows_c, c['seg'], c.get('span'), seg_k_bu, span_k_bu)
      o_bchd, lse_bch = keyset_partial(c['q'], kv_bud, sees_bcu, scale)
      return o_bchd.astype(kv_bud.dtype), lse_bch  # in kv's dtype, as the chunked window's

    xs = {'q': q_bthd[:, r0:r1], 'seg': segment_ids_bt[:, r0:r1]}
    if span_ids_bt is not None:
      xs['span'] = span_ids_bt[:, r0:r1]
    # Checkpointed: the backward recomputes a chunk's probabilities instead of keeping them all.
    outs.append(map_query_chunks(jax.checkpoint(per_chunk), xs, chunk))
  if len(outs) == 1:
    return outs[0]
  return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*outs))


def _check_shapes(q_bthd, kv_btd, segment_ids_bt):
  if q_bthd.ndim != 4 or kv_btd.ndim != 3 or q_bthd.shape[-1] != kv_btd.shape[-1]:
    raise ValueError(f'expected q [B,T,H,d] and kv [B,T,d], got {q_bthd.shape} and {kv_btd.shape}')
  if q_bthd.shape[:2] != kv_btd.shape[:2] or segment_ids_bt.shape != q_bthd.shape[:2]:
    raise ValueError(f'q {q_bthd.shape}, kv {kv_btd.shape} and segment_ids '
                     f'{segment_ids_bt.shape} disagree on [B, T]')


def dense_partial(q_bthd, kv_btd, segment_ids_bt, *, impl: str = 'chunked',
                  chunk: int | None = None, scale: float | None = None, span_ids_bt=None):
  """Every earlier key of the document as a partial: (o_bthd, lse_bth fp32).

  q_bthd [B, T, H, d]; kv_btd [B, T, d], the shared K=V latent; segment_ids_bt [B, T] int, 0 =
  padding, documents contiguous within a row; span_ids_bt: image spans (their keys left out).
  scale defaults to 1/sqrt(d). chunk: queries per chunk of the chunked path (None: all). The
  output is fp32 from the reference and in kv's dtype from the chunked and fused paths.
  """
  _check_shapes(q_bthd, kv_btd, segment_ids_bt)
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  if impl == 'reference':
    return _dense_partial_reference(q_bthd, kv_btd, segment_ids_bt, scale, span_ids_bt)
  if impl == 'chunked':
    return _dense_partial_chunked(q_bthd, kv_btd, segment_ids_bt, scale, chunk, span_ids_bt)
  if impl == 'fused':  # a window as long as the row: the causal prefix of every query
    return swa_partial(q_bthd, kv_btd, segment_ids_bt, window=q_bthd.shape[1], impl='fused',
                       scale=scale, span_ids_bt=span_ids_bt)
  raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')


def dense_branch(q_bthd, kv_btd, segment_ids_bt, *, scale: float | None = None,
                 span_ids_bt=None) -> Branch:
  """The fused dense partial as a `softmax_merge.Branch` (model.merged_backward): its backward
  runs from the merged softmax's statistics."""
  _check_shapes(q_bthd, kv_btd, segment_ids_bt)
  return window_branch(q_bthd, kv_btd, segment_ids_bt, window=q_bthd.shape[1], scale=scale,
                       span_ids_bt=span_ids_bt)
