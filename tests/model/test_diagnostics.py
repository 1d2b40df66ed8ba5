"""The selection against dense attention (model/diagnostics.py): exact against numpy, 1.0 when
the selection is every visible entry, lower when it is restricted (a constructed 16K case), and
the answer's fate per query."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.compressor import CompressedKV
from deepseek41.model.diagnostics import (probe_rows, selection_diagnostics, selection_stats,
                                          selection_totals, summarize, summarize_totals)
from deepseek41.model.shared import Probe
from deepseek41.model.transformer import Transformer
from tests.helpers import packed_layout, resolved


def entries(kv_bnd, seg_bt, ratio=1):
  """A KV source's entries in the row layout, groups inside one document only."""
  b, n, _ = kv_bnd.shape
  last = np.arange(n) * ratio + ratio - 1
  seg = np.asarray(seg_bt)[:, ::ratio][:, :n]
  whole = np.asarray(seg_bt)[:, np.minimum(last, seg_bt.shape[1] - 1)] == seg
  return CompressedKV(latent_bnd=None, kv_bnd=jnp.asarray(kv_bnd),
                      pos_bn=jnp.asarray(np.tile(np.arange(n) * ratio, (b, 1)), jnp.int32),
                      seg_bn=jnp.asarray(np.where(whole, seg, 0), jnp.int32),
                      last_bn=jnp.asarray(np.tile(last, (b, 1)), jnp.int32), ratio=ratio)


def numpy_stats(q, kv, seg, ratio, sel, sel_valid, answers, topk, window):
  b, t, h, d = q.shape
  n = kv.shape[1]
  out = {k: np.zeros((b, t)) for k in ('recall', 'mass', 'selected', 'in_dense', 'visible',
                                       'in_window', 'neighbour', 'shared')}
  for i in range(b):
    for r in range(t):
      chosen = {int(j) for j, v in zip(sel[i, r], sel_valid[i, r]) if v}
      before = {int(j) for j, v in zip(sel[i, r - 1], sel_valid[i, r - 1]) if v} if r else set()
      if chosen and before and seg[i, r] != 0 and seg[i, r] == seg[i, r - 1]:
        out['neighbour'][i, r] = 1
        out['shared'][i, r] = len(chosen & before) / len(chosen)
      vis = [j for j in range(n) if j * ratio + ratio - 1 <= r and seg[i, r] != 0 and
             all(seg[i, j * ratio + u] == seg[i, r] for u in range(ratio))]
      a = answers[i, r]
      out['in_window'][i, r] = a >= 0 and 0 <= r - a < window and seg[i, a] == seg[i, r] != 0
      if not vis:
        continue
      s = q[i, r].astype(np.float64) @ kv[i, vis].T.astype(np.float64) / math.sqrt(d)
      p = np.exp(s - s.max(-1, keepdims=True))
      p = (p / p.sum(-1, keepdims=True)).mean(0)
      dense = [vis[j] for j in np.argsort(-p, kind='stable')[:min(topk, len(vis))]]
      chosen = {int(j) for j, v in zip(sel[i, r], sel_valid[i, r]) if v}
      out['recall'][i, r] = len(chosen & set(dense)) / len(dense)
      out['mass'][i, r] = sum(p[vis.index(j)] for j in chosen if j in vis)
      if a >= 0 and a // ratio in vis:
        out['visible'][i, r] = 1
        out['selected'][i, r] = a // ratio in chosen
        out['in_dense'][i, r] = a // ratio in dense
  return out


