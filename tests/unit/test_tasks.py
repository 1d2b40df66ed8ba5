"""Long-context task sources (data/tasks/): deterministic documents whose answers are right (read
back from the text), a loss mask on exactly the answers, mixing by weight, a held-out split."""

import os
import pickle
import re

import numpy as np
import pytest

from deepseek41.batch import batch_keys
from deepseek41.config import ConfigError, ImageGeometry, load_config_file, resolve
from deepseek41.data.pipeline import (TaskSource, document_answer_rows, document_batch,
                                      make_dataset, open_task)
from deepseek41.data.shards import DataError
from deepseek41.data.tasks import held_out_documents
from deepseek41.data.tokenizer import load_tokenizer, train_tokenizer
from tests.helpers import REPO_ROOT, WORDS, prepare_sentences, small_config, take_batches

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

SEQ = 96
@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """A prepared dataset of plain sentences (train and held-out splits)."""
  return prepare_sentences(str(tmp_path_factory.mktemp('corpus')), 300)


def _cfg(corpus, sources, **overrides):
  return resolve(small_config(**{'data.synthetic': False, 'data.sources': sources,
                                 'data.seq_len': SEQ, 'data.document_align': 2,
                                 'model.vocab_size': 320, **overrides}),
                 num_devices=1, backend='cpu')


def _tokenizer(corpus):
  return load_tokenizer(f'{corpus}/tokenizer.json')


def _text_before(tok, doc, start):
  return tok.decode(doc.tokens[:start])


def _check_answers(tok, name, doc, length):
  """The document has length + 1 tokens, ends (only) with eos, and each answer is what its text
  says it should be."""
  assert len(doc.tokens) == length + 1 and doc.tokens[-1] == tok.eos_id
  assert (doc.tokens[:-1] != tok.eos_id).all() and doc.answers
  answers = [tok.decode(a).strip() for a in doc.answer_tokens()]
  if name == 'mqar':
    text = tok.decode(doc.tokens)
    for (start, _), value in zip(doc.answers, answers):
      key = re.search(r' ([a-z]+):$', _text_before(tok, doc, start)).group(1)
      told = re.search(rf' {key}:(\d{{3}})', text).group(1)  # its first mention: the pairs
      assert value == told
    assert len(doc.answers) == 2
  elif name == 'passkey':
    told = re.search(r'the secret number is (\d+)\.', tok.decode(doc.tokens)).group(1)
    assert answers == [told] and _text_before(tok, doc, doc.answers[0][0]).endswith(
        'What is the secret number? The secret number is')
  else:
    told = dict(re.findall(r'Note that the code for (\w+) is (\d+)\.', tok.decode(doc.tokens)))
    assert len(told) == 3  # the asked needles and the distractor
    for (start, _), value in zip(doc.answers, answers):
      key = re.search(r'What is the code for (\w+)\? The code for \1 is$',
                      _text_before(tok, doc, start)).group(1)
      assert told[key] == value


@pytest.mark.parametrize('name', ['mqar', 'passkey', 'needle'])
def test_documents_are_deterministic_and_their_answers_right(corpus, name):
  cfg = _cfg(corpus, 'default', **{'tasks.mqar_pairs': 5, 'tasks.mqar_queries': 2,
                                   'tasks.needle_count': 3, 'tasks.needle_queries': 2,
                                   'tasks.needle_filler': corpus})
  tok = _tokenizer(corpus)
  task = open_task(cfg.data, name, 'heldout', tok)
  docs = [task.document(np.random.default_rng([3, i]), 400) for i in range(6)]
  again = [task.document(np.random.default_rng([3, i]), 400) for i in range(6)]
  for a, b in zip(docs, again):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.answers == b.answers
  assert len({d.tokens.tobytes() for d in docs}) == 6
  for doc in docs:
    _check_answers(tok, name, doc, 400)
  # Grain's worker processes get the source pickled: the same documents there
  source = TaskSource(task, 10, 400, seed=3)
  there = pickle.loads(pickle.dumps(source))
  for i in (0, 7):
    assert all((source[i][k] == there[i][k]).all() for k in source[i])


