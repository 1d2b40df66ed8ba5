"""What the tasks are made of: documents with marked answers, text encoded through the run's
tokenizer, and the filler that separates what is hidden from where it is asked for.

Every piece of text is encoded on its own and the ids concatenated, so a number reads as the
same ids where it is hidden and where it is the answer, whatever the tokenizer would merge
across a boundary: the answer's tokens are well defined, and accuracy with them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from deepseek41.data.shards import DataError, TokenShardSource, read_meta
from deepseek41.data.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class TaskDocument:
  """One task document: its tokens (end-of-document last), where its answers are and where each
  answer's item is hidden in the context."""
  tokens: np.ndarray                      # int32 [n]
  answers: tuple[tuple[int, int], ...]    # [start, end) of each answer in `tokens`
  depth: float | None = None              # where the asked item is hidden; None: no depth
  # [start, end) of the hidden item each answer retrieves (the same ids), in answers' order
  sources: tuple[tuple[int, int], ...] = ()

  def answer_mask(self) -> np.ndarray:
    """int32 [n - 1] over the targets (tokens[1:]): 1 where the target is an answer token."""
    mask_t = np.zeros(len(self.tokens) - 1, np.int32)
    for start, end in self.answers:
      mask_t[start - 1:end - 1] = 1
    return mask_t

  def answer_rows(self) -> np.ndarray:
    """int32 [n - 1] over the query rows (row t reads tokens[t] and predicts tokens[t + 1]): the
    row before an answer's i-th token holds the row of its hidden item's i-th token, the row a
    retrieval should read; -1 elsewhere (model/diagnostics.py's answer_rows_bt)."""
    rows_t = np.full(len(self.tokens) - 1, -1, np.int32)
    for (start, end), (source, _) in zip(self.answers, self.sources):
      rows_t[start - 1:end - 1] = np.arange(source, source + end - start)
    return rows_t

  def answer_tokens(self) -> list[np.ndarray]:
    return [self.tokens[s:e] for s, e in self.answers]


class Hidden(NamedTuple):
  """A document part that is an item hidden in the context: `item` names it."""
  item: int


class Answer(NamedTuple):
  """A document part that is an answer (supervised): the hidden `item` it retrieves."""
  item: int


def assemble(parts: Sequence[tuple[np.ndarray, Hidden | Answer | None]], eos_id: int,
             depth: float | None = None) -> TaskDocument:
  """The document of `parts` (ids, role) in order, then end-of-document. Every Answer names one
  Hidden part of the same ids: its source."""
  spans: dict[type, list[tuple[int, int, int]]] = {Hidden: [], Answer: []}
  offset = 0
  for ids, role in parts:
    if role is not None:
      spans[type(role)].append((role.item, offset, offset + len(ids)))
    offset += len(ids)
  tokens = np.concatenate([ids for ids, _ in parts] + [np.asarray([eos_id], np.int32)])
  tokens = tokens.astype(np.int32)
  hidden = {item: (start, end) for item, start, end in spans[Hidden]}
  if len(hidden) != len(spans[Hidden]):
    raise ValueError('two hidden parts name one item')
  sources = []
  for item, start, end in spans[Answer]:
    source = hidden.get(item)
    if source is None or not np.array_equal(tokens[slice(*source)], tokens[start:end]):
      raise ValueError(f'answer at {start} has no hidden part of its ids (item {item})')
    sources.append(source)
  return TaskDocument(tokens, tuple((s, e) for _, s, e in spans[Answer]), depth, tuple(sources))