def test_stats_equal_a_numpy_reference():
  """Two documents (one ends in a group straddling the boundary), ratio 2, a random selection
  with invalid slots, answers before, inside and after each query's reach."""
  rng = np.random.default_rng(0)
  b, t, h, d, ratio, k = 2, 24, 2, 8, 2, 3
  seg, _ = packed_layout([(11, 13), (24,)], t)
  q = rng.standard_normal((b, t, h, d)).astype(np.float32)
  kv = rng.standard_normal((b, t // ratio, d)).astype(np.float32)
  sel = rng.integers(0, t // ratio, (b, t, 4)).astype(np.int32)
  for i in range(b):   # distinct entries per query, as a top-k is
    for r in range(t):
      sel[i, r] = rng.permutation(t // ratio)[:4]
  sel_valid = rng.random((b, t, 4)) < 0.7
  answers = rng.integers(-1, t, (b, t)).astype(np.int32)
  got = selection_stats(jnp.asarray(q), entries(kv, seg, ratio), jnp.asarray(sel),
                        jnp.asarray(sel_valid), jnp.asarray(seg), jnp.asarray(answers),
                        topk=k, window=5, chunk=7)
  want = numpy_stats(q, kv, seg, ratio, sel, sel_valid, answers, k, 5)
  np.testing.assert_allclose(np.asarray(got.recall), want['recall'], atol=1e-6)
  np.testing.assert_allclose(np.asarray(got.mass), want['mass'], atol=1e-5)
  for name, key in (('answer_selected', 'selected'), ('answer_in_dense_topk', 'in_dense'),
                    ('answer_visible', 'visible'), ('answer_in_window', 'in_window')):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), want[key].astype(bool), name)
  np.testing.assert_array_equal(np.asarray(got.answered), answers >= 0)
  # the neighbour measure across chunk boundaries (chunk 7) and document starts
  np.testing.assert_array_equal(np.asarray(got.neighbour_counted), want['neighbour'] == 1)
  np.testing.assert_allclose(np.asarray(got.neighbour_shared), want['shared'], atol=1e-6)
  assert 0 < want['shared'].mean() < want['neighbour'].mean()  # some shared, not all
  # Measured at some rows only (probe rows, padded with -1): each field equals the full
  # stats' at its row, and the padding counts nowhere (at ratio 1 row 0 sees an entry).
  rows = jnp.asarray([[0, 5, 11, 12, 23, -1, -1], [3, 4, 17, -1, -1, -1, -1]], jnp.int32)
  for r, kv_r in ((ratio, kv), (1, rng.standard_normal((b, t, d)).astype(np.float32))):
    def stats(**at):
      return selection_stats(jnp.asarray(q), entries(kv_r, seg, r), jnp.asarray(sel),
                             jnp.asarray(sel_valid), jnp.asarray(seg), jnp.asarray(answers),
                             topk=k, window=5, **at)
    full, at = stats(chunk=7), stats(chunk=4, rows_bm=rows)
    assert np.asarray(full.counted)[:, 0].any() == (r == 1)
    for name, full_bt in full._asdict().items():
      want_bm = np.take_along_axis(np.asarray(full_bt), np.maximum(np.asarray(rows), 0), 1)
      got_bm, measured = np.asarray(getattr(at, name)), np.asarray(rows) >= 0
      np.testing.assert_allclose(got_bm[measured], want_bm[measured], atol=1e-6, err_msg=name)
      assert not got_bm[~measured].any(), name


def test_probe_rows_lists_each_rows_answers_in_a_shared_bucket():
  answers = np.full((3, 40), -1, np.int32)
  answers[0, [4, 9, 30]] = [1, 2, 3]
  answers[2, 39] = 0
  got = probe_rows(answers, at_least=2)
  assert got.shape == (3, 4)      # three rows at most, the next power of two
  assert got.tolist() == [[4, 9, 30, -1], [-1] * 4, [39, -1, -1, -1]]
  assert probe_rows(answers).shape == (3, 256)   # one query chunk: one compiled shape
  many = np.zeros((1, 600), np.int32)
  assert probe_rows(many).shape == (1, 1024)


def test_needles_at_16k_recall_drops_when_the_selection_misses_them():
  """16,384 tokens, ratio 1: four needle entries that every query attends to. Selecting the
  needles recovers the dense top-4 exactly; selecting the 4 newest entries (a restricted
  selection) recovers none of it, and the answer (a needle) is then never selected."""
  t, h, d, k = 16384, 2, 8, 4
  needles = np.array([100, 3000, 9000, 15000])
  rng = np.random.default_rng(1)
  u = np.zeros(d, np.float32)
  u[0] = 1.0
  kv = rng.standard_normal((1, t, d)).astype(np.float32) * 0.1
  kv[0, needles, 0] = 5.0
  q = np.broadcast_to(10 * u, (1, t, h, d)).astype(np.float32)
  seg = np.ones((1, t), np.int32)
  rows = np.arange(t)
  comp = entries(kv, seg)
  needle_sel = np.broadcast_to(needles, (1, t, k)).astype(np.int32)
  newest = np.maximum(rows[:, None] - np.arange(k)[None, :], 0)[None].astype(np.int32)
  answers = np.full((1, t), 3000, np.int32)
  run = jax.jit(lambda sel, valid: selection_stats(
      jnp.asarray(q), comp, sel, valid, jnp.asarray(seg), jnp.asarray(answers), topk=k,
      window=128, chunk=1024))
  hit = run(jnp.asarray(needle_sel), jnp.asarray(needle_sel <= rows[None, :, None]))
  miss = run(jnp.asarray(newest), jnp.asarray(np.ones((1, t, k), bool)))
  late = rows >= needles[-1] + k
  assert np.all(np.asarray(hit.recall)[0, late] == 1.0)
  assert np.all(np.asarray(hit.mass)[0, late] > 0.99)
  assert np.all(np.asarray(miss.recall)[0, late] == 0.0)
  assert np.all(np.asarray(miss.mass)[0, late] < 0.01)
  visible = rows >= 3000
  np.testing.assert_array_equal(np.asarray(hit.answer_visible)[0], visible)
  np.testing.assert_array_equal(np.asarray(hit.answer_in_dense_topk)[0], visible)
  np.testing.assert_array_equal(np.asarray(hit.answer_selected)[0], visible)
  np.testing.assert_array_equal(np.asarray(miss.answer_selected)[0],
                                (rows >= 3000) & (rows < 3000 + k))
  np.testing.assert_array_equal(np.asarray(miss.answer_in_window)[0],
                                (rows >= 3000) & (rows < 3000 + 128))


def _model(**overrides):
  cfg = resolved(**{'model.attention_variant': 'csa2', 'model.candidate_source_layer_id': -1,
                    'model.index_n_heads': 2, 'model.index_head_dim': 8, **overrides}).model
  return Transformer(cfg, nnx.Rngs(params=0))


def _batch(t=48):
  seg, pos = packed_layout([(30, 18)], t)
  tokens = np.random.default_rng(2).integers(3, 96, (1, t)).astype(np.int32)
  return {'tokens': jnp.asarray(tokens), 'segment_ids': jnp.asarray(seg),
          'positions': jnp.asarray(pos), 'modality': jnp.zeros((1, t), jnp.int32)}


def test_model_selecting_every_visible_entry_has_recall_one():
  """index_topk >= every visible count: each CSA2 layer selects all it sees, so its recall and
  mass are 1 wherever it sees an entry, and an answer is selected wherever it is visible."""
  model = _model(**{'model.index_topk': 48})
  answers = np.where(np.arange(48) >= 30, 33, 5)[None].astype(np.int32)
  stats = nnx.jit(lambda m, b, a: selection_diagnostics(m, b, a))(model, _batch(), answers)
  assert sorted(stats) == [1, 2, 3]    # every ratio > 0 layer of the small config
  for st in stats.values():
    counted = np.asarray(st.counted)
    assert counted.any()
    np.testing.assert_allclose(np.asarray(st.recall)[counted], 1.0)
    np.testing.assert_allclose(np.asarray(st.mass)[counted], 1.0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(st.answer_selected), np.asarray(st.answer_visible))
  summary = summarize(stats)
  assert summary['dense_recall'] == 1.0
  assert 0 < summary['answer_selected/L2'] == summary['answer_visible/L2'] < 1  # rows 0-4, 30-32


def test_model_with_a_small_top_k_misses_part_of_the_dense_top_k():
  model = _model(**{'model.index_topk': 2})
  stats = nnx.jit(lambda m, b: selection_diagnostics(m, b))(model, _batch())
  summary = summarize(stats, query_mask_bt=np.ones((1, 48), bool))
  assert 0.0 < summary['dense_recall'] < 1.0
  assert {f'dense_recall/L{layer}' for layer in (1, 2, 3)} <= set(summary)
  assert math.isnan(summary['answer_selected'])   # no answers given


def test_no_stats_for_the_dense_and_window_variants():
  for variant in ('dense', 'window'):
    model = _model(**{'model.attention_variant': variant})
    assert selection_diagnostics(model, _batch()) == {}


def test_the_forward_with_a_probe_measures_the_same_and_totals_add_up_over_batches():
  """One forward gives the logits (unchanged) and the stats (those of selection_diagnostics);
  totals summed over two halves of the rows read as the summary over all of them."""
  model = _model(**{'model.index_topk': 2})
  batch = _batch()
  answers = np.where(np.arange(48) >= 30, 33, 5)[None].astype(np.int32)
  plain, _ = nnx.jit(lambda m, b: m(b))(model, batch)
  logits, aux = nnx.jit(lambda m, b, a: m(b, probe=Probe(answer_rows_bt=a)))(model, batch,
                                                                              answers)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=1e-5)
  alone = nnx.jit(lambda m, b, a: selection_diagnostics(m, b, a))(model, batch, answers)
  # block remat (the evaluation model of a run that trains with it) passes the probe through
  rematerialized = Transformer(model.cfg, nnx.Rngs(params=0), remat='block')  # same weights
  _, remat = nnx.jit(lambda m, b, a: m(b, probe=Probe(answer_rows_bt=a)))(rematerialized, batch,
                                                                          answers)
  assert sorted(aux['selection']) == sorted(alone) == sorted(remat['selection']) == [1, 2, 3]
  for layer, st in alone.items():
    for name, want in st._asdict().items():
      for got in (aux, remat):
        np.testing.assert_allclose(np.asarray(getattr(got['selection'][layer], name)),
                                   np.asarray(want), atol=1e-6, err_msg=f'{name} L{layer}')
  # Probed at the answer rows only (the task evaluation's way): the same totals.
  some = np.where(np.arange(48) % 3 == 0, answers, -1).astype(np.int32)  # 16 of the 48 rows
  rows = probe_rows(some, at_least=8)
  assert rows.shape == (1, 16)
  _, probed = nnx.jit(lambda m, b, a, r: m(b, probe=Probe(answer_rows_bt=a, rows_bm=r)))(
      model, batch, some, rows)
  whole_at_answers = jax.device_get(selection_totals(
      nnx.jit(lambda m, b, a: selection_diagnostics(m, b, a))(model, batch, some), some >= 0))
  for layer, st in probed['selection'].items():
    np.testing.assert_allclose(np.asarray(jax.device_get(selection_totals({0: st}, rows >= 0))[0]),
                               whole_at_answers[layer], atol=1e-5, err_msg=f'L{layer}')
  first = np.arange(48)[None] < 31
  halves = [jax.device_get(selection_totals(alone, m)) for m in (first, ~first)]
  summed = summarize_totals({layer: halves[0][layer] + halves[1][layer] for layer in alone})
  whole = summarize(alone)
  assert set(summed) == set(whole) and 'answer_selected/L3' in whole
  for key, value in whole.items():
    assert summed[key] == pytest.approx(value, abs=1e-6, nan_ok=True), key