@pytest.mark.parametrize('name', ['mqar', 'passkey', 'needle'])
def test_each_answer_records_where_its_item_is_hidden(corpus, name):
  """The sources, read back from the text: the pair's value (the key's first mention), the
  passkey, the asked needle's number; each holds its answer's ids, before the answer. The
  answer rows point the query before each answer token at the same token in the source."""
  cfg = _cfg(corpus, 'default', **{'tasks.mqar_pairs': 5, 'tasks.mqar_queries': 2,
                                   'tasks.needle_count': 3, 'tasks.needle_queries': 2,
                                   'tasks.needle_filler': corpus})
  tok = _tokenizer(corpus)
  task = open_task(cfg.data, name, 'heldout', tok)
  for depth in (0.0, 0.5, 1.0):
    for doc in held_out_documents(task, 400, depth, 3):
      assert len(doc.sources) == len(doc.answers) == (1 if name == 'passkey' else 2)
      for (start, end), (s, e) in zip(doc.answers, doc.sources):
        assert e - s == end - start and e <= start
        np.testing.assert_array_equal(doc.tokens[s:e], doc.tokens[start:end])
        asked, hidden = _text_before(tok, doc, start), _text_before(tok, doc, s)
        if name == 'mqar':
          key = re.search(r' ([a-z]+):$', asked).group(1)
          assert hidden.endswith(f' {key}:') and f' {key}:' not in hidden[:-len(key) - 2]
        elif name == 'passkey':
          assert hidden.endswith('Remember it: the secret number is')
        else:
          word = re.search(r'What is the code for (\w+)\? The code for \1 is$', asked).group(1)
          assert hidden.endswith(f'Note that the code for {word} is')
      rows_t = doc.answer_rows()
      np.testing.assert_array_equal(rows_t >= 0, doc.answer_mask().astype(bool))
      at = np.flatnonzero(rows_t >= 0)
      np.testing.assert_array_equal(doc.tokens[rows_t[at]], doc.tokens[at + 1])
      assert (rows_t[at] < at).all()


@pytest.mark.parametrize('name', ['passkey', 'needle'])
def test_depth_places_the_hidden_item(corpus, name):
  cfg = _cfg(corpus, 'default', **{'tasks.needle_filler': corpus})
  tok = _tokenizer(corpus)
  task = open_task(cfg.data, name, 'heldout', tok)
  marker = 'Remember it' if name == 'passkey' else 'Note that'
  where = []
  for depth in (0.0, 0.5, 1.0):
    doc, = held_out_documents(task, 400, depth, 1)
    assert doc.depth == depth
    text = tok.decode(doc.tokens)
    where.append(text.index(marker) / text.index('What is'))
  assert where[0] < 0.05 and 0.3 < where[1] < 0.7 and where[2] > 0.8


def test_the_loss_mask_covers_exactly_the_answers(corpus):
  cfg = _cfg(corpus, f'passkey,{corpus}', **{'data.seq_len': 160, 'tasks.length': 150})
  tok = _tokenizer(corpus)
  rows = 0
  for batch in take_batches(make_dataset(cfg.data, split='train', batch_size=8, seed=0), 2):
    for r in range(8):
      mask = batch['loss_mask'][r].astype(bool)
      if mask.sum() > 20:
        continue  # text
      rows += 1
      # one 150-position document in the row (with no room for another), then padding
      assert (batch['segment_ids'][r] == np.r_[np.ones(150), np.zeros(10)]).all()
      answer = tok.decode(batch['targets'][r][mask]).strip()
      told = re.search(r'the secret number is (\d+)\.', tok.decode(batch['tokens'][r])).group(1)
      assert answer == told and len(answer) == cfg.tasks.passkey_digits
      at = np.flatnonzero(mask)
      assert (np.diff(at) == 1).all() and at[-1] == 148  # one run, the last target before eos
  assert rows >= 4
  everything = _cfg(corpus, f'passkey,{corpus}', **{'data.seq_len': 160,
                                                    'tasks.supervise': 'all'})
  batch, = take_batches(make_dataset(everything.data, split='train', batch_size=8, seed=0), 1)
  whole = (batch['segment_ids'] == 1).all(axis=1)  # the task documents (the text is shorter)
  assert whole.any() and (batch['loss_mask'][whole] == 1).all()


