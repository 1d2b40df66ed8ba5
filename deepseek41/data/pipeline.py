"""Grain pipeline: token shards -> mixed, shuffled, packed [batch, seq_len] batches.

    per source: documents cut into seq_len + 1 pieces -> this process's slice -> shuffle
    (reseeded every epoch) -> repeat -> weighted mixture -> first-fit packing -> batch ->
    prefetch (worker processes or a thread)

Every batch is a dict with exactly the keys of deepseek41.batch.batch_keys(vision) (batch.py
is the contract); with model.vision off, int32 arrays of shape [batch_size, seq_len]:

    tokens       input ids (0 in padding)
    targets      the next token of the same document (0 in padding)
    segment_ids  1, 2, ... per packed piece within a row; 0 = padding
    positions    0, 1, ... restarting at each piece
    loss_mask    1 where targets is real (segment_ids != 0)
    modality     TEXT

With model.vision on (data.images set) every batch also carries the image keys, and the mixture
takes data.image_sources (multimodal.py) next to the text sources:

    text pieces ---------------------------------+-> weighted mixture -> flatten -> first-fit
    image-text samples -> list of pieces each ---+   packing (text keys at seq_len, image arrays
                                                     at max_images_per_row) -> collate

Packing keeps every piece, so every image span, whole in one row and never takes more than
data.max_images_per_row images into a row; collate re-bases image_index and image_span from
piece-local to row-local numbering (a piece's images take the row's slots after those of the
pieces packed before it) and sets modality = IMAGE on every image-span position.

A document of n tokens yields ceil((n - 1) / seq_len) pieces of at most seq_len + 1 tokens that
overlap by one, so inputs = piece[:-1] and targets = piece[1:] predict every token of the
document after the first exactly once. Pieces are never split across rows; each piece is its own
attention segment with positions from 0, because nothing before it is visible in its row.
Pieces, not documents, are shuffled: a long file's hundreds of pieces would otherwise fill
consecutive batches, and a model trained on such a stream fits one file at a time (seen on the
default corpus: held-out loss rose for the first 40 steps while the training loss fell).

Task sources (data.sources names `mqar`, `passkey` or `needle`, data/tasks/) generate their
documents from a seed per index, each one whole piece of tasks.length (default seq_len)
positions whose loss mask covers only its answers (tasks.supervise); they encode their text with
the first text source's tokenizer (the default corpus's when data.sources names tasks only)
and keep a held-out split of their own (another seed; the needle task's filler text from the
held-out split of its corpus).

Mixture weights count pieces (so roughly tokens) of text sources and samples (usually one
piece each) of image sources. The iterator's `get_state()` / `set_state()` resume with identical
batches as long as the config, batch size, process layout and `num_workers` are unchanged
(packing runs per worker, so batches depend on the worker count).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import grain
import numpy as np
from absl import flags

from deepseek41.batch import IMAGE, ROLE_PATCH, TEXT, batch_keys
from deepseek41.config import TASK_NAMES, DataConfig, ImageGeometry
from deepseek41.data import multimodal
from deepseek41.data.default_corpus import default_corpus_dir
from deepseek41.data.shards import META_FILE, DataError, TokenShardSource, read_meta
from deepseek41.data.tasks import Task, TaskDocument, build_task
from deepseek41.data.tokenizer import Tokenizer, load_tokenizer

SPLITS = ('train', 'heldout')
KINDS = ('text', 'image')
DEFAULT_SOURCE = 'default'  # the embedded default corpus, by name in data.sources
BATCH_KEYS = batch_keys(False)
_SYNTHETIC_TRAIN_DOCS = 1 << 40  # effectively endless; documents are generated on demand
_SYNTHETIC_EVAL_DOCS = 4096


# ---------------------------------------------------------------------------------------------
# Sources.


def _default_dir(cfg: DataConfig) -> str:
  return default_corpus_dir(cfg.cache_dir, cfg.default_corpus_vocab_size,
                            cfg.default_corpus_max_files)


def resolve_sources(cfg: DataConfig) -> list[tuple[str, float]]:
  """Prepared dataset directories with their mixture weights; checks they can be mixed.

  No data.sources means the embedded default corpus; the name `default` in data.sources
  ("default:0.3,/data/mine:0.7") means it too. Task names (config.TASK_NAMES) are not
  directories: they are left out ([] when data.sources names tasks only).
  """
  if cfg.sources:
    sources = [(_default_dir(cfg) if path == DEFAULT_SOURCE else path, float(w))
               for path, w in cfg.sources if path not in TASK_NAMES]
  else:
    sources = [(_default_dir(cfg), 1.0)]
  seen = {}
  for path, _ in sources:
    if not os.path.isdir(path):
      raise DataError(f'data.sources: {path} does not exist; prepare it with '
                      f'`python -m deepseek41.data.prepare --input ... --output {path}`')
    meta_path = os.path.join(path, 'train', META_FILE)
    if not os.path.isfile(meta_path):
      raise DataError(f'data.sources: {path} has no train split ({meta_path} is missing); it is '
                      'not a dataset made by deepseek41.data.prepare, or preparing it failed')
    with open(meta_path) as f:
      try:
        meta = json.load(f)
      except json.JSONDecodeError as e:
        raise DataError(f'{meta_path} is not valid JSON ({e}); re-run prepare') from e
    seen[path] = (meta.get('vocab_size'), meta.get('tokenizer_sha256') or '')
  vocab_sizes = {v for v, _ in seen.values()}
  if len(vocab_sizes) > 1:
    listing = ', '.join(f'{p}: {v}' for p, (v, _) in seen.items())
    raise DataError(f'data.sources use different tokenizer vocabularies ({listing}); prepare '
                    'them all with the same --tokenizer')
  hashes = {h for _, h in seen.values() if h}
  if len(hashes) > 1:
    raise DataError(f'data.sources {", ".join(seen)} were prepared with different tokenizers of '
                    'the same size, so the same id means different text; prepare them all with '
                    'the same --tokenizer')
  return sources


def _tokenizer_dataset(cfg: DataConfig) -> str:
  """The dataset whose tokenizer every source shares: the first text source, or the default
  corpus when data.sources names tasks only (the tasks encode their text through it)."""
  sources = resolve_sources(cfg)
  return sources[0][0] if sources else _default_dir(cfg)


def vocab_size_of(cfg: DataConfig, synthetic_vocab_size: int = 512) -> int:
  """Vocabulary size of the data's tokenizer: model.vocab_size must be at least this."""
  if cfg.synthetic:
    return synthetic_vocab_size
  return TokenShardSource(os.path.join(_tokenizer_dataset(cfg), 'train')).vocab_size


