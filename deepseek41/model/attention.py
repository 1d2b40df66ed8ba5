"""The V4.1 attention core: shared-KV latent MQA with a sink (docs/architecture.md 3.3-3.5, 3.8).

    q_r = q_norm(x W_qa);  q = q_r W_qb  -> [B,T,H,d];  q_h <- q_h / rms(q_h)   (q_head_norm)
    c   = kv_norm(x W_kv)                  -> [B,T,d]    one latent = key = value for all heads
    RoPE on the last rope_head_dim channels of q and c ("main" for ratio-0 layers, else "compress")
    o   = softmax over {window keys} (+ the compressed branch) with sink exp(z_h) in the denominator
    o[..., -rope:] <- inverse RoPE at the query position
    y   = concat_g(o_g W_oa[g]) W_ob        grouped low-rank output, G groups of H/G heads

Image-span positions also see their whole span (ops/span_attention.py, one more partial).
What a layer of ratio > 0 adds is `model.attention_variant` (docs/architecture.md 3.8.1):
- csa2: the compressed sparse branch (`csa2.CSA2`: its KV source's entries selected by its index
  source) as a second softmax partial, merged with the window by log-sum-exp;
- dense: no window: every earlier key of the document (ops/dense_attention.py), exactly;
- window: nothing; the layer attends over its sliding window only.
Ratio-0 layers attend over their window in every variant.

Generation: each layer owns its cache (`init_cache`, `decode`): the ring of its newest latents
(a window's, or at a dense layer every position's), and at a KV source its compressed entries
(csa2.py `EntryCache`). A chunk of new tokens attends to its own keys and to the ring's in one
softmax, then is written into the ring.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from deepseek41.config import SWA, LayerRole, ModelConfig
from deepseek41.model.csa2 import CSA2, EntryCache, merged_backward
from deepseek41.model.layer_cache import CacheSpec, ring_slots, scatter_rows
from deepseek41.model.norms import RMSNorm, rms_normalize
from deepseek41.model.params import const_param, dtype_of, normal_param
from deepseek41.model.rope import apply_rope, rope_for_role
from deepseek41.model.shared import Shared
from deepseek41.ops.dense_attention import dense_branch, dense_partial
from deepseek41.ops.fp8_matmul import batched_fp8_matmul, dense
from deepseek41.ops.span_attention import span_partial
from deepseek41.ops.softmax_merge import merge
from deepseek41.ops.swa_attention import (keyset_partial, swa_partial, window_branch,
                                            window_mask_btu)
from deepseek41.ops.union_attention import union_attention
from deepseek41.packing import empty_stored, load, store
from deepseek41.quant import get_fake_quant


@struct.dataclass
class AttentionCache:
  """One layer's generation cache (C = `CacheSpec.ring` slots, slot pos % C)."""
  ring: Any                  # the latents of the newest C positions (a dense layer: all), in
                             # model.swa_quant
  ring_pos: jax.Array        # int32 [B, C]: the position in each slot, -1 = empty
  entries: EntryCache | None = None  # a KV source's compressed entries (csa2.py)

  def without_window(self) -> AttentionCache:
    """The cache with an empty ring (bounded replay rebuilds it)."""
    return self.replace(ring_pos=jnp.full_like(self.ring_pos, -1))


def ring_sees(ring_pos_bc, pos_bt, valid_bt, start_b, window: int):
  """[B, T, C] bool: slot u of the ring is seen by query t iff it holds a position before the
  chunk's start within t's window."""
  kpos = ring_pos_bc[:, None, :]
  return (kpos >= 0) & (kpos < start_b[:, None, None]) & (pos_bt[:, :, None] - kpos < window) \
      & valid_bt[:, :, None]


