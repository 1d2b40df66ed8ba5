"""Image spans inside the language model: attention, routing biases, Engram, CED (section 3.15)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.batch import IMAGE, TEXT
from deepseek41.model.ced import ced_prefill_logits, exact_tail_rows
from deepseek41.model.transformer import Transformer
from deepseek41.ops.span_attention import span_partial
from deepseek41.ops.swa_attention import (_masked_softmax_partial, combine_with_sink, swa_partial,
                                          window_mask_btu)
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import make_train_step
from tests.helpers import SLOTS, VISION, image_batch, resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

T = 48


def spans_of(batch):
  s = batch['image_span'][0]
  return [(int(np.argmax(s == k)), int(np.argmax(s == k)) + int((s == k).sum()))
          for k in range(1, s.max() + 1)]


# ---------------------------------------------------------------------------------------------
# The attention op


def test_span_partial_gathered_equals_reference():
  batch = image_batch()
  k1, k2 = jax.random.split(jax.random.key(0))
  q = jax.random.normal(k1, (2, T, 3, 8))
  kv = jax.random.normal(k2, (2, T, 8))
  span_ids = jnp.asarray(batch['image_span'])
  ref = span_partial(q, kv, span_ids, num_spans=SLOTS, max_span=24, impl='reference')
  fast = span_partial(q, kv, span_ids, num_spans=SLOTS, max_span=24, impl='gathered')
  np.testing.assert_allclose(fast[0], ref[0], atol=1e-5)
  np.testing.assert_array_equal(np.isinf(fast[1]), np.isinf(ref[1]))
  np.testing.assert_allclose(np.where(np.isinf(ref[1]), 0, fast[1]),
                             np.where(np.isinf(ref[1]), 0, ref[1]), atol=1e-5)
  assert np.isinf(ref[1][:, :6]).all() and np.isfinite(ref[1][:, 6:14]).all()


@pytest.mark.parametrize('chunk', [0, 4, 24])
def test_span_partial_gathered_gradients_and_saved_residuals(chunk):
  """Chunked and recomputed in the backward: the reference's gradients, and no saved residual of
  the size of a span's [S, H, S] scores (the probabilities used to stay for the backward)."""
  from jax._src.ad_checkpoint import saved_residuals  # noqa: PLC0415 (what jax.checkpoint saves)
  batch = image_batch()
  k1, k2 = jax.random.split(jax.random.key(2))
  q = jax.random.normal(k1, (2, T, 3, 8))
  kv = jax.random.normal(k2, (2, T, 8))
  span_ids = jnp.asarray(batch['image_span'])

  def loss(impl):
    def fn(q, kv):
      o, lse = span_partial(q, kv, span_ids, num_spans=SLOTS, max_span=24, impl=impl,
                            chunk=chunk)
      return jnp.sum(o * jnp.cos(o)) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) ** 2)
    return fn
  want = jax.grad(loss('reference'), argnums=(0, 1))(q, kv)
  got = jax.grad(loss('gathered'), argnums=(0, 1))(q, kv)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5)
  scores_size = 2 * SLOTS * 24 * 3 * 24  # [B, spans, S, H, S]
  sizes = [aval.size for aval, _ in saved_residuals(loss('gathered'), q, kv)]
  if chunk:
    assert max(sizes) < scores_size / 2, sorted(sizes)[-3:]
  else:  # span_chunk=0 keeps them
    assert max(sizes) >= scores_size, sorted(sizes)[-3:]


@pytest.mark.parametrize('impl', ['reference', 'chunked'])
def test_window_and_span_partials_are_one_softmax_over_their_union(impl):
  """Window minus own span, plus the span branch == one softmax over (window or same span)."""
  batch = image_batch()
  k1, k2 = jax.random.split(jax.random.key(1))
  q = jax.random.normal(k1, (2, T, 3, 8))
  kv = jax.random.normal(k2, (2, T, 8))
  sink = jnp.array([0.3, -0.2, 0.0])
  seg, span_ids = jnp.asarray(batch['segment_ids']), jnp.asarray(batch['image_span'])
  window = 4
  parts = [swa_partial(q, kv, seg, window=window, impl=impl, chunk=4, span_ids_bt=span_ids),
           span_partial(q, kv, span_ids, num_spans=SLOTS, max_span=24)]
  got = combine_with_sink(parts, sink, dtype=jnp.float32)

  same_span = (span_ids[:, :, None] == span_ids[:, None, :]) & (span_ids != 0)[:, :, None]
  union = window_mask_btu(seg, window) | same_span
  scores = jnp.einsum('bthd,bud->bthu', q, kv) / np.sqrt(8)
  probs, lse = _masked_softmax_partial(scores, union[:, :, None, :])
  dense = jnp.einsum('bthu,bud->bthd', probs, kv)
  want = combine_with_sink([(dense, lse)], sink, dtype=jnp.float32)
  np.testing.assert_allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The whole model: perturbation tests


@pytest.fixture(scope='module')
def model_and_logits():
  cfg = resolved(**VISION, **{'model.attention_variant': 'csa2', 'model.engram': True,
                              'model.residual': 'mhc_single_pass'}).model
  model = Transformer(cfg, nnx.Rngs(0))
  run = jax.jit(lambda b: model(b)[0])
  return cfg, model, run


def _changed_rows(a, b):
  return np.abs(np.asarray(a) - np.asarray(b)).max(axis=-1) > 1e-6  # [B, T]


