"""Image preprocessing for the vision encoder (docs/architecture.md 3.15): size, load, patches.

    H, W = target_size(height, width, geometry)     # pixels, multiples of the patch size
    img = resize(load_image(path, record='x.jsonl:3'), (H, W))
    patches, (h, w) = patchify(img, geometry.patch_size, geometry.max_patches)

Sizing keeps the aspect ratio, scales up to at least `min_pixels` and down until the merged grid
ceil(h / merge) * ceil(w / merge) fits `max_image_tokens` (the token budget wins over the minimum
area). Released geometry (patch 14, merge 3, 1024 tokens, 295,936 px): at most 1344 x 1344.
Pixels stay uint8 here; the model normalises them ((x / 255 - 0.5) / 0.5).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageOps

from deepseek41.config import ImageGeometry
from deepseek41.data.shards import DataError

IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.webp')


def merged_tokens(h: int, w: int, merge: int) -> int:
  """LM tokens of an h x w patch grid: the aligner pads it to multiples of `merge`."""
  return -(-h // merge) * -(-w // merge)


def _grid(height: int, width: int, scale: float, patch: int, rounding) -> tuple[int, int]:
  return (max(1, int(rounding(height * scale / patch))),
          max(1, int(rounding(width * scale / patch))))


def _round_half_up(x: float) -> int:
  return math.floor(x + 0.5)


def target_size(height: int, width: int, geometry: ImageGeometry) -> tuple[int, int]:
  """(H, W) in pixels to resize an image of `height` x `width` to (module docstring)."""
  if height < 1 or width < 1:
    raise DataError(f'image size must be positive, got {height} x {width}')
  p, merge, budget = geometry.patch_size, geometry.merge, geometry.max_image_tokens
  scale, rounding = 1.0, _round_half_up
  h, w = _grid(height, width, scale, p, rounding)
  if h * w * p * p < geometry.min_pixels:
    scale, rounding = math.sqrt(geometry.min_pixels / (height * width)), math.ceil
    h, w = _grid(height, width, scale, p, rounding)
  if merged_tokens(h, w, merge) > budget:
    # The merged-token count only grows with the scale: bisect for the largest one that fits.
    lo, hi = 0.0, scale
    for _ in range(64):
      mid = (lo + hi) / 2
      if merged_tokens(*_grid(height, width, mid, p, rounding), merge) <= budget:
        lo = mid
      else:
        hi = mid
    h, w = _grid(height, width, lo, p, rounding)
  return h * p, w * p


def load_image(path: str, record: str | None = None) -> np.ndarray:
  """uint8 [H, W, 3] RGB pixels (EXIF orientation applied); DataError naming file and record."""
  where = f' (referenced by {record})' if record else ''
  try:
    with Image.open(path) as im:
      im = ImageOps.exif_transpose(im)
      return np.asarray(im.convert('RGB'), dtype=np.uint8)
  except FileNotFoundError as e:
    raise DataError(f'image file {path}{where} does not exist') from e
  except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
    # PIL raises UnidentifiedImageError (an OSError) for non-images, OSError for truncated
    # files, SyntaxError / ValueError for some corrupt headers.
    raise DataError(f'image file {path}{where} cannot be read as an image: {e}') from e


def resize(img_hw3: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """Bicubic resize to size = (H, W); returns the input itself when it already has that size."""
  height, width = size
  if img_hw3.shape[:2] == (height, width):
    return img_hw3
  out = Image.fromarray(img_hw3).resize((width, height), Image.Resampling.BICUBIC)
  return np.asarray(out, dtype=np.uint8)


def patchify(img_hw3: np.ndarray, patch: int, max_patches: int
             ) -> tuple[np.ndarray, tuple[int, int]]:
  """(patches uint8 [max_patches, patch * patch * 3], (h, w)) of an image whose sides are
  multiples of `patch`: patches in raster order of the h x w grid, each flattened in (row, col,
  channel) order; rows after h * w are zero."""
  height, width, channels = img_hw3.shape
  if channels != 3 or height % patch or width % patch:
    raise DataError(f'patchify needs an [H, W, 3] image with sides divisible by {patch}, got '
                    f'{img_hw3.shape}')
  h, w = height // patch, width // patch
  if h * w > max_patches:
    raise DataError(f'an image of {h} x {w} patches exceeds the {max_patches} patch slots')
  grid_hwppc = img_hw3.reshape(h, patch, w, patch, 3).transpose(0, 2, 1, 3, 4)
  patches = np.zeros((max_patches, patch * patch * 3), np.uint8)
  patches[:h * w] = grid_hwppc.reshape(h * w, patch * patch * 3)
  return patches, (h, w)


def image_patches(img_hw3: np.ndarray, geometry: ImageGeometry
                  ) -> tuple[np.ndarray, tuple[int, int]]:
  """target_size -> resize -> patchify: what the pipeline stores for one image."""
  size = target_size(img_hw3.shape[0], img_hw3.shape[1], geometry)
  return patchify(resize(img_hw3, size), geometry.patch_size, geometry.max_patches)
