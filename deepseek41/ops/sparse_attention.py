"""The compressed branch of CSA2 attention (docs/architecture.md section 3.8) as a softmax partial.

Query t attends to the compressed entries its layer selected (top-k of the index source, at most
`index_topk` per query), with the same shared-latent MQA as the window branch: every head of a
query uses the same gathered latent as key and value. The partial `(o_bthd, lse_bth)` merges
with the window partial and the sink through `swa_attention.combine_with_sink`.

- `reference`: dense scores over all N entries, masked to the selection ([B, T, H, N]); ground
  truth for tests and tiny shapes.
- `gathered`: per query chunk, gather the k selected latents ([B, C, K, d]) and attend over them
  only; memory is linear in T and no [T, N] array exists. The H heads of a query share each
  gathered latent in one [H, d] x [d, K] matmul.
- `fused`: the GPU kernel (ops/gpu/sparse_kernel.py): the gather happens on chip, nothing of size
  [T, K, d] or [T, H, K] reaches HBM, forward and backward.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from deepseek41.ops.chunking import map_query_chunks
from deepseek41.ops.gpu.sparse_kernel import sparse_backward_fused, sparse_partial_fused
from deepseek41.ops.parallel.per_device import batch_local
from deepseek41.ops.softmax_merge import Branch
from deepseek41.ops.swa_attention import _masked_softmax_partial

IMPLS = ('reference', 'gathered', 'fused')


def selection_mask(idx_btk, valid_btk, num_entries: int):
  """bool [B, T, N] from a selection: True at the valid slots' entries (a scatter, no one-hot)."""
  b, t, _ = idx_btk.shape
  target_btk = jnp.where(valid_btk, idx_btk, num_entries)  # out of range: dropped
  bi = jnp.arange(b)[:, None, None]
  ti = jnp.arange(t)[None, :, None]
  return jnp.zeros((b, t, num_entries), jnp.bool_).at[bi, ti, target_btk].set(True, mode='drop')


def _partial_reference(q_bthd, kv_bnd, idx_btk, valid_btk, scale):
  mask_btn = selection_mask(idx_btk, valid_btk, kv_bnd.shape[1])
  scores_bthn = jnp.einsum('bthd,bnd->bthn', q_bthd, kv_bnd,
                           preferred_element_type=jnp.float32) * scale
  probs_bthn, lse_bth = _masked_softmax_partial(scores_bthn, mask_btn[:, :, None, :])
  o_bthd = jnp.einsum('bthn,bnd->bthd', probs_bthn.astype(kv_bnd.dtype), kv_bnd,
                      preferred_element_type=jnp.float32)
  mass_btk = jnp.take_along_axis(jnp.mean(probs_bthn, axis=2), idx_btk, axis=-1) * valid_btk
  return o_bthd, lse_bth, mass_btk


@jax.custom_vjp
def gather_rows(x_bnd, idx_bck, valid_bck):
  """x_bnd[b, idx_bck[b, c, k]] -> [B, C, K, d], whose gradient scatter-adds in fp32.

  Autodiff of the plain gather scatter-adds the bf16 cotangent straight into a bf16 [N, d]
  buffer; many queries pick the same entry, and bf16 atomics on the GPU are emulated, which made
  the sparse branch's backward slower than dense attention's at 16K tokens.
  The backward drops the slots that are not `valid_bck`: they all hold entry 0 (`select_topk`),
  and adding their zeros serialised every query's unused slots on one row's atomics, which
  made the scatter most of the step on short documents (docs/performance.md section 7.1).
  """
  del valid_bck
  return jax.vmap(lambda x_nd, idx_ck: x_nd[idx_ck])(x_bnd, idx_bck)


def _gather_rows_fwd(x_bnd, idx_bck, valid_bck):
  return gather_rows(x_bnd, idx_bck, valid_bck), (x_bnd, idx_bck, valid_bck)


def _gather_rows_bwd(res, ct_bckd):
  x_bnd, idx_bck, valid_bck = res  # x_bnd only for its shape and dtype: it is alive anyway
  b = jnp.arange(x_bnd.shape[0])[:, None, None]
  target_bck = jnp.where(valid_bck, idx_bck, x_bnd.shape[1])  # out of range: dropped
  grad_bnd = jnp.zeros(x_bnd.shape, jnp.float32).at[b, target_bck].add(
      ct_bckd.astype(jnp.float32), mode='drop')
  return grad_bnd.astype(x_bnd.dtype), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def selected_rows(kv_bnd, idx_bck, valid_bck, load_rows=None):
  """The selected entries [B, C, K, d]; with load_rows, kv_bnd is stored rows (generation's
  packed cache): gathered as stored, then only those unpacked."""
  if load_rows is None:
    return gather_rows(kv_bnd, idx_bck, valid_bck)
  return load_rows(jax.tree.map(
      lambda x: jax.vmap(lambda x_n, idx_ck: x_n[idx_ck])(x, idx_bck), kv_bnd))


