"""The Engram tokenizer compression (docs/architecture.md 3.12): token ids -> the ids Engram
hashes, built from the tokenizer's vocabulary, and the checks that tie model.vocab_size and
model.engram_compressed_vocab_size to the data's tokenizer.

One place builds the map: the trainer (from the data's tokenizer, `model_fits_data`) and
generation (from the run's tokenizer.json, `compression_map`) both call it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import tokenizers
from tokenizers import Regex, normalizers

from deepseek41.config import ConfigError, DataConfig, ModelConfig, engram_compresses
from deepseek41.data.pipeline import tokenizer_path_of, vocab_size_of


@functools.cache
def _normalizer():
  """The normaliser as HF `tokenizers` components: the references run exactly these, and their
  Unicode tables (NFKC, marks, lowercase) differ from Python's `unicodedata` for ~550 code
  points, any of which would shift the compressed ids."""
  lone_space = '\ue000'  # private-use stand-in so a token that is one space survives Strip()
  return normalizers.Sequence([
      normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
      normalizers.Replace(Regex(r'[ \t\r\n]+'), ' '),  # only these collapse; other spaces strip
      normalizers.Replace(Regex(r'^ $'), lone_space),  # no \n is left, so ^ $ = the whole string
      normalizers.Strip(),  # Rust White_Space on both ends
      normalizers.Replace(lone_space, ' '),
  ])


def normalize_token_string(s: str) -> str:
  """NFKC, NFD, drop marks, lowercase, collapse [ \\t\\r\\n]+ to ' ', keep a lone ' ', strip.

  May return '' (e.g. a token of only marks or of other whitespace); `compress_vocab` then keys the
  token by its raw decode, as the references do.
  """
  return _normalizer().normalize_str(s)


def compress_vocab(token_strings: Sequence[str],
                   raw_tokens: Sequence[str] | None = None) -> tuple[np.ndarray, int]:
  """old id -> compressed id (int64 [V]) and the compressed vocab size.

  `token_strings[i]` is the decode of token i alone (special tokens kept); `raw_tokens[i]` its
  vocabulary string (`id_to_token`). New ids number the distinct keys in order of first appearance
  over old ids 0..V-1. Key: the raw vocabulary string if the decode holds U+FFFD (a partial UTF-8
  byte token), else the normalised decode, or the decode itself when that normalises to ''.
  """
  if raw_tokens is not None and len(raw_tokens) != len(token_strings):
    raise ValueError(f'raw_tokens has {len(raw_tokens)} entries, '
                     f'token_strings has {len(token_strings)}; pass one per token id')
  key_to_new: dict[str, int] = {}
  old_to_new = np.empty(len(token_strings), np.int64)
  for i, text in enumerate(token_strings):
    if '\ufffd' in text:
      key = text if raw_tokens is None else raw_tokens[i]  # [I] decode when no raw string is given
    else:
      key = normalize_token_string(text) or text
    old_to_new[i] = key_to_new.setdefault(key, len(key_to_new))
  return old_to_new, len(key_to_new)


def vocab_strings(hf_tokenizer) -> tuple[list[str], list[str]]:
  """(decodes, raw strings) of every id of an HF `tokenizers.Tokenizer`, for `compress_vocab`."""
  n = hf_tokenizer.get_vocab_size(with_added_tokens=True)
  decodes = [hf_tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
  return decodes, [hf_tokenizer.id_to_token(i) for i in range(n)]



def compression_map(m: ModelConfig, hf_tokenizer: tokenizers.Tokenizer,
                    source: str = 'the tokenizer') -> np.ndarray | None:
  """old id -> compressed id (int32 [V]) when the model hashes compressed ids
  (model.engram_compressed_vocab_size > 0), checked against that size; None to hash raw ids.
  `source` names the tokenizer in the error."""
  if not engram_compresses(m):
    return None
  mapping, count = compress_vocab(*vocab_strings(hf_tokenizer))
  if count != m.engram_compressed_vocab_size:
    raise ConfigError(f'model.engram_compressed_vocab_size: {m.engram_compressed_vocab_size}, '
                      f'but {source} compresses to {count} ids')
  return mapping.astype(np.int32)


def model_fits_data(m: ModelConfig, d: DataConfig) -> np.ndarray | None:
  """Check the model against the data's tokenizer (the default corpus is prepared here on first
  use) and return its Engram compression map (`compression_map`; None on synthetic data, whose
  tokens are drawn below model.vocab_size)."""
  if d.synthetic:
    return None
  vocab = vocab_size_of(d)
  if vocab > m.vocab_size:
    raise ConfigError(f'model.vocab_size: {m.vocab_size} is smaller than the tokenizer '
                      f'vocabulary of the data ({vocab})')
  if not engram_compresses(m):
    return None
  path = tokenizer_path_of(d)
  return compression_map(m, tokenizers.Tokenizer.from_file(path), f'the tokenizer {path}')
