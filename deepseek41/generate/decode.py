"""The backbone over a chunk of new tokens per row, reading and extending the caches (cache.py).

`forward_chunk` runs the same modules as training (`Transformer.run_blocks`) with a `Decoding`
in `Shared.decode` (model/shared.py): where each row's chunk starts and ends, and every layer's
cache. Each attention layer then runs its own `decode` (model/attention.py): the chunk's keys
and its cached window ring in one softmax, and at a KV source the chunk's completed groups
appended to its entries, all of which it publishes to the layers that read them. CSA2's
selection, the candidate pool, Reuse and Reindex run unchanged over the cached entries, with
each row's query positions (`row_offset` per row). This module only drives: it builds the
chunk's batch, runs the layers and keeps the cache-level fields (`length`, `tokens`).

Every row of a chunk starts at its own `cache['length']`; its valid tokens are a prefix of the
chunk (`valid_bq`), so prompts of different lengths prefill in one right-padded chunk. What a
chunk writes at positions past what a caller keeps (a rejected draft) is masked by position
until it is overwritten.

CED prefill (`ced_prefill`): the encoder over the whole prompt, the decoder's KV source published
from the encoder output over every row, the decoder over the last `n_win` tokens only (its
windows floored there; model/ced.py). A prompt longer than one dispatch should hold prefills in
chunks: `forward_chunk` chunk by chunk (full prefill), or `ced_encoder_chunk` chunk by chunk and
then `ced_decoder_tail` (CED), the same caches and last logits as the whole prompt at once.
Bounded replay (`replay_windows`): the windows dropped and
rebuilt from the last `n_win` tokens, the stored entries kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepseek41.config import ModelConfig
from deepseek41.generate.cache import drop_windows
from deepseek41.model.engram import layer_addresses, row_ids
from deepseek41.model.layer_cache import scatter_rows
from deepseek41.model.shared import Decoding, Shared


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
    rows = row_ids(cfg, layer_addresses(cfg), ext)
    batch['engram_row_ids'] = {layer: ids[:, look:] for layer, ids in rows.items()}
  return batch


def _finish(cache, decoding: Decoding, tokens_bq, batch):
  """The cache after a chunk: the layers' updated caches, its tokens, the longer length."""
  pos_bq, valid_bq = batch['positions'], batch['segment_ids'] > 0
  cap = cache['tokens'].shape[1]
  slots = jnp.where(valid_bq, pos_bq, cap)
  return {**cache, 'layers': decoding.caches,
          'tokens': scatter_rows(cache['tokens'], slots, tokens_bq),
          'length': jnp.maximum(cache['length'], decoding.end_b)}


def _rows_at(tree, row_b):
  """Row row_b[b] (along axis 1) of every [B, T, ...] array of `tree`, kept as [B, 1, ...]."""
  def one(v):
    return jnp.take_along_axis(v, row_b.reshape((-1, 1) + (1,) * (v.ndim - 2)), axis=1)
  return jax.tree.map(one, tree)


def forward_chunk(model, cache: dict, tokens_bq, valid_bq, *, engram_map=None,
                  capture_layers: tuple[int, ...] = (), start_b=None, write_entries: bool = True,
                  images: dict | None = None, logits_row_b=None):
  """(logits [B, Tq, V] fp32, captured {layer: [B, Tq, D]}, cache): the chunk's tokens at
  positions start_b .. (default: each row's cached length), appended to the cache.
  logits_row_b: only that row of each chunk row's logits, [B, 1, V] (a long prefill chunk
  needs only its last prompt position's)."""
  cfg = model.cfg
  start_b = cache['length'] if start_b is None else start_b
  batch = chunk_batch(cfg, cache, tokens_bq, valid_bq, start_b, engram_map, images)
  end_b = start_b + jnp.sum(valid_bq, axis=1, dtype=jnp.int32)
  decoding = Decoding(start_b, end_b, cache['layers'], write_entries)
  x, pre = model.residual_input(batch)
  x, pre, _, captured, shared = model.run_blocks(x, pre, batch, Shared(decode=decoding),
                                                 capture_layers)
  if logits_row_b is not None:
    x, pre = _rows_at((x, pre), jnp.clip(logits_row_b, 0, tokens_bq.shape[1] - 1))
  return model.logits(x, pre), captured, _finish(cache, shared.decode, tokens_bq, batch)


def _tail_rows(x, start_b, n_win: int):
  return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, n_win, axis=0))(x, start_b)


