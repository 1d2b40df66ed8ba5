"""Host batches -> global device arrays."""

from __future__ import annotations

import jax
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