class TaskText:
  """Text -> ids through the run's tokenizer (fixed phrases encoded once), and random numbers
  and words to hide."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.eos_id = tokenizer.eos_id
    self._cache: dict[str, np.ndarray] = {}
    special = {int(i) for i, t in tokenizer.hf.get_added_tokens_decoder().items() if t.special}
    special |= {tokenizer.eos_id, tokenizer.pad_id}
    # Ids free to use as random filler: never a special token, so never an end of document.
    self.plain_ids = np.asarray([i for i in range(tokenizer.vocab_size) if i not in special],
                                np.int32)

  def ids(self, text: str) -> np.ndarray:
    if text not in self._cache:
      if len(self._cache) > 4096:  # phrases repeat, numbers and words do not
        self._cache.clear()
      ids = self.tokenizer.hf.encode(text, add_special_tokens=False).ids
      self._cache[text] = np.asarray(ids, np.int32)
    return self._cache[text]

  def encode_fresh(self, text: str) -> np.ndarray:
    """Ids of text that will not repeat (a number, a key): not cached."""
    return np.asarray(self.tokenizer.hf.encode(text, add_special_tokens=False).ids, np.int32)


def random_number(rng: np.random.Generator, digits: int) -> str:
  """A number of exactly `digits` digits (no leading zero unless it is one digit)."""
  first = str(rng.integers(1 if digits > 1 else 0, 10))
  return first + ''.join(str(d) for d in rng.integers(0, 10, digits - 1))


def random_letters(rng: np.random.Generator, count: int, letters: int) -> list[str]:
  """`count` distinct lowercase strings of `letters` letters."""
  seen: dict[str, None] = {}
  while len(seen) < count:
    seen.setdefault(''.join(chr(97 + c) for c in rng.integers(0, 26, letters)), None)
  return list(seen)


_CONSONANTS, _VOWELS = 'bdfgklmnprstvz', 'aeiou'


def random_words(rng: np.random.Generator, count: int, syllables: int = 3) -> list[str]:
  """`count` distinct pronounceable made-up words ('kanoribe'), to name the needles."""
  seen: dict[str, None] = {}
  while len(seen) < count:
    word = ''.join(_CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(5)]
                   for _ in range(syllables))
    seen.setdefault(word, None)
  return list(seen)


# ---------------------------------------------------------------------------------------------
# Filler.


class SentenceFiller:
  """Repeated plain sentences (the passkey task's haystack), cut at sentence boundaries."""

  def __init__(self, text: TaskText, sentences: Sequence[str]):
    self.blocks = [text.ids(s) for s in sentences]

  def take(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(n filler ids, the offsets in [0, n] where a sentence starts or the filler ends)."""
    out, bounds, total = [], [0], 0
    k = int(rng.integers(len(self.blocks)))
    while total < n:
      block = self.blocks[k % len(self.blocks)][:n - total]
      out.append(block)
      total += len(block)
      bounds.append(total)
      k += 1
    ids = np.concatenate(out) if out else np.zeros(0, np.int32)
    return ids.astype(np.int32), np.asarray(bounds, np.int64)


class CorpusFiller:
  """Real text from a prepared dataset's split (the needle task's haystack): documents one after
  another from a random one on, their ends dropped, in the task tokenizer's ids (re-encoded from
  the text when the dataset was prepared with another tokenizer)."""

  def __init__(self, split_dir: str, text: TaskText, key: str):
    meta = read_meta(split_dir)
    self.docs = TokenShardSource(split_dir)
    if len(self.docs) == 0 or not int(self.docs.doc_lengths().sum()):
      raise DataError(f'{key}: {split_dir} holds no text to hide needles in')
    self.text = text
    tokenizer_path = os.path.normpath(os.path.join(split_dir, meta['tokenizer']))
    same = meta.get('tokenizer_sha256') == text.tokenizer.sha256()
    self.source_tokenizer = None if same else load_tokenizer(tokenizer_path)
    self.drop_id = text.eos_id if same else self.source_tokenizer.eos_id

  def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
    out, total = [], 0
    d = int(rng.integers(len(self.docs)))
    newline = self.text.ids('\n')
    while total < n:
      doc_t = np.asarray(self.docs[d % len(self.docs)])
      doc_t = doc_t[doc_t != self.drop_id]  # documents end in a line break instead
      if self.source_tokenizer is not None and len(doc_t):
        doc_t = self.text.encode_fresh(self.source_tokenizer.decode(doc_t))
      doc_t = np.concatenate([doc_t.astype(np.int32), newline])
      out.append(doc_t[:n - total])
      total += len(out[-1])
      d += 1
    return np.concatenate(out) if out else np.zeros(0, np.int32)
