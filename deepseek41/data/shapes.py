"""The embedded multimodal task: coloured shapes and a caption only the image can tell.

    img, caption = render(np.random.default_rng(0), size=48)
    # caption is e.g. 'two red circles at the top left.'

An image is a plain background with one group of 1-3 identical shapes (circle, square or
triangle) of one colour, inside one of five regions (the four quadrants or the centre). The
caption names count, colour, shape and region in one fixed template: 21 word forms and
3 * 5 * 3 * 5 = 225 captions, kept this small so a tiny model can learn the task in a short CPU
run. A single shape fills its region; two or three sit in cells of a 2 x 2 grid over it, with
random size and jitter, so images vary far more than captions, and shapes never touch. Rendering is numpy only;
nothing is downloaded, and the same generator state gives the same sample on every machine.
"""

from __future__ import annotations

import numpy as np

from deepseek41.data.shards import DataError

MIN_SIZE = 16
COUNTS = ('one', 'two', 'three')
COLOURS = {
    'red': (220, 40, 40),
    'green': (40, 180, 60),
    'blue': (50, 90, 235),
    'yellow': (235, 215, 40),
    'white': (240, 240, 240),
}
SHAPES = ('circle', 'square', 'triangle')
POSITIONS = ('top left', 'top right', 'bottom left', 'bottom right', 'centre')
BACKGROUND = (28, 28, 28)
# Region origin as fractions of the image side: (row, col); each region is half the side.
_REGION_ORIGIN = {'top left': (0.0, 0.0), 'top right': (0.0, 0.5), 'bottom left': (0.5, 0.0),
                  'bottom right': (0.5, 0.5), 'centre': (0.25, 0.25)}


def caption_of(count: int, colour: str, shape: str, position: str) -> str:
  plural = 's' if count > 1 else ''
  return f'{COUNTS[count - 1]} {colour} {shape}{plural} at the {position}.'


def _shape_mask(kind: str, size: int, cy: float, cx: float, r: float) -> np.ndarray:
  yy, xx = np.mgrid[0:size, 0:size] + 0.5
  dy, dx = yy - cy, xx - cx
  if kind == 'circle':
    return dy * dy + dx * dx <= r * r
  if kind == 'square':
    half = 0.85 * r  # about the circle's area
    return (np.abs(dy) <= half) & (np.abs(dx) <= half)
  if kind == 'triangle':  # apex up, base 2r wide at the bottom
    t = (dy + r) / (2 * r)
    return (t >= 0) & (t <= 1) & (np.abs(dx) <= t * r)
  raise ValueError(f'unknown shape {kind!r}')


def render(rng: np.random.Generator, size: int = 48) -> tuple[np.ndarray, str]:
  """(uint8 [size, size, 3] image, caption) drawn from `rng`; size >= MIN_SIZE."""
  if size < MIN_SIZE:
    raise DataError(f'data.shapes_image_size must be >= {MIN_SIZE} (smaller shapes are a few '
                    f'pixels and cannot be told apart), got {size}')
  count = int(rng.integers(1, len(COUNTS) + 1))
  colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
  kind = SHAPES[int(rng.integers(len(SHAPES)))]
  position = POSITIONS[int(rng.integers(len(POSITIONS)))]
  img = np.empty((size, size, 3), np.uint8)
  img[:] = BACKGROUND
  region = size / 2
  # One shape fills its region; two or three share a 2 x 2 grid of cells over it. Large shapes
  # keep the task learnable by a tiny ViT in a short CPU run (at a quarter of this size the
  # caption loss did not move off the blank-image loss within 400 steps).
  grid = 1 if count == 1 else 2
  cell = region / grid
  oy, ox = (f * size for f in _REGION_ORIGIN[position])
  cells = rng.permutation(grid * grid)[:count]
  for c in cells:
    r = cell * rng.uniform(0.36, 0.46)  # radius: the shape spans 72-92% of its cell
    slack = max(cell / 2 - r - 1, 0.0)  # jitter that keeps a pixel between shapes
    cy = oy + (c // grid + 0.5) * cell + rng.uniform(-slack, slack)
    cx = ox + (c % grid + 0.5) * cell + rng.uniform(-slack, slack)
    img[_shape_mask(kind, size, cy, cx, r)] = COLOURS[colour]
  return img, caption_of(count, colour, kind, position)