def tokenizer_path_of(cfg: DataConfig) -> str:
  """tokenizer.json of the text sources (the default corpus without data.sources): image
  sources and tasks encode their text with it, so all share one vocabulary."""
  if cfg.synthetic:
    raise DataError('data.synthetic has no tokenizer; image sources and tasks need data.sources '
                    '(or the default corpus) for theirs')
  split_dir = os.path.join(_tokenizer_dataset(cfg), 'train')
  tokenizer = os.path.normpath(os.path.join(split_dir, read_meta(split_dir)['tokenizer']))
  if not os.path.isfile(tokenizer):
    raise DataError(f'{split_dir}/{META_FILE} names the tokenizer {tokenizer}, which does not '
                    'exist; re-run prepare')
  return tokenizer


def open_task(cfg: DataConfig, name: str, split: str, tokenizer: Tokenizer | None = None) -> Task:
  """The task `name` (config.TASK_NAMES) with the tasks section's parameters, encoding through
  `tokenizer` (default: the sources' own, tokenizer_path_of); the needle task hides its needles
  in `split` of tasks.needle_filler (default: the first text source, else the default corpus).
  """
  if tokenizer is None:
    tokenizer = load_tokenizer(tokenizer_path_of(cfg))
  filler = None
  if name == 'needle':
    chosen = cfg.task_params().needle_filler
    if chosen == DEFAULT_SOURCE:
      root = _default_dir(cfg)
    elif chosen:
      root = chosen
      if not os.path.isfile(os.path.join(root, split, META_FILE)):
        raise DataError(f'tasks.needle_filler: {root} is not a dataset prepared by '
                        f'deepseek41.data.prepare (no {split}/{META_FILE})')
    else:
      root = _tokenizer_dataset(cfg)
    filler = os.path.join(root, split)
  return build_task(name, cfg.task_params(), tokenizer, filler)


