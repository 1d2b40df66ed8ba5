"""The three retrieval tasks. Each `document(rng, length, depth)` returns one TaskDocument of
exactly length + 1 tokens (the inputs and targets of `length` positions, end-of-document last),
deterministic in `rng`; `depth` in [0, 1] places what is hidden (None: drawn at random).

    mqar     multi-query associative recall (Zoology, Arora et al. 2023): key:value pairs,
             then random tokens with some of the keys asked again at random places
             " abc:123 xyz:804 ... <random ids> ... xyz:[804] ... abc:[123] ..." <eos>
    passkey  a number hidden in repeated plain sentences (Mohtashami and Jaggi 2023), asked for
             at the end: "... The secret number is 41720. Remember it. ... What is the secret
             number? The secret number is[ 41720]" <eos>
    needle   sentences "the code for <word> is <number>" hidden in real text (needle in a
             haystack, with distractors and several queries as in RULER, Hsieh et al. 2024),
             some of them asked for at the end

Brackets mark the answers: the only supervised tokens unless tasks.supervise = 'all'. Each
document also records where each answer's item is hidden (the value of the pair, the passkey,
the needle's number: `TaskDocument.sources`), the row a retrieval should read.
"""

from __future__ import annotations

import numpy as np

from deepseek41.data.shards import DataError
from deepseek41.data.tasks.text import (Answer, CorpusFiller, Hidden, SentenceFiller,
                                        TaskDocument, TaskText, assemble, random_letters,
                                        random_number, random_words)

# Our own filler: plain sentences with no number in them.
PASSKEY_FILLER = (
    ' The tide came in slowly over the flat grey sand.',
    ' A cart rolled down the hill road toward the market.',
    ' Smoke rose from the chimney of the last house in the lane.',
    ' Nobody in the village had seen the river run so high.',
    ' The baker opened his shop before dawn, as he always did.',
    ' Far away a bell rang twice and then was quiet again.',
)


def _too_short(task: str, length: int, fixed: int, keys: str) -> DataError:
  return DataError(f'{task}: a document of {length} tokens cannot hold its {fixed} tokens of '
                   f'pairs, needles or questions; use a longer context or fewer ({keys})')


def _insert(filler_t: np.ndarray, cuts: list[tuple[int, list[tuple]]]) -> list[tuple]:
  """The filler's parts with each (offset, parts) inserted at its offset (offsets into the
  filler; at one offset in the order given)."""
  out, at = [], 0
  for offset, parts in sorted(cuts, key=lambda c: c[0]):
    out += [(filler_t[at:offset], None), *parts]
    at = offset
  return out + [(filler_t[at:], None)]


class Mqar:
  name = 'mqar'
  has_depth = False

  def __init__(self, text: TaskText, pairs: int, queries: int, key_letters: int,
               value_digits: int):
    self.text, self.pairs, self.queries = text, pairs, queries
    self.key_letters, self.value_digits = key_letters, value_digits

  def document(self, rng: np.random.Generator, length: int,
               depth: float | None = None) -> TaskDocument:
    del depth  # every pair is asked from anywhere after it
    t = self.text
    keys = random_letters(rng, self.pairs, self.key_letters)
    values = [random_number(rng, self.value_digits) for _ in keys]
    key_ids = [t.encode_fresh(' ' + k) for k in keys]
    value_ids = [t.encode_fresh(v) for v in values]
    colon = t.ids(':')
    pairs = [part for i, (k, v) in enumerate(zip(key_ids, value_ids))
             for part in ((k, None), (colon, None), (v, Hidden(i)))]
    asked = rng.permutation(self.pairs)[:self.queries]
    fixed = sum(len(ids) for ids, _ in pairs) + sum(
        len(key_ids[q]) + len(colon) + len(value_ids[q]) for q in asked)
    noise = length - fixed  # + eos = length + 1 tokens
    if noise < 0:
      raise _too_short('mqar', length, fixed, 'tasks.mqar_pairs, tasks.mqar_queries')
    noise_t = rng.choice(t.plain_ids, noise)
    at = np.sort(rng.integers(0, noise + 1, len(asked)))
    parts, prev = list(pairs), 0
    for offset, q in zip(at, asked):
      parts += [(noise_t[prev:offset], None), (key_ids[q], None), (colon, None),
                (value_ids[q], Answer(int(q)))]
      prev = offset
    parts.append((noise_t[prev:], None))
    return assemble(parts, t.eos_id)


