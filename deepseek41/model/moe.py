"""DeepSeekMoE with modality-separated aux-loss-free balancing (docs/architecture.md section 3.11).

Router math is fp32: `s = sqrt(softplus(x W_g))`; the correction bias of the token's modality
steers *selection* only (`idx = top_k(s + b[modality])`), the combine weights use the unbiased
scores (`g = s[idx] / sum s[idx] * route_scale`). The two biases (text, image) are `RouterBias`
state, updated after each step by the sign rule from the loads of the global batch
(`update_router_bias`), never by the optimizer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import ModelConfig
from deepseek41.model.params import RouterBias, normal_param
from deepseek41.ops.expert_gemm import GROUPED_BACKENDS, clipped_swiglu
from deepseek41.ops.fp8_matmul import dense
from deepseek41.ops.gpu.grouped_gemm import default_tiles
from deepseek41.ops.parallel.expert_parallel import routed_experts
from deepseek41.ops.parallel.per_device import batch_local

NUM_MODALITIES = 2  # 0 = text, 1 = image (batch field `modality`)
SMALL_CALL_TOKENS = 128  # a call of fewer tokens is decode-sized (`MoE.grouped_tiles`)


def router_scores(x_btd, w_router_de):
  """sqrt(softplus(.)) affinities in fp32: [B, T, E]."""
  logits_bte = jnp.einsum('btd,de->bte', x_btd.astype(jnp.float32), w_router_de.astype(jnp.float32))
  return jnp.sqrt(jax.nn.softplus(logits_bte))


def route(scores_bte, bias_me, modality_bt, k: int, route_scale: float):
  """Top-k by biased score; weights from unbiased scores, normalised, times route_scale."""
  biased_bte = scores_bte + bias_me[modality_bt]
  _, idx_btk = jax.lax.top_k(jax.lax.stop_gradient(biased_bte), k)
  s_btk = jnp.take_along_axis(scores_bte, idx_btk, axis=-1)
  weights_btk = s_btk / (jnp.sum(s_btk, axis=-1, keepdims=True) + 1e-20) * route_scale
  return idx_btk, weights_btk


def expert_load(idx_btk, modality_bt, valid_bt, num_experts: int):
  """Assignments per (modality, expert) over real tokens: [M, E] float32."""
  hits_bte = jnp.sum(jax.nn.one_hot(idx_btk, num_experts, dtype=jnp.float32), axis=-2)
  mod_btm = jax.nn.one_hot(modality_bt, NUM_MODALITIES, dtype=jnp.float32) * valid_bt[..., None]
  return jnp.einsum('btm,bte->me', mod_btm, hits_bte)


def sequence_balance_loss(scores_bte, idx_btk, valid_bt, k: int):
  """V3-style sequence-wise balance term sum_e f_e P_e, averaged over rows (weight applied outside)."""
  e = scores_bte.shape[-1]
  valid = valid_bt.astype(jnp.float32)
  n_b = jnp.maximum(jnp.sum(valid, axis=-1), 1.0)
  hits_bte = jnp.sum(jax.nn.one_hot(idx_btk, e, dtype=jnp.float32), axis=-2) * valid[..., None]
  f_be = e / (k * n_b[:, None]) * jnp.sum(hits_bte, axis=1)
  p_bte = scores_bte / (jnp.sum(scores_bte, axis=-1, keepdims=True) + 1e-20) * valid[..., None]
  p_be = jnp.sum(p_bte, axis=1) / n_b[:, None]
  return jnp.mean(jnp.sum(jax.lax.stop_gradient(f_be) * p_be, axis=-1))


def update_router_bias(bias_me, load_me, rate: float):
  """Sign rule per modality: b_e += rate * sign(mean load - load_e).

  A modality with no tokens in the batch has load 0 everywhere, so its bias does not move.
  """
  mean_m1 = jnp.mean(load_me, axis=-1, keepdims=True)
  return bias_me + rate * jnp.sign(mean_m1 - load_me)


class MoE(nnx.Module):
  """Routed experts (top-k of E) plus shared experts."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, e, f = cfg.d_model, cfg.n_routed_experts, cfg.moe_intermediate_size
    std = cfg.init_std
    self.cfg = cfg
    self.w_router = normal_param(rngs, (d, e), ('embed', None), std)
    self.router_bias = RouterBias(jnp.zeros((NUM_MODALITIES, e), jnp.float32),
                                  logical_axes=(None, None))
    self.w_gate = normal_param(rngs, (e, d, f), ('experts', 'embed', 'expert_mlp'), std,
                               stack_axes=(0,))
    self.w_up = normal_param(rngs, (e, d, f), ('experts', 'embed', 'expert_mlp'), std,
                             stack_axes=(0,))
    self.w_down = normal_param(rngs, (e, f, d), ('experts', 'expert_mlp', 'embed'), std,
                               stack_axes=(0,))  # one matrix per expert, for Muon
    fs = f * cfg.n_shared_experts
    if fs:
      self.shared_gate = normal_param(rngs, (d, fs), ('embed', 'mlp'), std)
      self.shared_up = normal_param(rngs, (d, fs), ('embed', 'mlp'), std)
      self.shared_down = normal_param(rngs, (fs, d), ('mlp', 'embed'), std)

  def shared_experts(self, x_btd):
    """The shared experts: one clipped SwiGLU of width n_shared * F, the routed experts' math."""
    fp8 = self.cfg.fp8
    h_btf = clipped_swiglu(dense(x_btd, self.shared_gate[...], fp8),
                           dense(x_btd, self.shared_up[...], fp8), self.cfg.swiglu_limit)
    return dense(h_btf, self.shared_down[...], fp8)

  def grouped_tiles(self, tokens: int):
    """The grouped backends' kernel tiles for a call of `tokens` tokens: a decode-sized call (fewer
    than SMALL_CALL_TOKENS) lays each expert's rows out in tiles of
    model.moe_small_call_block_m rows, not the training's 128: at batch 32 of the 1B model the
    layout was 8,320 rows for 192 assignments, every GEMM computing and writing them
    (docs/performance.md section 67)."""
    cfg = self.cfg
    if cfg.moe_backend not in GROUPED_BACKENDS:
      return None
    tiles = default_tiles(cfg.grouped_wgrad)
    small = cfg.moe_small_call_block_m
    if small and tokens < SMALL_CALL_TOKENS and small < tiles.block_m:
      tiles = dataclasses.replace(tiles, block_m=small, block_r=min(tiles.block_r, small))
    return tiles

  def __call__(self, x_btd, modality_bt, valid_bt):
    cfg = self.cfg
    dt = x_btd.dtype
    scores_bte = router_scores(x_btd, self.w_router[...])
    # Per device: GSPMD cannot split top_k's custom call, and ran every device's routing over
    # the whole batch (f32 [global batch, T, E] gathered per MoE layer, in the plan).
    idx_btk, weights_btk = batch_local(
        functools.partial(route, k=cfg.num_experts_per_tok, route_scale=cfg.route_scale),
        scores_bte, self.router_bias[...], modality_bt, replicated=(1,))
    y_btd, dropped = routed_experts(
        x_btd, idx_btk, weights_btk, valid_bt.astype(bool),
        self.w_gate[...].astype(dt), self.w_up[...].astype(dt), self.w_down[...].astype(dt),
        swiglu_limit=cfg.swiglu_limit, backend=cfg.moe_backend,
        capacity_factor=cfg.capacity_factor, fp8=cfg.fp8,
        buffer_factor=cfg.expert_buffer_factor, exchange=cfg.expert_exchange,
        partials=cfg.expert_partials, gather_small=cfg.moe_gather_small_calls,
        grouped_tiles=self.grouped_tiles(x_btd.shape[0] * x_btd.shape[1]))
    if cfg.n_shared_experts:
      y_btd = y_btd + self.shared_experts(x_btd)
    aux = {
        'load_me': expert_load(idx_btk, modality_bt, valid_bt, cfg.n_routed_experts),
        'balance': sequence_balance_loss(scores_bte, idx_btk, valid_bt, cfg.num_experts_per_tok),
        'dropped': dropped,
    }
    return y_btd.astype(dt), aux
