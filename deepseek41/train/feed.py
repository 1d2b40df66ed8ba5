"""Host batches -> global device arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from deepseek41.batch import batch_keys


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding,
                 engram_map: np.ndarray | None = None, *, vision: bool = False,
                 blank_images: bool = False) -> dict[str, jax.Array]:
  """The process-local batch as global arrays; with an Engram compression map, also the
  compressed ids (`engram_tokens`) the Engram hashes read. `blank_images` replaces every image
  by a uniform black one (the caption evaluation's control)."""
  local = dict(local)
  if engram_map is not None:
    local['engram_tokens'] = engram_map[np.asarray(local['tokens'])]
  if blank_images:
    local['image_patches'] = np.zeros_like(local['image_patches'])
  keys = batch_keys(vision) + (('engram_tokens',) if engram_map is not None else ())
  # Pixels stay uint8 on the way to the device (4x less transfer); the model normalises them.
  return {k: jax.make_array_from_process_local_data(
              sharding, np.asarray(local[k], np.uint8 if k == 'image_patches' else np.int32))
          for k in keys}


def abstract_batch(cfg, rows: int | None = None, *, sharding: NamedSharding | None = None,
                   engram: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
  """What `global_batch` makes, as shapes (deepseek41/batch.py): `rows` rows (default the global
  train.batch_size), each array with `sharding`, and `engram_tokens` where an Engram compression
  map is in use. Lets a step compile before its first batch exists."""
  m, t = cfg.model, cfg.data.seq_len
  b = cfg.train.batch_size if rows is None else rows
  shapes = {k: ((b, t), jnp.int32) for k in batch_keys(m.vision)}
  if m.vision:
    n, p = cfg.data.max_images_per_row, m.vision_merge**2 * m.vision_max_image_tokens
    shapes['image_patches'] = ((b, n, p, m.vision_patch**2 * 3), jnp.uint8)
    shapes['image_grid'] = ((b, n, 2), jnp.int32)
  if engram:
    shapes['engram_tokens'] = ((b, t), jnp.int32)
  return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
          for k, (shape, dtype) in shapes.items()}