class Passkey:
  name = 'passkey'
  has_depth = True

  def __init__(self, text: TaskText, digits: int):
    self.text, self.digits = text, digits
    self.filler = SentenceFiller(text, PASSKEY_FILLER)
    self.before = text.ids(' Remember it: the secret number is')
    self.after = text.ids('. Keep the secret number in mind.')
    self.question = text.ids(' What is the secret number? The secret number is')

  def document(self, rng: np.random.Generator, length: int,
               depth: float | None = None) -> TaskDocument:
    depth = float(rng.uniform()) if depth is None else depth
    key_t = self.text.encode_fresh(' ' + random_number(rng, self.digits))
    needle = [(self.before, None), (key_t, Hidden(0)), (self.after, None)]
    fixed = sum(len(ids) for ids, _ in needle) + len(self.question) + len(key_t)
    n = length - fixed
    if n < 0:
      raise _too_short('passkey', length, fixed, 'tasks.passkey_digits')
    filler_t, bounds = self.filler.take(n, rng)
    at = int(bounds[np.argmin(np.abs(bounds - depth * n))])  # the nearest sentence boundary
    parts = _insert(filler_t, [(at, needle)])
    parts += [(self.question, None), (key_t, Answer(0))]
    return assemble(parts, self.text.eos_id, depth)


class Needle:
  name = 'needle'
  has_depth = True

  def __init__(self, text: TaskText, filler: CorpusFiller, count: int, queries: int,
               value_digits: int):
    self.text, self.filler = text, filler
    self.count, self.queries, self.value_digits = count, queries, value_digits

  def document(self, rng: np.random.Generator, length: int,
               depth: float | None = None) -> TaskDocument:
    t = self.text
    depth = float(rng.uniform()) if depth is None else depth
    words = random_words(rng, self.count)
    values = [t.encode_fresh(' ' + random_number(rng, self.value_digits)) for _ in words]
    period = t.ids('.')
    needles = [[(np.concatenate([t.ids(' Note that the code for'), t.encode_fresh(' ' + w),
                                 t.ids(' is')]), None), (v, Hidden(i)), (period, None)]
               for i, (w, v) in enumerate(zip(words, values))]
    # Needle 0 is asked for, at `depth`; the others are asked too (needle_queries) or only
    # distract, anywhere.
    asked = [0] + list(1 + rng.permutation(self.count - 1)[:self.queries - 1])
    order = [int(i) for i in rng.permutation(asked)]
    questions = [np.concatenate([t.ids(' What is the code for'), t.encode_fresh(' ' + words[i]),
                                 t.ids('? The code for'), t.encode_fresh(' ' + words[i]),
                                 t.ids(' is')]) for i in order]
    fixed = sum(len(ids) for parts in needles for ids, _ in parts) + sum(
        map(len, questions)) + sum(
        len(values[i]) for i in order) + len(period) * (len(order) - 1)
    n = length - fixed
    if n < 0:
      raise _too_short('needle', length, fixed,
                       'tasks.needle_count, tasks.needle_queries, tasks.needle_value_digits')
    filler_t = self.filler.take(n, rng)
    cuts = [(int(round(depth * n)), needles[0])]
    cuts += [(int(rng.integers(0, n + 1)), ids) for ids in needles[1:]]
    parts = _insert(filler_t, cuts)
    for k, i in enumerate(order):
      if k:
        parts.append((period, None))
      parts += [(questions[k], None), (values[i], Answer(i))]
    return assemble(parts, t.eos_id, depth)
