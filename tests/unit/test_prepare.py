"""`prepare` on awkward input: binary files, text that is not UTF-8, whitespace-free runs, and a
corpus too small for the vocabulary asked for. Each is handled and said, not passed over."""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from deepseek41.data.prepare import decode_text, prepare_dataset
from deepseek41.data.shards import DataError, TokenShardSource
from deepseek41.data.tokenizer import MAX_PIECE_BYTES, load_tokenizer, train_tokenizer

TEXT = ('def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog.\n'
        'import os\nprint(os.getcwd())\n') * 20


@pytest.fixture
def warnings_of_prepare(caplog):
  caplog.set_level(logging.WARNING, logger='deepseek41.data')
  return lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _decoded(out: str) -> list[str]:
  tok = load_tokenizer(os.path.join(out, 'tokenizer.json'))
  docs = []
  for split in ('train', 'heldout'):
    src = TokenShardSource(os.path.join(out, split))
    docs += [tok.decode(src[i]) for i in range(len(src))]
  return sorted(docs)


def _record(out: str) -> dict:
  with open(os.path.join(out, 'prepare.json')) as f:
    return json.load(f)


def _letters(n: int, seed: int = 0) -> str:
  """n random lowercase letters: one whitespace-free run, and no two chunks alike."""
  return np.random.default_rng(seed).integers(97, 123, n, dtype=np.uint8).tobytes().decode()


# ---------------------------------------------------------------------------------------------
# Binary files and text that is not UTF-8.


def test_binary_files_are_skipped_with_a_warning_naming_them(tmp_path, warnings_of_prepare):
  rng = np.random.default_rng(0)
  d = tmp_path / 'corpus'
  d.mkdir()
  (d / 'code.txt').write_text(TEXT)
  (d / 'latin1.txt').write_bytes(TEXT.replace('quick', 'qu\xefck').encode('latin-1'))  # text
  (d / 'nul.bin').write_bytes(b'\x89PNG\r\n\x1a\n\0\0\0\rIHDR')
  (d / 'noise.dat').write_bytes(rng.integers(128, 256, 4096, dtype=np.uint8).tobytes())  # no NUL
  named = tmp_path / 'archive.gz'  # named explicitly: skipped too
  named.write_bytes(b'\x1f\x8b\x08\0' + rng.bytes(512))
  out = prepare_dataset([str(d), str(named)], str(tmp_path / 'out'), vocab_size=300,
                        heldout_fraction=0.0, progress=False)

  (warning, latin1_warning) = warnings_of_prepare()
  assert warning.startswith('skipped 3 binary files')
  assert re.search(f'{d / "noise.dat"} \\([0-9]+ of its first 4096 bytes are not UTF-8\\), '
                   f'{d / "nul.bin"} \\(it contains NUL bytes\\), '
                   f'{named} \\(it contains NUL bytes\\); prepare reads UTF-8 text', warning)
  assert 'latin1.txt' in latin1_warning  # a few Latin-1 bytes: text with a warning, not binary
  assert _record(out)['skipped_binary_files'] == [str(d / 'noise.dat'), str(d / 'nul.bin'),
                                                  str(named)]
  assert _decoded(out) == sorted([TEXT, TEXT.replace('quick', 'qu\ufffdck')])

  with pytest.raises(DataError, match=f'every input file is binary.*{d / "nul.bin"}'):
    prepare_dataset([str(d / 'nul.bin'), str(named)], str(tmp_path / 'o2'), vocab_size=300,
                    progress=False)
  assert not (tmp_path / 'o2').exists()


