"""DSpark, V4.1's drafting module (docs/architecture.md section 3.14).

Per anchor position P (the token the target just produced) it drafts K = block_size tokens in
one pass of `num_blocks` stacked draft blocks:

    m_t     = RMSNorm(W_main [h_t^{l1}; h_t^{l2}; h_t^{l3}])   h^l: the residual entering target
                                                               layer l, mean over the mHC streams
    rows    = [anchor, noise x (K-1)] at positions P..P+K-1, embedded by the (frozen) backbone table
    block b = a V4.1 block (mHC, MoE with its own experts) whose attention sees, from every row,
              the context ring RoPE(kv_norm_b(W_kv,b m_t)) for t in [P-W, P-1] (same document) and
              every row of the block (bidirectional inside the block), plus the sink
    U_k     = head(RMSNorm(read of the last block)), the backbone's (frozen) LM head
    B_k     = w2 . w1[x_{k-1}]                                  Markov bias, rank r; x_0 = anchor
    c_k     = sigmoid(w_c . [h_k ; w1[x_{k-1}]])                confidence of slot k

Slot k (row k-1) predicts the token at P+k. In training x_{k-1} is the true token (teacher
forcing); the labels are the true tokens P+1..P+K, and the targets the backbone's distributions at
P..P+K-1.

Our choices where the sources are silent [I]: DSpark's own final RMSNorm; the draft blocks run the
mHC sites through the reference path (their rows are [N, K], not sequences the fused kernels
tile); with the multi-pass residual the last block is read as the mean of the streams; the
confidence head has no bias.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import SWA, DSparkConfig, LayerRole, ModelConfig
from deepseek41.model.attention import Attention
from deepseek41.model.mhc import collapse
from deepseek41.model.norms import RMSNorm
from deepseek41.model.params import TokenTable, dtype_of, normal_param
from deepseek41.model.rope import apply_rope, rope_for_role
from deepseek41.model.shared import Shared
from deepseek41.model.transformer import Block
from deepseek41.ops.fp8_matmul import dense
from deepseek41.ops.swa_attention import combine_with_sink, keyset_partial


def draft_model_config(cfg: ModelConfig, ds: DSparkConfig) -> ModelConfig:
  """The backbone's block shapes with the draft MoE's expert count and top-k (section 3.14)."""
  return dataclasses.replace(cfg, n_routed_experts=ds.n_routed_experts,
                             num_experts_per_tok=ds.num_experts_per_tok, mhc_impl='reference',
                             engram_layer_ids=(), attention_variant='window')


def draft_role(layer: int) -> LayerRole:
  """Window-only attention with the main RoPE: what every draft block is."""
  return LayerRole(layer=layer, block='decoder', ratio=0, mode=SWA, kv_source=-1,
                   index_source=-1, publishes_candidates=False, uses_candidates=False,
                   engram=False, rope='main')


class DraftAttention(Attention):
  """The draft rows' attention: the context ring of the anchor plus the whole block.

  `batch['dspark_context']` holds, per anchor n, the ring's features m [N, W, D], their
  positions [N, W] and which slots are real [N, W] (before the sequence start or in another
  document: not). Each block turns m into its own keys with its own W_kv and kv_norm.
  """

  def __call__(self, x_nrd, batch, shared: Shared):
    ctx = batch['dspark_context']
    positions_nr = batch['positions']
    _, q_nrhd, kv_nrd = self.project(x_nrd, positions_nr)
    kv_nwd = self.latent(ctx['m_nwd'].astype(x_nrd.dtype), ctx['positions_nw'])
    keys_nud = jnp.concatenate([kv_nwd, kv_nrd.astype(kv_nwd.dtype)], axis=1)
    n, r = positions_nr.shape
    w = kv_nwd.shape[1]
    sees_nru = jnp.concatenate([jnp.broadcast_to(ctx['ok_nw'][:, None, :], (n, r, w)),
                                jnp.ones((n, r, r), bool)], axis=-1)  # bidirectional block
    o_nrhd = combine_with_sink([keyset_partial(q_nrhd, keys_nud, sees_nru)], self.sink[...],
                               dtype=x_nrd.dtype)
    inv_freq = rope_for_role(self.cfg, self.role.rope)
    o_nrhd = apply_rope(o_nrhd, positions_nr, inv_freq, inverse=True)
    return self.output(o_nrhd), shared


class Anchors(NamedTuple):
  """Where the drafts start: row b_n of the batch, position p_n (int32 [N] each)."""
  b_n: jax.Array
  p_n: jax.Array


class Drafts(NamedTuple):
  """DSpark's output for N anchors x K slots (slot k predicts the token at P+k)."""
  logits_nkv: jax.Array     # fp32 U_k + B_k: the draft distribution's logits
  conf_logit_nk: jax.Array  # fp32: c_k = sigmoid(conf_logit)
  labels_nk: jax.Array      # int32: the true token at P+k
  valid_nk: jax.Array       # bool: P+k lies in the anchor's document
  auxes: tuple              # the draft blocks' MoE aux (loads for the router-bias rule)


