"""Data package: tokenizer, shards, prepare CLI, default corpus and the packed Grain pipeline.

Pipeline tests write documents of globally unique, consecutive token ids, so every output token
says which document and offset it came from and the packing invariants can be checked as
properties rather than against recorded outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deepseek41.config import DataConfig
from deepseek41.data import default_corpus, pipeline
from deepseek41.data.pipeline import BATCH_KEYS, make_dataset, resolve_sources, vocab_size_of
from deepseek41.data.prepare import prepare_dataset
from deepseek41.data.shards import DataError, ShardWriter, TokenShardSource
from deepseek41.data.tokenizer import load_tokenizer, train_tokenizer
from tests.helpers import REPO_ROOT, take_batches as _take

REPO = REPO_ROOT
TEXTS = [
    'def add(a, b):\n    return a + b\n',
    'The quick brown fox jumps over the lazy dog. ' * 3,
    'import os\nprint(os.getcwd())\n',
    'héllo wörld — unicode ✓\n',
    'class A:\n    pass\n\n\nclass B(A):\n    x = 1\n',
    'a JSON string may hold a raw line separator\u2028 like this',
]


def _cfg(**overrides) -> DataConfig:
  base = dict(seq_len=16, sources=(), synthetic=False, cache_dir='', default_corpus_vocab_size=300,
              default_corpus_max_files=20, shuffle_seed=0, num_workers=0, prefetch=0,
              packing_bins=4, document_align=1, image_sources=(), max_images_per_row=4,
              image_heldout_fraction=0.02, shapes_image_size=48, streams=0, images=None)
  base.update(overrides)
  return DataConfig(**base)


def _read(path) -> str:
  with open(path) as f:
    return f.read()


def _all_docs(split_dir: str) -> list[np.ndarray]:
  src = TokenShardSource(split_dir)
  return [src[i] for i in range(len(src))]


# ---------------------------------------------------------------------------------------------
# Tokenizer.


def test_tokenizer_is_deterministic_with_fixed_special_ids(tmp_path):
  a = train_tokenizer(iter(TEXTS * 4), 300)
  b = train_tokenizer(iter(TEXTS * 4), 300)
  assert a.sha256() == b.sha256()
  assert (a.pad_id, a.eos_id) == (0, 1)
  ids = a.encode_batch(['x <eos> y', ''])
  assert all(i.dtype == np.int32 for i in ids)
  assert ids[1].tolist() == [a.eos_id]
  assert ids[0][-1] == a.eos_id and a.eos_id not in ids[0][:-1]  # literal "<eos>" is just text
  assert a.decode(ids[0]) == 'x <eos> y'
  path = str(tmp_path / 'tok.json')
  a.save(path)
  assert load_tokenizer(path).sha256() == a.sha256()


def test_load_tokenizer_errors_name_the_file(tmp_path):
  with pytest.raises(DataError, match='nope.json'):
    load_tokenizer(str(tmp_path / 'nope.json'))
  bad = tmp_path / 'bad.json'
  bad.write_text('{not json')
  with pytest.raises(DataError, match='bad.json'):
    load_tokenizer(str(bad))
  with pytest.raises(DataError, match='vocab_size must be >='):
    train_tokenizer(iter(TEXTS), 100)


# ---------------------------------------------------------------------------------------------
# Shards.


def test_shard_writer_rolls_shards_and_source_reads_back(tmp_path):
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 70000, size=n).astype(np.int32) for n in rng.integers(0, 40, 50)]
  w = ShardWriter(str(tmp_path / 's'), 70000, shard_tokens=100)
  for d in docs:
    w.add(d)
  meta = w.close()
  assert meta['dtype'] == 'int32' and len(meta['shards']) > 3
  assert meta['num_tokens'] == sum(len(d) for d in docs)
  src = TokenShardSource(str(tmp_path / 's'))
  assert len(src) == len(docs)
  for i in (0, 17, len(docs) - 1):
    np.testing.assert_array_equal(src[i], docs[i])
    assert src[i].dtype == np.int32
  assert ShardWriter(str(tmp_path / 'u'), 300).dtype == np.uint16
  with pytest.raises(DataError, match=r'token ids must be in \[0, 300\)'):
    ShardWriter(str(tmp_path / 'v'), 300).add(np.array([5, 300]))


def test_shard_errors_name_the_file(tmp_path):
  split = tmp_path / 'train'
  w = ShardWriter(str(split), 300, shard_tokens=4)
  for n in (3, 5, 2):
    w.add(np.arange(n))
  w.close()
  (split / 'tokens-00001.npy').unlink()
  with pytest.raises(DataError, match='tokens-00001.npy'):
    TokenShardSource(str(split))
  (split / 'offsets-00000.npy').write_bytes(b'garbage')
  with pytest.raises(DataError, match='offsets-00000.npy'):
    TokenShardSource(str(split))
  (split / 'meta.json').write_text('{"format_version": 1,')
  with pytest.raises(DataError, match='meta.json'):
    TokenShardSource(str(split))
  with pytest.raises(DataError, match='does not exist'):
    TokenShardSource(str(tmp_path / 'missing'))


# ---------------------------------------------------------------------------------------------
# Prepare.


def _write_corpus(root) -> tuple[list[str], str, str]:
  """A directory of text files (plus files a walk must skip) and a JSONL file."""
  d = root / 'corpus'
  (d / 'sub').mkdir(parents=True)
  (d / '.git').mkdir()
  (d / '.git' / 'HEAD').write_text('hidden, skipped')
  (d / 'image.bin').write_bytes(b'\x89PNG\0\0\0binary')
  for i, text in enumerate(TEXTS[:3]):
    (d / ('sub' if i else '') / f'f{i}.txt').write_text(text)
  (d / 'latin1.txt').write_bytes(b'caf\xe9 bytes\n')  # not UTF-8: decoded with U+FFFD
  jsonl = root / 'docs.jsonl'
  jsonl.write_text('\n'.join(json.dumps({'text': t, 'id': i}, ensure_ascii=False) for i, t in enumerate(TEXTS)) + '\n\n')
  expected = TEXTS[:3] + ['caf\ufffd bytes\n'] + TEXTS
  return expected, str(d), str(jsonl)


def _decoded(out: str) -> dict[str, list[str]]:
  tok = load_tokenizer(os.path.join(out, 'tokenizer.json'))
  result = {}
  for split in ('train', 'heldout'):
    docs = _all_docs(os.path.join(out, split))
    assert all(d[-1] == tok.eos_id for d in docs)
    result[split] = [tok.decode(d) for d in docs]
  return result


def test_prepare_directory_and_jsonl(tmp_path):
  expected, corpus, jsonl = _write_corpus(tmp_path)
  out = prepare_dataset([corpus, jsonl], str(tmp_path / 'out'), vocab_size=300,
                        heldout_fraction=0.3, progress=False)
  docs = _decoded(out)
  assert sorted(docs['train'] + docs['heldout']) == sorted(expected)
  assert docs['train'] and docs['heldout']
  record = json.loads(_read(os.path.join(out, 'prepare.json')))
  assert record['skipped_binary_files'] == [os.path.join(corpus, 'image.bin')]
  assert record['inputs'] == [corpus, jsonl]
  # Same inputs -> same tokenizer and the same held-out documents.
  again = prepare_dataset([corpus, jsonl], str(tmp_path / 'again'), vocab_size=300,
                          heldout_fraction=0.3, progress=False)
  assert _read(os.path.join(out, 'tokenizer.json')) == _read(os.path.join(again, 'tokenizer.json'))
  assert _decoded(again) == docs
  with pytest.raises(DataError, match='already exists'):
    prepare_dataset([corpus], out, vocab_size=300, progress=False)


def test_prepare_with_given_tokenizer_and_small_heldout(tmp_path):
  _, corpus, jsonl = _write_corpus(tmp_path)
  first = prepare_dataset([jsonl], str(tmp_path / 'a'), vocab_size=300, progress=False)
  tok_path = os.path.join(first, 'tokenizer.json')
  out = prepare_dataset([os.path.join(corpus, 'f0.txt')], str(tmp_path / 'b'),
                        tokenizer_path=tok_path, heldout_fraction=0.0, progress=False)
  (doc,) = _all_docs(os.path.join(out, 'train'))
  np.testing.assert_array_equal(doc, load_tokenizer(tok_path).encode(TEXTS[0]))
  assert TokenShardSource(os.path.join(out, 'heldout')).meta['num_docs'] == 0
  # A tiny corpus with a small fraction still gets one held-out document.
  assert TokenShardSource(os.path.join(first, 'heldout')).meta['num_docs'] == 1
  with pytest.raises(DataError, match='exactly one of'):
    prepare_dataset([jsonl], str(tmp_path / 'c'), tok_path, 300, progress=False)


def test_prepare_errors_name_the_input(tmp_path):
  missing = str(tmp_path / 'no_such_dir')
  with pytest.raises(DataError, match=f'input path {missing} does not exist'):
    prepare_dataset([missing], str(tmp_path / 'o1'), vocab_size=300, progress=False)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "fine"}\n{"text": oops}\n')
  with pytest.raises(DataError, match=f'{bad}:2: not valid JSON'):
    prepare_dataset([str(bad)], str(tmp_path / 'o2'), vocab_size=300, progress=False)
  bad.write_text('{"text": "fine"}\n\n{"body": "x"}\n')
  with pytest.raises(DataError, match=f"{bad}:3: no field 'text'"):
    prepare_dataset([str(bad)], str(tmp_path / 'o3'), vocab_size=300, progress=False)
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'a.txt').write_text('')
  with pytest.raises(DataError, match='no non-empty documents'):
    prepare_dataset([str(empty)], str(tmp_path / 'o4'), vocab_size=300, progress=False)
  assert not any(p.name.startswith('o') for p in tmp_path.iterdir())  # nothing half-written


def test_prepare_cli(tmp_path):
  _, corpus, jsonl = _write_corpus(tmp_path)
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  cmd = [sys.executable, '-m', 'deepseek41.data.prepare', '--input', corpus, '--input', jsonl,
         '--output', str(tmp_path / 'out'), '--vocab_size', '300', '--no_progress']
  ok = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
  assert ok.returncode == 0, ok.stderr
  assert 'wrote' in ok.stdout and 'RuntimeWarning' not in ok.stderr
  assert (f'WARNING: skipped 1 binary files (prepare.json lists them): {corpus}/image.bin'
          in ok.stderr)
  assert f'WARNING: {corpus}/latin1.txt is not valid UTF-8: replaced 1 byte by' in ok.stderr
  assert json.loads(_read(tmp_path / 'out' / 'prepare.json'))['argv'] == cmd[3:]
  cmd[cmd.index(corpus)] = str(tmp_path / 'missing')
  cmd[cmd.index(str(tmp_path / 'out'))] = str(tmp_path / 'out2')
  bad = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
  assert bad.returncode == 2 and str(tmp_path / 'missing') in bad.stderr


# ---------------------------------------------------------------------------------------------
# Default corpus.


def test_default_corpus_splits_by_file(tmp_path):
  out = default_corpus.default_corpus_dir(str(tmp_path), 300, 20, progress=False)
  assert default_corpus.default_corpus_dir(str(tmp_path), 300, 20) == out  # reused, not redone
  files = default_corpus.stdlib_files(20)
  assert len(files) == 20 and [f.key for f in files] == sorted(f.key for f in files)
  assert not any(part in ('test', 'tests', 'idlelib', 'site-packages')
                 for f in files for part in f.key.split('/'))
  texts = {f.key: Path(f.path).read_bytes().decode('utf-8', 'replace') for f in files}
  docs = _decoded(out)
  by_text = {t: k for k, t in texts.items() if t}
  train = {by_text[d] for d in docs['train']}
  heldout = {by_text[d] for d in docs['heldout']}
  assert heldout and train and not train & heldout  # every document is a whole file
  assert train | heldout == set(by_text.values())
  cfg = _cfg(cache_dir=str(tmp_path))
  assert resolve_sources(cfg) == [(out, 1.0)]
  assert vocab_size_of(cfg) <= 300


# ---------------------------------------------------------------------------------------------
# Pipeline.


def _write_unique_dataset(root, lengths, start=2, vocab_size=None, heldout_lengths=(3, 5)):
  """Dataset whose documents are runs of consecutive ids, unique across the dataset."""
  docs, next_id = [], start
  for n in lengths:
    docs.append(np.arange(next_id, next_id + n, dtype=np.int32))
    next_id += n
  vocab = vocab_size or next_id + 10
  w = ShardWriter(os.path.join(root, 'train'), vocab, shard_tokens=50)
  for d in docs:
    w.add(d)
  w.close()
  w = ShardWriter(os.path.join(root, 'heldout'), vocab)
  for n in heldout_lengths:
    w.add(np.arange(start, start + n))
  w.close()
  return docs


def _check_batch_format(batch, batch_size, seq_len):
  assert set(batch) == set(BATCH_KEYS)
  for k, v in batch.items():
    assert v.shape == (batch_size, seq_len) and v.dtype == np.int32, k
  seg = batch['segment_ids']
  np.testing.assert_array_equal(batch['loss_mask'], (seg != 0).astype(np.int32))
  assert (batch['modality'] == pipeline.TEXT).all()
  for k in ('tokens', 'targets', 'positions'):
    assert (batch[k][seg == 0] == 0).all(), k


def _pieces(batches):
  """Every packed piece as (row tokens, row targets, row positions), segment by segment."""
  for b in batches:
    for r in range(b['tokens'].shape[0]):
      seg = b['segment_ids'][r]
      real = seg[seg > 0]
      # Segments are contiguous runs numbered 1, 2, ... and padding only trails.
      assert (np.diff(real) >= 0).all() and (real[0] == 1 if real.size else True)
      assert (seg[real.size:] == 0).all()
      for s in np.unique(real):
        m = seg == s
        yield b['tokens'][r][m], b['targets'][r][m], b['positions'][r][m]


def _check_coverage(batches, docs, seq_len):
  """Each document's tokens (but the last) are inputs exactly once, in order, in aligned pieces."""
  doc_of = {}
  for i, d in enumerate(docs):
    for off, t in enumerate(d):
      doc_of[int(t)] = (i, off)
  seen = np.zeros(max(doc_of) + 1, np.int32)
  for tokens, targets, positions in _pieces(batches):
    np.testing.assert_array_equal(positions, np.arange(len(tokens)))  # reset per piece
    i, off = doc_of[int(tokens[0])]
    np.testing.assert_array_equal(tokens, docs[i][off:off + len(tokens)])  # one doc, in order
    np.testing.assert_array_equal(targets, docs[i][off + 1:off + len(tokens) + 1])  # next token
    assert off % seq_len == 0  # only long documents are cut, at multiples of seq_len
    is_last = off + len(tokens) == len(docs[i]) - 1
    assert len(tokens) == seq_len or is_last
    seen[tokens] += 1
  for d in docs:
    np.testing.assert_array_equal(seen[d[:-1]], 1)
    assert seen[d[-1]] == 0


