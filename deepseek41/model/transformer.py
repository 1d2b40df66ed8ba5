"""Embedding -> blocks -> final RMSNorm -> LM head (untied), with the role table driving each block.

The residual is `model.residual` (docs/architecture.md section 3.2; mhc.py for the site math):
  plain:            h = x + Attn(attn_norm(x));  out = h + MoE(ffn_norm(h))
  mhc_multi_pass:   (V4) each site computes (pre, post, C) from its input and reads with that pre;
                    the final norm reads the streams through a learned head
  mhc_single_pass:  (V4.1) each site's pre is consumed by the next site: attention reads with the
                    previous layer's ffn pre (layer 0: stream 0), the ffn with this layer's attention
                    pre, the final norm with the last ffn pre; no head
With mHC the residual is [B, T, hc_mult, D], the embedding copied into every stream.
With `model.vision` the image-span positions take the vision encoder's aligned tokens and the
learned delimiters instead of the table embedding (section 3.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepseek41.config import LayerRole, ModelConfig, layer_roles, remats_layer
from deepseek41.model.attention import Attention, AttentionCache
from deepseek41.model.csa2 import SELECTION
from deepseek41.model.engram import Engram, dead_tokens, layer_addresses, row_ids
from deepseek41.model.mhc import (MHCHead, MHCSite, collapse, expand, fused_expand_site_collapse,
                                  fused_site_collapse)
from deepseek41.model.moe import MoE
from deepseek41.model.norms import RMSNorm
from deepseek41.model.layer_cache import CacheSpec
from deepseek41.model.params import TokenTable, dtype_of, normal_param
from deepseek41.model.shared import Probe, Shared
from deepseek41.model.vision import VisionEncoder
from deepseek41.ops.cross_entropy import head_logits
from deepseek41.ops.gpu.mhc_kernel import MHC_TOKEN_BLOCK, expand_fused
from deepseek41.ops.launch import KERNEL_OUTPUTS
from deepseek41.ops.parallel.per_device import constrain_tokens, gather_tensor_split


class Block(nnx.Module):
  """One layer: attention and MoE sublayers on the residual (`attention` picks the attention
  module: DSpark's draft blocks pass their own)."""

  def __init__(self, cfg: ModelConfig, role: LayerRole, rngs: nnx.Rngs, engram_rows: int = 0,
               attention: type[Attention] = Attention):
    self.residual = cfg.residual
    self.mhc_impl = cfg.mhc_impl
    self.mhc_decode_block_d = cfg.mhc_decode_block_d
    self.mhc_decode_splits = cfg.mhc_decode_splits
    self.layer = role.layer
    self.engram = Engram(cfg, engram_rows, rngs) if engram_rows else None
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.attn = attention(cfg, role, rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    self.moe = MoE(cfg, rngs)
    if cfg.residual != 'plain':
      self.attn_site = MHCSite(cfg, rngs)
      self.ffn_site = MHCSite(cfg, rngs)

  def __call__(self, x, pre_prev, batch, shared: Shared):
    """(x, pre for the next site (single pass; else None), aux, shared)."""
    valid_bt = batch['segment_ids'] > 0
    engram_dropped = jnp.zeros((), jnp.int32)
    if self.engram is not None:  # on the whole residual, before this layer's mHC site
      with jax.named_scope('engram'):
        x, engram_dropped = self.engram(x, batch['engram_row_ids'][self.layer],
                                        dead_tokens(batch))

    @jax.named_scope('attention')  # scopes name the GPU trace's kernels (trace_summary.py)
    def attention(u_btd, shared):
      return self.attn(self.attn_norm(u_btd), batch, shared)

    @jax.named_scope('moe')
    def ffn(u_btd):
      y_btd, aux = self.moe(self.ffn_norm(u_btd), batch['modality'], valid_bt)
      return y_btd, {**aux, 'engram_dropped': engram_dropped}

    if self.residual == 'plain':
      attn_btd, shared = attention(x, shared)
      h_btd = x + attn_btd
      y_btd, aux = ffn(h_btd)
      return (h_btd + y_btd).astype(x.dtype), None, aux, shared
    mhc = jax.named_scope('mhc')  # the residual mixing: sites, reads and writes
    single = self.residual == 'mhc_single_pass'
    if self.mhc_impl == 'fused':  # the same sites, each one pass over the streams
      knobs = {}
      if x.shape[0] * x.shape[1] < MHC_TOKEN_BLOCK:  # a decode-sized call
        knobs = dict(decode_splits=self.mhc_decode_splits)
        if self.mhc_decode_block_d:
          knobs['block_d'] = self.mhc_decode_block_d
      u_btd, pre_a, post_a, comb_a = mhc(fused_site_collapse)(
          self.attn_site, x, pre_prev if single else None, **knobs)
      attn_btd, shared = attention(u_btd, shared)
      x, u_btd, pre_f, post_f, comb_f = mhc(fused_expand_site_collapse)(
          self.ffn_site, x, attn_btd, post_a, comb_a, pre_a if single else None, **knobs)
      y_btd, aux = ffn(u_btd)
      x = mhc(expand_fused)(x, y_btd, post_f, comb_f, **knobs)
      return x, (pre_f if single else None), aux, shared
    pre_a, post_a, comb_a = mhc(self.attn_site)(x)
    attn_btd, shared = attention(mhc(collapse)(x, pre_prev if self.residual == 'mhc_single_pass'
                                               else pre_a), shared)
    x = mhc(expand)(x, attn_btd, post_a, comb_a)
    pre_f, post_f, comb_f = mhc(self.ffn_site)(x)
    y_btd, aux = ffn(mhc(collapse)(x, pre_a if self.residual == 'mhc_single_pass' else pre_f))
    x = mhc(expand)(x, y_btd, post_f, comb_f)
    return x, (pre_f if self.residual == 'mhc_single_pass' else None), aux, shared

  def publish_global_kv(self, x, pre_prev, batch, shared: Shared) -> Shared:
    """Only this KV-source layer's compressor and index keys, over every row (CED prefill).

    The same attention input as `__call__` builds (Engram, then the mHC read); nothing else of
    the layer runs.
    """
    if self.engram is not None:
      x, _ = self.engram(x, batch['engram_row_ids'][self.layer], dead_tokens(batch))
    if self.residual == 'mhc_single_pass':
      x = collapse(x, pre_prev)
    elif self.residual == 'mhc_multi_pass':
      x = collapse(x, self.attn_site(x)[0])
    return self.attn.publish_kv(self.attn_norm(x), batch, shared)


def _rematerialized(block: Block, x, pre_prev, batch, shared, sequence_parallel: bool = False,
                    keep_kernel_outputs: bool = False):
  """Run a block whose activations are recomputed in the backward pass.

  A pure `jax.checkpoint` over (graph, state): the forward never mutates state, so nothing has
  to flow back out, and NNX's lifted remat (which does propagate state) is not needed. A
  sequence-parallel x is gathered inside, so the input kept for the backward stays split.
  `shared` (model/shared.py) is a pytree: what earlier layers published goes in, this layer's
  additions come out. Saved besides the block's inputs: an index source's selection (`csa2.SELECTION`, int32
  [B, T, K] and its mask), whose recomputation would rescore every visible entry (the
  indexer's O(T N) scores) and rerun the top-k, for a few hundred MB at 64K tokens.
  keep_kernel_outputs (`train.remat=block_keep_attention`): also the GPU attention kernels'
  outputs (`KERNEL_OUTPUTS`: window and sparse partials, slot masses, the indexer's selected
  scores), so the backward runs no forward kernel again; about 2 GB a layer at 64K tokens of
  configs/ablation_1b.py. The jnp paths (CPU, TPU) name nothing: there it is plain block remat.
  """
  graphdef, state = nnx.split(block)
  names = (SELECTION, KERNEL_OUTPUTS) if keep_kernel_outputs else (SELECTION,)

  def run(state, x, pre_prev, batch, shared):
    return nnx.merge(graphdef, state)(gather_tensor_split(x, sequence_parallel), pre_prev,
                                      batch, shared)
  return jax.checkpoint(run, policy=jax.checkpoint_policies.save_only_these_names(*names))(
      state, x, pre_prev, batch, shared)


class Transformer(nnx.Module):
  """The V4.1 backbone. `__call__(batch) -> (logits [B,T,V] fp32, aux)`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: str = 'none',
               sequence_parallel: bool = True, remat_layers: int = 0):
    self.cfg = cfg
    self.remat = remat
    self.remat_layers = remat_layers  # train.remat_layers: the first n layers (0: all)
    self.sequence_parallel = sequence_parallel  # mesh.sequence_parallel
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'), cfg.init_std,
                              TokenTable)
    self.vision = VisionEncoder(cfg, rngs, remat) if cfg.vision else None
    rows = {l: a.rows for l, a in self._engram_addresses().items()}
    self.blocks = nnx.List([Block(cfg, role, rngs, rows.get(role.layer, 0))
                            for role in layer_roles(cfg)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
    if cfg.residual == 'mhc_multi_pass':
      self.hc_head = MHCHead(cfg, rngs)
    self.head = normal_param(rngs, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'), cfg.init_std,
                             TokenTable, token_axis=1)

  def _engram_addresses(self):
    return layer_addresses(self.cfg) if self.cfg.engram else {}

  def with_engram_rows(self, batch):
    """The batch plus every Engram layer's row ids: hashes depend only on token ids, so they
    are computed once per batch, not per layer."""
    addresses = self._engram_addresses()
    if not addresses:
      return batch
    return {**batch, 'engram_row_ids': row_ids(self.cfg, addresses, batch)}

  def final_hidden(self, x, pre):
    """The LM head's input h [B, T, D]: the final read of the residual (collapse for mHC), then
    the final RMSNorm."""
    cfg = self.cfg
    x = gather_tensor_split(x, self.sequence_parallel)
    if cfg.residual == 'mhc_multi_pass':
      x = collapse(x, self.hc_head(x))
    elif cfg.residual == 'mhc_single_pass':
      x = collapse(x, pre)
    return self.final_norm(x)

  def head_weight(self):
    """The LM head W [D, V] in the compute dtype."""
    return self.head[...].astype(dtype_of(self.cfg.compute_dtype))

  def logits(self, x, pre):
    """Final read of the residual, RMSNorm, LM head: fp32 [B, T, V]."""
    return head_logits(self.final_hidden(x, pre), self.head_weight())

  def embed_inputs(self, batch):
    """[B, T, D] input embeddings: the table, with image spans filled in by the vision path."""
    dt = dtype_of(self.cfg.compute_dtype)
    e_btd = jnp.take(self.embed[...], batch['tokens'], axis=0).astype(dt)
    if self.vision is not None and 'image_patches' in batch:  # (a decode step has no images)
      merged_bnmd = self.vision(batch['image_patches'], batch['image_grid'], dt)
      e_btd = self.vision.place(e_btd, batch, merged_bnmd)
    return e_btd

  def residual_input(self, batch):
    """(x, pre) entering layer 0: the embedding ([B,T,D], or copied into every mHC stream) and
    the single-pass pre-mix of stream 0 (None otherwise)."""
    cfg = self.cfg
    e_btd = self.embed_inputs(batch)
    if cfg.residual == 'plain':
      return e_btd, None
    b, t, d = e_btd.shape
    x = jnp.broadcast_to(e_btd[:, :, None, :], (b, t, cfg.hc_mult, d))
    pre = None
    if cfg.residual == 'mhc_single_pass':
      pre = jnp.broadcast_to(jax.nn.one_hot(0, cfg.hc_mult, dtype=jnp.float32), (b, t, cfg.hc_mult))
    return x, pre

  def __call__(self, batch, probe: Probe | None = None):
    logits_btv, aux, _ = self.forward(batch, probe=probe)
    return logits_btv, aux

  def init_cache(self, spec: CacheSpec) -> dict[int, AttentionCache]:
    """Every layer's empty generation cache, {layer: cache} (the layers' `init_cache`)."""
    return {block.layer: block.attn.init_cache(spec) for block in self.blocks}

  def run_blocks(self, x, pre, batch, shared: Shared, capture_layers: tuple[int, ...] = (),
                 blocks=None):
    """The layers in order (`blocks`, default all of them): (x, pre, per-layer aux, captured
    inputs, shared). `batch` already holds the Engram row ids (`with_engram_rows`). Generation
    passes `Shared(decode=...)` holding the layers' caches, and takes them back updated."""
    auxes = []
    captured = {}
    for block in self.blocks if blocks is None else blocks:
      if block.layer in capture_layers:
        u = gather_tensor_split(x, self.sequence_parallel)
        captured[block.layer] = u if u.ndim == 3 else jnp.mean(u.astype(jnp.float32), axis=2)
      with jax.named_scope(f'layer{block.layer}'):
        if remats_layer(self.remat, self.remat_layers, block.layer):
          x, pre, aux, shared = _rematerialized(
              block, x, pre, batch, shared, self.sequence_parallel,
              keep_kernel_outputs=self.remat == 'block_keep_attention')
        else:
          x, pre, aux, shared = block(gather_tensor_split(x, self.sequence_parallel), pre,
                                      batch, shared)
        x = constrain_tokens(x, self.sequence_parallel)
      auxes.append(aux)
    return x, pre, auxes, captured, shared

  def forward(self, batch, capture_layers: tuple[int, ...] = (), probe: Probe | None = None,
              head: bool = True):
    """(logits [B,T,V] fp32, aux, captured): captured[l] is the residual entering layer l, the
    mean over the mHC streams ([B, T, D]; DSpark's context features). With a `probe`, each CSA2
    layer's selection against dense attention is measured too: aux['selection'] =
    {layer: diagnostics.SelectionStats} (model/diagnostics.py). `head=False`: the head's input
    h [B, T, D] in place of the logits, for a loss that applies the head itself
    (`model.head_chunk`, ops/cross_entropy.py) without the whole logits."""
    with jax.named_scope('embed'):  # top-level scopes too, so no kernel of the step is unnamed
      x, pre = self.residual_input(batch)
      # context (and sequence) parallelism: each shard holds its stretch of tokens
      x = constrain_tokens(x, self.sequence_parallel)
      batch = self.with_engram_rows(batch)
    # shared: compressed KV and selections published by source layers (CSA2)
    x, pre, auxes, captured, shared = self.run_blocks(x, pre, batch, Shared(probe=probe),
                                                      capture_layers)
    with jax.named_scope('head'):
      out = self.logits(x, pre) if head else self.final_hidden(x, pre)
    totals = shared.indexer_totals
    kl_sum, counted, recall_sum = jnp.zeros(3, jnp.float32) if totals is None else totals
    aux = {
        'indexer_loss': kl_sum / jnp.maximum(counted, 1.0),
        'indexer_recall': recall_sum / jnp.maximum(counted, 1.0),
        'load_lme': jnp.stack([a['load_me'] for a in auxes]),
        'balance': sum(a['balance'] for a in auxes),  # one V3 term per MoE layer
        'dropped': sum(a['dropped'] for a in auxes),
        'engram_dropped': sum(a['engram_dropped'] for a in auxes),
    }
    if probe is not None:
      aux['selection'] = dict(sorted(shared.probe.stats.items()))
    return out, aux, captured
