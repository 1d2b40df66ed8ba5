"""Grain pipeline: token shards -> mixed, shuffled, packed [batch, seq_len] batches.

    per source: documents cut into seq_len + 1 pieces -> this process's slice -> shuffle
    (reseeded every epoch) -> repeat -> weighted mixture -> first-fit packing -> batch ->
    prefetch (worker processes or a thread)

Every batch is a dict of int32 arrays of shape [batch_size, seq_len]:

    tokens       input ids (0 in padding)
    targets      the next token of the same document (0 in padding)
    segment_ids  1, 2, ... per packed piece within a row; 0 = padding
    positions    0, 1, ... restarting at each piece
    loss_mask    1 where targets is real (segment_ids != 0)
    modality     0 = text (1 is reserved for image tokens)

A document of n tokens yields ceil((n - 1) / seq_len) pieces of at most seq_len + 1 tokens that
overlap by one, so inputs = piece[:-1] and targets = piece[1:] predict every token of the
document after the first exactly once. Pieces are never split across rows; each piece is its own
attention segment with positions from 0, because nothing before it is visible in its row.
Pieces, not documents, are shuffled: a long file's hundreds of pieces would otherwise fill
consecutive batches, and a model trained on such a stream fits one file at a time (seen on the
default corpus: held-out loss rose for the first 40 steps while the training loss fell).

Mixture weights count pieces (so roughly tokens). The iterator's `get_state()` / `set_state()`
resume with identical batches as long as the config, batch size, process layout and
`num_workers` are unchanged (packing runs per worker, so batches depend on the worker count).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import grain
import numpy as np

from deepseek41.config import DataConfig
from deepseek41.data.default_corpus import default_corpus_dir
from deepseek41.data.shards import META_FILE, DataError, TokenShardSource

SPLITS = ('train', 'heldout')
BATCH_KEYS = ('tokens', 'targets', 'segment_ids', 'positions', 'loss_mask', 'modality')
TEXT, IMAGE = 0, 1  # modality ids
_SYNTHETIC_TRAIN_DOCS = 1 << 40  # effectively endless; documents are generated on demand
_SYNTHETIC_EVAL_DOCS = 4096


# ---------------------------------------------------------------------------------------------
# Sources.


def resolve_sources(cfg: DataConfig) -> list[tuple[str, float]]:
  """Prepared dataset directories with their mixture weights; checks they can be mixed."""
  if cfg.sources:
    sources = [(path, float(w)) for path, w in cfg.sources]
  else:
    sources = [(default_corpus_dir(cfg.cache_dir, cfg.default_corpus_vocab_size,
                                   cfg.default_corpus_max_files), 1.0)]
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


def vocab_size_of(cfg: DataConfig, synthetic_vocab_size: int = 512) -> int:
  """Vocabulary size of the data's tokenizer: model.vocab_size must be at least this."""
  if cfg.synthetic:
    return synthetic_vocab_size
  path, _ = resolve_sources(cfg)[0]
  return TokenShardSource(os.path.join(path, 'train')).vocab_size


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


def aligned_piece(piece_t: np.ndarray, align: int) -> dict[str, np.ndarray]:
  """(inputs, targets, mask) of a piece, padded at its end to a multiple of `align` positions.

  With every piece a multiple of `align` long, first-fit packing starts every document at a
  multiple of `align` within its row, so ratio-2 compressed groups never straddle two documents
  (ARCHITECTURE.md section 4, "Packing"). The padding positions belong to the document (they
  come after all its real tokens, so no real query sees them) and carry mask 0: no loss.
  """
  tokens_t, targets_t = piece_t[:-1], piece_t[1:]
  n = len(tokens_t)
  extra = (-n) % align
  mask_t = np.ones(n + extra, np.int32)
  if extra:
    tokens_t = np.concatenate([tokens_t, np.zeros(extra, tokens_t.dtype)])
    targets_t = np.concatenate([targets_t, np.zeros(extra, targets_t.dtype)])
    mask_t[n:] = 0
  return {'tokens': tokens_t, 'targets': targets_t, 'mask': mask_t}


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


