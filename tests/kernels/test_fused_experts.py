"""The `grouped_fused` expert backend (ops/gpu/fused_experts.py) in the Pallas interpreter.

Against `reference` (every expert on every token, plain jnp): the output and the gradients in x,
the router weights and the three expert tensors, f32 and bf16, with routing that has a hot expert
spanning several row tiles, groups that do not fill their last tile, experts with no rows,
padding tokens and single invalid assignments, several tilings, the clamp on and off, both
combines. The kernels alone against the layout's jnp references; the forward's jaxpr holds no
gathered copy of the tokens and no gate or up; the Triton lowering at the 1B shapes; a model's
train step with model.moe_backend=grouped_fused equals reference's.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import numpy as np
import pytest

from deepseek41.config import ConfigError, resolve
from deepseek41.config.schema import MOE_BACKENDS
from deepseek41.ops import expert_gemm, grouped_gemm, launch
from deepseek41.ops.gpu import fused_experts as fe
from deepseek41.ops.gpu import grouped_gemm as gg
from deepseek41.ops.swiglu import clipped_swiglu
from tests.helpers import one_train_step, small_config, triton_lowering_for_h200

N, K, E, D, F = 64, 2, 8, 24, 40  # D, F not multiples of 16: the kernels pad them
EMPTY = (3, 6)
TILES = gg.INTERPRET_TILES  # 32-row tiles, 16-wide outputs and steps
# 16-row tiles, one 32-wide output tile of the SwiGLU kernel, 32-deep steps, 8-row tgmm steps.
OTHER_TILES = dataclasses.replace(TILES, block_m=16, block_n=32, block_k=32, swiglu_block_n=32,
                                  block_d=32, block_f=16, block_r=8)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def inputs(seed, per_assignment=False):
  """Tokens, top-K routing skewed to expert 0 (several tiles), experts EMPTY never chosen,
  about a fifth of the tokens padding (or, per_assignment, a fifth of the assignments invalid),
  router weights and the three expert tensors."""
  ks = jax.random.split(jax.random.key(seed), 8)
  x = jax.random.normal(ks[0], (N, D))
  logits = jax.random.uniform(ks[1], (N, E)) - 2.0 * (jnp.arange(E) > 0)
  logits = logits.at[:, list(EMPTY)].set(-10.0)
  idx = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
  valid = jax.random.uniform(ks[2], (N, K) if per_assignment else (N,)) >= 0.2
  weight = 1.5 * jax.nn.softmax(jax.random.normal(ks[3], (N, K)), axis=-1)
  w = [jax.random.normal(k, s) / np.sqrt(s[1])
       for k, s in zip(ks[4:], ((E, D, F), (E, D, F), (E, F, D)))]
  return x, idx, weight, valid, w


def run(backend, x, idx, weight, valid, w, limit, **kw):
  """(y, gradients in x, weight and the three expert tensors) of a token-dependent loss."""
  ct = jnp.cos(jnp.arange(N * D, dtype=jnp.float32).reshape(N, D))

  def loss(x, weight, *w):
    y, dropped = expert_gemm.expert_ffn(x, idx, weight, valid, *w, swiglu_limit=limit,
                                        backend=backend, **kw)
    return jnp.sum(y.astype(jnp.float32) * ct), (y, dropped)
  (_, (y, dropped)), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, weight, *w)
  assert int(dropped) == 0
  return y, grads


CASES = [  # dtype, swiglu_limit, combine, recompute, tiles, out_dtype, per-assignment validity
    (jnp.float32, 1.0, 'gather', True, TILES, None, False),
    (jnp.float32, None, 'atomic', False, OTHER_TILES, None, True),
    (jnp.bfloat16, 1.0, 'atomic', True, TILES, jnp.float32, False),
    (jnp.bfloat16, 1.0, 'gather', False, OTHER_TILES, None, True),
    (jnp.bfloat16, None, 'gather', True, OTHER_TILES, None, True),
]


@pytest.mark.parametrize('dtype,limit,combine,recompute,tiles,out_dtype,per_assignment', CASES)
def test_block_equals_the_reference(dtype, limit, combine, recompute, tiles, out_dtype,
                                    per_assignment):
  x, idx, weight, valid, w = inputs(0, per_assignment)
  counts = np.bincount(np.asarray(idx)[np.broadcast_to(
      np.asarray(valid).reshape(N, -1), (N, K))], minlength=E)
  assert counts[0] > tiles.block_m and counts[EMPTY[0]] == 0  # a group spans two tiles or more
  assert np.any(counts % tiles.block_m)  # some group does not fill its last tile
  if limit is not None:  # the clamp is active on some gate and up values
    h = jnp.einsum('nd,edf->nef', x, w[0])
    assert float(jnp.mean(jnp.abs(h) > limit)) > 0.05
  # The reference in the same dtype: in bf16 gate and up are rounded before the clamp, whose
  # derivative jumps there, so a value rounded across it moves a gradient entry by a lot (the
  # bf16 reference is 6% off the f32 one in dx here); the kernels round at the same points.
  x_c, w_c = x.astype(dtype), [a.astype(dtype) for a in w]
  y_ref, g_ref = run('reference', x_c, idx, weight, valid, w_c, limit, out_dtype=jnp.float32)
  y, grads = run('grouped_fused', x_c, idx, weight, valid, w_c, limit, grouped_tiles=tiles,
                 fused_combine=combine, fused_recompute=recompute, out_dtype=out_dtype)
  assert y.dtype == (out_dtype or dtype)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
  # Padding tokens output exactly 0.
  if not per_assignment:
    assert np.all(np.asarray(y, np.float32)[~np.asarray(valid)] == 0)
  for name, g, r in zip(('x', 'weight', 'w_gate', 'w_up', 'w_down'), grads, g_ref):
    assert np.abs(np.asarray(r)).max() > 0, name
    assert rel_err(g, r) <= tol, (name, rel_err(g, r))
  for gw in grads[2:]:  # experts without rows: zero gradient
    assert np.all(np.asarray(gw, np.float32)[list(EMPTY)] == 0)


def test_bf16_rounds_as_the_grouped_backend():
  """Gate and up rounded to bf16 before SwiGLU, the down rows before their weight: the forward
  equals `grouped`'s to a few bf16 ulps of the output (the combine's f32 sum is reordered)."""
  x, idx, weight, valid, w = inputs(1)
  bf = jnp.bfloat16
  args = (x.astype(bf), idx, weight, valid, *(a.astype(bf) for a in w))
  kw = dict(swiglu_limit=1.0, grouped_tiles=TILES, out_dtype=jnp.float32)
  y_g, _ = jax.jit(functools.partial(expert_gemm.expert_ffn, backend='grouped', **kw))(*args)
  y_f, _ = jax.jit(functools.partial(expert_gemm.expert_ffn, backend='grouped_fused', **kw))(
      *args)
  assert rel_err(y_f, y_g) <= 1e-6


def test_saving_gate_and_up_gives_the_recomputed_gradients():
  """fused_recompute=False (gate and up saved, their derivative in XLA) against the backward
  kernel's epilogue on the recomputed ones, bf16: the same values, the same formula."""
  x, idx, weight, valid, w = inputs(6)
  bf = jnp.bfloat16
  args = (x.astype(bf), idx, weight, valid, [a.astype(bf) for a in w], 1.0)
  _, g_re = run('grouped_fused', *args, grouped_tiles=TILES, fused_recompute=True)
  _, g_sv = run('grouped_fused', *args, grouped_tiles=TILES, fused_recompute=False)
  for a, b in zip(g_sv, g_re):
    assert rel_err(a, b) <= 1e-6


