"""The V4.1 attention core: shared-KV latent MQA with a sink (docs/architecture.md 3.3-3.5, 3.8).

    q_r = q_norm(x W_qa);  q = q_r W_qb  -> [B,T,H,d];  q_h <- q_h / rms(q_h)   (q_head_norm)
    c   = kv_norm(x W_kv)                  -> [B,T,d]    one latent = key = value for all heads
    RoPE on the last rope_head_dim channels of q and c ("main" for ratio-0 layers, else "compress")
    o   = softmax over {window keys} (+ the compressed branch) with sink exp(z_h) in the denominator
    o[..., -rope:] <- inverse RoPE at the query position
    y   = concat_g(o_g W_oa[g]) W_ob        grouped low-rank output, G groups of H/G heads

Image-span positions also see their whole span (ops/span_attention.py, one more partial).
With `model.csa2` on, layers of ratio > 0 add the compressed sparse branch (`csa2.CSA2`: their
KV source's entries selected by their index source) as a second softmax partial, merged with the
window by log-sum-exp; off, every layer attends only over its sliding window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import SWA, LayerRole, ModelConfig
from deepseek41.model.csa2 import CSA2, DECODE, merged_backward
from deepseek41.model.norms import RMSNorm, rms_normalize
from deepseek41.model.params import const_param, normal_param
from deepseek41.model.rope import apply_rope, rope_for_role
from deepseek41.ops.fp8_matmul import batched_fp8_matmul, dense
from deepseek41.ops.span_attention import span_partial
from deepseek41.ops.softmax_merge import merge
from deepseek41.ops.swa_attention import swa_partial, window_branch
from deepseek41.quant import get_fake_quant


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, role: LayerRole, rngs: nnx.Rngs):
    d_model, h, d, g = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.o_groups
    std = cfg.init_std
    self.cfg = cfg
    self.role = role
    self.wq_a = normal_param(rngs, (d_model, cfg.q_lora_rank), ('embed', 'q_lora'), std)
    self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
    self.wq_b = normal_param(rngs, (cfg.q_lora_rank, h, d), ('q_lora', 'heads', 'head_dim'), std,
                             stack_axes=(1,))  # Muon orthogonalises each head's slice
    self.wkv = normal_param(rngs, (d_model, d), ('embed', 'kv_latent'), std)
    self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
    self.sink = const_param(0.0, (h,), ('heads',))
    self.wo_a = normal_param(rngs, (g, (h // g) * d, cfg.o_lora_rank),
                             ('o_groups', 'head_dim', 'o_lora'), std, stack_axes=(0,))
    self.wo_b = normal_param(rngs, (g * cfg.o_lora_rank, d_model), ('o_lora', 'embed'), std)
    self.csa2 = CSA2(cfg, role, rngs) if cfg.csa2 and role.mode != SWA else None

  def __call__(self, x_btd, batch, shared: dict):
    """Returns (output [B,T,D], shared): `shared` carries compressed KV and selections onward."""
    if DECODE in shared:  # generation: the keys before this chunk come from the caches
      return shared[DECODE].attention(self, x_btd, batch, shared)
    q_r_btr, q_bthd, kv_btd = self.project(x_btd, batch['positions'])
    o_bthd, shared = self.attend(x_btd, q_r_btr, q_bthd, kv_btd, batch, shared)
    return self.output(o_bthd), shared

  def project(self, x_btd, positions_bt, quantize_latent: bool = True):
    """(q_r_btr, q_bthd, kv_btd): the low-rank query and the RoPE'd query heads and latent
    (in its cache format, or before it with quantize_latent=False)."""
    cfg = self.cfg
    dt = x_btd.dtype
    inv_freq = rope_for_role(cfg, self.role.rope)
    q_r_btr = self.q_norm(dense(x_btd, self.wq_a[...], cfg.fp8))
    if cfg.fp8 == 'off':
      q_bthd = jnp.einsum('btr,rhd->bthd', q_r_btr, self.wq_b[...].astype(dt))
    else:  # heads x head_dim as one output axis: a plain 2-D GEMM
      wq_b_rhd = self.wq_b[...]
      q_bthd = dense(q_r_btr, wq_b_rhd.reshape(wq_b_rhd.shape[0], -1), cfg.fp8)
      q_bthd = q_bthd.reshape(*q_r_btr.shape[:2], *wq_b_rhd.shape[1:])
    if cfg.q_head_norm:
      q_bthd = rms_normalize(q_bthd, cfg.rms_norm_eps).astype(dt)
    q_bthd = apply_rope(q_bthd, positions_bt, inv_freq)
    latent = self.latent if quantize_latent else self.latent_unquantized
    return q_r_btr, q_bthd, latent(x_btd, positions_bt)

  def latent(self, x_btd, positions_bt):
    """The shared K=V latent [B, T, d]: normed, RoPE'd at the positions, in its cache format."""
    return get_fake_quant(self.cfg.swa_quant)(self.latent_unquantized(x_btd, positions_bt))

  def latent_unquantized(self, x_btd, positions_bt):
    """The latent before the cache format's quantization (what a packed cache packs)."""
    cfg = self.cfg
    kv_btd = self.kv_norm(dense(x_btd, self.wkv[...], cfg.fp8))
    return apply_rope(kv_btd, positions_bt, rope_for_role(cfg, self.role.rope))

  def attend(self, x_btd, q_r_btr, q_bthd, kv_btd, batch, shared: dict, extra_partials=()):
    """The attention core: window (+ compressed) partials, sink, inverse RoPE -> (o_bthd, shared).

    Split out so the benchmarks time exactly what dense attention replaces. `extra_partials`:
    more key sets in the same softmax (generation's cached window before the chunk).
    """
    cfg = self.cfg
    span_ids_bt = batch.get('image_span')  # image spans: bidirectional inside, causal outside
    with jax.named_scope('swa'):  # scopes name the GPU trace's kernels (trace_summary.py)
      if merged_backward(cfg, shared) and cfg.attention_impl == 'fused':
        window = window_branch(q_bthd, kv_btd, batch['segment_ids'], window=cfg.sliding_window,
                               span_ids_bt=span_ids_bt)
      else:
        window = swa_partial(q_bthd, kv_btd, batch['segment_ids'], window=cfg.sliding_window,
                             impl=cfg.attention_impl, span_ids_bt=span_ids_bt)
      partials = [window, *extra_partials]
    if span_ids_bt is not None:
      with jax.named_scope('span'):
        partials.append(span_partial(
            q_bthd, kv_btd, span_ids_bt, num_spans=batch['image_grid'].shape[1],
            max_span=cfg.image_span_max_len, chunk=cfg.span_chunk,
            impl='reference' if cfg.attention_impl == 'reference' else 'gathered'))
    if self.csa2 is not None:
      with jax.named_scope('csa2'):
        compressed, shared = self.csa2(x_btd, q_r_btr, q_bthd, batch, shared)
      partials.append(compressed)
    # Shared K=V: the output is rotated back by the inverse RoPE, in the merge's pass.
    rope = functools.partial(apply_rope, inv_freq=rope_for_role(cfg, self.role.rope))
    o_bthd, handoffs = merge(partials, self.sink[...], dtype=x_btd.dtype, rope=rope,
                             positions_bt=batch['positions'])
    for published in handoffs:
      shared = {**shared, **published}
    return o_bthd, shared

  def output(self, o_bthd):
    """Grouped low-rank output projection: [B,T,H,d] -> [B,T,D]."""
    cfg = self.cfg
    b, t = o_bthd.shape[:2]
    dt = o_bthd.dtype
    o_btgf = o_bthd.reshape(b, t, cfg.o_groups, -1)
    if cfg.fp8 == 'off':
      low_btgr = jnp.einsum('btgf,gfr->btgr', o_btgf, self.wo_a[...].astype(dt))
    else:  # one fp8 GEMM per group, each with its own row scales
      o_gmf = jnp.moveaxis(o_btgf, 2, 0).reshape(cfg.o_groups, b * t, -1)
      low_gmr = batched_fp8_matmul(o_gmf, self.wo_a[...].astype(dt))
      low_btgr = jnp.moveaxis(low_gmr.reshape(cfg.o_groups, b, t, -1), 0, 2)
    return dense(low_btgr.reshape(b, t, -1), self.wo_b[...], cfg.fp8)
