"""DSpark loss, acceptance and calibration math against numpy transcriptions and a Monte-Carlo
simulation of rejection sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.model import dspark_objective as dso


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _case(seed=0, n=6, k=5, v=11):
  rng = np.random.default_rng(seed)
  draft = rng.normal(size=(n, k, v)).astype(np.float32) * 2.0
  target = rng.normal(size=(n, k, v)).astype(np.float32) * 2.0
  labels = rng.integers(0, v, size=(n, k)).astype(np.int32)
  conf = rng.normal(size=(n, k)).astype(np.float32) * 2.0
  valid = np.ones((n, k), bool)
  valid[1, 3:] = False       # document ends after slot 3
  valid[2, 1:] = False       # only slot 1 valid
  valid[4] = False           # padded anchor: fully invalid
  labels[4] = -1             # padding label must not break the gather
  return draft, target, labels, conf, valid


def _np_loss(draft, target, labels, conf, valid, ce_w=0.1, l1_w=0.9, bce_w=1.0, gamma=5.0):
  """Plain loop transcription of the brief."""
  n, k, _ = draft.shape
  w = np.exp(-np.arange(k) / gamma)
  ce_s = l1_s = bce_s = acc_s = 0.0
  cnt = 0
  anchors = 0
  for i in range(n):
    anchors += int(valid[i].any())
    for j in range(k):
      if not valid[i, j]:
        continue
      pd, pt = _softmax(draft[i, j].astype(np.float64)), _softmax(target[i, j].astype(np.float64))
      l1 = np.abs(pd - pt).sum()
      acc = 1.0 - 0.5 * l1
      c = _sigmoid(float(conf[i, j]))
      ce_s += -np.log(pd[labels[i, j]])
      l1_s += w[j] * l1
      bce_s += -(acc * np.log(c) + (1 - acc) * np.log(1 - c))
      acc_s += acc
      cnt += 1
  ce, bce, acc = ce_s / max(cnt, 1), bce_s / max(cnt, 1), acc_s / max(cnt, 1)
  l1 = l1_s / max(anchors, 1)
  return ce_w * ce + l1_w * l1 + bce_w * bce, dict(dspark_ce=ce, dspark_l1=l1, dspark_bce=bce,
                                                   dspark_accept=acc)


def test_slot_weights():
  np.testing.assert_allclose(dso.slot_weights(5, 5.0), np.exp(-np.arange(5) / 5.0), rtol=1e-6)
  np.testing.assert_allclose(dso.slot_weights(3, 2.0), [1.0, np.exp(-0.5), np.exp(-1.0)], rtol=1e-6)


def test_draft_loss_matches_numpy():
  draft, target, labels, conf, valid = _case()
  kw = dict(ce_weight=0.3, l1_weight=0.7, bce_weight=1.5, gamma=2.0)
  loss, terms = jax.jit(lambda *a: dso.draft_loss(*a, **kw))(draft, target, labels, conf, valid)
  ref_loss, ref_terms = _np_loss(draft, target, labels, conf, valid, 0.3, 0.7, 1.5, 2.0)
  assert set(terms) == set(ref_terms)
  for key, ref in ref_terms.items():
    np.testing.assert_allclose(float(terms[key]), ref, rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  # Defaults as in the brief.
  loss_d, _ = dso.draft_loss(draft, target, labels, conf, valid)
  np.testing.assert_allclose(float(loss_d), _np_loss(draft, target, labels, conf, valid)[0],
                             rtol=1e-5)


def test_draft_loss_gradients():
  draft, target, labels, conf, valid = _case(seed=1)

  def f(d, t, c):
    return dso.draft_loss(d, t, labels, c, valid)[0]

  g_d, g_t, g_c = jax.grad(f, argnums=(0, 1, 2))(jnp.asarray(draft), jnp.asarray(target),
                                                jnp.asarray(conf))
  assert np.all(np.asarray(g_t) == 0.0)                 # frozen backbone: exactly zero
  assert np.abs(np.asarray(g_d)[valid]).max() > 1e-4    # draft logits learn
  assert np.abs(np.asarray(g_c)[valid]).min() > 0.0     # every valid confidence learns
  assert np.all(np.asarray(g_d)[~valid] == 0.0)         # invalid slots contribute nothing
  assert np.all(np.asarray(g_c)[~valid] == 0.0)
  # BCE target is stop-gradient: the conf term's gradient on the draft is zero, so with only the
  # BCE weight on, the draft logits get no gradient.
  g_d_bce = jax.grad(lambda d: dso.draft_loss(d, target, labels, conf, valid, ce_weight=0.0,
                                              l1_weight=0.0)[0])(jnp.asarray(draft))
  assert np.all(np.asarray(g_d_bce) == 0.0)


def test_draft_loss_no_valid_slot():
  draft, target, labels, conf, valid = _case(seed=2)
  none = np.zeros_like(valid)
  loss, terms = dso.draft_loss(draft, target, labels, conf, none)
  assert float(loss) == 0.0 and all(float(v) == 0.0 for v in terms.values())
  g = jax.grad(lambda d, c: dso.draft_loss(d, target, labels, c, none)[0], argnums=(0, 1))(
      jnp.asarray(draft), jnp.asarray(conf))
  assert all(np.all(np.isfinite(np.asarray(x))) and np.all(np.asarray(x) == 0.0) for x in g)


def test_loss_accept_equals_acceptance():
  draft, target, labels, conf, valid = _case(seed=3)
  _, terms = dso.draft_loss(draft, target, labels, conf, valid)
  alpha = np.asarray(dso.acceptance_nk(draft, target))
  np.testing.assert_allclose(float(terms['dspark_accept']), alpha[valid].mean(), rtol=1e-5)


def _simulate(p_d, p_t, valid, trials, rng):
  """Rejection sampling, slot by slot: x ~ p_d, accept w.p. min(1, p_t[x]/p_d[x]); stop at the first
  rejection (an invalid slot is a rejection). Returns accepted counts [trials] and per-slot
  (reached, accepted) counts."""
  k = p_d.shape[0]
  acc = np.zeros((trials, k), bool)
  for j in range(k):
    x = np.minimum(np.searchsorted(np.cumsum(p_d[j]), rng.random(trials), side='right'),
                   p_d.shape[1] - 1)
    ratio = np.minimum(1.0, p_t[j][x] / p_d[j][x])
    acc[:, j] = (rng.random(trials) < ratio) & valid[j]
  alive = np.cumprod(acc, axis=1).astype(bool)           # accepted slot j and all before
  reached = np.concatenate([np.ones((trials, 1), bool), alive[:, :-1]], axis=1)
  return alive.sum(1), reached.sum(0), (reached & acc).sum(0)


@pytest.mark.parametrize('k', [3, 4, 5])
def test_acceptance_matches_monte_carlo(k):
  rng = np.random.default_rng(10 + k)
  n, v, trials = 3, 7, 100_000
  draft = rng.normal(size=(n, k, v)).astype(np.float32) * 1.5
  target = (draft + rng.normal(size=(n, k, v)) * 1.0).astype(np.float32)  # correlated, alpha ~.6-.9
  valid = np.ones((n, k), bool)
  valid[2, k - 1] = False
  alpha = np.asarray(dso.acceptance_nk(draft, target))
  length = np.asarray(dso.expected_accept_len(alpha, valid))
  p_d, p_t = _softmax(draft.astype(np.float64)), _softmax(target.astype(np.float64))
  for i in range(n):
    lens, reached, accepted = _simulate(p_d[i], p_t[i], valid[i], trials, rng)
    se = lens.std() / np.sqrt(trials)
    assert abs(lens.mean() - length[i]) < max(3 * se, 0.01), (i, lens.mean(), length[i], se)
    for j in range(k):
      if not valid[i, j]:
        continue
      rate = accepted[j] / reached[j]
      se_j = np.sqrt(alpha[i, j] * (1 - alpha[i, j]) / reached[j])
      assert abs(rate - alpha[i, j]) < max(3 * se_j, 0.005), (i, j, rate, alpha[i, j])
  # The closed form too: alpha = 1 - TV distance.
  np.testing.assert_allclose(alpha, 1 - 0.5 * np.abs(p_d - p_t).sum(-1), atol=1e-6)


def test_expected_accept_len_stops_at_invalid():
  alpha = np.array([[0.9, 0.8, 0.7, 0.6, 0.5],
                    [0.9, 0.8, 0.7, 0.6, 0.5],
                    [0.9, 0.8, 0.7, 0.6, 0.5]], np.float32)
  valid = np.array([[1, 1, 1, 1, 1],
                    [1, 1, 0, 1, 1],      # invalid in the middle: later slots don't count
                    [0, 1, 1, 1, 1]], bool)
  got = np.asarray(dso.expected_accept_len(alpha, valid))
  full = 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.7 + 0.9 * 0.8 * 0.7 * 0.6 + 0.9 * 0.8 * 0.7 * 0.6 * 0.5
  np.testing.assert_allclose(got, [full, 0.9 + 0.72, 0.0], rtol=1e-6)


def test_acceptance_metrics():
  draft, target, _, _, valid = _case(seed=4)
  m = jax.jit(dso.acceptance_metrics)(draft, target, valid)
  alpha = 1 - 0.5 * np.abs(_softmax(draft.astype(np.float64)) -
                           _softmax(target.astype(np.float64))).sum(-1)
  assert set(m) == {'dspark_accept_len'} | {f'dspark_accept/{k}' for k in range(1, 6)}
  for k in range(5):
    np.testing.assert_allclose(float(m[f'dspark_accept/{k + 1}']), alpha[valid[:, k], k].mean(),
                               rtol=1e-5)
  lens = []
  for i in range(valid.shape[0]):
    if valid[i, 0]:
      chain, total = 1.0, 0.0
      for k in range(5):
        if not valid[i, k]:
          break
        chain *= alpha[i, k]
        total += chain
      lens.append(total)
  np.testing.assert_allclose(float(m['dspark_accept_len']), np.mean(lens), rtol=1e-5)


def _np_ece(conf, target, valid, bins=10):
  conf, target = conf[valid], target[valid]
  total = 0.0
  for b in range(bins):
    lo, hi = b / bins, (b + 1) / bins
    sel = (conf >= lo) & ((conf < hi) if b < bins - 1 else (conf <= hi))
    if sel.any():
      total += sel.sum() / conf.size * abs(conf[sel].mean() - target[sel].mean())
  return total


def test_ece():
  rng = np.random.default_rng(5)
  conf = rng.random((40, 5)).astype(np.float32)
  conf[0, 0], conf[0, 1] = 1.0, 0.0                      # edges of the range
  valid = rng.random((40, 5)) < 0.8
  assert float(dso.ece(conf, conf, valid)) == 0.0        # perfectly calibrated
  target = np.clip(conf + rng.normal(size=conf.shape) * 0.2, 0, 1).astype(np.float32)
  target[~valid] = 5.0                                   # garbage where invalid must not count
  got = float(jax.jit(dso.ece, static_argnames='bins')(conf, target, valid, bins=10))
  np.testing.assert_allclose(got, _np_ece(conf, target, valid), rtol=1e-5)
  np.testing.assert_allclose(float(dso.ece(conf, target, valid, bins=4)),
                             _np_ece(conf, target, valid, bins=4), rtol=1e-5)
  assert float(dso.ece(conf, target, np.zeros_like(valid))) == 0.0


def test_fit_temperatures_recovers_known_temperature():
  rng = np.random.default_rng(6)
  alpha = rng.uniform(0.05, 0.95, size=(400, 5)).astype(np.float32)
  valid = rng.random((400, 5)) < 0.9
  t_true = np.array([3.0, 3.0, 3.0, 0.5, 8.0], np.float32)  # last two slots: other temperatures
  conf_logit = (t_true * np.log(alpha / (1 - alpha))).astype(np.float32)
  conf_logit[~valid] = 100.0                             # garbage where invalid must not count
  t_k = np.asarray(jax.jit(dso.fit_temperatures)(conf_logit, alpha, valid))
  grid = np.geomspace(0.05, 20.0, 64)
  step = np.log(grid[1] / grid[0])
  assert np.all(np.abs(np.log(t_k / t_true)) <= step), t_k
  assert np.all(np.isin(t_k, grid.astype(np.float32)))
  m = dso.calibration_metrics(conf_logit, alpha, valid, t_k)
  assert float(m['dspark_ece']) <= float(m['dspark_ece_raw'])
  assert float(m['dspark_ece_raw']) > 0.05 and float(m['dspark_ece']) < 0.02
  np.testing.assert_allclose(np.asarray(dso.calibrated(conf_logit, t_k)),
                             _sigmoid(conf_logit / t_k), rtol=1e-5)
  # A slot with no valid entry keeps T = 1; a custom grid is searched as given.
  valid[:, 2] = False
  assert float(dso.fit_temperatures(conf_logit, alpha, valid)[2]) == 1.0
  t_custom = np.asarray(dso.fit_temperatures(conf_logit, alpha, valid, grid=[1.0, 2.9, 7.0]))
  np.testing.assert_allclose(t_custom[[0, 1, 3]], [2.9, 2.9, 1.0])
