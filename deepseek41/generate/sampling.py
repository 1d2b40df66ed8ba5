"""Sampling and the rejection-sampling verification of drafts (docs/architecture.md section 3.14).

`probs(logits, temperature, top_p)`: the distribution a token is drawn from (temperature 0 is
greedy: one-hot at the argmax). Drafts and target go through the same transform, so rejection
sampling returns exactly the target's transformed distribution:

    slot i (draft d_i from q_i) is accepted with probability min(1, p_{i-1}(d_i) / q_i(d_i)),
    given slots 1..i-1 were; at the first rejection the token is drawn from
    norm(max(0, p_{i-1} - q_i)); when all `admit` slots pass, a bonus token from p_admit.

Greedy (temperature 0): a draft is accepted iff it is the target's argmax, and the next token is
the argmax where it first differs, so the output is exactly plain greedy decoding's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def probs(logits_xv, temperature: float, top_p: float = 1.0):
  """fp32 probabilities [..., V]: softmax(logits / T) cut to the smallest top-p set."""
  logits_xv = logits_xv.astype(jnp.float32)
  if temperature <= 0:
    return jax.nn.one_hot(jnp.argmax(logits_xv, axis=-1), logits_xv.shape[-1], dtype=jnp.float32)
  p_xv = jax.nn.softmax(logits_xv / temperature, axis=-1)
  if top_p < 1.0:
    sorted_xv = jnp.sort(p_xv, axis=-1)[..., ::-1]
    before_xv = jnp.cumsum(sorted_xv, axis=-1) - sorted_xv  # mass strictly above each
    kept = jnp.where(before_xv < top_p, sorted_xv, jnp.inf)
    floor_x1 = jnp.min(kept, axis=-1, keepdims=True)  # the smallest probability kept
    p_xv = jnp.where(p_xv >= floor_x1, p_xv, 0.0)
    p_xv = p_xv / jnp.sum(p_xv, axis=-1, keepdims=True)
  return p_xv


def draw(key, p_xv):
  """int32 [...]: one token from each distribution (its argmax where it is one-hot)."""
  # Not log(max(p, tiny)): under jit XLA flushes a denormal floor to 0 and the log turns NaN.
  positive = p_xv > 0
  logits = jnp.where(positive, jnp.log(jnp.where(positive, p_xv, 1.0)), -jnp.inf)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def sample(key, logits_xv, temperature: float, top_p: float = 1.0):
  """(tokens int32 [...], their distribution `probs` [..., V]). Greedy takes the argmax of the
  logits: what a draw from the one-hot gives, without its noise over the vocabulary."""
  p_xv = probs(logits_xv, temperature, top_p)
  if temperature <= 0:
    return jnp.argmax(logits_xv.astype(jnp.float32), axis=-1).astype(jnp.int32), p_xv
  return draw(key, p_xv), p_xv


def verify(key, p_bjv, q_bkv, drafts_bk, admit_b, greedy: bool):
  """(accepted_b, next_b): how many of the first admit_b drafts are accepted, and the token after
  them (a residual draw after a rejection, else the bonus).

  p_bjv [B, J, V]: the target's distributions at the chunk's positions (p_0 follows the anchor);
  q_bkv [B, J-1, V] and drafts_bk [B, J-1]: the drafts' distributions and tokens; admit_b <= J-1.
  Slot i's uniform depends on the key and i only, not on J: a verification of more drafts than
  a row admits accepts what a shorter one would (the device loop, programs.py's
  `Programs.speculate`, verifies every drafted slot; the host loop only as many as some row
  admits).
  """
  if greedy:
    return verify_greedy(p_bjv, drafts_bk, admit_b)
  b, j1 = drafts_bk.shape
  p_d_bk = jnp.take_along_axis(p_bjv[:, :j1], drafts_bk[..., None], axis=-1)[..., 0]
  q_d_bk = jnp.take_along_axis(q_bkv, drafts_bk[..., None], axis=-1)[..., 0]
  key_u, key_r = jax.random.split(key)
  u_bk = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key_u, i), (b,)),
                  out_axes=1)(jnp.arange(j1))
  ok_bk = u_bk * q_d_bk < p_d_bk  # u < p / q without dividing (q > 0 where d was drawn)
  accepted_b = _accepted(ok_bk, admit_b)
  p_next_bv = jnp.take_along_axis(p_bjv, accepted_b[:, None, None], axis=1)[:, 0]
  rejected_b = accepted_b < admit_b
  q_at = jnp.take_along_axis(q_bkv, jnp.minimum(accepted_b, j1 - 1)[:, None, None], axis=1)[:, 0]
  residual_bv = jnp.maximum(p_next_bv - q_at, 0.0)
  mass_b1 = jnp.sum(residual_bv, axis=-1, keepdims=True)
  residual_bv = jnp.where(mass_b1 > 0, residual_bv / jnp.where(mass_b1 > 0, mass_b1, 1.0),
                          p_next_bv)
  next_b = draw(key_r, jnp.where(rejected_b[:, None], residual_bv, p_next_bv))
  return accepted_b, next_b


def verify_greedy(scores_bjv, drafts_bk, admit_b):
  """`verify` at temperature 0: a draft is accepted while it is the target's argmax, and the
  next token is the argmax where the first one differs (or the bonus). scores_bjv: the logits,
  or any scores with the same argmax (greedy `probs`, its one-hot)."""
  target_bj = jnp.argmax(scores_bjv, axis=-1).astype(jnp.int32)
  accepted_b = _accepted(drafts_bk == target_bj[:, :drafts_bk.shape[1]], admit_b)
  return accepted_b, jnp.take_along_axis(target_bj, accepted_b[:, None], axis=1)[:, 0]


def _accepted(ok_bk, admit_b):
  """int32 [B]: the run of accepted slots from the first, among the first admit_b."""
  ok_bk = ok_bk & (jnp.arange(ok_bk.shape[1])[None, :] < admit_b[:, None])
  return jnp.sum(jnp.cumprod(ok_bk.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def verify_length(conf_bk, cost_per_position: float):
  """int32 [B]: drafts to verify per row. Positions are admitted in order while the expected
  tokens per unit of verify cost rise: with c_k the confidence of slot k, verifying j drafts
  yields 1 + sum_{i<=j} prod_{k<=i} c_k tokens (the accepted drafts and the next token) for a
  forward of cost 1 + cost_per_position * j (relative to one plain decode step)."""
  expected_bk = jnp.cumsum(jnp.cumprod(conf_bk, axis=1), axis=1)
  j_k = jnp.arange(1, conf_bk.shape[1] + 1)
  rate_bk = (1.0 + expected_bk) / (1.0 + cost_per_position * j_k)
  rate_bj = jnp.concatenate([jnp.ones_like(rate_bk[:, :1]), rate_bk], axis=1)  # j = 0: 1 token
  rising_bk = rate_bj[:, 1:] > rate_bj[:, :-1]
  return jnp.sum(jnp.cumprod(rising_bk.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