class Collate:
  """Packed rows -> the batch dict; pads a short final batch (finite passes) with empty rows."""

  def __init__(self, batch_size: int, seq_len: int):
    self.batch_size, self.seq_len = batch_size, seq_len

  def __call__(self, rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    def stack(key):
      x_bt = np.zeros((self.batch_size, self.seq_len), np.int32)
      x_bt[:len(rows)] = np.stack([r[key] for r in rows])
      return x_bt
    segment_ids_bt = stack('tokens_segment_ids')
    return {
        'tokens': stack('tokens'),
        'targets': stack('targets'),
        'segment_ids': segment_ids_bt,
        'positions': stack('tokens_positions'),
        'loss_mask': ((segment_ids_bt != 0) & (stack('mask') != 0)).astype(np.int32),
        'modality': np.full_like(segment_ids_bt, TEXT),
    }


# ---------------------------------------------------------------------------------------------
# The pipeline.


def _derived_seed(*parts: int) -> int:
  """Independent, reproducible seeds for each (run seed, config seed, stage, source)."""
  return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def _open_sources(cfg: DataConfig, split: str, repeat: bool, seed: int,
                  synthetic_vocab_size: int) -> list[tuple[object, float]]:
  if cfg.synthetic:
    num_docs = _SYNTHETIC_TRAIN_DOCS if repeat else _SYNTHETIC_EVAL_DOCS
    split_seed = _derived_seed(seed, cfg.shuffle_seed, SPLITS.index(split), 7)
    return [(SyntheticSource(num_docs, synthetic_vocab_size, cfg.seq_len, split_seed,
                             align=cfg.document_align), 1.0)]
  out = []
  for path, weight in resolve_sources(cfg):
    src = TokenShardSource(os.path.join(path, split))
    if len(src) == 0:
      raise DataError(f'{os.path.join(path, split)} has no documents; re-run prepare with a '
                      'larger corpus or --heldout_fraction > 0')
    if not src.has_targets():  # an endless stream of target-less documents would hang
      raise DataError(f'{os.path.join(path, split)} has no document with two or more tokens')
    out.append((PieceSource(src, cfg.seq_len, cfg.document_align), weight))
  return out


def _ensure_absl_flags_parsed() -> None:
  """Grain worker processes read absl flags; outside absl.app.run nobody has parsed them."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def make_dataset(cfg: DataConfig, *, split: str, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, repeat: bool = True,
                 shuffle: bool | None = None,
                 synthetic_vocab_size: int = 512) -> grain.IterDataset:
  """Packed batches for this process (module docstring); `iter()` it for a checkpointable iterator.

  `repeat=False` is one finite pass, unshuffled by default (`shuffle=None` means `repeat`), over
  every document of every source once, in order: the deterministic evaluation pass.
  """
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if batch_size < 1:
    raise DataError(f'batch_size must be >= 1, got {batch_size}')
  if not 0 <= process_index < process_count:
    raise DataError(f'process_index {process_index} is not in [0, process_count={process_count})')
  shuffle = repeat if shuffle is None else shuffle
  seq_len = cfg.seq_len

  per_source, weights = [], []
  for i, (src, weight) in enumerate(_open_sources(cfg, split, repeat, seed, synthetic_vocab_size)):
    ds = grain.MapDataset.source(src)
    if len(ds) < process_count:
      raise DataError(f'{src!r} has {len(ds)} documents, fewer than the {process_count} '
                      'processes that each need a share; use a larger corpus')
    ds = ds[process_index::process_count]  # disjoint, interleaved slices per process
    if shuffle and not cfg.synthetic:  # synthetic documents are random already
      ds = ds.shuffle(seed=_derived_seed(seed, cfg.shuffle_seed, 1, i))
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
  # scheduling overhead.
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
  it_ds = grain.experimental.FirstFitPackIterDataset(
      it_ds, length_struct={'tokens': seq_len, 'targets': seq_len, 'mask': seq_len},
      num_packing_bins=cfg.packing_bins, seed=_derived_seed(seed, cfg.shuffle_seed, 2),
      shuffle_bins=shuffle)
  it_ds = it_ds.batch(batch_size, drop_remainder=False, batch_fn=Collate(batch_size, seq_len))

  if cfg.num_workers > 0:
    _ensure_absl_flags_parsed()
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=cfg.num_workers, per_worker_buffer_size=max(cfg.prefetch, 1)))
  elif cfg.prefetch > 0:
    it_ds = grain.experimental.ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=cfg.prefetch)
  return it_ds
