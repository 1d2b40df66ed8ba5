"""Byte-level BPE tokenizer (HF `tokenizers`): train, save, load, and encode documents.

Our own tokenizers reserve `<pad>` = 0 and `<eos>` = 1, then the 256 byte symbols, then merges,
so any vocabulary size >= 259 works and no text is ever out of vocabulary. Every encoded
document ends with `<eos>`, which is how the model learns where documents stop. Pre-tokenized
pieces are at most MAX_PIECE_BYTES long (see `_pre_tokenizer`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Sequence

import numpy as np
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from deepseek41.data.shards import DataError

PAD, EOS = '<pad>', '<eos>'
SPECIAL_TOKENS = (PAD, EOS)  # their order fixes pad = 0, eos = 1
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1
# Names foreign tokenizer.json files use for the end-of-document and padding tokens.
EOS_NAMES = (EOS, '</s>', '<|endoftext|>', '<|end_of_text|>', '<｜end▁of▁sentence｜>', '[SEP]')
PAD_NAMES = (PAD, '<|pad|>', '[PAD]', '<|padding|>')
MAX_PIECE_BYTES = 256  # longest pre-tokenized piece, hence longest token (_pre_tokenizer)
MIN_FREQUENCY = 2  # a merge needs a byte pair that occurs at least this often

log = logging.getLogger(__name__)


class Tokenizer:
  """Wraps an HF tokenizer with the two ids the data pipeline needs."""

  def __init__(self, hf: tokenizers.Tokenizer, *, source: str = '<memory>'):
    self.hf = hf
    self.source = source
    # Special-token strings inside a document (e.g. "<eos>" in a source file) are plain text;
    # only the eos we append marks a document end.
    self.hf.encode_special_tokens = True
    eos = _first_token_id(hf, EOS_NAMES)
    if eos is None:
      raise DataError(f'tokenizer {source} has none of the end-of-document tokens {EOS_NAMES}; '
                      'add one of them as a special token or train one with --vocab_size')
    pad = _first_token_id(hf, PAD_NAMES)
    self.eos_id = eos
    self.pad_id = eos if pad is None else pad  # padding is masked out anyway; eos is a safe id

  @property
  def vocab_size(self) -> int:
    return self.hf.get_vocab_size(with_added_tokens=True)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text followed by eos (int32). The HF call runs on all cores."""
    encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
    out = []
    for enc in encodings:
      ids_t = np.empty(len(enc.ids) + 1, np.int32)
      ids_t[:-1] = enc.ids
      ids_t[-1] = self.eos_id
      out.append(ids_t)
    return out

  def encode(self, text: str) -> np.ndarray:
    return self.encode_batch([text])[0]

  def decode(self, ids: Iterable[int]) -> str:
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

  def save(self, path: str) -> None:
    self.hf.save(path)

  def to_str(self) -> str:
    return self.hf.to_str()

  def sha256(self) -> str:
    """Identity of the vocabulary, so datasets made with different tokenizers are not mixed."""
    return hashlib.sha256(self.to_str().encode()).hexdigest()


def _first_token_id(hf: tokenizers.Tokenizer, names: Sequence[str]) -> int | None:
  for name in names:
    i = hf.token_to_id(name)
    if i is not None:
      return i
  return None


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  """GPT-2 byte-level splitting, then every piece cut into chunks of <= MAX_PIECE_BYTES.

  Why the cut: the BPE trainer re-scans a whole piece for every merge that touches it, so one
  whitespace-free run (a minified file, a base64 blob, a 5 MB line) costs O(its length) per merge
  and prepare ran ~60x slower per byte than on normal text. Chunks bound that cost; they change
  nothing for ordinary words, and tokens longer than MAX_PIECE_BYTES are useless anyway. The cut
  lives in the tokenizer itself (saved in tokenizer.json), so training and every later encode
  split text the same way. It runs after ByteLevel, where one character is one byte.
  """
  return pre_tokenizers.Sequence([
      # No prefix space: source code and text keep their exact leading whitespace.
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
      pre_tokenizers.Split(Regex(f'.{{1,{MAX_PIECE_BYTES}}}'), behavior='isolated'),
  ])


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """Trains a byte-level BPE; the same texts in the same order give the same tokenizer.

  A corpus with fewer mergeable pairs than `vocab_size` asks for yields a smaller vocabulary:
  that is logged as a warning, and `Tokenizer.vocab_size` is the real size.
  """
  if vocab_size < MIN_VOCAB_SIZE:
    raise DataError(f'vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} '
                    f'special tokens + 1 merge), got {vocab_size}')
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = _pre_tokenizer()
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  seen = {'texts': 0, 'chars': 0}

  def counted(texts):
    for text in texts:
      seen['texts'] += 1
      seen['chars'] += len(text)
      yield text

  hf.train_from_iterator(counted(texts), trainer=trainer)
  tok = Tokenizer(hf, source=f'<trained, vocab_size={vocab_size}>')
  if tok.vocab_size < vocab_size:
    log.warning(
        'asked for a vocabulary of %d tokens but got only %d: the training corpus (%d documents, '
        '%d characters) is too small or too repetitive, BPE found only %d merges (pairs of '
        'tokens seen at least %d times). Using the %d-token vocabulary, the real size that '
        'prepare.json and meta.json record; give more text or a smaller --vocab_size.',
        vocab_size, tok.vocab_size, seen['texts'], seen['chars'],
        tok.vocab_size - MIN_VOCAB_SIZE + 1, MIN_FREQUENCY, tok.vocab_size)
  return tok


def load_tokenizer(path: str) -> Tokenizer:
  """Loads any HF tokenizer.json that has an end-of-document token."""
  if not os.path.isfile(path):
    raise DataError(f'tokenizer file {path} does not exist; pass a tokenizer.json written by HF '
                    'tokenizers, or omit --tokenizer to train one')
  try:
    hf = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises a bare Exception for malformed files
    raise DataError(f'tokenizer file {path} is not a valid HF tokenizer.json: {e}') from e
  return Tokenizer(hf, source=path)
