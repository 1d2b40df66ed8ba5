"""The CSA2 KV compressor of a KV-source layer (docs/architecture.md section 3.6).

    r = 1:  latent_t = kv_norm(x_t W_kv)                                     one entry per token
    r = 2:  kv_t = x_t W_kv,  g_t = x_t W_gate                (fp32)
            w = softmax over the pair (g_2j, g_2j+1), per channel           (fp32)
            latent_j = kv_norm(w_0 kv_2j + w_1 kv_2j+1)                     one entry per 2 tokens
    kv_j = quantize(RoPE_compress(latent_j, pos = position of the group's first token))

The pre-RoPE `latent` feeds the indexer keys (indexer.IndexKeys); `kv` is the compressed K=V that
the sparse attention reads. Quantisation (FP4 fake-quant in QAT) is the caller's: pass it as the
`quantize` hook; the default is the identity.

Layout of the entries of one batch row. Entry j is made of the row's tokens {j*r, ..., j*r + r-1}
(groups are aligned to the ROW, not to documents), so N = ceil(T / r). Every entry carries its
own metadata, so any slice of entries can be used on its own:

    pos_bn   int32  RoPE position = positions_bt of the group's first token (j*r in a document that
                    starts at an even row offset, as section 3.4 says)
    seg_bn   int32  segment id of the group; 0 when the group contains padding or STRADDLES two
                    documents (e.g. a document of odd length followed by another): such an entry
                    is never visible to anyone
    last_bn  int32  row index of the group's last token: the entry exists once that token is seen

Packing note: a document that starts at an odd row offset loses its first token to a straddling
(invisible) group and its entries are {1,2}, {3,4}, ... instead of {0,1}, {2,3}, ... as at
inference, with RoPE positions 1, 3, ...; the result is still causal and never leaks across
documents, but only documents that start at an even row offset compress exactly like inference
(docs/architecture.md section 4.1, "Packing").

If T is not a multiple of r the row is padded internally with padding tokens (segment 0), so the
last entry of such a row is invisible.

Visibility (`visible_btn`): entry j is visible to query row t iff
`seg_bn[j] == segment_ids_bt[t] != 0` and `last_bn[j] <= t`; inside a document that starts at an
even row offset this is exactly section 3.6's `j_local < floor((t_local + 1) / r)`. The scalable
path must never build [T, N] for a whole sequence: `visible_btn` takes a slice of query rows
(`row_offset`) and any slice of entries, so a caller builds it one query chunk at a time, and
`document_first_entry_bt` finds where each query's document starts among the entries in O(T).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from deepseek41.config import ModelConfig
from deepseek41.model.layer_cache import CacheSpec, ring_slots, scatter_rows
from deepseek41.model.norms import RMSNorm
from deepseek41.model.params import normal_param
from deepseek41.model.rope import apply_rope, rope_for_role


def identity(x):
  return x


@struct.dataclass
class CompressedKV:
  """The compressed entries of one KV-source layer for a batch of rows (N = ceil(T / ratio))."""
  latent_bnd: jax.Array   # normed pre-RoPE latent (indexer keys are derived from it)
  kv_bnd: jax.Array       # quantize(RoPE_compress(latent)): the compressed K=V of attention
  pos_bn: jax.Array       # int32 RoPE position of the entry (its first token's position)
  seg_bn: jax.Array       # int32 segment id, 0 = never visible (padding or straddling group)
  last_bn: jax.Array      # int32 row index of the group's last token
  ratio: int = struct.field(pytree_node=False, default=1)
  # Generation's packed cache: kv_bnd holds the stored rows and this unpacks gathered ones
  # (ops/sparse_attention.py `compressed_partial`); None: kv_bnd holds the values.
  load_rows: Callable | None = struct.field(pytree_node=False, default=None)

  @property
  def num_entries(self) -> int:
    return self.seg_bn.shape[-1]


@struct.dataclass
class RowRing:
  """Generation, ratio r > 1: the projected rows of each row's newest R positions (slot
  pos % R, R = `CacheSpec.raw`), from which a chunk pools the groups it completes."""
  kv_brd: jax.Array     # fp32
  gate_brd: jax.Array   # fp32
  pos_br: jax.Array     # int32 position in each slot, -1 = empty


# ---------------------------------------------------------------------------------------------
# Pure functions


def pad_rows_to_ratio(x_bt, ratio: int, value=0):
  """Pad axis 1 (T) at the end to a multiple of `ratio` with `value`."""
  t = x_bt.shape[1]
  extra = -t % ratio
  if extra == 0:
    return x_bt
  pad = [(0, 0)] * x_bt.ndim
  pad[1] = (0, extra)
  return jnp.pad(x_bt, pad, constant_values=value)


def group_layout(segment_ids_bt, positions_bt, ratio: int):
  """(pos_bn, seg_bn, last_bn) of the row-aligned groups of `ratio` tokens, all int32.

  seg_bn is the group's segment id if all its tokens share it, else 0 (straddling group);
  padding tokens have segment 0, so any group touching padding is 0 too.
  """
  seg = pad_rows_to_ratio(jnp.asarray(segment_ids_bt, jnp.int32), ratio)
  pos = pad_rows_to_ratio(jnp.asarray(positions_bt, jnp.int32), ratio)
  b, t = seg.shape
  n = t // ratio
  seg_bnr = seg.reshape(b, n, ratio)
  same_bn = jnp.all(seg_bnr == seg_bnr[..., :1], axis=-1)
  seg_bn = jnp.where(same_bn, seg_bnr[..., 0], 0)
  pos_bn = pos.reshape(b, n, ratio)[..., 0]
  last_bn = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) * ratio + (ratio - 1), (b, n))
  return pos_bn, seg_bn, last_bn


def gated_pool(kv_btd, gate_btd, ratio: int):
  """Per-channel softmax-gated sum over each group of `ratio` rows, in fp32: [B, N, d].

  T must be a multiple of `ratio` (see `pad_rows_to_ratio`).
  """
  b, t, d = kv_btd.shape
  n = t // ratio
  kv_bnrd = kv_btd.astype(jnp.float32).reshape(b, n, ratio, d)
  w_bnrd = jax.nn.softmax(gate_btd.astype(jnp.float32).reshape(b, n, ratio, d), axis=2)
  return jnp.sum(w_bnrd * kv_bnrd, axis=2)


def visible_btn(segment_ids_bt, comp: CompressedKV, row_offset=0):
  """bool [B, Tq, N]: entry j is visible to query row t (complete at or before t, same document).

  `segment_ids_bt` holds the segment ids of query rows [row_offset, row_offset + Tq) (the whole
  row by default); `comp` may be any slice of entries (their `last_bn` are absolute row indices).
  Build it per query chunk in the scalable path, never for a whole long sequence.
  """
  seg_q_bt = jnp.asarray(segment_ids_bt, jnp.int32)
  return visible_at_rows_btn(seg_q_bt, query_rows(row_offset, seg_q_bt.shape[1]), comp)


def visible_at_rows_btn(segment_ids_bq, rows_bq, comp: CompressedKV):
  """bool [B, Q, N]: `visible_btn` for queries at any rows (`rows_bq` int [1 or B, Q], their
  segment ids `segment_ids_bq`), not only a contiguous run of them."""
  same_doc_bqn = (comp.seg_bn[:, None, :] == segment_ids_bq[:, :, None]) & \
      (segment_ids_bq[:, :, None] != 0)
  return same_doc_bqn & (comp.last_bn[:, None, :] <= rows_bq[:, :, None])


def visible_entries_btp(segment_ids_bt, comp: CompressedKV, entry_btp, row_offset=0):
  """bool [B, Tq, P]: `visible_btn` at each query's own entries `entry_btp` (indices into
  `comp`'s entries) rather than at every entry."""
  seg_q_bt = jnp.asarray(segment_ids_bt, jnp.int32)
  t_q = query_rows(row_offset, seg_q_bt.shape[1])

  def at_entries(x_bn):
    return jax.vmap(lambda x_n, e_tp: x_n[e_tp])(x_bn, entry_btp)
  same_doc = (at_entries(comp.seg_bn) == seg_q_bt[..., None]) & (seg_q_bt[..., None] != 0)
  return same_doc & (at_entries(comp.last_bn) <= t_q[..., None])


