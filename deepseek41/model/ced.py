"""Causal encoder-decoder (CED) prefill (docs/architecture.md section 3.10).

The decoder's global KV is the first decoder layer's compressor (and index keys) applied to its
own input, which is a function of the encoder output only. So a prompt can be prefilled by
  1. running the encoder layers over every prompt token,
  2. publishing the decoder's compressed KV and index keys from the encoder output (every row),
  3. running the decoder layers only over the last `n_win` tokens, their sliding windows floored
     at the tail start (the tail's keys are all they have).
Step 3's sparse attention over the global KV is exact. Only windows, and an image span that
straddles the tail start, are truncated: a tail row t matches the full forward once
t - tail_start >= decoder_layers * (max(sliding_window, longest span) - 1), the reach back from t
of the stacked windows and spans (a span passes a difference on to its last position in one layer).
A decoder with dense layers (model.attention_variant='dense') reaches back to the document start:
its tail is exact only when it is the whole prompt (`tail_reach` is then `UNBOUNDED`).
"""

from __future__ import annotations

import sys

from deepseek41.model.shared import Shared
from deepseek41.model.transformer import Transformer


def _tail(batch, start: int):
  out = {}
  for key, value in batch.items():
    if key == 'engram_row_ids':
      out[key] = {layer: ids[:, start:] for layer, ids in value.items()}
    elif key in ('image_patches', 'image_grid'):  # per image slot, not per position
      out[key] = value
    else:
      out[key] = value[:, start:]
  out['row_offset'] = start
  return out


def ced_prefill_logits(model: Transformer, batch, n_win: int):
  """Logits [B, n_win, V] of the last n_win prompt positions, computed the CED way."""
  cfg = model.cfg
  encoder = cfg.num_encoder_layers
  if not 0 < encoder < cfg.num_layers:
    raise ValueError(f'CED prefill needs an encoder/decoder split; model.num_encoder_layers is '
                     f'{encoder} of {cfg.num_layers} layers')
  t = batch['tokens'].shape[1]
  if not 0 < n_win <= t:
    raise ValueError(f'n_win must be in [1, {t}], got {n_win}')
  x, pre = model.residual_input(batch)
  batch = model.with_engram_rows(batch)
  x, pre, _, _, shared = model.run_blocks(x, pre, batch, Shared(), blocks=model.blocks[:encoder])
  first_decoder = model.blocks[encoder]
  if first_decoder.attn.owns_kv:
    shared = first_decoder.publish_global_kv(x, pre, batch, shared)
  start = t - n_win
  tail = _tail(batch, start)
  x = x[:, start:]
  pre = None if pre is None else pre[:, start:]
  x, pre, _, _, _ = model.run_blocks(x, pre, tail, shared, blocks=model.blocks[encoder:])
  return model.logits(x, pre)


UNBOUNDED = sys.maxsize  # the reach of a dense decoder layer: the whole document


def tail_reach(cfg) -> int:
  """How far back from a decoder row the stacked windows and image spans reach (`UNBOUNDED`
  where a decoder layer attends densely)."""
  if cfg.dense and any(cfg.compress_ratios[cfg.num_encoder_layers:]):
    return UNBOUNDED
  per_layer = max(cfg.sliding_window, cfg.image_span_max_len) - 1
  return (cfg.num_layers - cfg.num_encoder_layers) * per_layer


def exact_tail_rows(cfg, n_win: int) -> int:
  """Rows at the end of the tail that match the full forward (no truncated window or span reaches)."""
  return max(0, n_win - tail_reach(cfg))

