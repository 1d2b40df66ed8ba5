"""DeepSeek-ViT, the 3x3 merge aligner and the learned span delimiters (docs/architecture.md 3.15).

    pixels uint8 -> (x/255 - 0.5)/0.5 -> patch embed -> L x [RMSNorm, attention with 2D RoPE,
    RMSNorm, SwiGLU] -> RMSNorm -> zero padding patches -> merge 3x3 (channel-major)
    -> Linear -> GELU -> Linear                                      [B, N, M, d_model]

Trained from scratch with the LM. Image slots are static (deepseek41/batch.py): N slots per row,
P = merge^2 * M patches per slot, the first h*w of them real, (h, w) dynamic per slot. Attention
runs per slot (the [B, N] axes folded into one), bidirectional over the slot's real patches only,
so nothing crosses slots and padding patches never reach a real patch.

Pure functions (`rope_2d`, `patch_rows_cols`, the two attentions, `merge_patches`,
`place_image_embeddings`) carry the conventions; `VisionEncoder` holds the parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepseek41.batch import NUM_DELIMITERS, ROLE_ALIGN, ROLE_PATCH, ROLE_START
from deepseek41.config import ModelConfig
from deepseek41.model.norms import RMSNorm
from deepseek41.model.params import VisionParam, const_param, normal_param
from deepseek41.ops import launch
from deepseek41.ops.parallel.per_device import batch_local

IMPLS = ('reference', 'fused')


# ---------------------------------------------------------------------------------------------
# 2D RoPE


def rope_2d_freqs(head_dim: int, theta: float) -> np.ndarray:
  """The hd/4 frequencies `theta^(-2i/(hd/2))`, float32 (computed in float64, rounded once)."""
  if head_dim % 4:
    raise ValueError(f'2D RoPE needs head_dim % 4 == 0, got {head_dim}')
  i = np.arange(head_dim // 4, dtype=np.float64)
  return (theta ** (-2.0 * i / (head_dim // 2))).astype(np.float32)


def rope_2d(x, rows, cols, theta: float):
  """Rotate all channels of x by its patch's (row, col); fp32 inside, x's dtype out.

  x: [..., hd] whose leading axes start with rows.shape (axes in between, e.g. heads, broadcast).
  Angle vector (length hd/2) = [row * f_0..f_{hd/4-1}, col * f_0..f_{hd/4-1}]; channels c and
  c + hd/2 form a pair rotated by angle[c] (NeoX "halves" convention).
  """
  hd = x.shape[-1]
  rows, cols = jnp.asarray(rows), jnp.asarray(cols)
  if x.shape[:rows.ndim] != rows.shape or rows.shape != cols.shape:
    raise ValueError(f'rows {rows.shape} / cols {cols.shape} must match the leading axes of x '
                     f'{x.shape}')
  f = jnp.asarray(rope_2d_freqs(hd, theta))
  angle = jnp.concatenate([rows.astype(jnp.float32)[..., None] * f,
                           cols.astype(jnp.float32)[..., None] * f], axis=-1)   # [*pos, hd/2]
  angle = angle.reshape(rows.shape + (1,) * (x.ndim - rows.ndim - 1) + (hd // 2,))
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :hd // 2], x32[..., hd // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def patch_rows_cols(num_patches: int, grid_s2):
  """(rows, cols) [S, P] int32: patch k of a slot with grid (h, w) sits at (k // w, k % w).

  Padding patches (k >= h*w) get rows past h; attention never lets them reach a real patch. An
  empty slot (w = 0) divides by 1 instead, so everything stays finite.
  """
  k_p = jnp.arange(num_patches, dtype=jnp.int32)
  w_s1 = jnp.maximum(grid_s2[:, 1:2], 1)
  return k_p[None] // w_s1, k_p[None] % w_s1


# ---------------------------------------------------------------------------------------------
# Attention inside one image slot


def vit_attention_reference(q_sphd, k_sphd, v_sphd, lengths_s):
  """Dense bidirectional attention over the first lengths[s] keys of each slot s.

  Keys >= length get the dtype's most negative score (not -inf), so a query that sees nothing
  (length 0, or the caller's padding rows) averages uniformly and stays finite. Returns q's dtype.
  """
  scale = q_sphd.shape[-1] ** -0.5
  scores_shpu = jnp.einsum('sphd,suhd->shpu', q_sphd, k_sphd,
                           preferred_element_type=jnp.float32) * scale
  key_ok_su = jnp.arange(k_sphd.shape[1])[None] < lengths_s[:, None]
  scores_shpu = jnp.where(key_ok_su[:, None, None, :], scores_shpu, jnp.finfo(jnp.float32).min)
  probs_shpu = jax.nn.softmax(scores_shpu, axis=-1)
  # p in the value dtype for the second matmul (fp32 accumulation), as flash kernels do.
  o_sphd = jnp.einsum('shpu,suhd->sphd', probs_shpu.astype(v_sphd.dtype), v_sphd,
                      preferred_element_type=jnp.float32)
  return o_sphd.astype(q_sphd.dtype)


CUDNN_SEQ_MULTIPLE = 64


def fused_implementation(dtype, head_dim: int) -> str | None:
  """cuDNN flash attention on a GPU where it applies, else None (= XLA's dense path).

  jax 0.11.2's `implementation=None` always means XLA (its "auto" is a TODO), so cuDNN has to be
  asked for by name. cuDNN takes only fp16/bf16 and head dims that are multiples of 8 (<= 128
  before Hopper), so fp32 compute and odd test shapes stay on XLA.
  """
  if (jax.default_backend() == 'gpu' and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0 and head_dim <= 128):
    return 'cudnn'
  return None


def vit_attention_fused(q_sphd, k_sphd, v_sphd, lengths_s, implementation='auto'):
  """`jax.nn.dot_product_attention` with per-slot sequence lengths; same contract as reference.

  Query lengths are passed too, so cuDNN can skip padding rows (their outputs come back zero).
  Lengths are clamped to >= 1: a kernel's row with no visible key may be NaN, and an empty slot's
  outputs are zeroed by the caller anyway.
  """
  if implementation == 'auto':
    implementation = fused_implementation(q_sphd.dtype, q_sphd.shape[-1])
  lengths_s = jnp.maximum(lengths_s, 1).astype(jnp.int32)
  p = q_sphd.shape[1]
  pad = (-p) % CUDNN_SEQ_MULTIPLE if implementation == 'cudnn' else 0
  if pad:  # cuDNN's flash kernel takes sequence lengths in multiples of 64; lengths mask the rest
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q_sphd, k_sphd, v_sphd = (jnp.pad(x, widths) for x in (q_sphd, k_sphd, v_sphd))
  o_sphd = jax.nn.dot_product_attention(q_sphd, k_sphd, v_sphd, query_seq_lengths=lengths_s,
                                        key_value_seq_lengths=lengths_s,
                                        implementation=implementation)
  return o_sphd[:, :p]


@jax.custom_vjp
def _flash_buffers(q_sphd, k_sphd, v_sphd, lengths_s):
  """vit_attention_fused's buffers as a flash kernel holds them (ops/launch.py): the output and
  the softmax statistics [S, H, P] forward, dq, dk, dv backward; never the [P, P] scores."""
  return _flash_forward(q_sphd, k_sphd, v_sphd, lengths_s)[0]


def _flash_forward(q_sphd, k_sphd, v_sphd, lengths_s):
  s, p, h, _ = q_sphd.shape
  o_sphd = launch.opaque(q_sphd.shape, q_sphd.dtype, q_sphd, k_sphd, v_sphd, lengths_s)
  stats_shp = launch.opaque((s, h, p), jnp.float32, q_sphd, k_sphd, lengths_s)
  return o_sphd, (q_sphd, k_sphd, v_sphd, lengths_s, o_sphd, stats_shp)


def _flash_backward(res, do_sphd):
  q_sphd, k_sphd, v_sphd, lengths_s, o_sphd, stats_shp = res
  ins = (q_sphd, k_sphd, v_sphd, o_sphd, do_sphd, stats_shp, lengths_s)
  return (*(launch.opaque(x.shape, x.dtype, *ins) for x in (q_sphd, k_sphd, v_sphd)), None)


_flash_buffers.defvjp(_flash_forward, _flash_backward)


def vit_attention(q_sphd, k_sphd, v_sphd, lengths_s, impl: str):
  if impl == 'reference':
    return vit_attention_reference(q_sphd, k_sphd, v_sphd, lengths_s)
  if impl == 'fused' and launch.active():
    # Per device, as cuDNN's partitioning rule runs it (an opaque call under GSPMD would be
    # given every device's slots).
    return batch_local(lambda *a: (_flash_buffers(*a),), q_sphd, k_sphd, v_sphd, lengths_s,
                       split_seq=False, heads={0: 2, 1: 2, 2: 2}, out_heads=(2,))[0]
  if impl == 'fused':
    return vit_attention_fused(q_sphd, k_sphd, v_sphd, lengths_s)
  raise ValueError(f'vision attention impl must be one of {IMPLS}, got {impl!r}')


# ---------------------------------------------------------------------------------------------
# Merge aligner input and placement into the token stream


def merge_patches(feats_bnpc, grid_bn2, merge: int, max_tokens: int):
  """Pixel-unshuffle merge x merge patch neighbourhoods: [B, N, P, C] -> [B, N, M, merge^2*C].

  The (h, w) patch grid is padded with zero cells to (hm*merge, wm*merge), hm = ceil(h/merge),
  wm = ceil(w/merge); merged token m = i*wm + j (raster order of the merged grid) holds value
  c*merge^2 + dy*merge + dx = channel c of patch (i*merge + dy, j*merge + dx) (CHANNEL-MAJOR).
  Tokens m >= hm*wm are zero. One gather built from index arithmetic; h, w dynamic per slot.
  """
  b, n, p, c = feats_bnpc.shape
  mm = merge * merge
  h_bn1, w_bn1 = grid_bn2[..., 0:1], grid_bn2[..., 1:2]
  wm_bn1 = (w_bn1 + merge - 1) // merge
  hm_bn1 = (h_bn1 + merge - 1) // merge
  m_bn1m = jnp.arange(max_tokens, dtype=jnp.int32)[None, None, :, None]   # [1, 1, M, 1]
  wm_safe = jnp.maximum(wm_bn1, 1)[..., None]                              # [B, N, 1, 1]
  i_bnm1, j_bnm1 = m_bn1m // wm_safe, m_bn1m % wm_safe
  q_k = jnp.arange(mm, dtype=jnp.int32)                                    # dy*merge + dx
  row_bnmk = i_bnm1 * merge + q_k // merge
  col_bnmk = j_bnm1 * merge + q_k % merge
  h_bn11, w_bn11 = h_bn1[..., None], w_bn1[..., None]
  valid_bnmk = ((m_bn1m < (hm_bn1 * wm_bn1)[..., None]) & (row_bnmk < h_bn11)
                & (col_bnmk < w_bn11))
  idx_bnmk = jnp.where(valid_bnmk, row_bnmk * w_bn11 + col_bnmk, 0)
  idx_bnmk = jnp.broadcast_to(idx_bnmk, (b, n, max_tokens, mm))
  gathered = jnp.take_along_axis(feats_bnpc, idx_bnmk.reshape(b, n, max_tokens * mm, 1), axis=2)
  gathered_bnmkc = gathered.reshape(b, n, max_tokens, mm, c)
  gathered_bnmkc = jnp.where(valid_bnmk[..., None], gathered_bnmkc, 0)
  return jnp.swapaxes(gathered_bnmkc, -1, -2).reshape(b, n, max_tokens, c * mm)


def place_image_embeddings(x_btd, image_role_bt, image_index_bt, merged_bnmd, delimiters_kd):
  """Overwrite image-span positions of the embedded stream x: ROLE_PATCH positions take merged
  token image_index of the row ([N, M] flattened), delimiter roles take delimiters[role -
  ROLE_START], ROLE_TEXT keeps x. Returns x's dtype."""
  b, n, m, d = merged_bnmd.shape
  flat_bkd = merged_bnmd.reshape(b, n * m, d)
  idx_bt1 = jnp.clip(image_index_bt, 0, n * m - 1)[..., None]
  patch_btd = jnp.take_along_axis(flat_bkd, idx_bt1, axis=1)
  delim_btd = jnp.take(delimiters_kd, jnp.clip(image_role_bt - ROLE_START, 0,
                                               delimiters_kd.shape[0] - 1), axis=0)
  role = image_role_bt[..., None]
  is_delim = (role >= ROLE_START) & (role <= ROLE_ALIGN)
  out = jnp.where(role == ROLE_PATCH, patch_btd.astype(x_btd.dtype), x_btd)
  return jnp.where(is_delim, delim_btd.astype(x_btd.dtype), out)


# ---------------------------------------------------------------------------------------------
# Modules


class VisionAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h = cfg.vision_dim, cfg.vision_heads
    hd = d // h
    std = cfg.init_std
    self.cfg = cfg
    # Fused qkv laid out [D, 3, H, hd]: flattening the output gives (q|k|v)-major, head, channel,
    # the order of a Linear(D -> 3D) [I], while heads stay an axis that shards.
    self.w_qkv = normal_param(rngs, (d, 3, h, hd), ('vision_embed', None, 'vision_heads',
                                                    'head_dim'), std, VisionParam,
                              stack_axes=(1, 2))  # Muon: one matrix per q/k/v head
    self.b_qkv = const_param(0.0, (3, h, hd), (None, 'vision_heads', 'head_dim'), VisionParam)
    self.w_o = normal_param(rngs, (h, hd, d), ('vision_heads', 'head_dim', 'vision_embed'), std,
                            VisionParam)
    self.b_o = const_param(0.0, (d,), ('vision_embed',), VisionParam)

  def __call__(self, x_spd, rows_sp, cols_sp, lengths_s):
    cfg, dt = self.cfg, x_spd.dtype
    qkv_sp3hd = (jnp.einsum('spd,dkhe->spkhe', x_spd, self.w_qkv[...].astype(dt))
                 + self.b_qkv[...].astype(dt))
    q_sphd, k_sphd, v_sphd = (qkv_sp3hd[:, :, i] for i in range(3))
    q_sphd = rope_2d(q_sphd, rows_sp, cols_sp, cfg.vision_rope_theta)
    k_sphd = rope_2d(k_sphd, rows_sp, cols_sp, cfg.vision_rope_theta)
    o_sphd = vit_attention(q_sphd, k_sphd, v_sphd, lengths_s, cfg.vision_attention_impl)
    return (jnp.einsum('sphe,hed->spd', o_sphd.astype(dt), self.w_o[...].astype(dt))
            + self.b_o[...].astype(dt))


class VisionBlock(nnx.Module):
  """Pre-norm ViT block: x + attn(norm(x)), then x + SwiGLU(norm(x)) (no MLP biases)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f, std = cfg.vision_dim, cfg.vision_mlp, cfg.init_std
    self.attn_norm = RMSNorm(d, cfg.vision_norm_eps, 'vision_embed', VisionParam)
    self.attn = VisionAttention(cfg, rngs)
    self.mlp_norm = RMSNorm(d, cfg.vision_norm_eps, 'vision_embed', VisionParam)
    self.w_gate = normal_param(rngs, (d, f), ('vision_embed', 'vision_mlp'), std, VisionParam)
    self.w_up = normal_param(rngs, (d, f), ('vision_embed', 'vision_mlp'), std, VisionParam)
    self.w_down = normal_param(rngs, (f, d), ('vision_mlp', 'vision_embed'), std, VisionParam)

  def __call__(self, x_spd, rows_sp, cols_sp, lengths_s):
    dt = x_spd.dtype
    x_spd = x_spd + self.attn(self.attn_norm(x_spd), rows_sp, cols_sp, lengths_s)
    u_spd = self.mlp_norm(x_spd)
    g_spf = jax.nn.silu(u_spd @ self.w_gate[...].astype(dt)) * (u_spd @ self.w_up[...].astype(dt))
    return x_spd + g_spf @ self.w_down[...].astype(dt)


def _rematerialized(block: VisionBlock, *args):
  """A block recomputed in the backward pass (same pattern as transformer._rematerialized)."""
  graphdef, state = nnx.split(block)

  def run(state, *args):
    return nnx.merge(graphdef, state)(*args)
  return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(state, *args)


class VisionEncoder(nnx.Module):
  """Patches -> aligned LM-width image tokens; also owns the span delimiter vectors.

  Every parameter here is a `VisionParam` (`train.vision_lr_multiplier` selects them by type).

  `__call__(image_patches [B,N,P,p*p*3] uint8, image_grid [B,N,2], dtype) -> [B,N,M,d_model]`.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: str = 'none'):
    d, std, dm = cfg.vision_dim, cfg.init_std, cfg.d_model
    mm = cfg.vision_merge * cfg.vision_merge
    self.cfg = cfg
    self.remat = remat
    p3 = cfg.vision_patch * cfg.vision_patch * 3
    self.w_patch = normal_param(rngs, (p3, d), ('patch_in', 'vision_embed'), std, VisionParam)
    self.b_patch = const_param(0.0, (d,), ('vision_embed',), VisionParam)
    self.blocks = nnx.List([VisionBlock(cfg, rngs) for _ in range(cfg.vision_layers)])
    self.final_norm = RMSNorm(d, cfg.vision_norm_eps, 'vision_embed', VisionParam)
    # Aligner: hidden width d_model, sharded like an MLP hidden (column- then row-parallel).
    self.w_align1 = normal_param(rngs, (mm * d, dm), ('merge_in', 'mlp'), std, VisionParam)
    self.b_align1 = const_param(0.0, (dm,), ('mlp',), VisionParam)
    self.w_align2 = normal_param(rngs, (dm, dm), ('mlp', 'embed'), std, VisionParam)
    self.b_align2 = const_param(0.0, (dm,), ('embed',), VisionParam)
    # start, newline, end, alignment pad (batch.py's role order). The 4th, for the alignment
    # pad, is ours [I]: the reference has only the three image_start/newline/end vectors.
    self.delimiters = normal_param(rngs, (NUM_DELIMITERS, dm), (None, 'embed'), std, VisionParam)

  @jax.named_scope('vision')  # names the GPU trace's kernels (trace_summary.py)
  def __call__(self, image_patches, image_grid, dtype):
    cfg = self.cfg
    b, n, p, _ = image_patches.shape
    s = b * n
    grid_s2 = image_grid.reshape(s, 2).astype(jnp.int32)
    lengths_s = grid_s2[:, 0] * grid_s2[:, 1]
    rows_sp, cols_sp = patch_rows_cols(p, grid_s2)
    # [I] pixel order inside a patch is (row, col, channel), as batch.py lays it out; the patch
    # embed is a plain Linear over that flattening.
    x_spc = (image_patches.reshape(s, p, -1).astype(jnp.float32) / 255.0 - 0.5) / 0.5
    x_spd = (x_spc.astype(dtype) @ self.w_patch[...].astype(dtype)
             + self.b_patch[...].astype(dtype))
    for block in self.blocks:
      if self.remat != 'none':  # block_keep_attention: the tower names no kernel outputs
        x_spd = _rematerialized(block, x_spd, rows_sp, cols_sp, lengths_s)
      else:
        x_spd = block(x_spd, rows_sp, cols_sp, lengths_s)
    x_spd = self.final_norm(x_spd)
    # Padding patches carry whatever attention gave their rows; zero them so the merge (whose
    # padded cells are zero too) and the gradients see only real patches.
    real_sp = jnp.arange(p)[None] < lengths_s[:, None]
    x_spd = jnp.where(real_sp[..., None], x_spd, 0)
    merged_bnmk = merge_patches(x_spd.reshape(b, n, p, -1), image_grid.astype(jnp.int32),
                                cfg.vision_merge, cfg.vision_max_image_tokens)
    # [I] exact (erf) GELU, torch nn.GELU()'s default, which DeepSeek-VL's aligner uses.
    h_bnmd = jax.nn.gelu(merged_bnmk @ self.w_align1[...].astype(dtype)
                         + self.b_align1[...].astype(dtype), approximate=False)
    return h_bnmd @ self.w_align2[...].astype(dtype) + self.b_align2[...].astype(dtype)

  def place(self, x_btd, batch, merged_bnmd):
    """`place_image_embeddings` with this module's delimiters and the batch's image fields."""
    return place_image_embeddings(x_btd, batch['image_role'], batch['image_index'], merged_bnmd,
                                  self.delimiters[...])
