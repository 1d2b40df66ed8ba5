"""Image-text data: sizing, patches, the shapes task, image spans, sources and packed batches.

The batch contract is deepseek41/batch.py. Packed-batch tests check it as properties of every
span in every row (whole, well formed, pointing at the right image slot with the right pixels,
followed by the right caption) rather than against recorded outputs.
"""

from __future__ import annotations

import json
import os
from collections import deque

import numpy as np
import pytest
from PIL import Image

from deepseek41.batch import (IMAGE, IMAGE_KEYS, ROLE_ALIGN, ROLE_END, ROLE_NEWLINE, ROLE_PATCH,
                              ROLE_START, ROLE_TEXT, TEXT, batch_keys, span_length)
from deepseek41.config import DataConfig, ImageGeometry
from deepseek41.data import multimodal, shapes
from deepseek41.data.images import (image_patches, load_image, merged_tokens, patchify, resize,
                                    target_size)
from deepseek41.data.pipeline import (make_dataset, resolve_sources, tokenizer_path_of,
                                      vocab_size_of)
from deepseek41.data.prepare import prepare_dataset
from deepseek41.data.shards import DataError
from deepseek41.data.tokenizer import load_tokenizer
from tests.helpers import take_batches as _take

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

RELEASED = ImageGeometry(patch_size=14, merge=3, max_image_tokens=1024, min_pixels=295936,
                         image_token_id=129264, max_images_per_row=4)
IMG_TOKEN = 299
M = 16  # merged tokens per image in the tiny geometry


def _geometry(**overrides) -> ImageGeometry:
  base = dict(patch_size=4, merge=3, max_image_tokens=M, min_pixels=0,
              image_token_id=IMG_TOKEN, max_images_per_row=4)
  base.update(overrides)
  return ImageGeometry(**base)


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  """A tiny prepared text dataset: its tokenizer is the run's tokenizer for image sources."""
  root = tmp_path_factory.mktemp('text')
  corpus = root / 'corpus'
  corpus.mkdir()
  words = 'the red green blue cat dog sat on a mat and ran to big small image of shapes'.split()
  rng = np.random.default_rng(0)
  for i in range(40):
    (corpus / f'd{i:02d}.txt').write_text(' '.join(rng.choice(words, rng.integers(3, 30))))
  return prepare_dataset([str(corpus)], str(root / 'ds'), vocab_size=300, heldout_fraction=0.2,
                         progress=False)


def _cfg(text_dir, **overrides) -> DataConfig:
  g = overrides.pop('images', None) or _geometry(
      max_images_per_row=overrides.get('max_images_per_row', 4))
  base = dict(seq_len=96, sources=((text_dir, 1.0),), synthetic=False, cache_dir='',
              default_corpus_vocab_size=300, default_corpus_max_files=5, shuffle_seed=0,
              num_workers=0, prefetch=0, packing_bins=4, document_align=2, image_sources=(),
              max_images_per_row=4, image_heldout_fraction=0.2, shapes_image_size=48, streams=0,
              images=g)
  base.update(overrides)
  return DataConfig(**base)


def _png(path, arr):
  path.parent.mkdir(parents=True, exist_ok=True)
  Image.fromarray(arr).save(path)
  return str(path)


def _noise(rng, h, w):
  return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Sizing, loading, patches.


