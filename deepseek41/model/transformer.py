"""Embedding -> blocks -> final RMSNorm -> LM head (untied), with the role table driving each block.

Residuals are plain pre-norm for now (single-pass mHC replaces them in issue 4):
    h = x + Attn(attn_norm(x));   out = h + MoE(ffn_norm(h))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import LayerRole, ModelConfig, layer_roles
from deepseek41.model.attention import Attention
from deepseek41.model.csa2 import INDEXER_TOTALS
from deepseek41.model.moe import MoE
from deepseek41.model.norms import RMSNorm
from deepseek41.model.params import dtype_of, normal_param


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, role: LayerRole, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.attn = Attention(cfg, role, rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.moe = MoE(cfg, rngs)

  def __call__(self, x_btd, batch, shared):
    valid_bt = batch['segment_ids'] > 0
    attn_btd, shared = self.attn(self.attn_norm(x_btd), batch, shared)
    h_btd = x_btd + attn_btd
    y_btd, aux = self.moe(self.ffn_norm(h_btd), batch['modality'], valid_bt)
    return (h_btd + y_btd).astype(x_btd.dtype), aux, shared


def _rematerialized(block: Block, x_btd, batch, shared):
  """Run a block whose activations are recomputed in the backward pass.

  A pure `jax.checkpoint` over (graph, state): the forward never mutates state, so nothing has
  to flow back out, and NNX's lifted remat (which does propagate state) is not needed.
  """
  graphdef, state = nnx.split(block)

  def run(state, x_btd, batch, shared):
    return nnx.merge(graphdef, state)(x_btd, batch, shared)
  return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(
      state, x_btd, batch, shared)


class Transformer(nnx.Module):
  """The V4.1 backbone. `__call__(batch) -> (logits [B,T,V] fp32, aux)`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: str = 'none'):
    self.cfg = cfg
    self.remat = remat
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'), cfg.init_std)
    self.blocks = nnx.List([Block(cfg, role, rngs) for role in layer_roles(cfg)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.head = normal_param(rngs, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'), cfg.init_std)

  def __call__(self, batch):
    dt = dtype_of(self.cfg.compute_dtype)
    x_btd = jnp.take(self.embed[...], batch['tokens'], axis=0).astype(dt)
    auxes = []
    shared = {}  # compressed KV and selections published by source layers (CSA2)
    for block in self.blocks:
      if self.remat == 'block':
        x_btd, aux, shared = _rematerialized(block, x_btd, batch, shared)
      else:
        x_btd, aux, shared = block(x_btd, batch, shared)
      auxes.append(aux)
    h_btd = self.final_norm(x_btd)
    logits_btv = jnp.einsum('btd,dv->btv', h_btd, self.head[...].astype(dt),
                            preferred_element_type=jnp.float32)
    kl_sum, counted, recall_sum = shared.get(INDEXER_TOTALS, jnp.zeros(3, jnp.float32))
    aux = {
        'indexer_loss': kl_sum / jnp.maximum(counted, 1.0),
        'indexer_recall': recall_sum / jnp.maximum(counted, 1.0),
        'load_lme': jnp.stack([a['load_me'] for a in auxes]),
        'balance': sum(a['balance'] for a in auxes),  # one V3 term per MoE layer
        'dropped': sum(a['dropped'] for a in auxes),
    }
    return logits_btv, aux