@pytest.mark.parametrize('seq_len,bins', [(16, 4), (7, 1)])
def test_packing_invariants_on_a_finite_pass(tmp_path, seq_len, bins):
  rng = np.random.default_rng(seq_len)
  lengths = [1, 2, seq_len, seq_len + 1, seq_len + 2, 3 * seq_len + 5] + \
      rng.integers(1, 2 * seq_len, 40).tolist()
  docs = _write_unique_dataset(str(tmp_path), lengths)
  cfg = _cfg(seq_len=seq_len, sources=((str(tmp_path), 1.0),), packing_bins=bins)
  ds = make_dataset(cfg, split='train', batch_size=3, seed=0, repeat=False)
  batches = _take(ds)
  for b in batches:
    _check_batch_format(b, 3, seq_len)
  _check_coverage(batches, docs, seq_len)
  # The evaluation pass is deterministic.
  again = _take(make_dataset(cfg, split='train', batch_size=3, seed=5, repeat=False))
  assert all((a[k] == b[k]).all() for a, b in zip(batches, again) for k in BATCH_KEYS)
  assert len(again) == len(batches)


def test_processes_read_disjoint_slices(tmp_path):
  docs = _write_unique_dataset(str(tmp_path), [5, 9, 3, 20, 4, 7, 2, 11])
  cfg = _cfg(sources=((str(tmp_path), 1.0),), seq_len=8)
  per_process = [_take(make_dataset(cfg, split='train', batch_size=2, seed=0, repeat=False,
                                    process_index=p, process_count=2)) for p in (0, 1)]
  _check_coverage(per_process[0] + per_process[1], docs, 8)
  firsts = [{int(t[0]) for t, _, p in _pieces(b) if p[0] == 0} for b in per_process]
  assert firsts[0] and firsts[1] and not firsts[0] & firsts[1]