def sample_anchors(key, segment_ids_bt, per_row: int) -> Anchors:
  """`per_row` anchors per row, uniform over the positions whose next token is in the same
  document (a row without one gets anchors whose slots are all invalid)."""
  b, t = segment_ids_bt.shape
  seg = segment_ids_bt
  ok_bt = jnp.zeros((b, t), bool).at[:, :-1].set((seg[:, :-1] > 0) & (seg[:, :-1] == seg[:, 1:]))
  # Gumbel top-k over the allowed positions: distinct anchors, uniform, no host loop.
  g_bt = jax.random.gumbel(key, (b, t)) + jnp.where(ok_bt, 0.0, -1e9)
  _, p_ba = jax.lax.top_k(g_bt, min(per_row, t))
  b_ba = jnp.broadcast_to(jnp.arange(b)[:, None], p_ba.shape)
  return Anchors(b_ba.reshape(-1).astype(jnp.int32), p_ba.reshape(-1).astype(jnp.int32))


class DSpark(nnx.Module):
  """The drafter: main projection, draft blocks, Markov and confidence heads (no embedding or
  LM head of its own: it reads the backbone's)."""

  def __init__(self, cfg: ModelConfig, ds: DSparkConfig, rngs: nnx.Rngs):
    d, std = cfg.d_model, cfg.init_std
    self.cfg, self.ds = cfg, ds
    self.targets = ds.targets(cfg.num_layers)
    draft_cfg = draft_model_config(cfg, ds)
    self.main_proj = normal_param(rngs, (len(self.targets) * d, d), ('dspark_in', 'embed'), std)
    self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
    self.blocks = nnx.List([Block(draft_cfg, draft_role(cfg.num_layers + i), rngs,
                                  attention=DraftAttention) for i in range(ds.num_blocks)])
    self.final_norm = RMSNorm(d, cfg.rms_norm_eps)
    self.markov_in = normal_param(rngs, (cfg.vocab_size, ds.markov_rank), ('vocab', 'markov'), std,
                                  TokenTable)
    self.markov_out = normal_param(rngs, (cfg.vocab_size, ds.markov_rank), ('vocab', 'markov'),
                                   std, TokenTable)
    self.confidence = normal_param(rngs, (d + ds.markov_rank,), ('dspark_conf',), std)

  def context(self, captured: dict) -> jax.Array:
    """m [B, T, D]: the projected, normed concatenation of the target layers' inputs."""
    dt = dtype_of(self.cfg.compute_dtype)
    h_btf = jnp.concatenate([captured[l].astype(dt) for l in self.targets], axis=-1)
    return self.main_norm(dense(h_btf, self.main_proj[...], self.cfg.fp8))

  def __call__(self, m_btd, batch, anchors: Anchors, embed_vd, head_dv) -> Drafts:
    """Training: the drafts of every anchor, the Markov bias teacher-forced with the true tokens."""
    k, w = self.ds.block_size, self.cfg.sliding_window
    tokens_bt, seg_bt, pos_bt = batch['tokens'], batch['segment_ids'], batch['positions']
    t = tokens_bt.shape[1]
    b_n, p_n = anchors
    j_k = jnp.arange(k, dtype=jnp.int32)
    anchor_n = tokens_bt[b_n, p_n]

    # The context ring: positions P-W..P-1 of the anchor's document.
    t_nw = p_n[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :]
    t_safe = jnp.clip(t_nw, 0, t - 1)
    seg_n = seg_bt[b_n, p_n]
    ok_nw = (t_nw >= 0) & (seg_bt[b_n[:, None], t_safe] == seg_n[:, None]) & (seg_n[:, None] > 0)
    context = {'m_nwd': m_btd[b_n[:, None], t_safe], 'positions_nw': pos_bt[b_n[:, None], t_safe],
               'ok_nw': ok_nw}
    h_nkd, base_nkv, auxes = self.draft_rows(anchor_n, pos_bt[b_n, p_n], context, embed_vd,
                                             head_dv)

    # Slot k's previous token: the anchor, then the true tokens (teacher forcing).
    ahead_nk = p_n[:, None] + 1 + j_k[None, :]                    # the position slot k predicts
    ahead_safe = jnp.clip(ahead_nk, 0, t - 1)
    labels_nk = tokens_bt[b_n[:, None], ahead_safe]
    prev_nk = jnp.concatenate([anchor_n[:, None], labels_nk[:, :-1]], axis=1)
    valid_nk = (ahead_nk < t) & (seg_bt[b_n[:, None], ahead_safe] == seg_n[:, None]) \
        & (seg_n[:, None] > 0)
    bias_nkv, e_nkr = self.markov(prev_nk)
    return Drafts(base_nkv + bias_nkv, self.confidence_logit(h_nkd, e_nkr),
                  labels_nk.astype(jnp.int32), valid_nk, auxes)

  def draft_rows(self, anchor_n, anchor_pos_n, context: dict, embed_vd, head_dv):
    """(h_nkd, U_nkv fp32, auxes): the draft blocks over [anchor, noise x (K-1)] at positions
    P..P+K-1 and the LM head's logits of every slot, before the Markov bias.

    context: the anchor's ring `m_nwd` [N, W', D], `positions_nw`, `ok_nw` (slots that are real
    positions P-W..P-1 of its document); W' >= W, in any order.
    """
    cfg, k = self.cfg, self.ds.block_size
    dt = dtype_of(cfg.compute_dtype)
    n = anchor_n.shape[0]
    rows_nk = jnp.concatenate(
        [anchor_n[:, None], jnp.full((n, k - 1), self.ds.noise_token_id, jnp.int32)], axis=1)
    positions_nk = anchor_pos_n[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    x = jnp.take(embed_vd, rows_nk, axis=0).astype(dt)
    pre = None
    if cfg.residual != 'plain':
      x = jnp.broadcast_to(x[:, :, None, :], (n, k, cfg.hc_mult, cfg.d_model))
      if cfg.residual == 'mhc_single_pass':
        pre = jnp.broadcast_to(jax.nn.one_hot(0, cfg.hc_mult, dtype=jnp.float32),
                               (n, k, cfg.hc_mult))
    rows_batch = {
        'segment_ids': jnp.ones((n, k), jnp.int32),  # every draft row is real
        'positions': positions_nk,
        'modality': jnp.zeros((n, k), jnp.int32),
        'dspark_context': context,
    }
    auxes = []
    for block in self.blocks:
      with jax.named_scope(f'dspark{block.layer}'):
        x, pre, aux, _ = block(x, pre, rows_batch, Shared())
      auxes.append(aux)

    if cfg.residual == 'mhc_single_pass':
      x = collapse(x, pre)
    elif cfg.residual == 'mhc_multi_pass':
      x = jnp.mean(x.astype(jnp.float32), axis=2).astype(dt)
    h_nkd = self.final_norm(x)
    base_nkv = jnp.einsum('nkd,dv->nkv', h_nkd, head_dv.astype(dt),
                          preferred_element_type=jnp.float32)
    return h_nkd, base_nkv, tuple(auxes)

  def markov(self, prev_nk):
    """(B_nkv fp32, w1[x_{k-1}] fp32 [N, K, r]): the Markov bias from each slot's previous token."""
    e_nkr = jnp.take(self.markov_in[...], prev_nk, axis=0).astype(jnp.float32)
    return jnp.einsum('nkr,vr->nkv', e_nkr, self.markov_out[...].astype(jnp.float32)), e_nkr

  def confidence_logit(self, h_nkd, e_nkr):
    """fp32 [N, K]: c_k = sigmoid of this."""
    feats_nkf = jnp.concatenate([h_nkd.astype(jnp.float32), e_nkr], axis=-1)
    return jnp.einsum('nkf,f->nk', feats_nkf, self.confidence[...].astype(jnp.float32))


def target_rows(x_bt, anchors: Anchors, k: int):
  """[N, K, ...]: the rows of a backbone array [B, T, ...] (its logits, or the head's input) for
  the same next tokens as the K slots: positions P..P+K-1."""
  t = x_bt.shape[1]
  b_n, p_n = anchors
  at_nk = jnp.clip(p_n[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, t - 1)
  return x_bt[b_n[:, None], at_nk]