def test_image_positions_see_their_whole_span_and_nothing_after(model_and_logits):
  _, _, run = model_and_logits
  batch = image_batch()
  (s0, e0), (s1, e1) = spans_of(batch)
  base = run(batch)

  # Later pixels of the first image reach every position of its span, the start included.
  later = {**batch, 'image_patches': batch['image_patches'].copy()}
  later['image_patches'][:, 0, 15] ^= 0xFF  # patch row 3, col 3: the last merged token
  changed = _changed_rows(run(later), base)
  assert changed[:, s0:e0].all()
  assert not changed[:, :s0].any()          # causal to everything before the span
  assert changed[:, e0:s1].all()            # and the text after it reads the image

  # Text after the first span does not reach back into it, or anywhere before itself.
  after = {**batch, 'tokens': batch['tokens'].copy()}
  after['tokens'][:, e0 + 3] = (after['tokens'][:, e0 + 3] + 1) % 90 + 6
  changed = _changed_rows(run(after), base)
  assert not changed[:, :e0 + 3].any()
  assert changed[:, e0 + 3:s1].any()


def test_text_after_an_image_is_unaffected_by_later_tokens_and_images(model_and_logits):
  _, _, run = model_and_logits
  batch = image_batch()
  (_, e0), (s1, _) = spans_of(batch)
  base = run(batch)
  later = {**batch, 'image_patches': batch['image_patches'].copy(),
           'tokens': batch['tokens'].copy()}
  later['image_patches'][:, 1] ^= 0x55      # the second image
  later['tokens'][:, -1] += 1
  changed = _changed_rows(run(later), base)
  assert not changed[:, :s1].any()          # text between the images included
  assert changed[:, s1:].any()


def test_engram_never_hashes_across_an_image(model_and_logits):
  cfg, model, _ = model_and_logits
  batch = image_batch()
  (s0, e0), _ = spans_of(batch)
  before = {**batch, 'tokens': batch['tokens'].copy()}
  before['tokens'][:, s0 - 1] += 1          # the text token just before the image
  ids = model.with_engram_rows({k: jnp.asarray(v) for k, v in batch.items()})['engram_row_ids']
  ids2 = model.with_engram_rows({k: jnp.asarray(v) for k, v in before.items()})['engram_row_ids']
  for layer in ids:
    a, b = np.asarray(ids[layer]), np.asarray(ids2[layer])
    diff = (a != b).reshape(a.shape[0], a.shape[1], -1).any(-1)
    assert diff[:, s0 - 1].all()            # the changed token's own n-grams
    assert not diff[:, s0:].any()           # nothing at or after the image sees it


def test_ced_prefill_matches_full_forward_with_images(model_and_logits):
  cfg, model, run = model_and_logits
  batch = {k: jnp.asarray(v) for k, v in image_batch().items()}
  n_win = 32  # the tail starts after the first span: a span cut by the tail start is truncated
  exact = exact_tail_rows(cfg, n_win)
  assert exact > 0
  full = run(batch)[:, -exact:]
  ced = jax.jit(lambda b: ced_prefill_logits(model, b, n_win))(batch)[:, -exact:]
  np.testing.assert_allclose(ced, full, atol=2e-4)


def test_ced_exact_rows_cover_a_span_cut_by_the_tail_start(model_and_logits):
  """A span longer than the window, cut by the tail start, reaches further than the windows."""
  cfg, model, run = model_and_logits
  raw = image_batch(spans=((6, (4, 4)), (20, (12, 3))))
  batch = {k: jnp.asarray(v) for k, v in raw.items()}
  _, (s1, e1) = spans_of(raw)
  assert e1 - s1 > cfg.sliding_window
  start = s1 + 1
  n_win = T - start
  exact = exact_tail_rows(cfg, n_win)
  assert exact > 0
  full = np.asarray(run(batch))
  ced = np.asarray(jax.jit(lambda b: ced_prefill_logits(model, b, n_win))(batch))
  np.testing.assert_allclose(ced[:, -exact:], full[:, -exact:], atol=2e-4)
  window_only = n_win - (cfg.num_layers - cfg.num_encoder_layers) * (cfg.sliding_window - 1)
  assert not np.allclose(ced[:, -window_only:], full[:, -window_only:], atol=2e-4)


# ---------------------------------------------------------------------------------------------
# Modality-separated balancing


def test_image_only_batch_moves_only_the_image_bias():
  cfg = resolved(**VISION)
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  md = state_lib.model_def(cfg, tx)
  step = jax.jit(make_train_step(cfg, md))
  batch = image_batch(b=8)
  batch['segment_ids'] = np.where(batch['modality'] == IMAGE, 1, 0).astype(np.int32)  # pad text
  batch['loss_mask'] &= batch['segment_ids']
  _, metrics = step(state, batch)
  bias_lme = np.asarray(metrics['bias_lme'])
  assert (bias_lme[:, 0] == 0).all()        # text controller untouched
  assert (np.abs(bias_lme[:, 1]) > 0).any(axis=-1).all()  # every layer moved

  text_batch = image_batch(b=8)
  text_batch['segment_ids'] = np.where(text_batch['modality'] == TEXT, 1, 0).astype(np.int32)
  text_batch['loss_mask'] &= text_batch['segment_ids']
  _, metrics = step(state, text_batch)
  bias_lme = np.asarray(metrics['bias_lme'])
  assert (bias_lme[:, 1] == 0).all()
  assert (np.abs(bias_lme[:, 0]) > 0).any(axis=-1).all()