def test_training_stream_shuffles_and_repeats(tmp_path):
  docs = _write_unique_dataset(str(tmp_path), [4] * 30)
  cfg = _cfg(sources=((str(tmp_path), 1.0),), seq_len=8, prefetch=2)
  batches = _take(make_dataset(cfg, split='train', batch_size=4, seed=0), 20)
  starts = [int(t[0]) for t, _, _ in _pieces(batches)]
  epoch = [int(d[0]) for d in docs]
  assert len(starts) > 2 * len(docs)  # repeats past one epoch
  assert sorted(starts[:len(docs)]) != starts[:len(docs)]  # not in file order
  other = _take(make_dataset(cfg, split='train', batch_size=4, seed=1), 20)
  assert [int(t[0]) for t, _, _ in _pieces(other)] != starts  # the seed matters
  assert set(starts) == set(epoch)


def test_mixture_weights_are_respected(tmp_path):
  a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
  # Disjoint id ranges tell the sources apart; one shared vocab size makes them mixable.
  _write_unique_dataset(a, [5] * 50, start=2, vocab_size=2000)
  _write_unique_dataset(b, [5] * 50, start=1000, vocab_size=2000)
  cfg = _cfg(sources=((a, 0.8), (b, 0.2)), seq_len=16)
  batches = _take(make_dataset(cfg, split='train', batch_size=8, seed=0), 60)
  starts = np.array([int(t[0]) for t, _, _ in _pieces(batches)])
  assert len(starts) > 1000
  assert abs((starts < 1000).mean() - 0.8) < 0.05


