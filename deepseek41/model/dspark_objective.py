"""DSpark drafting objective, acceptance and confidence calibration (pure jnp functions).

DSpark drafts K slots per anchor position P; slot k (1..K) predicts token P+k. Every function here
takes per-(anchor n, slot k) arrays: draft logits `[n, k, v]` (base logits U_k + Markov bias B_k),
the frozen backbone's logits for the same next token `[n, k, v]`, labels `[n, k]`, a confidence
logit `[n, k]` and `valid [n, k]` (False past the end of a document/sequence or on padded anchors).

Everything is jit-able (K, V and the bin/grid counts come from static shapes) and computed in f32.
Masked reductions divide by max(count, 1), so an empty batch gives 0 and never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _masked_mean(x, mask, axis=None):
  """Mean of x where mask, 0 where nothing is selected (the where keeps NaN/garbage out of sums)."""
  total = jnp.sum(jnp.where(mask, x, 0.0), axis=axis)
  count = jnp.sum(mask, axis=axis).astype(jnp.float32)
  return total / jnp.maximum(count, 1.0)


def _bce_with_logits(z, target):
  """-(t log s(z) + (1-t) log(1-s(z))) = softplus(z) - t z; stable for any finite z (no log(0))."""
  return jax.nn.softplus(z) - target * z


def _probs(logits_nkv):
  return jax.nn.softmax(logits_nkv.astype(jnp.float32), axis=-1)


# ---------------------------------------------------------------------------------------------
# Training loss
# ---------------------------------------------------------------------------------------------


def slot_weights(k: int, gamma: float):
  """f32[k]: w_k = exp(-(k-1)/gamma) for k = 1..K (later slots matter less: they are reached only
  if every earlier slot was accepted)."""
  return jnp.exp(-jnp.arange(k, dtype=jnp.float32) / gamma)


def draft_loss(draft_logits_nkv, target_logits_nkv, labels_nk, conf_logit_nk, valid_nk, *,
               ce_weight=0.1, l1_weight=0.9, bce_weight=1.0, gamma=5.0):
  """DSpark loss -> (loss f32[], terms).

  Per (n, k): p_d = softmax(draft), p_t = softmax(target) (no gradient: the backbone is frozen),
    ce_nk = -log p_d[label]                  (ground-truth next token),
    l1_nk = sum_v |p_d - p_t|                (total variation x2: 1 - l1/2 is the acceptance prob),
    accept_nk = 1 - l1_nk / 2                (no gradient: it is the confidence head's target),
    bce_nk = BCE(sigmoid(conf_logit), accept_nk), from logits.

  Aggregation [I] (our design choice, not from a reference):
    ce  = mean of ce_nk over valid (n, k);
    l1  = sum over valid (n, k) of w_k * l1_nk / (number of anchors with >= 1 valid slot), i.e. a
          per-anchor sum over slots with decaying weights w_k = slot_weights(K, gamma);
    bce = mean of bce_nk over valid (n, k).
  loss = ce_weight * ce + l1_weight * l1 + bce_weight * bce; 0 (finite, zero gradient) with no valid
  slot. Gradients reach the draft logits and the confidence logits only.

  terms: 'dspark_ce', 'dspark_l1', 'dspark_bce', 'dspark_accept' (mean accept_nk over valid).
  """
  draft = draft_logits_nkv.astype(jnp.float32)
  logp_d = jax.nn.log_softmax(draft, axis=-1)
  p_d = jnp.exp(logp_d)
  p_t = jax.lax.stop_gradient(_probs(target_logits_nkv))
  valid = valid_nk.astype(bool)
  n_anchor, n_slot, vocab = draft.shape

  # Labels of invalid slots may be padding (e.g. -1): clip so the gather stays in range; masked below.
  labels = jnp.clip(labels_nk.astype(jnp.int32), 0, vocab - 1)
  ce_nk = -jnp.take_along_axis(logp_d, labels[..., None], axis=-1)[..., 0]

  l1_nk = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
  accept_nk = jax.lax.stop_gradient(1.0 - 0.5 * l1_nk)
  bce_nk = _bce_with_logits(conf_logit_nk.astype(jnp.float32), accept_nk)

  ce = _masked_mean(ce_nk, valid)
  bce = _masked_mean(bce_nk, valid)
  w_k = slot_weights(n_slot, gamma)
  n_anchors = jnp.sum(jnp.any(valid, axis=-1)).astype(jnp.float32)
  l1 = jnp.sum(jnp.where(valid, w_k[None, :] * l1_nk, 0.0)) / jnp.maximum(n_anchors, 1.0)

  loss = ce_weight * ce + l1_weight * l1 + bce_weight * bce
  terms = {
      'dspark_ce': ce,
      'dspark_l1': l1,
      'dspark_bce': bce,
      'dspark_accept': _masked_mean(accept_nk, valid),
  }
  return loss, terms


# ---------------------------------------------------------------------------------------------
# Acceptance (speculative decoding with standard rejection sampling)
# ---------------------------------------------------------------------------------------------


def acceptance_nk(draft_logits_nkv, target_logits_nkv):
  """f32[n, k]: alpha = sum_v min(p_d, p_t), the probability that rejection sampling (draw x ~ p_d,
  accept with prob min(1, p_t[x] / p_d[x])) accepts slot k's token, given slots < k were accepted.
  Equals 1 - sum_v |p_d - p_t| / 2."""
  return jnp.sum(jnp.minimum(_probs(draft_logits_nkv), _probs(target_logits_nkv)), axis=-1)


def expected_accept_len(alpha_nk, valid_nk):
  """f32[n]: expected number of accepted draft tokens, sum_k prod_{i<=k} alpha_i. An invalid slot
  ends the chain (acts as a certain rejection), so it and every later slot contribute 0."""
  alpha = jnp.where(valid_nk.astype(bool), alpha_nk.astype(jnp.float32), 0.0)
  return jnp.sum(jnp.cumprod(alpha, axis=-1), axis=-1)


def acceptance_metrics(draft_logits_nkv, target_logits_nkv, valid_nk):
  """{'dspark_accept_len': mean expected accepted length over anchors whose slot 1 is valid,
  'dspark_accept/k' for k = 1..K: mean alpha over valid (n, k) of that slot}."""
  return acceptance_summary(acceptance_nk(draft_logits_nkv, target_logits_nkv), valid_nk)


def acceptance_summary(alpha_nk, valid_nk):
  """`acceptance_metrics` from the acceptance probabilities themselves."""
  valid = valid_nk.astype(bool)
  alpha = jnp.asarray(alpha_nk, jnp.float32)
  out = {'dspark_accept_len': _masked_mean(expected_accept_len(alpha, valid), valid[:, 0])}
  per_slot = _masked_mean(alpha, valid, axis=0)
  for k in range(alpha.shape[-1]):
    out[f'dspark_accept/{k + 1}'] = per_slot[k]
  return out


# ---------------------------------------------------------------------------------------------
# Confidence calibration
# ---------------------------------------------------------------------------------------------


def ece(conf_nk, target_nk, valid_nk, bins=10):
  """f32[]: expected calibration error of probabilities conf against target probabilities (the
  exact acceptance alpha, so no sampling noise in the target): equal-width bins on conf over
  [0, 1], sum_b (count_b / count) * |mean conf_b - mean target_b| over valid entries.
  Uses (count_b / count) * |mean diff| = |sum conf_b - sum target_b| / count; empty bins add 0."""
  conf = conf_nk.astype(jnp.float32).reshape(-1)
  target = target_nk.astype(jnp.float32).reshape(-1)
  valid = valid_nk.astype(bool).reshape(-1)
  # conf == 1 goes to the last bin (bins are [i/B, (i+1)/B) except the last, which is closed).
  b = jnp.clip(jnp.floor(conf * bins).astype(jnp.int32), 0, bins - 1)
  diff = jnp.where(valid, conf - target, 0.0)
  per_bin = jax.ops.segment_sum(diff, b, num_segments=bins)
  count = jnp.sum(valid).astype(jnp.float32)
  return jnp.sum(jnp.abs(per_bin)) / jnp.maximum(count, 1.0)


def default_temperature_grid(size=64, lo=0.05, hi=20.0):
  """f32[size]: log-spaced temperatures in [lo, hi] (ratio between neighbours (hi/lo)^(1/(size-1)))."""
  return jnp.asarray(np.geomspace(lo, hi, size), dtype=jnp.float32)


def fit_temperatures(conf_logit_nk, alpha_nk, valid_nk, grid=None):
  """f32[K]: per slot k the grid temperature T_k minimising the mean BCE of sigmoid(conf_logit / T)
  against alpha over that slot's valid entries ("sequential temperature scaling": each slot is
  fitted on its own; here all slots are searched at once, which gives the same result).
  A slot with no valid entry gets T = 1 (no change)."""
  grid = default_temperature_grid() if grid is None else jnp.asarray(grid, dtype=jnp.float32)
  valid = valid_nk.astype(bool)
  z_gnk = conf_logit_nk.astype(jnp.float32)[None] / grid[:, None, None]
  bce_gnk = _bce_with_logits(z_gnk, alpha_nk.astype(jnp.float32)[None])
  mean_bce_gk = _masked_mean(bce_gnk, valid[None], axis=1)
  t_k = grid[jnp.argmin(mean_bce_gk, axis=0)]
  return jnp.where(jnp.any(valid, axis=0), t_k, 1.0)


def calibrated(conf_logit_nk, t_k):
  """f32[n, k]: calibrated confidence sigmoid(conf_logit / T_k)."""
  return jax.nn.sigmoid(conf_logit_nk.astype(jnp.float32) / jnp.asarray(t_k, jnp.float32)[None, :])


def calibration_metrics(conf_logit_nk, alpha_nk, valid_nk, t_k):
  """{'dspark_ece_raw': ECE of sigmoid(conf_logit) vs alpha, 'dspark_ece': ECE after scaling by t_k}."""
  raw = jax.nn.sigmoid(conf_logit_nk.astype(jnp.float32))
  return {
      'dspark_ece_raw': ece(raw, alpha_nk, valid_nk),
      'dspark_ece': ece(calibrated(conf_logit_nk, t_k), alpha_nk, valid_nk),
  }
