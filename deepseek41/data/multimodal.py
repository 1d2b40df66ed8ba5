"""Interleaved image-text sources: samples -> documents with image spans -> packable pieces.

`data.image_sources` names, with mixture weights ("shapes:0.7,/data/pairs:0.2,/data/web.jsonl"):

    shapes          the embedded task (shapes.py): an endless training stream and a fixed
                    held-out set of SHAPES_HELDOUT_SAMPLES, generated on the fly
    DIR             image + caption pairs: every `x.png|jpg|jpeg|webp` below DIR with its `x.txt`,
                    sorted by relative path; the sample is [image, caption]. An image without
                    its caption, or a caption (any .txt) without its image, is an error.
    FILE.jsonl      one record per non-blank line: {"content": [{"text": "..."}, {"image": "a.png"},
                    ...]}; image paths are relative to the JSONL file's directory or absolute

A record of a directory or JSONL source is held out when a stable hash of its key (the pair's
relative name / the line number) falls below data.image_heldout_fraction; with a fraction > 0 and
two or more records, at least one record is held out and at least one is kept for training.

A sample becomes one document (deepseek41/batch.py has the contract): text parts are tokenized
with the run's tokenizer (that of the text sources, or of the default corpus), each image is
loaded, sized (images.target_size), resized and cut into patches and takes a span

    [align pad]? [start] ([patch] x wm [newline]) x hm [end]        hm, wm = ceil(h, w / merge)

where the alignment pad is present when [start] would fall on an odd position of the document.
Every span position carries model.image_token_id. The document ends with eos. A document longer
than seq_len + 1 tokens is cut like PieceSource cuts text (pieces of at most seq_len + 1 tokens
overlapping by one), but only where the cut keeps every span whole in one piece, at positions
that are multiples of data.document_align (so spans keep their parity), and with at most
data.max_images_per_row images per piece. The loss mask is 0 where the target is an image-span
position; the [end] position predicts the text after the image and keeps its loss.

Everything expensive (reading, decoding, resizing, tokenizing) happens in `__getitem__`, i.e. in
Grain's reader threads and worker processes; construction only lists records.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from deepseek41.batch import ROLE_ALIGN, ROLE_END, ROLE_NEWLINE, ROLE_PATCH, ROLE_START, ROLE_TEXT
from deepseek41.config import DataConfig, ImageGeometry
from deepseek41.data import shapes
from deepseek41.data.images import IMAGE_EXTENSIONS, image_patches, load_image
from deepseek41.data.prepare import heldout_score
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import load_tokenizer

SHAPES = 'shapes'
SHAPES_TRAIN_SAMPLES = 1 << 40  # effectively endless; samples are generated on demand
SHAPES_HELDOUT_SAMPLES = 512
_SHAPES_HELDOUT_SEED = 20260417  # fixed: the held-out set is the same for every run
SPLITS = ('train', 'heldout')

Part = dict[str, Any]  # {'text': str} or {'image': path or uint8 [H, W, 3]}


# ---------------------------------------------------------------------------------------------
# Sample collections: index -> (parts, record description). Module-level and picklable.


class ShapesSamples:
  """The embedded task: sample i of a split is render(default_rng([seed, i]))."""

  def __init__(self, num_samples: int, size: int, seed: int):
    if size < shapes.MIN_SIZE:
      shapes.render(np.random.default_rng(0), size)  # raises the DataError naming the key
    self.num_samples, self.size, self.seed = num_samples, size, seed

  def __len__(self) -> int:
    return self.num_samples

  def sample(self, index: int) -> tuple[list[Part], str]:
    img, caption = shapes.render(np.random.default_rng([self.seed, int(index)]), self.size)
    return [{'image': img}, {'text': caption}], f'shapes sample {index}'

  def __repr__(self) -> str:
    return f'ShapesSamples(num_samples={self.num_samples}, size={self.size}, seed={self.seed})'


def split_heldout(keys: Sequence[tuple[str, int]], fraction: float) -> np.ndarray:
  """Held-out flags of records by a stable hash of their keys (module docstring)."""
  scores = np.array([heldout_score(k, i) for k, i in keys], np.float64)
  held = scores < fraction
  if fraction > 0 and len(keys) >= 2:
    if not held.any():
      held[int(np.argmin(scores))] = True
    if held.all():
      held[int(np.argmax(scores))] = False
  return held


def _select(items: list, held: np.ndarray, split: str) -> list:
  return [x for x, h in zip(items, held) if h == (split == 'heldout')]


class PairSamples:
  """Image + caption pairs under a directory: (image relpath, caption relpath), sorted."""

  def __init__(self, root: str, split: str, heldout_fraction: float):
    self.root = root
    pairs = _scan_pairs(root)
    held = split_heldout([(os.path.splitext(img)[0], 0) for img, _ in pairs], heldout_fraction)
    self.pairs = _select(pairs, held, split)
    self.num_records = len(pairs)

  def __len__(self) -> int:
    return len(self.pairs)

  def sample(self, index: int) -> tuple[list[Part], str]:
    image_rel, caption_rel = self.pairs[int(index)]
    caption_path = os.path.join(self.root, caption_rel)
    record = f'pair {os.path.splitext(image_rel)[0]!r} of {self.root}'
    try:
      with open(caption_path, 'rb') as f:
        caption = f.read().decode('utf-8', errors='replace').strip()
    except OSError as e:
      raise DataError(f'caption file {caption_path} ({record}) cannot be read: '
                      f'{e.strerror or e}') from e
    return [{'image': os.path.join(self.root, image_rel)}, {'text': caption}], record

  def __repr__(self) -> str:
    return f'PairSamples({self.root!r}, records={len(self)})'


def _scan_pairs(root: str) -> list[tuple[str, str]]:
  images, texts = {}, set()
  for dirpath, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    for name in names:
      if name.startswith('.'):
        continue
      rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, '/')
      stem, ext = os.path.splitext(rel)
      if ext.lower() in IMAGE_EXTENSIONS:
        if stem in images:
          raise DataError(f'{os.path.join(root, images[stem])} and {os.path.join(root, rel)} '
                          f'share the caption {stem}.txt; rename one of them')
        images[stem] = rel
      elif ext == '.txt':
        texts.add(stem)
  if not images:
    raise DataError(f'data.image_sources: {root} holds no images ({"/".join(IMAGE_EXTENSIONS)})'
                    ' with captions')
  pairs = []
  for stem in sorted(images):
    if stem not in texts:
      raise DataError(f'image {os.path.join(root, images[stem])} has no caption: expected '
                      f'{os.path.join(root, stem + ".txt")}')
    pairs.append((images[stem], stem + '.txt'))
  # A caption without its image is most likely a broken copy of the dataset, not a choice.
  orphans = sorted(os.path.join(root, stem + '.txt') for stem in texts - images.keys())
  if orphans:
    named = ', '.join(orphans[:5]) + (f' and {len(orphans) - 5} more' if len(orphans) > 5 else '')
    raise DataError(f'data.image_sources: {len(orphans)} caption files in {root} have no image '
                    f'({"/".join(IMAGE_EXTENSIONS)} of the same name): {named}; restore the '
                    'images, or move the captions (and any other .txt file) out of the directory')
  return pairs


class JsonlSamples:
  """Records of a JSONL file, validated up front; a sample re-reads its line by byte offset."""

  def __init__(self, path: str, split: str, heldout_fraction: float):
    self.path = path
    offsets, lines = [], []
    try:
      with open(path, 'rb') as f:
        offset = 0
        for line_no, raw in enumerate(f, start=1):
          if raw.strip():
            _parse_record(raw, path, line_no)
            offsets.append(offset)
            lines.append(line_no)
          offset += len(raw)
    except OSError as e:
      raise DataError(f'data.image_sources: cannot read {path}: {e.strerror or e}') from e
    if not lines:
      raise DataError(f'data.image_sources: {path} holds no records')
    key = os.path.basename(path)
    held = split_heldout([(key, n) for n in lines], heldout_fraction)
    self.offsets = np.array(_select(offsets, held, split), np.int64)
    self.lines = np.array(_select(lines, held, split), np.int64)
    self.num_records = len(lines)

  def __len__(self) -> int:
    return len(self.lines)

  def sample(self, index: int) -> tuple[list[Part], str]:
    index = int(index)
    line_no = int(self.lines[index])
    try:
      with open(self.path, 'rb') as f:
        f.seek(int(self.offsets[index]))
        raw = f.readline()
    except OSError as e:
      raise DataError(f'cannot read {self.path}: {e.strerror or e}') from e
    parts = _parse_record(raw, self.path, line_no)
    base = os.path.dirname(os.path.abspath(self.path))
    for part in parts:
      if 'image' in part:
        part['image'] = os.path.join(base, part['image'])  # an absolute path stays as it is
    return parts, f'{self.path}:{line_no}'

  def __repr__(self) -> str:
    return f'JsonlSamples({self.path!r}, records={len(self)})'


def _parse_record(raw: bytes, path: str, line_no: int) -> list[Part]:
  where = f'{path}:{line_no}'
  try:
    record = json.loads(raw.decode('utf-8', errors='replace'))
  except json.JSONDecodeError as e:
    raise DataError(f'{where}: not valid JSON ({e})') from e
  content = record.get('content') if isinstance(record, dict) else None
  if not isinstance(content, list) or not content:
    raise DataError(f'{where}: expected an object {{"content": [{{"text": ...}}, {{"image": '
                    '...}}, ...]} with at least one part')
  parts = []
  for k, part in enumerate(content):
    kinds = [key for key in ('text', 'image') if isinstance(part, dict) and key in part]
    if len(kinds) != 1 or not isinstance(part[kinds[0]], str):
      raise DataError(f'{where}: content[{k}] must be {{"text": "..."}} or '
                      f'{{"image": "path"}}, got {json.dumps(part)[:100]}')
    if kinds == ['image'] and not part['image']:
      raise DataError(f'{where}: content[{k}] has an empty image path')
    parts.append({kinds[0]: part[kinds[0]]})  # other keys (metadata) are ignored
  return parts


# ---------------------------------------------------------------------------------------------
# Documents and pieces.


@dataclasses.dataclass
class Document:
  """A sample laid out as one token sequence (length L, eos last)."""
  tokens: np.ndarray   # int32 [L]
  role: np.ndarray     # int32 [L] ROLE_* (ROLE_TEXT on text)
  index: np.ndarray    # int32 [L] i * wm + j on ROLE_PATCH positions, 0 elsewhere
  span: np.ndarray     # int32 [L] image ordinal + 1 on start..end, 0 elsewhere (pad included)
  patches: list[np.ndarray]     # per image: uint8 [P, p * p * 3]
  grids: list[tuple[int, int]]  # per image: (h, w) patches


def build_document(parts: Sequence[Part], encode: Callable[[str], Sequence[int]], eos_id: int,
                   geometry: ImageGeometry, record: str) -> Document:
  tokens, role, index, span = [], [], [], []
  patches, grids = [], []
  merge = geometry.merge
  for part in parts:
    if 'text' in part:
      ids = list(encode(part['text']))
      tokens += ids
      role += [ROLE_TEXT] * len(ids)
      index += [0] * len(ids)
      span += [0] * len(ids)
      continue
    img = part['image']
    if isinstance(img, str):
      img = load_image(img, record)
    p_pd, (h, w) = image_patches(img, geometry)
    hm, wm = -(-h // merge), -(-w // merge)
    ordinal = len(patches) + 1
    patches.append(p_pd)
    grids.append((h, w))
    if len(tokens) % 2:
      role.append(ROLE_ALIGN)
      index.append(0)
      span.append(0)
    row_roles = [ROLE_PATCH] * wm + [ROLE_NEWLINE]
    role += [ROLE_START] + row_roles * hm + [ROLE_END]
    for i in range(hm):
      index += [0] + list(range(i * wm, (i + 1) * wm))  # [start] / previous [newline], patches
    index += [0, 0]  # the last [newline], [end]
    span += [ordinal] * (hm * (wm + 1) + 2)
    tokens += [geometry.image_token_id] * (len(role) - len(tokens))
  tokens.append(eos_id)
  role.append(ROLE_TEXT)
  index.append(0)
  span.append(0)
  as_i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
  return Document(as_i32(tokens), as_i32(role), as_i32(index), as_i32(span), patches, grids)


def cut_document(doc: Document, seq_len: int, align: int, max_images: int,
                 record: str) -> list[tuple[int, int]]:
  """Pieces (s, c): inputs doc[s:c], targets doc[s + 1:c + 1] (module docstring)."""
  n = len(doc.tokens)
  if n < 2:
    return []
  starts_before = np.concatenate([[0], np.cumsum(doc.role == ROLE_START)])  # starts in [0, c)
  positions = np.arange(n)
  # A cut c starts the next piece at c: never strictly inside a span (its [start] is fine),
  # and at a multiple of `align` so every span keeps its parity in the next piece.
  cuttable = ((doc.role == ROLE_TEXT) | (doc.role == ROLE_START)) & (positions % align == 0)
  cuttable[n - 1] = True  # the end of the document ends its last piece
  pieces, s = [], 0
  while s < n - 1:
    hi = min(s + seq_len, n - 1)
    ok = cuttable[s + 1:hi + 1] & (starts_before[s + 1:hi + 1] - starts_before[s] <= max_images)
    if not ok.any():
      ordinal = int(doc.span[s:hi + 1].max())
      span_len = int((doc.span == ordinal).sum())
      raise DataError(f'{record}: image {ordinal} takes a span of {span_len} positions, which '
                      f'does not fit a piece of data.seq_len={seq_len} with its alignment; raise '
                      'data.seq_len or lower model.vision_max_image_tokens')
    c = s + 1 + int(np.nonzero(ok)[0][-1])
    pieces.append((s, c))
    s = c
  return pieces


def empty_image_arrays(geometry: ImageGeometry) -> dict[str, np.ndarray]:
  p = geometry.patch_size
  return {'image_patches': np.zeros((0, geometry.max_patches, p * p * 3), np.uint8),
          'image_grid': np.zeros((0, 2), np.int32)}


def with_empty_images(piece: dict[str, np.ndarray],
                      geometry: ImageGeometry) -> dict[str, np.ndarray]:
  """A text piece (pipeline.aligned_piece) with the image keys of a piece without images."""
  zeros = np.zeros(len(piece['tokens']), np.int32)
  return {**piece, 'image_role': zeros, 'image_index': zeros, 'image_span': zeros,
          **empty_image_arrays(geometry)}


def piece_arrays(doc: Document, s: int, c: int, geometry: ImageGeometry,
                 align: int) -> dict[str, np.ndarray]:
  """The packable element of piece (s, c), padded at its end to a multiple of `align`."""
  n = c - s
  extra = (-n) % align

  def padded(x):
    return np.concatenate([x, np.zeros(extra, np.int32)]) if extra else x

  role = doc.role[s:c]
  span = doc.span[s:c]
  ordinals = span[span > 0]
  first = int(ordinals.min()) if ordinals.size else 1
  count = int(ordinals.max()) - first + 1 if ordinals.size else 0
  local = np.where(span > 0, span - first + 1, 0).astype(np.int32)
  index = np.where(role == ROLE_PATCH,
                   doc.index[s:c] + (local - 1) * geometry.max_image_tokens, 0).astype(np.int32)
  out = {
      'tokens': padded(doc.tokens[s:c]),
      'targets': padded(doc.tokens[s + 1:c + 1]),
      'mask': padded((doc.role[s + 1:c + 1] == ROLE_TEXT).astype(np.int32)),
      'image_role': padded(role),
      'image_index': padded(index),
      'image_span': padded(local),
  }
  if count:
    out['image_patches'] = np.stack(doc.patches[first - 1:first - 1 + count])
    out['image_grid'] = np.array(doc.grids[first - 1:first - 1 + count], np.int32)
  else:
    out.update(empty_image_arrays(geometry))
  return out


class MultimodalSource:
  """Grain random-access source: item i = the list of packable pieces of sample i."""

  def __init__(self, samples, tokenizer_path: str, geometry: ImageGeometry, seq_len: int,
               align: int):
    self.samples, self.tokenizer_path, self.geometry = samples, tokenizer_path, geometry
    self.seq_len, self.align = seq_len, align
    self._tokenizer = None
    self._get_tokenizer()  # a bad tokenizer fails at start-up

  def _get_tokenizer(self):
    if self._tokenizer is None:
      self._tokenizer = load_tokenizer(self.tokenizer_path)
    return self._tokenizer

  def __len__(self) -> int:
    return len(self.samples)

  def document(self, index: int) -> tuple[Document, str]:
    parts, record = self.samples.sample(index)
    tok = self._get_tokenizer()
    encode = lambda text: tok.hf.encode(text, add_special_tokens=False).ids  # noqa: E731
    return build_document(parts, encode, tok.eos_id, self.geometry, record), record

  def __getitem__(self, index: int) -> list[dict[str, np.ndarray]]:
    doc, record = self.document(index)
    cuts = cut_document(doc, self.seq_len, self.align, self.geometry.max_images_per_row, record)
    return [piece_arrays(doc, s, c, self.geometry, self.align) for s, c in cuts]

  def __getstate__(self):
    state = self.__dict__.copy()
    state['_tokenizer'] = None  # workers load their own
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)

  def __repr__(self) -> str:
    return f'MultimodalSource({self.samples!r})'


# ---------------------------------------------------------------------------------------------
# Opening the configured sources.


def resolve_image_sources(cfg: DataConfig) -> list[tuple[str, str, float]]:
  """(kind, path, weight) of every data.image_sources entry; kind is shapes | pairs | jsonl."""
  out = []
  for path, weight in cfg.image_sources:
    if path == SHAPES:
      out.append((SHAPES, SHAPES, float(weight)))
    elif os.path.isdir(path):
      out.append(('pairs', path, float(weight)))
    elif path.endswith('.jsonl') and os.path.isfile(path):
      out.append(('jsonl', path, float(weight)))
    elif not os.path.exists(path):
      raise DataError(f'data.image_sources: {path} does not exist (expected `shapes`, a '
                      'directory of image + caption pairs, or a .jsonl file)')
    else:
      raise DataError(f'data.image_sources: {path} is neither a directory of image + caption '
                      'pairs nor a .jsonl file')
  return out


def shapes_seed(split: str, seed: int, shuffle_seed: int) -> list[int]:
  """Training samples depend on the run's seeds; the held-out set is the same for every run."""
  if split == 'heldout':
    return [_SHAPES_HELDOUT_SEED]
  return [int(seed) & 0xFFFFFFFF, int(shuffle_seed) & 0xFFFFFFFF, 0]


def open_image_source(kind: str, path: str, cfg: DataConfig, *, split: str, seed: int,
                      tokenizer_path: str) -> MultimodalSource:
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if cfg.images is None:
    raise DataError('data.image_sources need model.vision=True')
  if kind == SHAPES:
    num = SHAPES_TRAIN_SAMPLES if split == 'train' else SHAPES_HELDOUT_SAMPLES
    samples = ShapesSamples(num, cfg.shapes_image_size,
                            np.random.SeedSequence(shapes_seed(split, seed, cfg.shuffle_seed))
                            .generate_state(1)[0].item())
  elif kind == 'pairs':
    samples = PairSamples(path, split, cfg.image_heldout_fraction)
  elif kind == 'jsonl':
    samples = JsonlSamples(path, split, cfg.image_heldout_fraction)
  else:
    raise DataError(f'unknown image source kind {kind!r}')
  if len(samples) == 0:
    raise DataError(f'data.image_sources: {path} has no {split} records ({samples.num_records} '
                    f'in all, data.image_heldout_fraction={cfg.image_heldout_fraction})')
  return MultimodalSource(samples, tokenizer_path, cfg.images, cfg.seq_len, cfg.document_align)