def test_resolve_sources_errors(tmp_path):
  with pytest.raises(DataError, match=str(tmp_path / 'nope')):
    resolve_sources(_cfg(sources=((str(tmp_path / 'nope'), 1.0),)))
  (tmp_path / 'empty').mkdir()
  with pytest.raises(DataError, match='no train split'):
    resolve_sources(_cfg(sources=((str(tmp_path / 'empty'), 1.0),)))
  _write_unique_dataset(str(tmp_path / 'v1'), [3], vocab_size=300)
  _write_unique_dataset(str(tmp_path / 'v2'), [3], vocab_size=400)
  with pytest.raises(DataError, match='different tokenizer vocabularies'):
    resolve_sources(_cfg(sources=((str(tmp_path / 'v1'), 1.0), (str(tmp_path / 'v2'), 1.0))))
  _write_unique_dataset(str(tmp_path / 'noheld'), [3], heldout_lengths=())
  with pytest.raises(DataError, match='heldout has no documents'):
    make_dataset(_cfg(sources=((str(tmp_path / 'noheld'), 1.0),)), split='heldout',
                 batch_size=1, seed=0)
  _write_unique_dataset(str(tmp_path / 'short'), [1, 0, 1])
  with pytest.raises(DataError, match='no document with two or more tokens'):
    make_dataset(_cfg(sources=((str(tmp_path / 'short'), 1.0),)), split='train',
                 batch_size=1, seed=0)


