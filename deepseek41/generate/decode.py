"""The backbone over a chunk of new tokens per row, reading and extending the caches (cache.py).

`forward_chunk` runs the same modules as training (`Transformer.run_blocks`): a `CacheKeeper` in
`shared[DECODE]` takes over two things, the attention layers' window (the chunk's own keys in
one partial, the cached ring in another, merged in the same softmax) and the KV sources'
publishing (the chunk's completed groups appended to the layer's entries, then every entry
published to the layers that read them). CSA2's selection, the candidate pool, Reuse and Reindex
run unchanged over the cached entries, with each row's query positions (`row_offset` per row).

Every row of a chunk starts at its own `cache['length']`; its valid tokens are a prefix of the
chunk (`valid_bq`), so prompts of different lengths prefill in one right-padded chunk. What a
chunk writes at positions past what a caller keeps (a rejected draft) is masked by position
until it is overwritten.

CED prefill (`ced_prefill`): the encoder over the whole prompt, the decoder's KV source published
from the encoder output over every row, the decoder over the last `n_win` tokens only (its
windows floored there; model/ced.py). Bounded replay (`replay_windows`): the windows dropped and
rebuilt from the last `n_win` tokens, the stored entries kept.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from deepseek41.config import ModelConfig
from deepseek41.generate.cache import drop_windows, load, scatter_rows, store
from deepseek41.model.compressor import CompressedKV
from deepseek41.model.csa2 import DECODE, _kv_key
from deepseek41.model.engram import row_ids
from deepseek41.model.rope import apply_rope, rope_for_role
from deepseek41.ops.swa_attention import keyset_partial


def ring_partial(q_bthd, ring_kv_bcd, ring_pos_bc, pos_bt, valid_bt, start_b, window: int):
  """The window keys cached before the chunk as one more partial: slot u is seen by query t iff
  it holds a position before the chunk's start within t's window."""
  kpos = ring_pos_bc[:, None, :]
  sees_btc = (kpos >= 0) & (kpos < start_b[:, None, None]) & (pos_bt[:, :, None] - kpos < window) \
      & valid_bt[:, :, None]
  return keyset_partial(q_bthd, ring_kv_bcd, sees_btc)


def ring_slots(pos_bq, valid_bq, end_b, capacity: int):
  """Ring slot (pos % capacity) of each valid position among a row's last `capacity` (end_b:
  one past the row's last); out of range (dropped by the scatter) for the others, so no two
  positions of a chunk land in one slot."""
  keep_bq = valid_bq & (pos_bq >= end_b[:, None] - capacity)
  return jnp.where(keep_bq, pos_bq % capacity, capacity)


@dataclasses.dataclass
class CacheKeeper:
  """The chunk's view of the caches (shared[DECODE]); `layers` is updated as layers run."""
  cfg: ModelConfig
  layers: dict
  start_b: jax.Array      # int32 [B]: the chunk's first position per row
  end_b: jax.Array        # int32 [B]: one past its last valid position
  write_entries: bool = True   # False in bounded replay: the stored entries are exact

  def _b_idx(self):
    return jnp.arange(self.start_b.shape[0])[:, None]

  def attention(self, attn, x_btd, batch, shared):
    cfg, key = self.cfg, str(attn.role.layer)
    lc = dict(self.layers[key])
    pos_bt, valid_bt = batch['positions'], batch['segment_ids'] > 0
    q_r_btr, q_bthd, raw_btd = attn.project(x_btd, pos_bt, quantize_latent=False)
    new_ring = store(cfg.swa_quant, raw_btd)
    kv_btd = load(cfg.swa_quant, new_ring, x_btd.dtype)  # = the fake quantization, bit for bit
    ring_kv = load(cfg.swa_quant, lc['ring'], x_btd.dtype)
    cached = ring_partial(q_bthd, ring_kv, lc['ring_pos'], pos_bt, valid_bt, self.start_b,
                          cfg.sliding_window)
    o_bthd, shared = attn.attend(x_btd, q_r_btr, q_bthd, kv_btd, batch, shared,
                                 extra_partials=(cached,))
    capacity = lc['ring_pos'].shape[1]
    slots = ring_slots(pos_bt, valid_bt, self.end_b, capacity)
    lc = dict(self.layers[key])  # publish (inside attend) may have updated this layer's entries
    lc['ring'] = scatter_rows(lc['ring'], self._b_idx(), slots, new_ring)
    lc['ring_pos'] = scatter_rows(lc['ring_pos'], self._b_idx(), slots, pos_bt)
    self.layers[key] = lc
    return attn.output(o_bthd), shared

  def publish(self, csa2, x_btd, batch, shared):
    """Append the chunk's completed groups to this KV source's entries; publish all of them."""
    cfg, key = self.cfg, str(csa2.role.layer)
    lc = dict(self.layers[key])
    comp = csa2.compressor
    r = comp.ratio
    b_idx = self._b_idx()
    if self.write_entries:
      pos_bq, valid_bq = batch['positions'], batch['segment_ids'] > 0
      kv_rows, gate_rows = comp.project(x_btd)
      if r == 1:
        latent_bgd = comp.pool(kv_rows, None, x_btd.dtype)
        first_bg, complete_bg = pos_bq, valid_bq
      else:
        latent_bgd, first_bg, complete_bg, lc = self._pool_groups(lc, comp, kv_rows, gate_rows,
                                                                  pos_bq, valid_bq, x_btd.dtype)
      entry_raw = apply_rope(latent_bgd, first_bg, rope_for_role(cfg, 'compress'))
      keys_raw = csa2.index_keys(latent_bgd, first_bg)
      n = lc['written'].shape[1]
      slot_bg = jnp.where(complete_bg, first_bg // r, n)
      lc['kv'] = scatter_rows(lc['kv'], b_idx, slot_bg, store(cfg.kv_quant, entry_raw))
      lc['keys'] = scatter_rows(lc['keys'], b_idx, slot_bg, store(cfg.index_quant, keys_raw))
      lc['written'] = scatter_rows(lc['written'], b_idx, slot_bg, complete_bg)
    self.layers[key] = lc
    n = lc['written'].shape[1]
    j_n = jnp.arange(n, dtype=jnp.int32)
    b = lc['written'].shape[0]
    dt = x_btd.dtype
    # The entries stay packed: attention gathers its selected rows and unpacks only those;
    # the indexer scores every key, so the keys are unpacked whole.
    view = CompressedKV(latent_bnd=None, kv_bnd=lc['kv'],
                        pos_bn=jnp.broadcast_to(j_n * r, (b, n)),
                        seg_bn=lc['written'].astype(jnp.int32),
                        last_bn=jnp.broadcast_to(j_n * r + r - 1, (b, n)), ratio=r,
                        load_rows=functools.partial(load, cfg.kv_quant, dtype=dt))
    return {**shared, _kv_key(csa2.role.layer): (view, load(cfg.index_quant, lc['keys'], dt))}

  def _pool_groups(self, lc, comp, kv_rows, gate_rows, pos_bq, valid_bq, dtype):
    """Ratio r > 1: the groups the chunk touches, pooled from the cached rows of the positions
    before it (raw ring) and the chunk's rows. Returns (latent [B, G, d], first position [B, G],
    complete [B, G], the layer cache with the chunk's rows in its raw ring)."""
    r, tq = comp.ratio, kv_rows.shape[1]
    b_idx = self._b_idx()
    cap = lc['raw_pos'].shape[1]
    before = self.start_b[:, None] - (r - 1) + jnp.arange(r - 1, dtype=jnp.int32)[None, :]
    slot = jnp.clip(before % cap, 0, cap - 1)
    have = (before >= 0) & (jnp.take_along_axis(lc['raw_pos'], slot, 1) == before)
    prev_kv = jnp.where(have[..., None], jnp.take_along_axis(lc['raw_kv'], slot[..., None], 1), 0.)
    prev_gate = jnp.where(have[..., None], jnp.take_along_axis(lc['raw_gate'], slot[..., None], 1),
                          0.)
    groups = -(-(tq + r - 1) // r)
    pad = groups * r + (r - 1) - (tq + r - 1)
    rows_kv = jnp.concatenate([prev_kv, kv_rows, jnp.zeros_like(kv_rows[:, :1].repeat(pad, 1))], 1)
    rows_gate = jnp.concatenate([prev_gate, gate_rows,
                                 jnp.zeros_like(gate_rows[:, :1].repeat(pad, 1))], 1)
    shift_b = (r - 1) - self.start_b % r  # where the first group touching the chunk begins

    def take(rows, s):
      return jax.lax.dynamic_slice_in_dim(rows, s, groups * r, axis=0)
    g_kv = jax.vmap(take)(rows_kv, shift_b)
    g_gate = jax.vmap(take)(rows_gate, shift_b)
    latent_bgd = comp.pool(g_kv, g_gate, dtype)
    g0_b = self.start_b - self.start_b % r
    first_bg = g0_b[:, None] + r * jnp.arange(groups, dtype=jnp.int32)[None, :]
    complete_bg = (first_bg + r - 1 < self.end_b[:, None]) & (first_bg + r - 1 >= self.start_b[:, None])
    slots = ring_slots(pos_bq, valid_bq, self.end_b, cap)
    lc = {**lc, 'raw_kv': scatter_rows(lc['raw_kv'], b_idx, slots, kv_rows),
          'raw_gate': scatter_rows(lc['raw_gate'], b_idx, slots, gate_rows),
          'raw_pos': scatter_rows(lc['raw_pos'], b_idx, slots, pos_bq)}
    return latent_bgd, first_bg, complete_bg, lc


def chunk_batch(cfg: ModelConfig, cache: dict, tokens_bq, valid_bq, start_b, engram_map=None,
                images: dict | None = None):
  """The model's batch for a chunk at positions start_b + q, with the Engram rows hashed over the
  tokens before the chunk too (the cache's token history). `images`: the batch contract's image
  fields of a prompt chunk (docs/design.md, "Batches"); their span positions are the IMAGE
  modality."""
  b, tq = tokens_bq.shape
  pos_bq = start_b[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]
  modality_bq = jnp.zeros((b, tq), jnp.int32)
  batch = {'tokens': tokens_bq, 'segment_ids': valid_bq.astype(jnp.int32), 'positions': pos_bq,
           'row_offset': start_b[:, None]}
  if images is not None:
    batch.update(images)
    modality_bq = (images['image_role'] != 0).astype(jnp.int32)
  batch['modality'] = modality_bq
  if cfg.engram:
    look = cfg.engram_max_ngram - 1
    back_bl = start_b[:, None] - look + jnp.arange(look, dtype=jnp.int32)[None, :]
    hist_bl = jnp.take_along_axis(cache['tokens'], jnp.clip(back_bl, 0, None), axis=1)
    # Image-span positions carry model.image_token_id: that is how the history knows them.
    hist_modality = (hist_bl == cfg.image_token_id).astype(jnp.int32) if cfg.vision else \
        jnp.zeros_like(hist_bl)
    ext = {'tokens': jnp.concatenate([hist_bl, tokens_bq], axis=1),
           'segment_ids': jnp.concatenate([(back_bl >= 0).astype(jnp.int32),
                                           batch['segment_ids']], axis=1),
           'modality': jnp.concatenate([hist_modality, modality_bq], axis=1)}
    if engram_map is not None:
      ext['engram_tokens'] = jnp.take(engram_map, ext['tokens'], axis=0)
    from deepseek41.model.engram import layer_addresses
    rows = row_ids(cfg, layer_addresses(cfg), ext)
    batch['engram_row_ids'] = {layer: ids[:, look:] for layer, ids in rows.items()}
  return batch


def _finish(cache, keeper: CacheKeeper, tokens_bq, batch):
  b_idx = jnp.arange(tokens_bq.shape[0])[:, None]
  pos_bq, valid_bq = batch['positions'], batch['segment_ids'] > 0
  cap = cache['tokens'].shape[1]
  slots = jnp.where(valid_bq, pos_bq, cap)
  return {**cache, 'layers': keeper.layers,
          'tokens': scatter_rows(cache['tokens'], b_idx, slots, tokens_bq),
          'length': jnp.maximum(cache['length'], keeper.end_b)}


def forward_chunk(model, cache: dict, tokens_bq, valid_bq, *, engram_map=None,
                  capture_layers: tuple[int, ...] = (), start_b=None, write_entries: bool = True,
                  images: dict | None = None):
  """(logits [B, Tq, V] fp32, captured {layer: [B, Tq, D]}, cache): the chunk's tokens at
  positions start_b .. (default: each row's cached length), appended to the cache."""
  cfg = model.cfg
  start_b = cache['length'] if start_b is None else start_b
  batch = chunk_batch(cfg, cache, tokens_bq, valid_bq, start_b, engram_map, images)
  end_b = start_b + jnp.sum(valid_bq, axis=1, dtype=jnp.int32)
  keeper = CacheKeeper(cfg, dict(cache['layers']), start_b, end_b, write_entries)
  x, pre = model.residual_input(batch)
  x, pre, _, captured, _ = model.run_blocks(x, pre, batch, {DECODE: keeper}, capture_layers)
  return model.logits(x, pre), captured, _finish(cache, keeper, tokens_bq, batch)


def _tail_rows(x, start_b, n_win: int):
  return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, n_win, axis=0))(x, start_b)