def _partial_gathered_chunk(q_bchd, kv_bnd, idx_bck, valid_bck, scale, load_rows=None):
  kv_bckd = selected_rows(kv_bnd, idx_bck, valid_bck, load_rows)
  scores_bchk = jnp.einsum('bchd,bckd->bchk', q_bchd, kv_bckd,
                           preferred_element_type=jnp.float32) * scale
  probs_bchk, lse_bch = _masked_softmax_partial(scores_bchk, valid_bck[:, :, None, :])
  # The partial output leaves in the input dtype (bf16 in training, as a flash kernel's would):
  # an fp32 [T, H, d] per branch is 17 GB at 128K tokens and V4.1's 64 x 512 heads.
  o_bchd = jnp.einsum('bchk,bckd->bchd', probs_bchk.astype(kv_bckd.dtype), kv_bckd,
                      preferred_element_type=jnp.float32).astype(kv_bckd.dtype)
  return o_bchd, lse_bch, jnp.mean(probs_bchk, axis=2)


def _partial_gathered(q_bthd, kv_bnd, idx_btk, valid_btk, scale, chunk, load_rows=None):
  def per_chunk(c, offset):
    del offset
    return _partial_gathered_chunk(c['q'], kv_bnd, c['idx'], c['valid'], scale, load_rows)
  # Recomputed in the backward pass (flash-attention style): the saved residuals would be each
  # chunk's gathered latents and probabilities, [T, K, d] + [T, H, K], which at 64K tokens and
  # V4.1's shapes is tens of GB per layer.
  return map_query_chunks(jax.checkpoint(per_chunk),
                          {'q': q_bthd, 'idx': idx_btk, 'valid': valid_btk}, chunk)


def _sparse_fused(q_bthd, kv_bnd, idx_btk, valid_btk, *sink, with_mass, tensor_axis, later=0,
                  **kw):
  """The sparse kernels on this device's queries and heads; the slot mass, an average over
  heads, averaged over the tensor shards' heads too. Flat outputs: (o, lse[, mass], the `later`
  sinks' arrays...)."""
  o_bthd, lse_bth, mass_btk, *sinks = sparse_partial_fused(
      q_bthd, kv_bnd, idx_btk, valid_btk, with_mass=with_mass, later=later,
      sink=sink if sink and sink[0] is not None else None, **kw)
  out = (o_bthd, lse_bth)
  if with_mass:
    if tensor_axis is not None:
      mass_btk = jax.lax.pmean(mass_btk, tensor_axis)
    out += (mass_btk,)
  return out + tuple(a for s in (sinks[0] if sinks else ()) for a in s)


# Head dimension of a deferred call's sink arrays (ops/gpu/sparse_kernel.py `sink_shapes`).
_SINK_HEADS = (3, 3, 2, 2)


def compressed_partial(q_bthd, kv_bnd, idx_btk, valid_btk, *, impl: str = 'gathered',
                       chunk: int | None = None, scale: float | None = None,
                       with_mass: bool = False, load_rows=None, later: int = 0, sink=None,
                       dkv_tile: int = 0):
  """Attention of each query over its selected compressed entries: (o_bthd, lse_bth fp32).

  o_bthd is fp32 from the reference and in kv's dtype from the gathered and fused paths.

  q_bthd [B, T, H, d]; kv_bnd [B, N, d] (RoPE'd, possibly fake-quantized latents; key = value);
  idx_btk int [B, T, K] selected entries; valid_btk bool [B, T, K] (false for unused slots and
  for queries that see no entry). `chunk` bounds the queries processed at once (gathered).
  with_mass: also return mass_btk, the head-averaged attention probability of each selected slot
  within this branch (sums to 1 over the valid slots): the indexer's distillation target.
  load_rows: kv_bnd is stored rows (a pytree of [B, N, ...] arrays, e.g. packed codes and
  scales) and load_rows turns gathered ones into [..., d] values; `gathered` only, no gradient.
  later / sink (`fused` only): calls over the same kv and selection that defer their key/value
  gradient to the first (ops/gpu/sparse_kernel.py): `later` > 0 makes this the first and appends
  its sinks (one per later call) to the outputs; `sink`, one of them, makes this a later call.
  dkv_tile (`fused` only): the key/value gradient's adds merged per tile of that many queries
  (model.sparse_dkv_tile; ops/gpu/merged_dkv.py), 0 per query.
  """
  if (later or sink is not None) and impl != 'fused':
    raise ValueError(f'the deferred key/value gradient (later / sink) needs impl=fused, got '
                     f'{impl!r}')
  if load_rows is not None:
    if impl != 'gathered' or with_mass:
      raise ValueError('stored kv rows (load_rows) are read by the gathered path, without mass')
    return _partial_gathered(q_bthd, kv_bnd, idx_btk, valid_btk,
                             1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale,
                             chunk, load_rows)[:2]
  if q_bthd.shape[-1] != kv_bnd.shape[-1]:
    raise ValueError(f'q {q_bthd.shape} and kv {kv_bnd.shape} differ in the latent width')
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  if impl == 'reference':
    out = _partial_reference(q_bthd, kv_bnd, idx_btk, valid_btk, scale)
  elif impl == 'gathered':
    out = _partial_gathered(q_bthd, kv_bnd, idx_btk, valid_btk, scale, chunk)
  elif impl == 'fused':  # on the CPU the kernels run in the Pallas interpreter (tests)
    kernel = functools.partial(_sparse_fused, scale=scale, with_mass=with_mass, later=later,
                               dkv_tile=dkv_tile)
    heads = {0: 2}
    if sink is not None:
      heads.update({4 + i: h for i, h in enumerate(_SINK_HEADS)})
    sink = tuple(sink) if sink is not None else (None,) * len(_SINK_HEADS)
    out_heads = (2, 2) + ((None,) if with_mass else ()) + _SINK_HEADS * later
    out = batch_local(kernel, q_bthd, kv_bnd, idx_btk, valid_btk, *sink, whole_seq=(1,),
                      heads=heads, out_heads=out_heads, tensor_kw='tensor_axis')
    if later:
      flat = out[len(out) - len(_SINK_HEADS) * later:]
      out = out[:len(out) - len(flat)]
      sinks = tuple(tuple(flat[i:i + len(_SINK_HEADS)])
                    for i in range(0, len(flat), len(_SINK_HEADS)))
      return (out if with_mass else out[:2]) + (sinks,)
  else:
    raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')
  return out if with_mass else out[:2]


