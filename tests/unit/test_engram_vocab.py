"""The Engram tokenizer compression (docs/architecture.md 3.12) and the checks that tie the
model's vocabulary sizes to the data's tokenizer (data/engram_vocab.py)."""

import numpy as np
import pytest
import tokenizers

from deepseek41.config import ConfigError, resolve
from deepseek41.data.engram_vocab import (compress_vocab, compression_map, model_fits_data,
                                          normalize_token_string, vocab_strings)
from deepseek41.data.default_corpus import default_corpus_dir
from deepseek41.data.pipeline import tokenizer_path_of
from tests.helpers import small_config

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.mark.parametrize('raw, expected', [
    ('  Hello\tWorld ', 'hello world'),
    ('é', 'e'), ('e\u0301', 'e'), ('Ångström', 'angstrom'),
    (' ', ' '), ('\t', ' '), ('\n\n', ' '), ('  ', ' '),  # a lone (collapsed) space is kept
    (' the', 'the'), ('a \r\n b', 'a b'),
    ('ﬁ', 'fi'), ('\u00a0X', 'x'),  # NFKC before the rest
    ('\u0301', ''),  # marks only: empty (compress_vocab falls back to the raw decode)
    ('ΑΣ', 'ασ'),  # lowercase is per char: no final sigma
])
def test_normalize_token_string(raw, expected):
  assert normalize_token_string(raw) == expected


def test_compress_vocab_dedupes_in_first_appearance_order():
  decodes = ['<s>', 'Hello', ' hello', 'world', 'HELLO', ' ', '\t', '\ufffd', '\u0301', '\u0301',
             '\ufffd', 'é', 'e']
  raws = ['<s>', 'Hello', 'Ġhello', 'world', 'HELLO', 'Ġ', 'ĉ', 'Ãł', '\u0301', '\u0301',
          'world', 'Ã©', 'e']
  old_to_new, n = compress_vocab(decodes, raws)
  # U+FFFD tokens key by their raw string ('Ãł' new; 'world' joins the normalised 'world');
  # '\u0301' normalises to '' and keys by its decode.
  assert old_to_new.dtype == np.int64
  assert old_to_new.tolist() == [0, 1, 1, 2, 1, 3, 3, 4, 5, 5, 2, 6, 6]
  assert n == 7


def test_vocab_strings_from_hf_tokenizer():
  hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({'<s>': 0, 'Hello': 1, 'HELLO': 2, 'x': 3}))
  decodes, raws = vocab_strings(hf)
  assert decodes == raws == ['<s>', 'Hello', 'HELLO', 'x']
  assert compress_vocab(decodes, raws)[0].tolist() == [0, 1, 1, 2]


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  """A 5-file slice of the default corpus with a 300-token BPE vocabulary, as data.sources."""
  path = default_corpus_dir(str(tmp_path_factory.mktemp('cache')), 300, 5, progress=False)
  return {'data.synthetic': False, 'data.sources': path}


def test_the_vocabulary_must_cover_the_tokenizer(prepared):
  small = small_config(**prepared, **{'model.vocab_size': 299})
  cfg = resolve(small, num_devices=1, backend='cpu')  # resolve reads no tokenizer
  with pytest.raises(ConfigError, match=r'model\.vocab_size: 299 is smaller than the tokenizer '
                                        r'vocabulary of the data \(300\)'):
    model_fits_data(cfg.model, cfg.data)
  cfg = resolve(small_config(**prepared, **{'model.vocab_size': 300}), num_devices=1,
                backend='cpu')
  assert model_fits_data(cfg.model, cfg.data) is None  # fits; no Engram compression


def test_the_engram_compressed_vocabulary_must_match_the_tokenizer(prepared):
  engram = {**prepared, 'model.vocab_size': 300, 'model.engram': True}
  cfg = resolve(small_config(**engram), num_devices=1, backend='cpu')
  tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path_of(cfg.data))
  _, count = compress_vocab(*vocab_strings(tokenizer))
  assert 3 < count < 300  # case and whitespace variants of BPE tokens merge
  wrong = small_config(**engram, **{'model.engram_compressed_vocab_size': count + 1})
  wrong_cfg = resolve(wrong, num_devices=1, backend='cpu')
  with pytest.raises(ConfigError, match=rf'model\.engram_compressed_vocab_size: {count + 1}, '
                                        rf'but the tokenizer .* compresses to {count} ids'):
    model_fits_data(wrong_cfg.model, wrong_cfg.data)
  right = resolve(small_config(**engram, **{'model.engram_compressed_vocab_size': count}),
                  num_devices=1, backend='cpu')
  mapping = model_fits_data(right.model, right.data)
  assert mapping.dtype == np.int32 and mapping.shape == (300,) and mapping.max() == count - 1
  # generation builds the same map from the run's tokenizer
  np.testing.assert_array_equal(compression_map(right.model, tokenizer), mapping)