def query_rows(row_offset, tq: int):
  """int32 [1 or B, Tq]: the row index of each query. `row_offset` is one offset for every row
  (training, CED's tail) or one per batch row, [B] or [B, 1] (decoding rows of different
  lengths)."""
  return jnp.reshape(jnp.asarray(row_offset, jnp.int32), (-1, 1)) + jnp.arange(tq, dtype=jnp.int32)


def document_first_entry_bt(segment_ids_bt, comp: CompressedKV, row_offset=0):
  """int32 [B, Tq]: the first entry of each query row's document, -1 if the row sees no entry.

  O(T + N), no mask; `comp` must hold all entries of the row in the row-aligned layout (entry
  j = rows [j*r, j*r + r), as `Compressor` builds it). Row t's newest complete group is
  j* = floor((t+1)/r) - 1, and t sees an entry iff j* is in t's document (else t starts its
  document, or j* straddles into it). A document's entries are one run of equal segment ids
  (straddling groups and padding have id 0), so its first entry is where j*'s run starts.
  """
  seg_bn = comp.seg_bn
  n = seg_bn.shape[1]
  j_n = jnp.arange(n, dtype=jnp.int32)
  new_run_bn = jnp.concatenate([jnp.ones_like(seg_bn[:, :1], bool),
                                seg_bn[:, 1:] != seg_bn[:, :-1]], axis=1)
  run_start_bn = jax.lax.cummax(jnp.where(new_run_bn, j_n, 0), axis=1)
  seg_q_bt = jnp.asarray(segment_ids_bt, jnp.int32)
  t_q = query_rows(row_offset, seg_q_bt.shape[1])
  j_bt = jnp.broadcast_to((t_q + 1) // comp.ratio - 1, seg_q_bt.shape)
  j_safe_bt = jnp.clip(j_bt, 0, n - 1)
  sees_bt = (j_bt >= 0) & (jnp.take_along_axis(seg_bn, j_safe_bt, axis=1) == seg_q_bt) & \
      (seg_q_bt != 0)
  return jnp.where(sees_bt, jnp.take_along_axis(run_start_bn, j_safe_bt, axis=1), -1)


# ---------------------------------------------------------------------------------------------
# Module


class Compressor(nnx.Module):
  """Compressor of a KV-source layer with ratio 1 or 2 (parameters: wkv, wgate if r=2, kv_norm)."""

  def __init__(self, cfg: ModelConfig, ratio: int, rngs: nnx.Rngs):
    if ratio not in (1, 2):
      raise ValueError(f'compress ratio must be 1 or 2, got {ratio}')
    d_model, d = cfg.d_model, cfg.head_dim
    self.cfg = cfg
    self.ratio = ratio
    self.wkv = normal_param(rngs, (d_model, d), ('embed', 'kv_latent'), cfg.init_std)
    if ratio > 1:
      self.wgate = normal_param(rngs, (d_model, d), ('embed', 'kv_latent'), cfg.init_std)
    self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)

  def project(self, x_btd):
    """(kv_btd, gate_btd or None): the per-token rows a group pools. Ratio 2 projects in fp32
    (gate softmax and pooling too), as the HF reference does."""
    if self.ratio == 1:
      return x_btd @ self.wkv[...].astype(x_btd.dtype), None
    x32_btd = x_btd.astype(jnp.float32)
    return x32_btd @ self.wkv[...].astype(jnp.float32), x32_btd @ self.wgate[...].astype(jnp.float32)

  def pool(self, kv_btd, gate_btd, dtype):
    """The normed pre-RoPE latent [B, T / ratio, d] of groups of `ratio` projected rows (T a
    multiple of the ratio); the pooled latent is cast to `dtype` before the norm."""
    if self.ratio == 1:
      return self.kv_norm(kv_btd)
    return self.kv_norm(gated_pool(kv_btd, gate_btd, self.ratio).astype(dtype))

  def __call__(self, x_btd, segment_ids_bt, positions_bt,
               quantize: Callable = identity) -> CompressedKV:
    """x_btd: the layer's normed attention input. `quantize` is applied to kv_bnd after RoPE."""
    r = self.ratio
    kv_btd, gate_btd = self.project(pad_rows_to_ratio(x_btd, r))
    latent_bnd = self.pool(kv_btd, gate_btd, x_btd.dtype)
    pos_bn, seg_bn, last_bn = group_layout(segment_ids_bt, positions_bt, r)
    kv_bnd = quantize(apply_rope(latent_bnd, pos_bn, rope_for_role(self.cfg, 'compress')))
    return CompressedKV(latent_bnd=latent_bnd, kv_bnd=kv_bnd, pos_bn=pos_bn, seg_bn=seg_bn,
                        last_bn=last_bn, ratio=r)

  # -------------------------------------------------------------------------------------------
  # Generation: a chunk of new tokens per row, each row's chunk at positions [start_b, end_b)

  def init_cache(self, spec: CacheSpec) -> RowRing | None:
    """The empty row ring of ratio > 1 (ratio 1 pools nothing across chunks: None)."""
    if self.ratio == 1:
      return None
    b, r, d = spec.batch, spec.raw(self.ratio), self.cfg.head_dim
    return RowRing(kv_brd=jnp.zeros((b, r, d), jnp.float32),
                   gate_brd=jnp.zeros((b, r, d), jnp.float32),
                   pos_br=jnp.full((b, r), -1, jnp.int32))

  def decode(self, x_btd, pos_bq, valid_bq, start_b, end_b, rows: RowRing | None):
    """The groups the chunk touches: (normed pre-RoPE latent [B, G, d], first position
    [B, G], complete [B, G], the row ring with the chunk's rows in it). A group is complete
    when the chunk holds its last token; its earlier tokens come from the ring."""
    kv_rows, gate_rows = self.project(x_btd)
    if self.ratio == 1:
      return self.pool(kv_rows, None, x_btd.dtype), pos_bq, valid_bq, rows
    r, tq = self.ratio, kv_rows.shape[1]
    cap = rows.pos_br.shape[1]
    before = start_b[:, None] - (r - 1) + jnp.arange(r - 1, dtype=jnp.int32)[None, :]
    slot = jnp.clip(before % cap, 0, cap - 1)
    have = (before >= 0) & (jnp.take_along_axis(rows.pos_br, slot, 1) == before)
    prev_kv = jnp.where(have[..., None], jnp.take_along_axis(rows.kv_brd, slot[..., None], 1), 0.)
    prev_gate = jnp.where(have[..., None], jnp.take_along_axis(rows.gate_brd, slot[..., None], 1),
                          0.)
    groups = -(-(tq + r - 1) // r)
    pad = groups * r + (r - 1) - (tq + r - 1)
    rows_kv = jnp.concatenate([prev_kv, kv_rows, jnp.zeros_like(kv_rows[:, :1].repeat(pad, 1))], 1)
    rows_gate = jnp.concatenate([prev_gate, gate_rows,
                                 jnp.zeros_like(gate_rows[:, :1].repeat(pad, 1))], 1)
    shift_b = (r - 1) - start_b % r  # where the first group touching the chunk begins

    def take(rows, s):
      return jax.lax.dynamic_slice_in_dim(rows, s, groups * r, axis=0)
    g_kv = jax.vmap(take)(rows_kv, shift_b)
    g_gate = jax.vmap(take)(rows_gate, shift_b)
    latent_bgd = self.pool(g_kv, g_gate, x_btd.dtype)
    g0_b = start_b - start_b % r
    first_bg = g0_b[:, None] + r * jnp.arange(groups, dtype=jnp.int32)[None, :]
    complete_bg = (first_bg + r - 1 < end_b[:, None]) & (first_bg + r - 1 >= start_b[:, None])
    slots = ring_slots(pos_bq, valid_bq, end_b, cap)
    rows = RowRing(kv_brd=scatter_rows(rows.kv_brd, slots, kv_rows),
                   gate_brd=scatter_rows(rows.gate_brd, slots, gate_rows),
                   pos_br=scatter_rows(rows.pos_br, slots, pos_bq))
    return latent_bgd, first_bg, complete_bg, rows