def test_kernels_equal_the_layout_references():
  """Each kernel of fused_experts.py against plain jnp on the padded layout, f32."""
  x, idx, weight, valid, (wg, wu, wd) = inputs(2)
  lay = grouped_gemm.make_layout(idx, valid, E, TILES.block_m)
  src_m = jnp.where(lay.used_m, lay.assign_m // K, -1)
  x_md = jnp.where(lay.used_m[:, None], x[jnp.maximum(src_m, 0)], 0)
  te, g = lay.tile_expert_t, lay.group_tiles_e1
  ref = functools.partial(grouped_gemm.grouped_matmul_reference, tile_expert_t=te)
  kw = dict(tiles=TILES, interpret=True)
  scale_m = jax.random.uniform(jax.random.key(3), src_m.shape) * lay.used_m

  gate, up = ref(x_md, wg), ref(x_md, wu)
  h = fe.swiglu_gate_up(x, src_m, wg, wu, te, limit=1.0, **kw)
  assert h.shape == (src_m.shape[0], F)
  assert rel_err(h, clipped_swiglu(gate, up, 1.0)) <= 1e-6
  dh = jax.random.normal(jax.random.key(4), h.shape)
  d_gate, d_up = fe.swiglu_gate_up(x, src_m, wg, wu, te, limit=1.0, dh_mf=dh, scale_m=scale_m,
                                   **kw)
  _, vjp = jax.vjp(lambda a, b: clipped_swiglu(a, b, 1.0), gate, up)
  want = vjp(dh * scale_m[:, None])
  assert rel_err(d_gate, want[0]) <= 1e-6 and rel_err(d_up, want[1]) <= 1e-6

  dy_nd = jax.random.normal(jax.random.key(5), (N, D))
  dy_md = jnp.where(lay.used_m[:, None], dy_nd[jnp.maximum(src_m, 0)], 0)
  got = fe.gmm_rows(((dy_nd, wd),), te, src_m=src_m, transpose_rhs=True, **kw)
  assert rel_err(got, ref(dy_md, jnp.swapaxes(wd, 1, 2))) <= 1e-6
  got = fe.gmm_rows(((h, wd),), te, scale_m=scale_m, out_dtype=jnp.float32, **kw)
  assert rel_err(got, ref(h, wd) * scale_m[:, None]) <= 1e-6
  summed = fe.gmm_rows(((h, wd),), te, scale_m=scale_m, dest_m=jnp.where(src_m >= 0, src_m, N),
                       n_dest=N, **kw)
  assert rel_err(summed, fe.gather_sum(got, lay.row_a.reshape(N, K),
                                       lay.valid_a.reshape(N, K))) <= 1e-6
  two = fe.gmm_rows(((d_gate, wg), (d_up, wu)), te, transpose_rhs=True, **kw)
  want = ref(d_gate, jnp.swapaxes(wg, 1, 2)) + ref(d_up, jnp.swapaxes(wu, 1, 2))
  assert rel_err(two, want) <= 1e-6

  dw = fe.tgmm_rows(x, d_gate, g, block_m=TILES.block_m, rows_x=src_m, **kw)
  assert rel_err(dw, gg.tgmm(x_md, d_gate, g, block_m=TILES.block_m, **kw)) <= 1e-6
  dw = fe.tgmm_rows(h, dy_nd, g, block_m=TILES.block_m, rows_dy=src_m, scale_m=scale_m, **kw)
  want = gg.tgmm(h, dy_md * scale_m[:, None], g, block_m=TILES.block_m, **kw)
  assert rel_err(dw, want) <= 1e-6 and np.all(np.asarray(dw)[list(EMPTY)] == 0)


def _values(jaxpr):
  """(primitive, shape, dtype) of every value the program computes, inside its calls and custom
  rules but not inside the kernels (a kernel's body works on its tiles)."""
  out = []
  for eqn in jaxpr.eqns:
    out += [(eqn.primitive.name, tuple(v.aval.shape), v.aval.dtype) for v in eqn.outvars]
    if eqn.primitive.name != 'pallas_call':
      for sub in jex_core.jaxprs_in_params(eqn.params):
        out += _values(sub)
  return out


@pytest.mark.parametrize('combine', fe.COMBINES)
def test_the_forward_writes_neither_gathered_rows_nor_gate_and_up(combine):
  """grouped_fused's forward (bf16) gathers no [M_pad, D] copy of the tokens, and its kernels
  write one [M_pad, F] array, h, and one [M_pad, D] array, the weighted rows of the gather combine
  (none with the atomic one); `grouped`'s, the contrast that makes the check bite, gathers the
  token rows and its kernels write gate and up."""
  x, idx, weight, valid, w = inputs(3)
  bf = jnp.bfloat16
  args = (x.astype(bf), idx, weight, valid, *(a.astype(bf) for a in w))
  m_pad = grouped_gemm.padded_rows(N * K, E, TILES.block_m)
  values = {}
  for backend in ('grouped', 'grouped_fused'):
    fwd = functools.partial(expert_gemm.expert_ffn, swiglu_limit=1.0, backend=backend,
                            grouped_tiles=TILES, fused_combine=combine)
    values[backend] = _values(jax.make_jaxpr(fwd)(*args).jaxpr)

  def rows(backend, width, primitive):
    widths = (width, -(-width // 16) * 16)  # the kernels pad widths to 16
    return [v for v in values[backend]
            if v[0] == primitive and v[1][:1] == (m_pad,) and v[1][1:] in [(c,) for c in widths]]
  assert rows('grouped', D, 'gather') and not rows('grouped_fused', D, 'gather')
  assert len(rows('grouped', F, 'pallas_call')) == 2  # gate and up
  assert [v[2] for v in rows('grouped_fused', F, 'pallas_call')] == [bf]  # h only
  assert len(rows('grouped_fused', D, 'pallas_call')) == (combine == 'gather')


def test_fp8_is_refused_by_name():
  x, idx, weight, valid, w = inputs(4)
  with pytest.raises(ValueError, match='grouped_fused'):
    expert_gemm.expert_ffn(x, idx, weight, valid, *w, swiglu_limit=1.0, backend='grouped_fused',
                           fp8='rowwise')
  for key in ('model.moe_backend', 'model.eval_moe_backend'):
    c = small_config(**{key: 'grouped_fused', 'model.fp8': 'rowwise'})
    with pytest.raises(ConfigError, match=re.escape(key) + r'.*model\.fp8'):
      resolve(c, num_devices=1, backend='gpu')
  assert MOE_BACKENDS == expert_gemm.BACKENDS
  for backend in ('cpu', 'gpu', 'tpu'):  # opt-in: auto never picks it
    assert resolve(small_config(), num_devices=1, backend=backend).model.moe_backend != \
        'grouped_fused'


def test_bounded_layout_with_max_valid():
  """max_valid (the bounded allgather exchange) sizes the layout by the valid assignments."""
  x, idx, weight, valid, w = inputs(5, per_assignment=True)
  bound = int(np.asarray(valid).sum())
  y_ref, g_ref = run('reference', x, idx, weight, valid, w, 1.0)
  y, grads = run('grouped_fused', x, idx, weight, valid, w, 1.0, grouped_tiles=TILES,
                 max_valid=bound)
  assert rel_err(y, y_ref) <= 1e-5
  for g, r in zip(grads, g_ref):
    assert rel_err(g, r) <= 1e-5


def test_kernels_lower_to_triton_at_the_1b_shapes(monkeypatch):
  """The Triton lowering (gathered loads, the SwiGLU derivative in the epilogue, atomics) at
  configs/ablation_1b.py's expert shapes, forward and backward, both combines, gate and up
  recomputed or saved. It does not run Triton's compiler, which needs the GPU; so every launch's
  pipeline stages are checked to fit Hopper's shared memory here (dx's two GEMM pairs at 3 stages
  asked for 288 KB and failed on the H100)."""
  stages_asked = {}  # a step's operand bytes: the stages granted

  def recording_fit_stages(num_stages, stage_bytes):
    stages = gg.fit_stages(num_stages, stage_bytes)
    stages_asked[stage_bytes] = stages
    return stages
  monkeypatch.setattr(fe, 'fit_stages', recording_fit_stages)
  with triton_lowering_for_h200():
    e, d, f, n, k, bm = 64, 1024, 384, 4096, 6, gg.GPU_TILES.block_m
    m = grouped_gemm.padded_rows(n * k, e, bm)
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    args = (s((n, d), bf16), s((m,), jnp.float32), s((e, d, f), bf16), s((e, d, f), bf16),
            s((e, f, d), bf16), s((m,), jnp.int32), s((m // bm,), jnp.int32),
            s((e + 1,), jnp.int32), s((n, k), jnp.int32), s((n, k), bool))
    for combine, recompute in (('gather', True), ('atomic', False)):
      def fwd_bwd(x, wm, wg, wu, wd, *layout, combine=combine, recompute=recompute):
        y, vjp = jax.vjp(lambda *a: fe.fused_expert_block(
            *a, *layout, 10.0, combine, jnp.dtype(bf16), gg.GPU_TILES, False, recompute),
            x, wm, wg, wu, wd)
        return y, vjp(y)
      text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=('cuda',)).as_text()
      swiglu = ('moe_swiglu', 'moe_swiglu_bwd') if recompute else ('moe_swiglu_save',)
      for name in (*swiglu, 'moe_gmm_rows', 'moe_tgmm_rows'):
        assert f'"{name}"' in text, name
      assert ('"moe_gmm_scatter"' in text) == (combine == 'atomic')
  assert all(n * b <= gg.SHARED_MEMORY_BYTES for b, n in stages_asked.items()), stages_asked
  two_pairs = 2 * (bm + gg.GPU_TILES.block_n) * gg.GPU_TILES.block_k * 2  # dx: gate and up
  assert stages_asked[two_pairs] == 2 < gg.GPU_TILES.num_stages


def test_a_train_step_equals_reference():
  """model.moe_backend=grouped_fused against reference: one train step's gradients and updated
  parameters (f32 on the CPU; the kernels interpreted)."""
  grads_ref, state_ref, metrics_ref = one_train_step(**{'model.moe_backend': 'reference'})
  grads, state, metrics = one_train_step(**{'model.moe_backend': 'grouped_fused'})
  np.testing.assert_allclose(metrics['loss'], metrics_ref['loss'], rtol=1e-5)
  leaves, leaves_ref = jax.tree.leaves(grads), jax.tree.leaves(grads_ref)
  assert len(leaves) == len(leaves_ref)
  for a, b in zip(leaves, leaves_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)
  # Adam's first update is about lr * g / (|g| + eps) per entry: where g is near eps, a gradient
  # difference at rounding level moves the update by a fraction of lr (3e-3); 1% of lr allowed.
  for a, b in zip(jax.tree.leaves(state['params']), jax.tree.leaves(state_ref['params'])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=3e-5)


def test_shapes_only_stand_in_never_runs():
  """tools.plan's stand-in (ops/launch.py): within shapes_only the backend's kernels compile as
  their buffers, and the program so traced refuses to run."""
  x, idx, weight, valid, w = inputs(7)

  def loss(x, weight, *w):
    y, _ = expert_gemm.expert_ffn(x, idx, weight, valid, *w, swiglu_limit=1.0,
                                  backend='grouped_fused', grouped_tiles=TILES)
    return jnp.sum(y ** 2)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  with launch.shapes_only():
    hlo = grads.lower(x, weight, *w).compile().as_text()
  assert 'moe_swiglu' not in hlo and 'cpu_callback' in hlo
  with pytest.raises(Exception, match='compile-only stand-in'):
    jax.block_until_ready(grads(x, weight, *w))