def test_target_size_rule():
  p = RELEASED.patch_size
  assert target_size(4000, 4000, RELEASED) == (1344, 1344)  # 96 x 96 patches = 32 x 32 tokens
  assert target_size(1344, 1344, RELEASED) == (1344, 1344)
  for h, w in [(4000, 4000), (3000, 1500), (720, 1280), (1280, 720), (100, 100), (5, 7),
               (2000, 300), (600, 601)]:
    H, W = target_size(h, w, RELEASED)
    assert H % p == 0 and W % p == 0, (h, w)
    assert merged_tokens(H // p, W // p, 3) <= 1024, (h, w)  # the token budget
    assert H * W >= RELEASED.min_pixels, (h, w)  # the minimum area
    assert abs(np.log((H / W) / (h / w))) < 0.05, (h, w)  # aspect ratio kept
    if h * w > 2000 * 2000:  # scaled down: as large as the budget allows
      bigger = merged_tokens(H // p + 1, round((H / p + 1) * w / h), 3)
      assert bigger > 1024, (h, w)
  # Small images are scaled up, just enough.
  H, W = target_size(100, 100, RELEASED)
  assert H == W and (H - p) ** 2 < RELEASED.min_pixels <= H * W
  # The tiny geometry leaves a 48 px image alone (12 x 12 patches = 4 x 4 tokens).
  assert target_size(48, 48, _geometry()) == (48, 48)
  assert target_size(480, 48, _geometry()) == (140, 12)  # 35 x 3 patches -> 12 x 1 tokens
  # At least one patch per side, even for extreme aspect ratios.
  H, W = target_size(1, 5000, _geometry())
  assert H == 4 and merged_tokens(1, W // 4, 3) <= M


def test_patchify_raster_order_and_padding():
  p, h, w = 4, 3, 5
  img = np.arange(h * p * w * p * 3, dtype=np.int64).reshape(h * p, w * p, 3) % 251
  img = img.astype(np.uint8)
  patches, grid = patchify(img, p, max_patches=20)
  assert grid == (h, w) and patches.shape == (20, p * p * 3) and patches.dtype == np.uint8
  for k in range(h * w):
    i, j = divmod(k, w)
    np.testing.assert_array_equal(patches[k], img[i * p:(i + 1) * p, j * p:(j + 1) * p].reshape(-1))
  assert (patches[h * w:] == 0).all()
  with pytest.raises(DataError, match='exceeds'):
    patchify(img, p, max_patches=14)


def test_load_and_resize(tmp_path):
  rng = np.random.default_rng(0)
  rgb = _noise(rng, 10, 14)
  np.testing.assert_array_equal(load_image(_png(tmp_path / 'a.png', rgb)), rgb)
  gray = load_image(_png(tmp_path / 'g.png', rgb[..., 0]))
  assert gray.shape == (10, 14, 3) and (gray[..., 0] == rgb[..., 0]).all()
  rgba = np.concatenate([rgb, np.full((10, 14, 1), 255, np.uint8)], -1)
  np.testing.assert_array_equal(load_image(_png(tmp_path / 'x.webp', rgba)).shape, (10, 14, 3))
  out = resize(rgb, (20, 8))
  assert out.shape == (20, 8, 3) and out.dtype == np.uint8
  assert resize(rgb, (10, 14)) is rgb
  with pytest.raises(DataError, match=f'{tmp_path}/nope.png .*rec:7.* does not exist'):
    load_image(str(tmp_path / 'nope.png'), 'rec:7')
  (tmp_path / 'bad.png').write_bytes(b'not a png at all')
  with pytest.raises(DataError, match=f'{tmp_path}/bad.png .*rec:8.* cannot be read'):
    load_image(str(tmp_path / 'bad.png'), 'rec:8')


# ---------------------------------------------------------------------------------------------
# The shapes task.


def _components(mask: np.ndarray) -> list[list[tuple[int, int]]]:
  """4-connected components of a boolean image."""
  seen = np.zeros_like(mask)
  out = []
  for y, x in zip(*np.nonzero(mask)):
    if seen[y, x]:
      continue
    comp, todo = [], deque([(y, x)])
    seen[y, x] = True
    while todo:
      cy, cx = todo.popleft()
      comp.append((cy, cx))
      for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
        inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
        if inside and mask[ny, nx] and not seen[ny, nx]:
          seen[ny, nx] = True
          todo.append((ny, nx))
    out.append(comp)
  return out


def test_shapes_are_deterministic_and_captions_describe_the_image():
  a = shapes.render(np.random.default_rng([3, 1, 7]))
  b = shapes.render(np.random.default_rng([3, 1, 7]))
  assert a[1] == b[1] and (a[0] == b[0]).all()
  captions, words = set(), set()
  for i in range(200):
    img, caption = shapes.render(np.random.default_rng(i), 48)
    assert img.shape == (48, 48, 3) and img.dtype == np.uint8
    captions.add(caption)
    words.update(caption.rstrip('.').split())
    count, colour, kind, rest = caption.split(' ', 3)
    position = rest.removeprefix('at the ').rstrip('.')
    n = shapes.COUNTS.index(count) + 1
    assert kind.rstrip('s') in shapes.SHAPES and (kind.endswith('s') == (n > 1))
    # Only the named colour is drawn, as n separate shapes inside the named region.
    painted = (img != shapes.BACKGROUND).any(-1)
    is_colour = (img == shapes.COLOURS[colour]).all(-1)
    assert (painted == is_colour).all(), caption
    comps = _components(is_colour)
    assert len(comps) == n, caption
    ys, xs = np.nonzero(is_colour)
    oy, ox = (int(f * 48) for f in shapes._REGION_ORIGIN[position])
    assert ys.min() >= oy and ys.max() < oy + 24 and xs.min() >= ox and xs.max() < ox + 24
  assert len(captions) > 80  # captions vary with the image
  assert words >= set(shapes.COUNTS) | set(shapes.COLOURS) | {'left', 'right', 'centre'}
  assert len(words) == 21  # a small, regular vocabulary
  with pytest.raises(DataError, match='shapes_image_size'):
    shapes.render(np.random.default_rng(0), 8)


# ---------------------------------------------------------------------------------------------
# Documents: span layout, loss mask, cutting.


def _encode(text):
  return [ord(c) for c in text]


def test_span_layout_alignment_and_loss_mask():
  g = _geometry()
  img = np.zeros((24, 36, 3), np.uint8)  # 6 x 9 patches -> hm, wm = 2, 3
  doc = multimodal.build_document([{'text': 'abc'}, {'image': img}, {'text': 'xy'}], _encode,
                                  1, g, 'rec')
  roles = [ROLE_START] + ([ROLE_PATCH] * 3 + [ROLE_NEWLINE]) * 2 + [ROLE_END]
  assert len(roles) == span_length(2, 3)
  expected_role = [ROLE_TEXT] * 3 + [ROLE_ALIGN] + roles + [ROLE_TEXT] * 3  # 'x', 'y', eos
  np.testing.assert_array_equal(doc.role, expected_role)
  assert np.nonzero(doc.role == ROLE_START)[0][0] == 4  # [start] at an even position
  np.testing.assert_array_equal(doc.tokens[:3], _encode('abc'))
  assert (doc.tokens[3:3 + 1 + len(roles)] == IMG_TOKEN).all()
  np.testing.assert_array_equal(doc.tokens[-3:], _encode('xy') + [1])
  np.testing.assert_array_equal(doc.index[doc.role == ROLE_PATCH], np.arange(6))  # i * wm + j
  assert (doc.index[doc.role != ROLE_PATCH] == 0).all()
  np.testing.assert_array_equal(doc.span, [0] * 4 + [1] * len(roles) + [0] * 3)
  assert doc.grids == [(6, 9)] and doc.patches[0].shape == (g.max_patches, 48)

  (cut,) = multimodal.cut_document(doc, 96, 2, 4, 'rec')
  piece = multimodal.piece_arrays(doc, *cut, g, align=2)
  n = len(doc.tokens) - 1
  np.testing.assert_array_equal(piece['targets'][:n], doc.tokens[1:])
  end = int(np.nonzero(piece['image_role'] == ROLE_END)[0][0])
  # No loss where the target is in the span (the last text token, the pad and the span itself);
  # the [end] position predicts the text after the image and keeps its loss.
  want_mask = np.ones(len(piece['mask']), np.int32)
  want_mask[2:end] = 0
  want_mask[n:] = 0  # the alignment padding at the end of the piece
  np.testing.assert_array_equal(piece['mask'], want_mask)
  assert piece['targets'][end] == ord('x')
  assert piece['image_patches'].shape == (1, g.max_patches, 48)
  np.testing.assert_array_equal(piece['image_grid'], [[6, 9]])

  # An even text length needs no pad; a second image is span 2, slot 1.
  doc = multimodal.build_document([{'text': 'ab'}, {'image': img}, {'text': 'c'},
                                   {'image': img[:12, :12]}], _encode, 1, g, 'rec')
  assert doc.role[2] == ROLE_START and ROLE_ALIGN not in doc.role[:3]
  second = np.nonzero(doc.role == ROLE_START)[0][1]
  assert second == 14 and doc.role[13] == ROLE_ALIGN  # 2 + 10 + 1 = 13: padded
  (cut,) = multimodal.cut_document(doc, 96, 2, 4, 'rec')
  piece = multimodal.piece_arrays(doc, *cut, g, align=2)
  assert set(np.unique(piece['image_span'])) == {0, 1, 2}
  np.testing.assert_array_equal(piece['image_index'][piece['image_span'] == 2][1:-1],
                                [M + 0, 0])  # 3 x 3 patches = 1 merged token: slot 1, token 0


def test_long_documents_are_cut_between_spans():
  g = _geometry(max_image_tokens=4)  # spans of at most 4 * 2 + 2 (+1 pad) = 11 positions
  rng = np.random.default_rng(0)
  for trial in range(30):
    parts = []
    for _ in range(rng.integers(1, 8)):
      if rng.random() < 0.5:
        parts.append({'image': np.zeros((4 * int(rng.integers(1, 7)),
                                         4 * int(rng.integers(1, 7)), 3), np.uint8)})
      else:
        parts.append({'text': 'x' * int(rng.integers(0, 30))})
    doc = multimodal.build_document(parts, _encode, 1, g, f'trial {trial}')
    seq_len, align, max_images = int(rng.choice([12, 16, 20])), 2, int(rng.integers(1, 3))
    cuts = multimodal.cut_document(doc, seq_len, align, max_images, 'r')
    assert cuts[0][0] == 0 and cuts[-1][1] == len(doc.tokens) - 1
    for (s, c), nxt in zip(cuts, cuts[1:] + [None]):
      assert 0 < c - s <= seq_len and s % align == 0
      if nxt is not None:
        assert nxt[0] == c  # consecutive pieces overlap by one token (c is input and target)
      assert (doc.role[s:c] == ROLE_START).sum() <= max_images
      # Every span lies entirely inside one piece's inputs.
      for ordinal in np.unique(doc.span[doc.span > 0]):
        where = np.nonzero(doc.span == ordinal)[0]
        inside = (where >= s) & (where < c)
        assert inside.all() or not inside.any()
      piece = multimodal.piece_arrays(doc, s, c, g, align)
      assert len(piece['tokens']) % align == 0
      assert piece['image_patches'].shape[0] == (doc.role[s:c] == ROLE_START).sum()
  # A span that cannot fit is an error naming the record.
  doc = multimodal.build_document([{'image': np.zeros((48, 48, 3), np.uint8)}], _encode, 1,
                                  _geometry(), 'web.jsonl:12')  # a span of 4 * 5 + 2 = 22
  with pytest.raises(DataError, match='web.jsonl:12'):
    multimodal.cut_document(doc, 16, 2, 4, 'web.jsonl:12')


# ---------------------------------------------------------------------------------------------
# Sources.


def _write_pairs(root, n, rng, sizes=((24, 36), (48, 48), (12, 40), (40, 16))):
  """Noise images of several sizes with short, distinct captions."""
  expected = {}
  for i in range(n):
    h, w = sizes[i % len(sizes)]
    ext = ('png', 'jpg', 'webp', 'jpeg')[i % 4]
    path = _png(root / f'sub{i % 2}' / f'im{i:03d}.{ext}', _noise(rng, h, w))
    caption = f'cat {i}'
    (root / f'sub{i % 2}' / f'im{i:03d}.txt').write_text(caption + '\n')
    expected[path] = caption
  return expected


def test_pair_and_jsonl_sources_and_their_errors(tmp_path, text_dir):
  rng = np.random.default_rng(0)
  pairs = _write_pairs(tmp_path / 'pairs', 12, rng)
  cfg = _cfg(text_dir, image_sources=((str(tmp_path / 'pairs'), 1.0),))
  tok = load_tokenizer(tokenizer_path_of(cfg))
  seen = {}
  for split in ('train', 'heldout'):
    src = multimodal.open_image_source('pairs', str(tmp_path / 'pairs'), cfg, split=split,
                                       seed=0, tokenizer_path=tokenizer_path_of(cfg))
    for i in range(len(src)):
      (piece,) = src[i]
      parts, record = src.samples.sample(i)
      seen[parts[0]['image']] = split
      end = int(np.nonzero(piece['image_role'] == ROLE_END)[0][0])
      caption = tok.decode(piece['targets'][end:][piece['mask'][end:] == 1])
      assert caption == pairs[parts[0]['image']]
      assert piece['image_patches'].shape[0] == 1
  assert set(seen) == set(pairs)  # every pair is in exactly one split
  assert 'heldout' in seen.values() and 'train' in seen.values()
  assert sorted(seen) == [os.path.join(str(tmp_path / 'pairs'), k) for k in
                          sorted(os.path.relpath(p, tmp_path / 'pairs') for p in pairs)]

  # JSONL: interleaved records, relative and absolute image paths, metadata keys ignored.
  img_a = _png(tmp_path / 'j' / 'imgs' / 'a.png', _noise(rng, 16, 16))
  img_b = _png(tmp_path / 'elsewhere' / 'b.png', _noise(rng, 8, 24))
  records = [
      {'content': [{'text': 'look: '}, {'image': 'imgs/a.png'}, {'text': ' and '},
                   {'image': img_b, 'alt': 'x'}, {'text': ' end'}]},
      {'content': [{'image': 'imgs/a.png'}, {'text': 'the cat'}], 'id': 5},
      {'content': [{'text': 'only text'}]},
  ]
  jsonl = tmp_path / 'j' / 'web.jsonl'
  jsonl.write_text('\n'.join(json.dumps(r) for r in records[:2]) + '\n\n' +
                   json.dumps(records[2]) + '\n')
  samples = {}
  for split in ('train', 'heldout'):
    s = multimodal.JsonlSamples(str(jsonl), split, 0.3)
    samples.update({int(s.lines[i]): s.sample(i) for i in range(len(s))})
  assert sorted(samples) == [1, 2, 4]  # line numbers; the blank line is not a record
  parts, record = samples[1]
  assert record == f'{jsonl}:1'
  assert [p.get('image') for p in parts] == [None, img_a, None, img_b, None]
  src = multimodal.MultimodalSource(multimodal.JsonlSamples(str(jsonl), 'train', 0.0),
                                    tokenizer_path_of(cfg), _geometry(), 96, 2)
  (piece,) = src[0]
  assert piece['image_patches'].shape[0] == 2 and set(np.unique(piece['image_span'])) == {0, 1, 2}

  # Errors name the culprit.
  (tmp_path / 'pairs' / 'sub0' / 'lonely.png').write_bytes(b'')
  with pytest.raises(DataError, match=r'image .*lonely\.png has no caption'):
    multimodal.PairSamples(str(tmp_path / 'pairs'), 'train', 0.2)
  (tmp_path / 'pairs' / 'sub0' / 'lonely.png').unlink()
  (tmp_path / 'pairs' / 'sub1' / 'im001.jpg').unlink()  # its caption im001.txt stays behind
  with pytest.raises(DataError, match=r'1 caption files in .*pairs have no image \(.*\): '
                                      r'.*pairs/sub1/im001\.txt; restore the images'):
    multimodal.PairSamples(str(tmp_path / 'pairs'), 'train', 0.2)
  bad = tmp_path / 'bad'
  _png(bad / 'ok.png', _noise(rng, 8, 8))
  (bad / 'ok.txt').write_text('fine')
  (bad / 'broken.png').write_bytes(b'garbage')
  (bad / 'broken.txt').write_text('broken')
  src = multimodal.MultimodalSource(multimodal.PairSamples(str(bad), 'train', 0.0),
                                    tokenizer_path_of(cfg), _geometry(), 96, 2)
  with pytest.raises(DataError, match=r"broken\.png \(referenced by pair 'broken' of .*\) "
                                      'cannot be read'):
    src[0]
  src[1]  # the good pair loads
  for text, msg in [('{"content": [{"text": "a"}]}\n{"content": oops}\n', 'not valid JSON'),
                    ('{"content": [{"text": "a"}, {"picture": "a.png"}]}\n', r'content\[1\]'),
                    ('{"content": [{"text": 1}]}\n', r'content\[0\]'),
                    ('[1, 2]\n', 'expected an object'),
                    ('{"content": []}\n', 'expected an object .* at least one part')]:
    jsonl.write_text(text)
    line = text.count('\n')
    with pytest.raises(DataError, match=f'{jsonl}:{line}: {msg}'):
      multimodal.JsonlSamples(str(jsonl), 'train', 0.0)
  jsonl.write_text('{"content": [{"image": "missing.png"}]}\n')
  src = multimodal.MultimodalSource(multimodal.JsonlSamples(str(jsonl), 'train', 0.0),
                                    tokenizer_path_of(cfg), _geometry(), 96, 2)
  with pytest.raises(DataError, match=f'missing.png \\(referenced by {jsonl}:1\\) does not exist'):
    src[0]
  with pytest.raises(DataError, match='neither a directory'):
    multimodal.resolve_image_sources(_cfg(text_dir, image_sources=((str(bad / 'ok.txt'), 1.0),)))
  with pytest.raises(DataError, match='does not exist'):
    multimodal.resolve_image_sources(_cfg(text_dir, image_sources=(('nowhere', 1.0),)))


def test_split_disjointness(tmp_path, text_dir):
  keys = [(f'k{i}', 0) for i in range(200)]
  held = multimodal.split_heldout(keys, 0.1)
  assert 5 < held.sum() < 40
  np.testing.assert_array_equal(held, multimodal.split_heldout(keys, 0.1))  # stable
  assert multimodal.split_heldout(keys[:2], 0.01).sum() == 1  # at least one held out...
  assert multimodal.split_heldout(keys[:2], 0.99).sum() == 1  # ...and one kept for training
  assert multimodal.split_heldout(keys[:1], 0.5).sum() <= 1
  assert not multimodal.split_heldout(keys, 0.0).any()
  # Shapes: the held-out set is fixed across runs; the training stream follows the run's seed.
  cfg = _cfg(text_dir, image_sources=(('shapes', 1.0),))
  tok = tokenizer_path_of(cfg)

  def first(split, seed, n=6):
    src = multimodal.open_image_source('shapes', 'shapes', cfg, split=split, seed=seed,
                                       tokenizer_path=tok)
    return len(src), [src.samples.sample(i)[0][0]['image'].tobytes() for i in range(n)]
  n_held, held0 = first('heldout', 0)
  _, held1 = first('heldout', 1)
  n_train, train0 = first('train', 0)
  _, train1 = first('train', 1)
  assert n_held == multimodal.SHAPES_HELDOUT_SAMPLES and n_train > 1 << 30
  assert held0 == held1 and train0 != train1
  assert not set(held0) & set(train0)


# ---------------------------------------------------------------------------------------------
# Packed batches.


def _check_batches(batches, cfg, expected_images=None, tok=None):
  """Batch contract properties; returns (number of text pieces, number of image pieces)."""
  g = cfg.images
  n, p = g.max_images_per_row, g.patch_size
  counts = [0, 0]
  for b in batches:
    assert set(b) == set(batch_keys(True))
    bsz, t = b['tokens'].shape
    for k in batch_keys(False) + ('image_role', 'image_index', 'image_span'):
      assert b[k].shape == (bsz, t) and b[k].dtype == np.int32, k
    assert b['image_patches'].shape == (bsz, n, g.max_patches, p * p * 3)
    assert b['image_patches'].dtype == np.uint8
    assert b['image_grid'].shape == (bsz, n, 2) and b['image_grid'].dtype == np.int32
    role, seg = b['image_role'], b['segment_ids']
    np.testing.assert_array_equal(b['modality'], np.where(role != 0, IMAGE, TEXT))
    assert (b['tokens'][role != 0] == g.image_token_id).all()
    for k in IMAGE_KEYS[:3]:
      assert (b[k][seg == 0] == 0).all()
    for r in range(bsz):
      span, index, grid = b['image_span'][r], b['image_index'][r], b['image_grid'][r]
      ids = np.unique(span[span > 0])
      np.testing.assert_array_equal(ids, np.arange(1, len(ids) + 1))  # 1, 2, ... per row
      assert len(ids) <= n
      used = [int(k) for k in range(n) if grid[k].any()]
      assert used == list(range(len(ids)))  # slots filled from the first, one per span
      for s in np.unique(seg[r][seg[r] > 0]):
        counts[bool((role[r][seg[r] == s] != 0).any())] += 1
      for sid in ids:
        where = np.nonzero(span == sid)[0]
        assert (np.diff(where) == 1).all()  # contiguous
        assert len(np.unique(seg[r][where])) == 1  # inside one piece
        rr = role[r][where]
        assert rr[0] == ROLE_START and rr[-1] == ROLE_END
        if where[0] > 0 and role[r][where[0] - 1] == ROLE_ALIGN:
          assert span[where[0] - 1] == 0
        assert b['positions'][r][where[0]] % 2 == 0  # [start] at an even position
        hm = int((rr == ROLE_NEWLINE).sum())
        wm = (len(rr) - 2) // hm - 1
        assert len(rr) == span_length(hm, wm)
        slots = index[where][rr == ROLE_PATCH] // M
        assert (slots == slots[0]).all()
        slot = int(slots[0])
        np.testing.assert_array_equal(index[where][rr == ROLE_PATCH] % M, np.arange(hm * wm))
        h, w = grid[slot]
        assert (-(-h // g.merge), -(-w // g.merge)) == (hm, wm)
        assert slot == sid - 1
        # Loss: none on targets inside the span; the [end] position keeps its loss.
        assert (b['loss_mask'][r][where[:-1]] == 0).all()
        if where[0] > 0 and seg[r][where[0] - 1] == seg[r][where[0]]:
          assert b['loss_mask'][r][where[0] - 1] == 0
        if expected_images is not None:
          got = b['image_patches'][r, slot]
          match = [c for c, (pats, gr) in expected_images.items()
                   if gr == (h, w) and np.array_equal(pats, got)]
          assert len(match) == 1, 'slot pixels are not one source image'
          if tok is not None:  # the caption after the span is that image's caption
            end = where[-1]
            run = end + np.cumprod(b['loss_mask'][r][end:] == 1).sum()
            assert tok.decode(b['targets'][r][end:run]) == match[0]
  return counts


def test_packed_batches_keep_spans_whole(tmp_path, text_dir):
  rng = np.random.default_rng(1)
  pairs = _write_pairs(tmp_path / 'pairs', 16, rng)
  g = _geometry(max_images_per_row=2)
  expected = {cap: (lambda pg: (pg[0], pg[1]))(image_patches(load_image(path), g))
              for path, cap in pairs.items()}
  cfg = _cfg(text_dir, image_sources=((str(tmp_path / 'pairs'), 1.0),), seq_len=64,
             max_images_per_row=2, images=g, image_heldout_fraction=0.0)
  tok = load_tokenizer(tokenizer_path_of(cfg))
  batches = _take(make_dataset(cfg, split='train', batch_size=3, seed=0, repeat=False,
                               kinds=('image',)))
  counts = _check_batches(batches, cfg, expected, tok)
  assert counts == [0, 16]  # every pair once, as one piece
  spans_per_row = [len(np.unique(s[s > 0])) for b in batches for s in b['image_span']]
  assert max(spans_per_row) == 2  # rows do take several images, re-based per row
  # A training stream mixing long multi-image JSONL records and shapes keeps every span whole.
  imgs = [_png(tmp_path / 'j' / f'{i}.png', _noise(rng, 8 + 4 * i, 36 - 4 * i)) for i in range(6)]
  lines = [json.dumps({'content': [
      {'text': 'word ' * int(rng.integers(0, 12))}, {'image': imgs[i]}, {'text': 'more'},
      {'image': imgs[(i + 1) % 6]}, {'image': imgs[i]}]}) for i in range(6)]
  (tmp_path / 'j' / 'web.jsonl').write_text('\n'.join(lines))
  expected = {str(i): image_patches(load_image(p), g) for i, p in enumerate(imgs)}
  expected = {k: (v[0], v[1]) for k, v in expected.items()}
  cfg = _cfg(text_dir, image_sources=((str(tmp_path / 'j' / 'web.jsonl'), 1.0), ('shapes', 1.0)),
             seq_len=64, max_images_per_row=2, images=g)
  batches = _take(make_dataset(cfg, split='train', batch_size=4, seed=0), 12)
  _check_batches(batches, cfg)
  jsonl_slots = 0
  for b in batches:  # shapes images are 12 x 12 patches; JSONL ones are one of `imgs`
    for r, k in zip(*np.nonzero(b['image_grid'].any(-1))):
      if tuple(b['image_grid'][r, k]) != (12, 12):
        jsonl_slots += 1
        assert any(np.array_equal(b['image_patches'][r, k], pats) and
                   tuple(b['image_grid'][r, k]) == grid for pats, grid in expected.values())
  assert jsonl_slots > 5


def test_mixing_text_and_image_sources_by_weight(tmp_path, text_dir):
  cfg = _cfg(text_dir, sources=((text_dir, 3.0),), image_sources=(('shapes', 1.0),),
             packing_bins=8)
  batches = _take(make_dataset(cfg, split='train', batch_size=8, seed=0), 40)
  text, image = _check_batches(batches, cfg)
  assert text + image > 400
  assert abs(image / (text + image) - 0.25) < 0.06
  # Text pieces carry empty image keys; image-only evaluation reads only the image sources.
  (held,) = _take(make_dataset(cfg, split='heldout', batch_size=4, seed=0, kinds=('image',),
                               repeat=False), 1)
  segs = held['segment_ids']
  assert all((held['image_role'][r][segs[r] == s] != 0).any()
             for r in range(4) for s in np.unique(segs[r][segs[r] > 0]))
  (text_only,) = _take(make_dataset(cfg, split='train', batch_size=4, seed=0, kinds=('text',)), 1)
  assert (text_only['image_role'] == 0).all() and (text_only['image_grid'] == 0).all()
  assert set(text_only) == set(batch_keys(True))
  with pytest.raises(DataError, match='kinds'):
    make_dataset(cfg, split='train', batch_size=4, seed=0, kinds=('audio',))
  with pytest.raises(DataError, match='image_sources'):
    make_dataset(_cfg(text_dir), split='train', batch_size=4, seed=0, kinds=('image',))


@pytest.mark.parametrize('num_workers,prefetch', [(0, 2), (2, 1)])
def test_state_restore_gives_identical_batches(tmp_path, text_dir, num_workers, prefetch):
  rng = np.random.default_rng(2)
  _write_pairs(tmp_path / 'pairs', 10, rng)
  cfg = _cfg(text_dir, image_sources=((str(tmp_path / 'pairs'), 1.0), ('shapes', 0.5)),
             num_workers=num_workers, prefetch=prefetch, seq_len=64)
  it = iter(make_dataset(cfg, split='train', batch_size=3, seed=3))
  try:
    for _ in range(4):
      next(it)
    state = it.get_state()
    json.dumps(state)  # checkpoints store it as JSON
    expected = [{k: np.array(v) for k, v in next(it).items()} for _ in range(4)]
  finally:
    it.close()
  assert any((e['image_role'] != 0).any() for e in expected)
  it = iter(make_dataset(cfg, split='train', batch_size=3, seed=3))
  try:
    it.set_state(state)
    for want in expected:
      got = next(it)
      for k in batch_keys(True):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  finally:
    it.close()


def test_default_corpus_tokenizer_serves_image_sources(tmp_path):
  cfg = _cfg('', sources=(), cache_dir=str(tmp_path), image_sources=(('shapes', 1.0),))
  (default_dir, _), = resolve_sources(cfg)
  assert tokenizer_path_of(cfg) == os.path.join(default_dir, 'tokenizer.json')
  assert vocab_size_of(cfg) <= 300
  named = _cfg('', sources=(('default', 0.3),), cache_dir=str(tmp_path),
               image_sources=(('shapes', 1.0),))
  assert resolve_sources(named) == [(default_dir, 0.3)]
  (batch,) = _take(make_dataset(cfg, split='train', batch_size=4, seed=0), 1)
  assert (batch['modality'] == IMAGE).any() and batch['tokens'].max() < 300
  with pytest.raises(DataError, match='synthetic'):
    make_dataset(_cfg('', synthetic=True, image_sources=(('shapes', 1.0),)), split='train',
                 batch_size=2, seed=0)