@pytest.mark.parametrize('num_workers,prefetch', [(0, 0), (0, 2), (2, 2)])
def test_state_restore_gives_identical_batches(tmp_path, num_workers, prefetch):
  rng = np.random.default_rng(1)
  _write_unique_dataset(str(tmp_path), rng.integers(1, 40, 200).tolist())
  cfg = _cfg(sources=((str(tmp_path), 1.0),), num_workers=num_workers, prefetch=prefetch)
  ds = make_dataset(cfg, split='train', batch_size=4, seed=3)
  it = iter(ds)
  try:
    for _ in range(5):
      next(it)
    state = it.get_state()
    json.dumps(state)  # checkpoints store it as JSON
    expected = [next(it) for _ in range(4)]
  finally:
    it.close()
  it = iter(make_dataset(cfg, split='train', batch_size=4, seed=3))
  try:
    it.set_state(state)
    for want in expected:
      got = next(it)
      for k in BATCH_KEYS:
        np.testing.assert_array_equal(got[k], want[k])
  finally:
    it.close()
  del expected, got, want


def test_synthetic_source_shapes():
  cfg = _cfg(synthetic=True, seq_len=32)
  assert vocab_size_of(cfg, synthetic_vocab_size=100) == 100
  (batch,) = _take(make_dataset(cfg, split='train', batch_size=4, seed=0,
                                synthetic_vocab_size=100), 1)
  _check_batch_format(batch, 4, 32)
  assert batch['tokens'].max() < 100 and batch['loss_mask'].mean() > 0.5
  held = _take(make_dataset(cfg, split='heldout', batch_size=4, seed=0, repeat=False), 2)
  assert not (held[0]['tokens'] == batch['tokens']).all()