def test_tasks_mix_with_text_by_weight_and_keep_a_held_out_split(corpus):
  cfg = _cfg(corpus, f'mqar:0.25,{corpus}:0.75', **{'tasks.mqar_pairs': 4,
                                                    'tasks.mqar_queries': 2})
  batches = take_batches(make_dataset(cfg.data, split='train', batch_size=8, seed=0), 40)
  task_pieces = text_pieces = 0
  for b in batches:
    for r in range(8):
      for s in range(1, b['segment_ids'][r].max() + 1):
        seg = b['segment_ids'][r] == s
        # a task piece fills its row and supervises 2 short answers; text supervises it all
        if b['loss_mask'][r][seg].sum() < seg.sum() // 2:
          task_pieces += 1
          assert seg.sum() == SEQ
        else:
          text_pieces += 1
  assert abs(task_pieces / (task_pieces + text_pieces) - 0.25) < 0.05

  def task_rows(split):
    out = []
    for b in take_batches(make_dataset(cfg.data, split=split, batch_size=8, seed=0), 10):
      out += [b['tokens'][r].tobytes() for r in range(8) if b['loss_mask'][r].sum() < SEQ // 2]
    return out
  train, heldout = task_rows('train'), task_rows('heldout')
  assert train and heldout and not set(train) & set(heldout)
  assert task_rows('train') == train  # and each is deterministic


def test_the_needle_filler_comes_from_the_split(corpus):
  cfg = _cfg(corpus, f'needle,{corpus}')
  tok = _tokenizer(corpus)
  texts = {}
  for split in ('train', 'heldout'):
    task = open_task(cfg.data, 'needle', split, tok)
    texts[split] = {tok.decode(task.filler.take(200, np.random.default_rng(k))) for k in range(8)}
    for text in texts[split]:  # the corpus's words, only the last one cut short
      assert all(w in WORDS for w in re.findall('[a-z]+', text)[:-1])
  assert not texts['train'] & texts['heldout']


def test_filler_of_another_tokenizer_is_re_encoded(corpus, tmp_path):
  cfg = _cfg(corpus, f'needle,{corpus}', **{'tasks.needle_filler': corpus})
  other = train_tokenizer(['completely different text, 0123456789 digits'] * 30, 290)
  task = open_task(cfg.data, 'needle', 'heldout', other)
  doc, = held_out_documents(task, 200, 0.5, 1)
  words = re.findall(r'[a-z]+', other.decode(doc.tokens))
  assert sum(w in WORDS for w in words) > 10  # the corpus text, read through `other`


def test_eval_batches_hold_one_document_per_row(corpus):
  cfg = _cfg(corpus, 'default')
  tok = _tokenizer(corpus)
  docs = held_out_documents(open_task(cfg.data, 'passkey', 'heldout', tok), 160, 0.5, 3)
  assert [d.tokens.tobytes() for d in docs] == [
      d.tokens.tobytes() for d in held_out_documents(open_task(cfg.data, 'passkey', 'heldout',
                                                               tok), 160, 0.5, 3)]
  batch = document_batch(docs, 4, 160)
  assert (batch['segment_ids'][:3] == 1).all() and (batch['segment_ids'][3] == 0).all()
  for r, doc in enumerate(docs):
    np.testing.assert_array_equal(batch['tokens'][r], doc.tokens[:-1])
    np.testing.assert_array_equal(batch['loss_mask'][r], doc.answer_mask())
  # beside it, each answer's query row points at the row whose input is the token it predicts
  rows_bt = document_answer_rows(docs, 4, 160)
  r, q = np.nonzero(rows_bt >= 0)
  np.testing.assert_array_equal(batch['loss_mask'] == 1, rows_bt >= 0)
  np.testing.assert_array_equal(batch['tokens'][r, rows_bt[r, q]], batch['targets'][r, q])
  assert (rows_bt[3] == -1).all() and len(q) == sum(e - s for d in docs for s, e in d.answers)


def test_every_config_takes_the_tasks():
  root = REPO_ROOT
  for name in ('tiny.py', 'tiny_multimodal.py', 'ablation_1b.py'):
    cfg = resolve(load_config_file(os.path.join(root, 'configs', name), {
        'data.sources': 'mqar:0.5,passkey:0.25,needle:0.25', 'train.eval_tasks': 'mqar@256'}),
        num_devices=1, backend='cpu')
    assert [p for p, _ in cfg.data.sources] == ['mqar', 'passkey', 'needle']
    assert cfg.data.task_params() is cfg.tasks


def test_eval_batches_of_a_vision_model_carry_empty_image_keys(corpus):
  cfg = _cfg(corpus, 'default')
  docs = held_out_documents(open_task(cfg.data, 'passkey', 'heldout', _tokenizer(corpus)),
                            160, 0.5, 2)
  geometry = ImageGeometry(patch_size=4, merge=3, max_image_tokens=16, min_pixels=0,
                           image_token_id=0, max_images_per_row=2)
  batch = document_batch(docs, 2, 160, geometry)
  assert set(batch) == set(batch_keys(True))
  assert batch['image_patches'].shape == (2, 2, 9 * 16, 48) and not batch['image_grid'].any()


def test_bad_task_settings_are_named(corpus):
  with pytest.raises(ConfigError, match=r'^tasks.mqar_queries: must be in \[1, '):
    _cfg(corpus, 'default', **{'tasks.mqar_queries': 9})
  with pytest.raises(ConfigError, match=r'^train.eval_tasks: passkey@1k: 1024 tokens exceed the '
                                        r'model.s 512 positions'):
    _cfg(corpus, 'default', **{'train.eval_tasks': 'passkey@1k'})
  with pytest.raises(ConfigError, match=r"^train.eval_tasks: unknown task 'key'"):
    _cfg(corpus, 'default', **{'train.eval_tasks': 'key@64'})
  cfg = _cfg(corpus, f'mqar,{corpus}', **{'tasks.mqar_pairs': 40, 'tasks.mqar_queries': 40})
  with pytest.raises(DataError, match=r'mqar: a document of 96 tokens cannot hold .*'
                                      r'tasks.mqar_pairs'):
    make_dataset(cfg.data, split='train', batch_size=2, seed=0)  # at once, not in a worker
  with pytest.raises(DataError, match='tasks.needle_filler: .* not a dataset prepared'):
    open_task(_cfg(corpus, f'needle,{corpus}',
                   **{'tasks.needle_filler': str(corpus) + '/nope'}).data,
              'needle', 'train', _tokenizer(corpus))