def seen_ring_slots(ring, ring_pos_bc, start_b, window: int):
  """(the ring's rows, their positions) at the slots of positions [start - window + 1, start):
  all that `ring_sees` admits for a chunk's queries (at start or later), each in its
  own slot (pos % C, C >= window). A window layer's ring has C = window + max_chunk - 1 slots,
  and a prefill chunk's dense [T, C] scores over all of it were quadratic in the chunk
  (docs/performance.md section 57)."""
  w = window - 1
  slot_bw = jnp.mod(start_b[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :],
                    ring_pos_bc.shape[1])

  def take(a):
    return jnp.take_along_axis(a, slot_bw.reshape(slot_bw.shape + (1,) * (a.ndim - 2)), axis=1)
  return jax.tree.map(take, ring), take(ring_pos_bc)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, role: LayerRole, rngs: nnx.Rngs):
    d_model, h, d, g = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.o_groups
    std = cfg.init_std
    self.cfg = cfg
    self.role = role
    self.wq_a = normal_param(rngs, (d_model, cfg.q_lora_rank), ('embed', 'q_lora'), std)
    self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    self.wq_b = normal_param(rngs, (cfg.q_lora_rank, h, d), ('q_lora', 'heads', 'head_dim'), std,
                             stack_axes=(1,))  # Muon orthogonalises each head's slice
    self.wkv = normal_param(rngs, (d_model, d), ('embed', 'kv_latent'), std)
    self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
    self.sink = const_param(0.0, (h,), ('heads',))
    self.wo_a = normal_param(rngs, (g, (h // g) * d, cfg.o_lora_rank),
                             ('o_groups', 'head_dim', 'o_lora'), std, stack_axes=(0,))
    self.wo_b = normal_param(rngs, (g * cfg.o_lora_rank, d_model), ('o_lora', 'embed'), std)
    self.csa2 = CSA2(cfg, role, rngs) if cfg.csa2 and role.mode != SWA else None
    # Dense: the same parameters as a window-only layer; its keys are every earlier latent.
    self.dense = cfg.dense and role.mode != SWA

  def __call__(self, x_btd, batch, shared: Shared):
    """Returns (output [B,T,D], shared): `shared` carries compressed KV and selections onward."""
    if shared.decode is not None:  # generation: the keys before this chunk come from the cache
      layer = self.role.layer
      y_btd, cache, shared = self.decode(x_btd, batch, shared.decode.caches[layer], shared)
      return y_btd, shared.with_cache(layer, cache)
    q_r_btr, q_bthd, kv_btd = self.project(x_btd, batch['positions'])
    o_bthd, shared = self.attend(x_btd, q_r_btr, q_bthd, kv_btd, batch, shared)
    return self.output(o_bthd), shared

  @property
  def owns_kv(self) -> bool:
    """Whether this is a KV source (it compresses its input for the layers it serves)."""
    return self.csa2 is not None and self.csa2.owns_kv

  def publish_kv(self, x_btd, batch, shared: Shared) -> Shared:
    """Only this KV source's entries and index keys, published (CED prefill): compressed from
    the rows in training, appended to the layer's cache in generation."""
    if shared.decode is None:
      return self.csa2.publish_kv(x_btd, batch, shared)
    layer = self.role.layer
    cache, shared = self._append_entries(x_btd, batch, shared.decode.caches[layer], shared)
    return shared.with_cache(layer, cache)

  def _append_entries(self, x_btd, batch, cache: AttentionCache, shared: Shared):
    """Generation at a KV source: (the cache with the chunk's groups in its entries, shared
    with every entry published)."""
    entries, published = self.csa2.decode_kv(x_btd, batch, cache.entries, shared.decode)
    return cache.replace(entries=entries), shared.with_kv(self.role.layer, published)

  def init_cache(self, spec: CacheSpec) -> AttentionCache:
    """This layer's empty generation cache."""
    cfg = self.cfg
    b, c = spec.batch, spec.max_len if self.dense else spec.ring(cfg)
    return AttentionCache(
        ring=empty_stored(cfg.swa_quant, (b, c), cfg.head_dim, dtype_of(cfg.compute_dtype)),
        ring_pos=jnp.full((b, c), -1, jnp.int32),
        entries=self.csa2.init_cache(spec) if self.owns_kv else None)

  def decode(self, x_btd, batch, cache: AttentionCache, shared: Shared):
    """Generation over a chunk (shared.decode): (output [B,T,D], the updated cache, shared).

    The chunk's own keys form the window (or dense) partial as in training; the ring's keys
    before the chunk one more partial of the same softmax (a dense layer's ring holds every
    position, so it sees them all). A KV source appends the groups the chunk
    completes to its entries and publishes all of them (unless CED prefill already has).
    """
    cfg, decoding = self.cfg, shared.decode
    pos_bt, valid_bt = batch['positions'], batch['segment_ids'] > 0
    q_r_btr, q_bthd, raw_btd = self.project(x_btd, pos_bt, quantize_latent=False)
    new_ring = store(cfg.swa_quant, raw_btd)
    kv_btd = load(cfg.swa_quant, new_ring, x_btd.dtype)  # = the fake quantization, bit for bit
    reach = cache.ring_pos.shape[1] if self.dense else cfg.sliding_window
    ring, ring_pos = cache.ring, cache.ring_pos
    if not self.dense and 1 < reach < ring_pos.shape[1]:  # a chunk program's longer ring
      ring, ring_pos = seen_ring_slots(ring, ring_pos, decoding.start_b, reach)
    ring_kv = load(cfg.swa_quant, ring, x_btd.dtype)
    sees_btc = ring_sees(ring_pos, pos_bt, valid_bt, decoding.start_b, reach)
    if self.owns_kv and self.role.layer not in shared.kv:
      cache, shared = self._append_entries(x_btd, batch, cache, shared)
    if self.one_softmax(x_btd, batch):
      o_bthd, shared = self.attend_union(x_btd, q_r_btr, q_bthd, kv_btd, batch, shared,
                                         (ring_kv, sees_btc))
    else:
      o_bthd, shared = self.attend(x_btd, q_r_btr, q_bthd, kv_btd, batch, shared,
                                   extra_partials=(keyset_partial(q_bthd, ring_kv, sees_btc),))
    slots = ring_slots(pos_bt, valid_bt, decoding.end_b, cache.ring_pos.shape[1])
    cache = cache.replace(ring=scatter_rows(cache.ring, slots, new_ring),
                          ring_pos=scatter_rows(cache.ring_pos, slots, pos_bt))
    return self.output(o_bthd), cache, shared

  def project(self, x_btd, positions_bt, quantize_latent: bool = True):
    """(q_r_btr, q_bthd, kv_btd): the low-rank query and the RoPE'd query heads and latent
    (in its cache format, or before it with quantize_latent=False)."""
    cfg = self.cfg
    dt = x_btd.dtype
    inv_freq = rope_for_role(cfg, self.role.rope)
    q_r_btr = self.q_norm(dense(x_btd, self.wq_a[...], cfg.fp8))
    if cfg.fp8 == 'off':
      q_bthd = jnp.einsum('btr,rhd->bthd', q_r_btr, self.wq_b[...].astype(dt))
    else:  # heads x head_dim as one output axis: a plain 2-D GEMM
      wq_b_rhd = self.wq_b[...]
      q_bthd = dense(q_r_btr, wq_b_rhd.reshape(wq_b_rhd.shape[0], -1), cfg.fp8)
      q_bthd = q_bthd.reshape(*q_r_btr.shape[:2], *wq_b_rhd.shape[1:])
    if cfg.q_head_norm:
      q_bthd = rms_normalize(q_bthd, cfg.rms_norm_eps).astype(dt)
    q_bthd = apply_rope(q_bthd, positions_bt, inv_freq)
    latent = self.latent if quantize_latent else self.latent_unquantized
    return q_r_btr, q_bthd, latent(x_btd, positions_bt)

  def latent(self, x_btd, positions_bt):
    """The shared K=V latent [B, T, d]: normed, RoPE'd at the positions, in its cache format."""
    return get_fake_quant(self.cfg.swa_quant)(self.latent_unquantized(x_btd, positions_bt))

  def latent_unquantized(self, x_btd, positions_bt):
    """The latent before the cache format's quantization (what a packed cache packs)."""
    cfg = self.cfg
    kv_btd = self.kv_norm(dense(x_btd, self.wkv[...], cfg.fp8))
    return apply_rope(kv_btd, positions_bt, rope_for_role(cfg, self.role.rope))

  def attend(self, x_btd, q_r_btr, q_bthd, kv_btd, batch, shared: Shared, extra_partials=()):
    """The attention core: window or dense (+ compressed) partials, sink, inverse RoPE ->
    (o_bthd, shared).

    Split out so the benchmarks time exactly what the variants change. `extra_partials`: more
    key sets in the same softmax (generation's cached keys before the chunk, `decode`).
    """
    cfg = self.cfg
    span_ids_bt = batch.get('image_span')  # image spans: bidirectional inside, causal outside
    seg_bt = batch['segment_ids']
    branch = merged_backward(cfg, shared) and cfg.attention_impl == 'fused'
    # scopes name the GPU trace's kernels (trace_summary.py)
    with jax.named_scope('dense' if self.dense else 'swa'):
      if self.dense and branch:
        own = dense_branch(q_bthd, kv_btd, seg_bt, span_ids_bt=span_ids_bt)
      elif self.dense:
        own = dense_partial(q_bthd, kv_btd, seg_bt, impl=cfg.attention_impl,
                            chunk=cfg.sparse_chunk, span_ids_bt=span_ids_bt)
      elif branch:
        own = window_branch(q_bthd, kv_btd, seg_bt, window=cfg.sliding_window,
                            span_ids_bt=span_ids_bt, fused_forward=cfg.window_forward)
      else:
        own = swa_partial(q_bthd, kv_btd, seg_bt, window=cfg.sliding_window,
                          impl=cfg.attention_impl, span_ids_bt=span_ids_bt)
      partials = [own, *extra_partials]
    if span_ids_bt is not None:
      with jax.named_scope('span'):
        partials.append(span_partial(
            q_bthd, kv_btd, span_ids_bt, num_spans=batch['image_grid'].shape[1],
            max_span=cfg.image_span_max_len, chunk=cfg.span_chunk,
            impl='reference' if cfg.attention_impl == 'reference' else 'gathered'))
    if self.csa2 is not None:
      with jax.named_scope('csa2'):
        compressed, shared = self.csa2(x_btd, q_r_btr, q_bthd, batch, shared)
      partials.append(compressed)
    # Shared K=V: the output is rotated back by the inverse RoPE, in the merge's pass.
    rope = functools.partial(apply_rope, inv_freq=rope_for_role(cfg, self.role.rope))
    o_bthd, handoffs = merge(partials, self.sink[...], dtype=x_btd.dtype, rope=rope,
                             positions_bt=batch['positions'])
    for sinks in handoffs:  # the sparse branch's {index source: sinks} (csa2.py)
      shared = shared.with_sinks(sinks)
    return o_bthd, shared

  def one_softmax(self, x_btd, batch) -> bool:
    """Whether a generation chunk attends over all its keys in one softmax
    (ops/union_attention.py): a chunk of at most model.decode_union_rows tokens, at a window
    layer (dense layers' rings hold every position) without image spans."""
    rows = self.cfg.decode_union_rows
    return (0 < x_btd.shape[1] <= rows and not self.dense and batch.get('image_span') is None)

  def attend_union(self, x_btd, q_r_btr, q_bthd, kv_btd, batch, shared: Shared, ring):
    """`attend` for a small generation chunk: the chunk's own window keys, the cached ring's
    (ring: (kv_bcd, sees_btc)) and the selected compressed entries in one softmax with the
    sink, then the inverse RoPE -> (o_bthd, shared)."""
    cfg = self.cfg
    own = (kv_btd, window_mask_btu(batch['segment_ids'], cfg.sliding_window))
    key_sets = [own, ring]
    if self.csa2 is not None:
      with jax.named_scope('csa2'):
        selected, shared = self.csa2(x_btd, q_r_btr, q_bthd, batch, shared, as_keys=True)
      key_sets.append(selected)
    o_bthd = union_attention(q_bthd, key_sets, self.sink[...]).astype(x_btd.dtype)
    return apply_rope(o_bthd, batch['positions'], rope_for_role(cfg, self.role.rope),
                      inverse=True), shared

  def output(self, o_bthd):
    """Grouped low-rank output projection: [B,T,H,d] -> [B,T,D]."""
    cfg = self.cfg
    b, t = o_bthd.shape[:2]
    dt = o_bthd.dtype
    o_btgf = o_bthd.reshape(b, t, cfg.o_groups, -1)
    if cfg.fp8 == 'off':
      low_btgr = jnp.einsum('btgf,gfr->btgr', o_btgf, self.wo_a[...].astype(dt))
    else:  # one fp8 GEMM per group, each with its own row scales
      o_gmf = jnp.moveaxis(o_btgf, 2, 0).reshape(cfg.o_groups, b * t, -1)
      low_gmr = batched_fp8_matmul(o_gmf, self.wo_a[...].astype(dt))
      low_btgr = jnp.moveaxis(low_gmr.reshape(cfg.o_groups, b, t, -1), 0, 2)
    return dense(low_btgr.reshape(b, t, -1), self.wo_b[...], cfg.fp8)