def test_unshuffled_repeating_heldout_is_deterministic_and_endless(tmp_path):
  # The multi-process evaluation recipe: every process gets a fixed number of batches.
  _write_unique_dataset(str(tmp_path), [4], heldout_lengths=(3, 9, 5, 12))
  cfg = _cfg(sources=((str(tmp_path), 1.0),), seq_len=8)
  one_pass = _take(make_dataset(cfg, split='heldout', batch_size=2, seed=0, repeat=False))
  runs = [_take(make_dataset(cfg, split='heldout', batch_size=2, seed=s, repeat=True,
                             shuffle=False), 3 * len(one_pass)) for s in (0, 1)]
  assert len(runs[0]) == 3 * len(one_pass)
  assert all((a[k] == b[k]).all() for a, b in zip(*runs) for k in BATCH_KEYS)


def test_document_alignment_pads_pieces_to_even_offsets(tmp_path):
  rng = np.random.default_rng(1)
  seq_len = 16
  docs = _write_unique_dataset(str(tmp_path), [2, 3, 5, 17, 18, 33] + rng.integers(1, 30, 30).tolist())
  cfg = _cfg(seq_len=seq_len, sources=((str(tmp_path), 1.0),), document_align=2)
  batches = _take(make_dataset(cfg, split='train', batch_size=3, seed=0, repeat=False))
  seen = {}
  for b in batches:
    for r in range(b['tokens'].shape[0]):
      seg, mask = b['segment_ids'][r], b['loss_mask'][r]
      for s in np.unique(seg[seg > 0]):
        where = np.nonzero(seg == s)[0]
        assert where[0] % 2 == 0 and len(where) % 2 == 0  # starts and lengths aligned
        real = where[mask[where] == 1]
        pad = where[mask[where] == 0]
        assert len(pad) <= 1 and (len(pad) == 0 or pad[0] == where[-1])  # one trailing pad
        assert (b['tokens'][r][pad] == 0).all() and (b['targets'][r][pad] == 0).all()
        for t, tgt in zip(b['tokens'][r][real], b['targets'][r][real]):
          seen[int(t)] = seen.get(int(t), 0) + 1
          assert int(tgt) in {int(x) for d in docs for x in d}
  for d in docs:  # every input token of every document exactly once, padding excluded
    assert all(seen.get(int(t), 0) == 1 for t in d[:-1])
  with pytest.raises(Exception, match='document_align'):
    from deepseek41.config import resolve
    from tests.helpers import small_config
    resolve(small_config(**{'data.seq_len': 47}), num_devices=1, backend='cpu')