def ced_prefill(model, cache: dict, tokens_bt, lengths_b, n_win: int, *, engram_map=None,
                capture_layers: tuple[int, ...] = (), images: dict | None = None):
  """CED prefill of right-padded prompts into an empty cache: (logits [B, n_win, V] of each
  row's last n_win prompt positions, captured inputs of those rows, cache).

  The encoder runs over every prompt token; the first decoder layer's KV source publishes its
  entries from the encoder output over every row; the decoder runs over each row's last n_win
  tokens, its windows beginning there (model/ced.py says which rows are exact).
  """
  cfg = model.cfg
  encoder = cfg.num_encoder_layers
  if not 0 < encoder < cfg.num_layers:
    raise ValueError(f'CED prefill needs an encoder/decoder split; model.num_encoder_layers is '
                     f'{encoder} of {cfg.num_layers} layers')
  t = tokens_bt.shape[1]
  if not 0 < n_win <= t:
    raise ValueError(f'n_win must be in [1, {t}], got {n_win}')
  valid_bt = jnp.arange(t)[None, :] < lengths_b[:, None]
  start_b = jnp.zeros_like(lengths_b)
  batch = chunk_batch(cfg, cache, tokens_bt, valid_bt, start_b, engram_map, images)
  keeper = CacheKeeper(cfg, dict(cache['layers']), start_b, lengths_b)
  shared = {DECODE: keeper}
  x, pre = model.residual_input(batch)
  x, pre, _, captured, shared = model.run_blocks(x, pre, batch, shared, capture_layers,
                                                 blocks=model.blocks[:encoder])
  first_decoder = model.blocks[encoder]
  if first_decoder.attn.csa2 is not None and first_decoder.attn.csa2.owns_kv:
    shared = first_decoder.publish_global_kv(x, pre, batch, shared)
  tail_b = jnp.maximum(lengths_b - n_win, 0)
  per_slot = ('row_offset', 'image_patches', 'image_grid')  # not per position
  tail = jax.tree.map(lambda v: _tail_rows(v, tail_b, n_win),
                      {k: v for k, v in batch.items() if k not in per_slot})
  tail.update({k: batch[k] for k in ('image_patches', 'image_grid') if k in batch})
  tail['row_offset'] = tail_b[:, None]
  keeper.start_b = tail_b
  captured, x, pre = jax.tree.map(lambda v: _tail_rows(v, tail_b, n_win), (captured, x, pre))
  x, pre, _, decoder_captured, shared = model.run_blocks(x, pre, tail, shared, capture_layers,
                                                         blocks=model.blocks[encoder:])
  captured.update(decoder_captured)
  return model.logits(x, pre), captured, _finish(cache, keeper, tokens_bt, batch)


def replay_windows(model, cache: dict, n_win: int, *, engram_map=None):
  """Bounded replay: (logits [B, n_win, V], cache) after dropping every SWA window and
  recomputing only each row's last n_win tokens over the stored entries (which stay as they
  are). Rows need length >= n_win."""
  cache = drop_windows(cache)
  start_b = cache['length'] - n_win
  tokens_bq = _tail_rows(cache['tokens'], start_b, n_win)
  valid_bq = jnp.ones(tokens_bq.shape, bool)
  logits, _, cache = forward_chunk(model, cache, tokens_bq, valid_bq, engram_map=engram_map,
                                   start_b=start_b, write_entries=False)
  return logits, cache