def compressed_branch(q_bthd, kv_bnd, idx_btk, valid_btk, *, scale: float | None = None,
                      with_mass: bool = False, later: int = 0, sink=None,
                      sinks_key: str = 'sinks', dkv_tile: int = 0):
  """The fused compressed partial as a `softmax_merge.Branch`: (branch, mass_btk or None).

  Its forward runs now (the slot mass, a stop-gradient target, comes with it); its backward
  runs from the merged softmax's statistics. The deferred key/value gradient works as in
  `compressed_partial`: `later` > 0 makes the branch hand off one sink per later reader under
  `sinks_key` (`Branch.handoffs`); `sink`, one of them, makes this a later reader, whose sink
  takes its coefficients back as its cotangent. dkv_tile as `compressed_partial`'s.
  """
  scale = 1.0 / math.sqrt(q_bthd.shape[-1]) if scale is None else scale
  sg = jax.lax.stop_gradient
  o_bthd, lse_bth, *rest = compressed_partial(sg(q_bthd), sg(kv_bnd), idx_btk, valid_btk,
                                              impl='fused', scale=scale, with_mass=with_mass,
                                              later=later, dkv_tile=dkv_tile)
  mass_btk = rest[0] if with_mass else None
  handoffs = {sinks_key: rest[-1]} if later else {}
  backward = functools.partial(_branch_backward, scale=scale, later_key=sinks_key if later
                               else None, dkv_tile=dkv_tile)
  return Branch(o_bthd, lse_bth, (q_bthd, kv_bnd, idx_btk, valid_btk,
                                  None if sink is None else tuple(sink)),
                backward, handoffs), mass_btk


def _branch_backward(args, merged, d_handoffs, *, scale, later_key, dkv_tile=0):
  q_bthd, kv_bnd, idx_btk, valid_btk, sink = args
  defer = sink is not None
  flat = [a for part in (d_handoffs[later_key] if later_key else ()) for a in part]
  kernel = functools.partial(_branch_backward_local, scale=scale, defer=defer,
                             dkv_tile=dkv_tile)
  heads = {0: 2, 4: 2, 5: 2, 6: 2}
  heads.update({7 + i: _SINK_HEADS[i % len(_SINK_HEADS)] for i in range(len(flat))})
  outs = batch_local(kernel, q_bthd, kv_bnd, idx_btk, valid_btk, *merged, *flat,
                     whole_seq=(1,), heads=heads, tensor_kw='tensor_axis',
                     context_kw='context_axis',
                     out_heads=(2,) + (_SINK_HEADS if defer else (None,)),
                     out_whole_seq=() if defer else (1,))
  dq = outs[0].astype(q_bthd.dtype)
  if defer:
    return dq, None, None, None, tuple(outs[1:])
  return dq, outs[1].astype(kv_bnd.dtype), None, None, None


def _branch_backward_local(q_bthd, kv_bnd, idx_btk, valid_btk, delta_bth, lse_bth, do_bthd,
                           *flat, scale, defer, tensor_axis, context_axis, dkv_tile=0):
  """`sparse_backward_fused` on this device's queries and heads. Every query may pick any entry,
  so the entries' gradient is summed over the context and tensor shards."""
  n = len(_SINK_HEADS)
  later_parts = [tuple(flat[i:i + n]) for i in range(0, len(flat), n)]
  out = sparse_backward_fused(q_bthd, kv_bnd, idx_btk, valid_btk, delta_bth, lse_bth, do_bthd,
                              scale=scale, defer=defer,
                              later_parts=later_parts, dkv_tile=dkv_tile)
  if defer:
    dq, part = out
    return (dq, *part)
  dq, dkv = out
  for axis in (tensor_axis, context_axis):
    if axis is not None:
      dkv = jax.lax.psum(dkv, axis)
  return dq, dkv