def test_text_that_is_not_utf8_is_decoded_with_a_warning_and_count(tmp_path, warnings_of_prepare):
  assert decode_text(b'caf\xe9 \xff\xfe ok') == ('caf\ufffd \ufffd\ufffd ok', 3)
  assert decode_text('héllo ✓'.encode()) == ('héllo ✓', 0)
  plain = tmp_path / 'latin1.txt'
  plain.write_bytes(b'caf\xe9 au lait, cr\xe8me br\xfbl\xe9e\n' + TEXT.encode())
  jsonl = tmp_path / 'docs.jsonl'
  lines = [json.dumps({'text': TEXT}).encode(), b'{"text": "na\xefve"}', b'{"text": "fine"}',
           b'{"text": "\xe0 la \xe0"}']
  jsonl.write_bytes(b'\n'.join(lines) + b'\n')
  out = prepare_dataset([str(plain), str(jsonl)], str(tmp_path / 'out'), vocab_size=300,
                        heldout_fraction=0.0, progress=False)
  # One warning per file, although prepare reads every file twice (train, then encode).
  assert sorted(warnings_of_prepare()) == [
      f'{jsonl} is not valid UTF-8: replaced 3 bytes on 2 lines (first: line 2) by U+FFFD; if '
      'it is text in another encoding, convert it first (e.g. iconv -f latin1 -t utf-8)',
      f'{plain} is not valid UTF-8: replaced 4 bytes by U+FFFD; if it is text in another '
      'encoding, convert it first (e.g. iconv -f latin1 -t utf-8)']
  assert 'na\ufffdve' in _decoded(out)


# ---------------------------------------------------------------------------------------------
# Long runs without whitespace.


def test_whitespace_free_runs_are_cut_into_bounded_pieces(tmp_path):
  """The BPE trainer pays a piece's whole length per merge that touches it: pieces are bounded,
  the same way when training and when encoding (the cut is saved in tokenizer.json)."""
  long_run = _letters(200_000)
  tok = train_tokenizer(iter([TEXT, long_run]), 300)
  tok.save(str(tmp_path / 'tokenizer.json'))
  loaded = load_tokenizer(str(tmp_path / 'tokenizer.json'))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  for text in (long_run, 'é' * 100_000, '=' * 1000 + '\n' + ' ' * 600 + 'x'):
    for pre in (tok.hf.pre_tokenizer, loaded.hf.pre_tokenizer):
      pieces = [p for p, _ in pre.pre_tokenize_str(text)]
      assert max(map(len, pieces)) == MAX_PIECE_BYTES  # one character is one byte here
      assert ''.join(pieces) == ''.join(p for p, _ in byte_level.pre_tokenize_str(text))
  # Ordinary text is split exactly as the plain byte-level pre-tokenizer splits it.
  assert tok.hf.pre_tokenizer.pre_tokenize_str(TEXT) == byte_level.pre_tokenize_str(TEXT)
  assert max(len(t) for t in tok.hf.get_vocab()) <= MAX_PIECE_BYTES


def test_prepare_a_long_line_without_whitespace(tmp_path):
  """200 KB on one line (the fault-injection run used 5 MB: ~25 minutes before the cut)."""
  d = tmp_path / 'corpus'
  d.mkdir()
  long_line = _letters(200_000, seed=1) + '+/=' + '0123456789' * 1000 + '\n'
  (d / 'blob.txt').write_text(long_line)
  (d / 'code.txt').write_text(TEXT)
  out = prepare_dataset([str(d)], str(tmp_path / 'out'), vocab_size=1024, heldout_fraction=0.0,
                        progress=False)
  assert _decoded(out) == sorted([long_line, TEXT])
  tok = load_tokenizer(os.path.join(out, 'tokenizer.json'))
  assert tok.vocab_size == 1024


# ---------------------------------------------------------------------------------------------
# Vocabulary size.


def test_a_smaller_vocabulary_than_asked_is_said_and_recorded(tmp_path, warnings_of_prepare):
  (tmp_path / 'tiny.txt').write_text('abc abc abd abd\n' * 3)
  out = prepare_dataset([str(tmp_path / 'tiny.txt')], str(tmp_path / 'out'), vocab_size=5000,
                        heldout_fraction=0.0, progress=False)
  real = load_tokenizer(os.path.join(out, 'tokenizer.json')).vocab_size
  assert 258 < real < 5000
  (warning,) = warnings_of_prepare()
  assert warning.startswith(f'asked for a vocabulary of 5000 tokens but got only {real}: the '
                            'training corpus (1 documents, 48 characters) is too small')
  record = _record(out)
  assert (record['requested_vocab_size'], record['vocab_size']) == (5000, real)
  assert TokenShardSource(os.path.join(out, 'train')).meta['vocab_size'] == real
  # Asking for what the corpus supports is silent.
  prepare_dataset([str(tmp_path / 'tiny.txt')], str(tmp_path / 'again'), vocab_size=real,
                  heldout_fraction=0.0, progress=False)
  assert len(warnings_of_prepare()) == 1
