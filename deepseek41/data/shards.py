"""On-disk token shards of one prepared split, and the Grain data source that reads them.

A split directory holds

    meta.json            {"format_version", "num_docs", "num_tokens", "dtype", "vocab_size",
                          "tokenizer", "tokenizer_sha256", "shards": [{"tokens", "offsets",
                          "num_docs", "num_tokens"}, ...]}
    tokens-00000.npy     every document of the shard, concatenated (uint16 or int32)
    offsets-00000.npy    int64[num_docs + 1]: document d is tokens[offsets[d]:offsets[d + 1]]

`meta.json` is written last, so a split without it is incomplete. `tokenizer` is relative to the
split directory (normally "../tokenizer.json").
"""

from __future__ import annotations

import bisect
import json
import os
from typing import Any

import numpy as np

FORMAT_VERSION = 1
META_FILE = 'meta.json'
DEFAULT_SHARD_TOKENS = 64 * 1024 * 1024  # 128 MiB of uint16 per shard file


class DataError(ValueError):
  """A dataset, shard, input file or data option is wrong; the message names it."""


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 halves the disk and page-cache footprint whenever every id fits."""
  return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


class ShardWriter:
  """Appends documents to a split directory, starting a new shard every `shard_tokens` tokens."""

  def __init__(self, split_dir: str, vocab_size: int, *, tokenizer: str = '../tokenizer.json',
               tokenizer_sha256: str = '', shard_tokens: int = DEFAULT_SHARD_TOKENS):
    if shard_tokens < 1:
      raise DataError(f'shard_tokens must be >= 1, got {shard_tokens}')
    os.makedirs(split_dir, exist_ok=True)
    self.split_dir = split_dir
    self.vocab_size = int(vocab_size)
    self.dtype = token_dtype(vocab_size)
    self._tokenizer = tokenizer
    self._tokenizer_sha256 = tokenizer_sha256
    self._shard_tokens = shard_tokens
    self._docs: list[np.ndarray] = []
    self._buffered_tokens = 0
    self._shards: list[dict[str, Any]] = []
    self.num_docs = 0
    self.num_tokens = 0
    self._closed = False

  def add(self, doc_t: np.ndarray) -> None:
    doc_t = np.asarray(doc_t)
    if doc_t.ndim != 1:
      raise DataError(f'a document must be a 1-D token array, got shape {doc_t.shape}')
    if doc_t.size and (doc_t.min() < 0 or doc_t.max() >= self.vocab_size):
      raise DataError(f'token ids must be in [0, {self.vocab_size}), got '
                      f'[{doc_t.min()}, {doc_t.max()}] (is vocab_size right?)')
    self._docs.append(doc_t.astype(self.dtype, copy=False))
    self._buffered_tokens += doc_t.size
    self.num_docs += 1
    self.num_tokens += doc_t.size
    if self._buffered_tokens >= self._shard_tokens:
      self._flush()

  def _flush(self) -> None:
    if not self._docs:
      return
    index = len(self._shards)
    tokens_name, offsets_name = f'tokens-{index:05d}.npy', f'offsets-{index:05d}.npy'
    lengths = np.fromiter((d.size for d in self._docs), np.int64, len(self._docs))
    offsets = np.zeros(len(self._docs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(self._docs) if offsets[-1] else np.zeros(0, self.dtype)
    np.save(os.path.join(self.split_dir, tokens_name), tokens)
    np.save(os.path.join(self.split_dir, offsets_name), offsets)
    self._shards.append({'tokens': tokens_name, 'offsets': offsets_name,
                         'num_docs': len(self._docs), 'num_tokens': int(offsets[-1])})
    self._docs, self._buffered_tokens = [], 0

  def close(self) -> dict[str, Any]:
    """Writes the last shard, then meta.json (which marks the split complete); returns the meta."""
    if self._closed:
      raise DataError(f'ShardWriter for {self.split_dir} is already closed')
    self._flush()
    self._closed = True
    meta = {'format_version': FORMAT_VERSION, 'num_docs': self.num_docs,
            'num_tokens': self.num_tokens, 'dtype': self.dtype.name,
            'vocab_size': self.vocab_size, 'tokenizer': self._tokenizer,
            'tokenizer_sha256': self._tokenizer_sha256, 'shards': self._shards}
    tmp = os.path.join(self.split_dir, META_FILE + '.tmp')
    with open(tmp, 'w') as f:
      json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(self.split_dir, META_FILE))
    return meta


def read_meta(split_dir: str) -> dict[str, Any]:
  """Loads and checks meta.json, raising DataError that names the file on any problem."""
  path = os.path.join(split_dir, META_FILE)
  if not os.path.isdir(split_dir):
    raise DataError(f'split directory {split_dir} does not exist; create it with '
                    '`python -m deepseek41.data.prepare --output DIR ...`')
  if not os.path.isfile(path):
    raise DataError(f'{path} is missing: {split_dir} is not a prepared split or its preparation '
                    'did not finish; re-run `python -m deepseek41.data.prepare`')
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise DataError(f'{path} is unreadable or not valid JSON ({e}); re-run prepare') from e
  required = {'format_version': int, 'num_docs': int, 'num_tokens': int, 'dtype': str,
              'vocab_size': int, 'tokenizer': str, 'shards': list}
  for key, kind in required.items():
    if not isinstance(meta.get(key) if isinstance(meta, dict) else None, kind):
      raise DataError(f'{path}: key {key!r} is missing or not a {kind.__name__}; re-run prepare')
  if meta['format_version'] != FORMAT_VERSION:
    raise DataError(f'{path}: format_version {meta["format_version"]} is not supported (this '
                    f'code reads version {FORMAT_VERSION}); re-run prepare with this version')
  for i, shard in enumerate(meta['shards']):
    if not isinstance(shard, dict) or not all(k in shard for k in ('tokens', 'offsets', 'num_docs')):
      raise DataError(f'{path}: shards[{i}] needs "tokens", "offsets" and "num_docs"; re-run prepare')
  if sum(s['num_docs'] for s in meta['shards']) != meta['num_docs']:
    raise DataError(f'{path}: num_docs does not match the sum over its shards; re-run prepare')
  return meta


def _open_npy(path: str, what: str) -> np.ndarray:
  if not os.path.isfile(path):
    raise DataError(f'shard file {path} ({what}) is missing; re-run prepare for this split')
  try:
    return np.load(path, mmap_mode='r', allow_pickle=False)
  except (OSError, ValueError) as e:
    raise DataError(f'shard file {path} ({what}) is corrupt: {e}; re-run prepare') from e


class TokenShardSource:
  """Grain RandomAccessDataSource: document i of a split as an int32 token array.

  Shards are memory-mapped lazily in each process, and pickling carries only the path, so Grain
  worker processes neither copy the tokens nor share file handles.
  """

  def __init__(self, split_dir: str):
    self.split_dir = split_dir
    self.meta = read_meta(split_dir)
    self.vocab_size = int(self.meta['vocab_size'])
    # doc_starts[s] = global index of shard s's first document; bisect maps index -> shard.
    self._doc_starts = np.cumsum([0] + [s['num_docs'] for s in self.meta['shards']]).tolist()
    self._shards: list[tuple[np.ndarray, np.ndarray]] | None = None
    self._open_shards()  # validate every file now, so a bad shard fails at start-up, not mid-run

  def _open_shards(self) -> list[tuple[np.ndarray, np.ndarray]]:
    if self._shards is None:
      shards = []
      dtype = np.dtype(self.meta['dtype'])
      for s in self.meta['shards']:
        tokens_path = os.path.join(self.split_dir, s['tokens'])
        offsets_path = os.path.join(self.split_dir, s['offsets'])
        tokens_t = _open_npy(tokens_path, 'tokens')
        offsets_d = _open_npy(offsets_path, 'document offsets')
        if tokens_t.ndim != 1 or tokens_t.dtype != dtype:
          raise DataError(f'shard file {tokens_path} has dtype {tokens_t.dtype} and shape '
                          f'{tokens_t.shape}, expected 1-D {dtype}; re-run prepare')
        if offsets_d.shape != (s['num_docs'] + 1,) or offsets_d.dtype != np.int64:
          raise DataError(f'shard file {offsets_path} has shape {offsets_d.shape}, expected '
                          f'({s["num_docs"] + 1},) int64; re-run prepare')
        if s['num_docs'] and int(offsets_d[-1]) != tokens_t.shape[0]:
          raise DataError(f'shard file {offsets_path} ends at token {int(offsets_d[-1])} but '
                          f'{tokens_path} holds {tokens_t.shape[0]}; re-run prepare')
        shards.append((tokens_t, offsets_d))
      self._shards = shards
    return self._shards

  def __len__(self) -> int:
    return int(self.meta['num_docs'])

  def __getitem__(self, index: int) -> np.ndarray:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f'document {index} out of range for {self.split_dir} ({len(self)} docs)')
    shard = bisect.bisect_right(self._doc_starts, index) - 1
    tokens_t, offsets_d = self._open_shards()[shard]
    local = index - self._doc_starts[shard]
    return np.array(tokens_t[offsets_d[local]:offsets_d[local + 1]], dtype=np.int32)

  def doc_lengths(self) -> np.ndarray:
    """Token count of every document, in index order (from the offsets alone)."""
    return np.concatenate([np.diff(offsets_d) for _, offsets_d in self._open_shards()] or
                          [np.zeros(0, np.int64)])

  def read(self, index: int, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of document `index`, without reading the rest of it."""
    shard = bisect.bisect_right(self._doc_starts, int(index)) - 1
    tokens_t, offsets_d = self._open_shards()[shard]
    base = int(offsets_d[int(index) - self._doc_starts[shard]])
    end = int(offsets_d[int(index) - self._doc_starts[shard] + 1])
    return np.array(tokens_t[base + start:min(base + stop, end)], dtype=np.int32)

  def has_targets(self) -> bool:
    """Whether any document has two or more tokens, i.e. at least one next-token target."""
    return any((np.diff(offsets_d) > 1).any() for _, offsets_d in self._open_shards())

  def __getstate__(self):
    state = self.__dict__.copy()
    state['_shards'] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)

  def __repr__(self) -> str:
    # Grain logs and compares sources by repr; keep it short and stable.
    return f'TokenShardSource({self.split_dir!r}, num_docs={len(self)})'