class SyntheticSource:
  """Random-token pieces for benchmarks: deterministic per index, no I/O.

  Each item is already a piece of 2 .. seq_len + 1 tokens, so packing has short and full rows.
  """

  def __init__(self, num_docs: int, vocab_size: int, seq_len: int, seed: int, eos_id: int = 1,
               align: int = 1):
    self.align = align
    if vocab_size < 3:
      raise DataError(f'synthetic_vocab_size must be >= 3 (pad, eos, one token), got {vocab_size}')
    self._num_docs, self.vocab_size, self._seq_len = num_docs, vocab_size, seq_len
    self._seed, self._eos_id = seed, eos_id

  def __len__(self) -> int:
    return self._num_docs

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self._seed, int(index)])
    n = int(rng.integers(2, self._seq_len + 2))
    piece_t = rng.integers(2, self.vocab_size, size=n, dtype=np.int32)
    piece_t[-1] = self._eos_id
    return aligned_piece(piece_t, self.align)

  def __repr__(self) -> str:
    return f'SyntheticSource(num_docs={self._num_docs}, vocab_size={self.vocab_size})'


def aligned_piece(piece_t: np.ndarray, align: int,
                  mask_t: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """(inputs, targets, mask) of a piece, padded at its end to a multiple of `align` positions;
  `mask_t` [len - 1] marks the supervised targets (default: all).

  With every piece a multiple of `align` long, first-fit packing starts every document at a
  multiple of `align` within its row, so ratio-2 compressed groups never straddle two documents
  (docs/architecture.md section 4, "Packing"). The padding positions belong to the document (they
  come after all its real tokens, so no real query sees them) and carry mask 0: no loss.
  """
  tokens_t, targets_t = piece_t[:-1], piece_t[1:]
  n = len(tokens_t)
  extra = (-n) % align
  mask_t = np.ones(n, np.int32) if mask_t is None else np.asarray(mask_t, np.int32)
  if extra:
    tokens_t = np.concatenate([tokens_t, np.zeros(extra, tokens_t.dtype)])
    targets_t = np.concatenate([targets_t, np.zeros(extra, targets_t.dtype)])
    mask_t = np.concatenate([mask_t, np.zeros(extra, np.int32)])
  return {'tokens': tokens_t, 'targets': targets_t, 'mask': mask_t}


class TaskSource:
  """Documents of a long-context task (data/tasks/), one per index, deterministic in (seed,
  index): each is one whole piece of `length` positions, supervised on its answers only unless
  `supervise_all`. Depths are drawn uniformly."""

  def __init__(self, task: Task, num_docs: int, length: int, seed: int, align: int = 1,
               supervise_all: bool = False):
    self.task, self._num_docs, self.length = task, num_docs, length
    self._seed, self.align, self.supervise_all = seed, align, supervise_all
    task.document(np.random.default_rng(seed), length)  # a length too short fails here, now

  def __len__(self) -> int:
    return self._num_docs

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    doc = self.task.document(np.random.default_rng([self._seed, int(index)]), self.length)
    return aligned_piece(doc.tokens, self.align, None if self.supervise_all else
                         doc.answer_mask())

  def __repr__(self) -> str:
    return f'TaskSource({self.task.name}, length={self.length}, docs={self._num_docs})'


class PieceSource:
  """Random access to the (input, target) pieces of a token-shard split.

  Document d of n tokens has ceil((n - 1) / seq_len) pieces; piece j covers tokens
  [j * seq_len, j * seq_len + seq_len + 1) of it (overlapping the next by one token).
  """

  def __init__(self, docs: TokenShardSource, seq_len: int, align: int = 1):
    self.docs, self.seq_len, self.align = docs, seq_len, align
    lengths_d = docs.doc_lengths()
    pieces_d = np.maximum(lengths_d - 1 + seq_len - 1, 0) // seq_len
    self._doc_p = np.repeat(np.arange(len(lengths_d), dtype=np.int64), pieces_d)
    first_p = np.repeat(np.cumsum(pieces_d) - pieces_d, pieces_d)
    self._start_p = (np.arange(len(self._doc_p), dtype=np.int64) - first_p) * seq_len

  def __len__(self) -> int:
    return len(self._doc_p)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start = int(self._start_p[index])
    piece_t = self.docs.read(int(self._doc_p[index]), start, start + self.seq_len + 1)
    return aligned_piece(piece_t, self.align)

  def __repr__(self) -> str:
    return f'PieceSource({self.docs!r}, seq_len={self.seq_len}, pieces={len(self)})'


# ---------------------------------------------------------------------------------------------
# Transformations (module-level classes so worker processes can unpickle them).


class TextPieceList:
  """Text piece -> [the piece with empty image keys], the element type of image sources."""

  def __init__(self, geometry: ImageGeometry):
    self.geometry = geometry

  def __call__(self, piece: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return [multimodal.with_empty_images(piece, self.geometry)]


class Flatten(grain.experimental.FlatMapTransform):
  """Lists of pieces -> pieces. Checkpointable: the state is the parent's state before the list
  and the index into it (Grain re-reads the list on restore)."""

  max_fan_out = 1 << 16

  def flat_map(self, element):
    return element


def _stack_rows(rows, key: str, batch_size: int, seq_len: int) -> np.ndarray:
  """[batch_size, seq_len] int32 of one key over the packed rows; missing rows are zeros."""
  x_bt = np.zeros((batch_size, seq_len), np.int32)
  x_bt[:len(rows)] = np.stack([r[key] for r in rows])
  return x_bt


class Collate:
  """Packed rows -> the batch dict; pads a short final batch (finite passes) with empty rows."""

  def __init__(self, batch_size: int, seq_len: int):
    self.batch_size, self.seq_len = batch_size, seq_len

  def __call__(self, rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    def stack(key):
      return _stack_rows(rows, key, self.batch_size, self.seq_len)
    segment_ids_bt = stack('tokens_segment_ids')
    return {
        'tokens': stack('tokens'),
        'targets': stack('targets'),
        'segment_ids': segment_ids_bt,
        'positions': stack('tokens_positions'),
        'loss_mask': ((segment_ids_bt != 0) & (stack('mask') != 0)).astype(np.int32),
        'modality': np.full_like(segment_ids_bt, TEXT),
    }


class MultimodalCollate:
  """Packed rows with image keys -> the batch dict of batch.batch_keys(True)."""

  def __init__(self, batch_size: int, seq_len: int, geometry: ImageGeometry):
    self.batch_size, self.seq_len, self.geometry = batch_size, seq_len, geometry

  def __call__(self, rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    g = self.geometry
    b, t, n, p = self.batch_size, self.seq_len, g.max_images_per_row, g.patch_size

    text = Collate(b, t)(rows)
    segment_ids_bt = text['segment_ids']

    role_bt, index_bt, span_bt = (_stack_rows(rows, k, b, t)
                                  for k in ('image_role', 'image_index', 'image_span'))
    patches_bnpd = np.zeros((b, n, g.max_patches, p * p * 3), np.uint8)
    grid_bn2 = np.zeros((b, n, 2), np.int32)
    for r, row in enumerate(rows):
      patches_bnpd[r] = row['image_patches']
      grid_bn2[r] = row['image_grid']
      # Slots are filled piece by piece, so piece s's images follow those of pieces 1 .. s-1:
      # its local image slot k is row slot offset[s] + k, and its k-th span is span offset[s] + k.
      slot_segment_n = row['image_grid_segment_ids']
      segments = max(int(segment_ids_bt[r].max()), int(slot_segment_n.max(initial=0))) + 1
      count_s = np.bincount(slot_segment_n, minlength=segments)
      count_s[0] = 0
      offset_t = (np.cumsum(count_s) - count_s)[segment_ids_bt[r]].astype(np.int32)
      index_bt[r] += np.where(role_bt[r] == ROLE_PATCH, offset_t * g.max_image_tokens, 0)
      span_bt[r] += np.where(span_bt[r] != 0, offset_t, 0)
    return {
        **text,
        'modality': np.where(role_bt != 0, IMAGE, TEXT).astype(np.int32),
        'image_role': role_bt,
        'image_index': index_bt,
        'image_span': span_bt,
        'image_patches': patches_bnpd,
        'image_grid': grid_bn2,
    }


def document_batch(docs: Sequence[TaskDocument], batch_size: int, length: int,
                   geometry: ImageGeometry | None = None) -> dict[str, np.ndarray]:
  """The batch (batch.py's contract) of one whole document per row, each of at most length + 1
  tokens, the loss mask on its answers; rows past len(docs) are empty (segment 0). With the
  vision model's `geometry`, the image keys of rows without images."""
  if len(docs) > batch_size:
    raise ValueError(f'{len(docs)} documents for {batch_size} rows')
  rows = []
  for doc in docs:
    piece = aligned_piece(doc.tokens, 1, doc.answer_mask())
    n = len(piece['tokens'])
    if n > length:
      raise DataError(f'a document of {n} positions does not fit rows of {length}')
    pad = length - n
    row = {k: np.concatenate([v, np.zeros(pad, np.int32)]) for k, v in piece.items()}
    row['tokens_segment_ids'] = np.concatenate([np.ones(n, np.int32), np.zeros(pad, np.int32)])
    row['tokens_positions'] = np.concatenate([np.arange(n, dtype=np.int32),
                                              np.zeros(pad, np.int32)])
    rows.append(row)
  batch = Collate(batch_size, length)(rows)
  if geometry is not None:
    p = geometry.patch_size
    zeros_bt = np.zeros((batch_size, length), np.int32)
    n = geometry.max_images_per_row
    batch.update({'image_role': zeros_bt, 'image_index': zeros_bt, 'image_span': zeros_bt,
                  'image_patches': np.zeros((batch_size, n, geometry.max_patches, p * p * 3),
                                            np.uint8),
                  'image_grid': np.zeros((batch_size, n, 2), np.int32)})
  return batch


def document_answer_rows(docs: Sequence[TaskDocument], batch_size: int,
                         length: int) -> np.ndarray:
  """int32 [batch_size, length] beside `document_batch(docs, batch_size, length)`: for each
  query row before an answer token the row holding its hidden item's token
  (TaskDocument.answer_rows), -1 elsewhere (model/diagnostics.py's answer_rows_bt)."""
  rows_bt = np.full((batch_size, length), -1, np.int32)
  for r, doc in enumerate(docs):
    rows_t = doc.answer_rows()
    rows_bt[r, :len(rows_t)] = rows_t
  return rows_bt


# ---------------------------------------------------------------------------------------------
# The pipeline.


def _derived_seed(*parts: int) -> int:
  """Independent, reproducible seeds for each (run seed, config seed, stage, source)."""
  return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _open_sources(cfg: DataConfig, split: str, repeat: bool, seed: int,
                  synthetic_vocab_size: int) -> list[tuple[object, float]]:
  num_docs = _SYNTHETIC_TRAIN_DOCS if repeat else _SYNTHETIC_EVAL_DOCS
  if cfg.synthetic:
    split_seed = _derived_seed(seed, cfg.shuffle_seed, SPLITS.index(split), 7)
    return [(SyntheticSource(num_docs, synthetic_vocab_size, cfg.seq_len, split_seed,
                             align=cfg.document_align), 1.0)]
  text = iter(resolve_sources(cfg))
  tokenizer = None
  out = []
  for name, weight in cfg.sources or ((DEFAULT_SOURCE, 1.0),):
    if name in TASK_NAMES:
      tk = cfg.task_params()
      tokenizer = tokenizer or load_tokenizer(tokenizer_path_of(cfg))
      task_seed = _derived_seed(seed, cfg.shuffle_seed, SPLITS.index(split), 11,
                                TASK_NAMES.index(name))
      out.append((TaskSource(open_task(cfg, name, split, tokenizer), num_docs,
                             tk.length or cfg.seq_len, task_seed, cfg.document_align,
                             supervise_all=tk.supervise == 'all'), float(weight)))
      continue
    path, weight = next(text)
    src = TokenShardSource(os.path.join(path, split))
    if len(src) == 0:
      raise DataError(f'{os.path.join(path, split)} has no documents; re-run prepare with a '
                      'larger corpus or --heldout_fraction > 0')
    if not src.has_targets():  # an endless stream of target-less documents would hang
      raise DataError(f'{os.path.join(path, split)} has no document with two or more tokens')
    out.append((PieceSource(src, cfg.seq_len, cfg.document_align), weight))
  return out


def _open_image_sources(cfg: DataConfig, split: str, seed: int) -> list[tuple[object, float]]:
  kinds = multimodal.resolve_image_sources(cfg)
  if not kinds:
    return []
  if cfg.images is None:
    raise DataError('data.image_sources need model.vision=True (the image geometry comes from '
                    'the vision model)')
  if cfg.synthetic:
    raise DataError('data.synthetic does not combine with data.image_sources: image sources '
                    'tokenize their text with the text sources\' tokenizer')
  tokenizer = tokenizer_path_of(cfg)
  return [(multimodal.open_image_source(kind, path, cfg, split=split, seed=seed,
                                        tokenizer_path=tokenizer), weight)
          for kind, path, weight in kinds]


def _is_random(src) -> bool:
  """Sources whose items are random draws already: shuffling them only costs time."""
  return isinstance(src, (SyntheticSource, TaskSource)) or (
      isinstance(src, multimodal.MultimodalSource) and
      isinstance(src.samples, multimodal.ShapesSamples))


def _ensure_absl_flags_parsed() -> None:
  """Grain worker processes read absl flags; outside absl.app.run nobody has parsed them."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def make_dataset(cfg: DataConfig, *, split: str, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, repeat: bool = True,
                 shuffle: bool | None = None, synthetic_vocab_size: int = 512,
                 kinds: Sequence[str] = KINDS) -> grain.IterDataset:
  """Packed batches for this process (module docstring); `iter()` it for a checkpointable iterator.

  `repeat=False` is one finite pass, unshuffled by default (`shuffle=None` means `repeat`), over
  every document of every source once, in order: the deterministic evaluation pass.
  `kinds` picks the sources: 'text' (data.sources, or the default corpus) and / or 'image'
  (data.image_sources; e.g. kinds=('image',), split='heldout' for caption evaluation).
  """
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if batch_size < 1:
    raise DataError(f'batch_size must be >= 1, got {batch_size}')
  if not 0 <= process_index < process_count:
    raise DataError(f'process_index {process_index} is not in [0, process_count={process_count})')
  kinds = tuple(kinds)
  if not kinds or not set(kinds) <= set(KINDS):
    raise DataError(f'kinds must be a non-empty subset of {KINDS}, got {kinds}')
  if 'image' in kinds and 'text' not in kinds and not cfg.image_sources:
    raise DataError("kinds=('image',) needs data.image_sources")
  shuffle = repeat if shuffle is None else shuffle
  seq_len = cfg.seq_len
  geometry = cfg.images  # None: model.vision off, the text-only batches of before

  text = _open_sources(cfg, split, repeat, seed, synthetic_vocab_size) if 'text' in kinds else []
  image = _open_image_sources(cfg, split, seed) if 'image' in kinds else []
  per_source, weights = [], []
  for i, (src, weight) in enumerate(text + image):
    ds = grain.MapDataset.source(src)
    if len(ds) < process_count:
      raise DataError(f'{src!r} has {len(ds)} documents, fewer than the {process_count} '
                      'processes that each need a share; use a larger corpus')
    ds = ds[process_index::process_count]  # disjoint, interleaved slices per process
    if shuffle and not _is_random(src):
      ds = ds.shuffle(seed=_derived_seed(seed, cfg.shuffle_seed, 1, i))
    if geometry is not None and i < len(text):
      ds = ds.map(TextPieceList(geometry))  # every element: a list of pieces with image keys
    if repeat:
      ds = ds.repeat(None)  # reseeds the shuffle every epoch
    per_source.append(ds)
    weights.append(weight)
  if len(per_source) == 1:
    ds = per_source[0]
  elif repeat:
    ds = grain.MapDataset.mix(per_source, weights)
  else:
    ds = grain.MapDataset.concatenate(per_source)  # a finite pass reads everything once

  # Reading a document is a memory-mapped slice: a few threads hide page faults, more only add
  # scheduling overhead. Images are decoded and resized while reading (Pillow releases the GIL).
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=4 if image else 2,
                                               prefetch_buffer_size=16))
  length_struct = {'tokens': seq_len, 'targets': seq_len, 'mask': seq_len}
  if geometry is not None:
    it_ds = grain.experimental.FlatMapIterDataset(it_ds, Flatten())
    # Grain packs every array along its first axis (trailing axes kept, 0-length arrays fine),
    # and a piece goes into the first row where all of its keys fit: its positions and its
    # images (at most max_images_per_row per row).
    length_struct.update({k: seq_len for k in ('image_role', 'image_index', 'image_span')})
    length_struct.update({k: geometry.max_images_per_row for k in ('image_patches', 'image_grid')})
  it_ds = grain.experimental.FirstFitPackIterDataset(
      it_ds, length_struct=length_struct,
      num_packing_bins=cfg.packing_bins, seed=_derived_seed(seed, cfg.shuffle_seed, 2),
      shuffle_bins=shuffle)
  collate = Collate(batch_size, seq_len) if geometry is None else \
      MultimodalCollate(batch_size, seq_len, geometry)
  it_ds = it_ds.batch(batch_size, drop_remainder=False, batch_fn=collate)

  if cfg.num_workers > 0:
    _ensure_absl_flags_parsed()
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=cfg.num_workers, per_worker_buffer_size=max(cfg.prefetch, 1)))
  elif cfg.prefetch > 0:
    it_ds = grain.experimental.ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=cfg.prefetch)
  return it_ds


# ---------------------------------------------------------------------------------------------
# Input streams: the global batch independent of the process count.


class DataStreams:
  """This process's part of the global batch: streams [first, first + n) of `total`, each a
  make_dataset() pipeline of batch_size / total rows over documents stream::total, concatenated
  row-wise in stream order.

  The global batch of step s is streams 0..total-1's batch s, whichever processes read them, so
  a run split into the same number of streams sees the same batches on 1 process or on several,
  and resumes from each stream's saved position on any process count that divides `total`. With
  total = 1 on one process this is make_dataset() itself (the same batches and iterator state).
  """

  def __init__(self, cfg: DataConfig, *, split: str, batch_size: int, seed: int, total: int,
               process_index: int, process_count: int, synthetic_vocab_size: int = 512):
    if total < 1 or total % process_count:
      raise DataError(f'{total} data stream(s) cannot be split evenly over {process_count} '
                      'processes; use a process count that divides the stream count')
    if batch_size % total:
      raise DataError(f'train.batch_size {batch_size} is not a multiple of the {total} data '
                      'streams')
    self.total = total
    per_process = total // process_count
    self.first = process_index * per_process
    self.streams = list(range(self.first, self.first + per_process))
    self._iters = [iter(make_dataset(cfg, split=split, batch_size=batch_size // total, seed=seed,
                                     process_index=k, process_count=total,
                                     synthetic_vocab_size=synthetic_vocab_size))
                   for k in self.streams]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self._iters]
    if len(parts) == 1:
      return parts[0]
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}

  def stream_states(self) -> dict[int, dict]:
    """{stream index: its Grain iterator state}."""
    return {k: it.get_state() for k, it in zip(self.streams, self._iters)}

  def set_stream_states(self, states: dict[int, dict]) -> None:
    for k, it in zip(self.streams, self._iters):
      it.set_state(states[k])
      if hasattr(it, 'start_prefetch'):  # as Grain's own checkpoint handler does after a restore
        it.start_prefetch()

  def close(self) -> None:
    for it in self._iters:
      if hasattr(it, 'close'):
        it.close()