def _encoder(model, batch, decoding: Decoding, capture_layers):
  """CED's encoder over a chunk with the caches, then the first decoder layer's entries
  appended from its output: (x, pre, captured, shared)."""
  encoder = model.cfg.num_encoder_layers
  x, pre = model.residual_input(batch)
  x, pre, _, captured, shared = model.run_blocks(x, pre, batch, Shared(decode=decoding),
                                                 capture_layers, blocks=model.blocks[:encoder])
  first_decoder = model.blocks[encoder]
  if first_decoder.attn.owns_kv:
    shared = first_decoder.publish_global_kv(x, pre, batch, shared)
  return x, pre, captured, shared


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
  x, pre, captured, shared = _encoder(model, batch, Decoding(start_b, lengths_b, cache['layers']),
                                      capture_layers)
  tail_b = jnp.maximum(lengths_b - n_win, 0)
  per_slot = ('row_offset', 'image_patches', 'image_grid')  # not per position
  tail = jax.tree.map(lambda v: _tail_rows(v, tail_b, n_win),
                      {k: v for k, v in batch.items() if k not in per_slot})
  tail.update({k: batch[k] for k in ('image_patches', 'image_grid') if k in batch})
  tail['row_offset'] = tail_b[:, None]
  shared = shared.replace(decode=shared.decode.replace(start_b=tail_b))  # the decoder's chunk
  captured, x, pre = jax.tree.map(lambda v: _tail_rows(v, tail_b, n_win), (captured, x, pre))
  x, pre, _, decoder_captured, shared = model.run_blocks(x, pre, tail, shared, capture_layers,
                                                         blocks=model.blocks[encoder:])
  captured.update(decoder_captured)
  return model.logits(x, pre), captured, _finish(cache, shared.decode, tokens_bt, batch)


def empty_tail(model, b: int, n_win: int, capture_layers: tuple[int, ...] = ()):
  """Zeros for what `ced_encoder_chunk` collects of each row's last n_win prompt positions: the
  encoder's output (x, pre) and the captured layers' inputs."""
  cfg = model.cfg
  probe = {'tokens': jnp.zeros((b, n_win), jnp.int32),
           'modality': jnp.zeros((b, n_win), jnp.int32)}
  x, pre = jax.eval_shape(model.residual_input, probe)
  encoder_layers = {blk.layer for blk in model.blocks[:cfg.num_encoder_layers]}
  captured = {l: jax.ShapeDtypeStruct((b, n_win, cfg.d_model), x.dtype)
              for l in capture_layers if l in encoder_layers}
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), {'x': x, 'pre': pre,
                                                              'captured': captured})


def ced_encoder_chunk(model, cache: dict, tokens_bq, valid_bq, tail: dict, tail_b, *,
                      engram_map=None, capture_layers: tuple[int, ...] = ()):
  """One chunk of a chunked CED prefill (rows at their cached lengths, as `forward_chunk`):
  the encoder over it, the first decoder layer's entries appended from the encoder output, and
  the chunk's rows that lie in each row's tail [tail_b, tail_b + n_win) copied into `tail`
  (`empty_tail`). Returns (cache, tail)."""
  cfg = model.cfg
  start_b = cache['length']
  batch = chunk_batch(cfg, cache, tokens_bq, valid_bq, start_b, engram_map)
  end_b = start_b + jnp.sum(valid_bq, axis=1, dtype=jnp.int32)
  x, pre, captured, shared = _encoder(model, batch, Decoding(start_b, end_b, cache['layers']),
                                      capture_layers)
  n_win = tail['x'].shape[1]
  pos_bq = batch['positions']
  in_tail_bq = valid_bq & (pos_bq >= tail_b[:, None]) & (pos_bq < tail_b[:, None] + n_win)
  slot_bq = jnp.where(in_tail_bq, pos_bq - tail_b[:, None], n_win)
  new = {'x': x, 'pre': pre, 'captured': {l: captured[l] for l in tail['captured']}}
  tail = jax.tree.map(lambda buf, rows: scatter_rows(buf, slot_bq, rows), tail, new)
  return _finish(cache, shared.decode, tokens_bq, batch), tail


def ced_decoder_tail(model, cache: dict, tail: dict, lengths_b, *, engram_map=None,
                     capture_layers: tuple[int, ...] = ()):
  """The end of a chunked CED prefill: the decoder over each row's last n_win prompt tokens
  from the encoder output `ced_encoder_chunk` collected, as `ced_prefill`'s decoder runs.
  Returns (logits [B, n_win, V], captured inputs of those rows, cache)."""
  cfg = model.cfg
  n_win = tail['x'].shape[1]
  tail_b = jnp.maximum(lengths_b - n_win, 0)
  pos_bq = tail_b[:, None] + jnp.arange(n_win, dtype=jnp.int32)
  valid_bq = pos_bq < lengths_b[:, None]
  tokens_bq = jnp.take_along_axis(cache['tokens'], jnp.minimum(pos_bq, cache['tokens'].shape[1] - 1),
                                  axis=1)
  batch = chunk_batch(cfg, cache, tokens_bq, valid_bq, tail_b, engram_map)
  # The decoder's KV source was appended chunk by chunk: it publishes its entries as they are.
  decoding = Decoding(tail_b, lengths_b, cache['layers'], write_entries=False)
  x, pre, _, captured, shared = model.run_blocks(tail['x'], tail['pre'], batch,
                                                 Shared(decode=decoding), capture_layers,
                                                 blocks=model.blocks[cfg.num_encoder_layers:])
  captured = {**tail['captured'], **captured}
  cache = {**cache, 'layers': shared.decode.caches}
  return model.logits(x, pre), captured, cache


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
