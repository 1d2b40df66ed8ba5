"""Grouped-GEMM kernels (Pallas interpreter) against plain jnp and lax.ragged_dot, f32 and bf16.

The layout is checked against its definition in numpy; gmm, its transposed-weight variant and
tgmm against the per-row-gathered reference; the custom VJP against lax.ragged_dot on the
unpadded rows (an independent formula). Routing is deliberately uneven: a hot expert spanning
several row tiles, empty experts, padding tokens, widths that are not multiples of 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41.ops import grouped_gemm
from deepseek41.ops.gpu import grouped_gemm as gg
from tests.helpers import jaxpr_eqns, triton_lowering_for_h200

N, K, E, D, F = 64, 2, 8, 24, 40  # D, F not multiples of 16: the kernels pad them
BM = gg.INTERPRET_TILES.block_m  # 32: tgmm takes two 16-row steps per tile
TILES = gg.INTERPRET_TILES
RTOL = 1e-5


def assert_close(a, b, rtol=RTOL, what=''):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(np.abs(b).max(), 1e-30)
  err = np.abs(a - b).max() / scale
  assert err <= rtol, f'{what}: max error {err:.2e} of max|ref| exceeds {rtol:.0e}'


def routing(seed, n=N, empty=(3, 6), pad_frac=0.2):
  """Distinct top-K experts per token, skewed to expert 0, experts `empty` never chosen."""
  ks = jax.random.split(jax.random.key(seed), 2)
  logits = jax.random.uniform(ks[0], (n, E)) - 2.0 * (jnp.arange(E) > 0)
  logits = logits.at[:, list(empty)].set(-10.0)
  idx = jax.lax.top_k(logits, K)[1].astype(jnp.int32)
  valid = jax.random.uniform(ks[1], (n,)) >= pad_frac
  return idx, valid


def dispatch(x_nd, lay):
  """Rows of the padded layout, padding rows zero (what the expert backend builds)."""
  return jnp.where(lay.used_m[:, None], x_nd[lay.assign_m // K], 0).astype(x_nd.dtype)


def test_layout_matches_definition():
  idx, valid = routing(0)
  lay = jax.jit(grouped_gemm.make_layout, static_argnums=(2, 3))(idx, valid, E, BM)
  idx, valid = np.asarray(idx), np.asarray(valid)
  m_pad = grouped_gemm.padded_rows(N * K, E, BM)
  te = np.asarray(lay.tile_expert_t)
  g = np.asarray(lay.group_tiles_e1)
  assert te.shape == (m_pad // BM,) and g.shape == (E + 1,)
  counts = np.bincount(idx[valid].reshape(-1), minlength=E)
  assert counts[0] > BM and counts[3] == 0  # one group spans tiles, one is empty
  np.testing.assert_array_equal(np.diff(g), -(-counts // BM))
  for e in range(E):
    assert np.all(te[g[e]:g[e + 1]] == e)
  assert np.all(te[g[E]:] == -1) and g[E] < len(te)  # unused tiles exist and are marked

  row_a, valid_a = np.asarray(lay.row_a), np.asarray(lay.valid_a)
  assign_m, used_m = np.asarray(lay.assign_m), np.asarray(lay.used_m)
  np.testing.assert_array_equal(valid_a, np.repeat(valid, K))
  assert used_m.sum() == valid_a.sum()
  rows = row_a[valid_a]
  assert len(set(rows.tolist())) == len(rows)  # distinct rows
  np.testing.assert_array_equal(used_m[rows], True)
  np.testing.assert_array_equal(assign_m[rows], np.flatnonzero(valid_a))  # inverse maps
  # Each assignment sits in a tile of its expert, token order kept within the group.
  e_a = idx.reshape(-1)
  np.testing.assert_array_equal(te[rows // BM], e_a[valid_a])
  for e in range(E):
    r = row_a[valid_a & (e_a == e)]
    np.testing.assert_array_equal(r, g[e] * BM + np.arange(len(r)))


def test_the_layout_launches_no_loop():
  """The tile -> expert search is one comparison of every tile with every group end, not XLA's
  binary-search while loop (a few launches per step, in every MoE layer of a decode step)."""
  idx, valid = routing(0)
  jaxpr = jax.make_jaxpr(grouped_gemm.make_layout, static_argnums=(2, 3))(idx, valid, E, BM)
  assert not {'while', 'scan'} & {e.primitive.name for e in jaxpr_eqns(jaxpr.jaxpr)}



@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_kernels_match_reference(dtype):
  idx, valid = routing(1)
  lay = grouped_gemm.make_layout(idx, valid, E, BM)
  ks = jax.random.split(jax.random.key(2), 3)
  x_md = dispatch(jax.random.normal(ks[0], (N, D)), lay).astype(dtype)
  w_edf = (jax.random.normal(ks[1], (E, D, F)) / np.sqrt(D)).astype(dtype)
  dy_mf = jnp.where(lay.used_m[:, None], jax.random.normal(ks[2], (x_md.shape[0], F)), 0)
  dy_mf = dy_mf.astype(dtype)
  # bf16: the reference takes the same bf16 values in f32, so only the output rounding differs.
  rtol = RTOL if dtype == jnp.float32 else 8e-3
  ref = lambda x, w: grouped_gemm.grouped_matmul_reference(x, w, lay.tile_expert_t)  # noqa: E731
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  y_ref, vjp = jax.vjp(ref, f32(x_md), f32(w_edf))
  dx_ref, dw_ref = vjp(f32(dy_mf))

  y = gg.gmm(x_md, w_edf, lay.tile_expert_t, tiles=TILES, interpret=True)
  assert y.dtype == dtype and y.shape == (x_md.shape[0], F)
  assert_close(y, y_ref, rtol, 'gmm')
  dx = gg.gmm(dy_mf, w_edf, lay.tile_expert_t, transpose_rhs=True, tiles=TILES, interpret=True)
  assert dx.shape == x_md.shape
  assert_close(dx, dx_ref, rtol, 'gmm transposed')
  dw = gg.tgmm(x_md, dy_mf, lay.group_tiles_e1, block_m=BM, tiles=TILES, interpret=True)
  assert dw.shape == w_edf.shape
  assert_close(dw, dw_ref, rtol, 'tgmm')
  dw = np.asarray(dw, np.float32)
  assert np.all(dw[[3, 6]] == 0) and np.abs(dw[0]).max() > 0  # empty experts: zero gradient
  # Unused tiles write zeros (the output buffer is not initialised otherwise).
  assert np.all(np.asarray(y, np.float32)[int(lay.group_tiles_e1[-1]) * BM:] == 0)


def test_grouped_matmul_grads_match_ragged_dot():
  """The custom VJP against lax.ragged_dot on the unpadded expert-sorted rows."""
  idx, valid = routing(3)
  lay = grouped_gemm.make_layout(idx, valid, E, BM)
  order_a, _, counts_e = grouped_gemm.sort_by_expert(idx, valid, E)
  ks = jax.random.split(jax.random.key(4), 3)
  x_nd = jax.random.normal(ks[0], (N, D))
  w_edf = jax.random.normal(ks[1], (E, D, F)) / np.sqrt(D)
  valid_a = np.repeat(np.asarray(valid), K)
  ct_af = jax.random.normal(ks[2], (N * K, F))

  def loss_grouped(x_nd, w_edf):
    y_mf = gg.grouped_matmul(dispatch(x_nd, lay), w_edf, lay.tile_expert_t, lay.group_tiles_e1,
                             TILES, True)
    y_af = jnp.where(lay.valid_a[:, None], y_mf[lay.row_a], 0)  # back in assignment order
    return jnp.sum(y_af * ct_af)

  def loss_ragged(x_nd, w_edf):
    x_sd = jnp.where((jnp.arange(N * K) < counts_e.sum())[:, None], x_nd[order_a // K], 0)
    y_sf = jax.lax.ragged_dot(x_sd, w_edf, counts_e, precision=jax.lax.Precision.HIGHEST)
    y_af = y_sf[jnp.argsort(order_a)]
    return jnp.sum(jnp.where(jnp.asarray(valid_a)[:, None], y_af, 0) * ct_af)

  (l, g), (l_ref, g_ref) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x_nd, w_edf)
                            for f in (loss_grouped, loss_ragged))
  assert_close(l, l_ref, what='loss')
  for name, a, b in zip(('x', 'w'), g, g_ref):
    assert np.abs(np.asarray(b)).max() > 0, name
    assert_close(a, b, what=f'd/d{name}')


def test_kernels_lower_to_triton_at_h200_shapes():
  """The Triton lowering (block shapes, scalar loads, dynamic loop bounds) at the 1B shapes.

  Lowers for CUDA on the CPU with a stand-in for the GPU query (a private hook: skipped if it
  moved). It does not run Triton's compiler; that needs the GPU.
  """
  with triton_lowering_for_h200():
    e, d, f, bm = 64, 1024, 384, gg.GPU_TILES.block_m
    m = grouped_gemm.padded_rows(4096 * 6, e, bm)
    bf16 = jnp.bfloat16
    x = jax.ShapeDtypeStruct((m, d), bf16)
    w = jax.ShapeDtypeStruct((e, d, f), bf16)
    dy = jax.ShapeDtypeStruct((m, f), bf16)
    te = jax.ShapeDtypeStruct((m // bm,), jnp.int32)
    g = jax.ShapeDtypeStruct((e + 1,), jnp.int32)
    fp8 = functools.partial(gg.grouped_matmul_fp8, tiles=gg.GPU_TILES, interpret=False)

    def fp8_fwd_bwd(x, w, te, g, dy):
      y, vjp = jax.vjp(lambda x, w: fp8(x, w, te, g), x, w)
      return y, vjp(dy)
    # Compiled, as on the GPU (the launch rule would interpret on this CPU).
    cases = [(lambda x, w, te: gg.gmm(x, w, te, interpret=False), (x, w, te)),
             (lambda dy, w, te: gg.gmm(dy, w, te, transpose_rhs=True, interpret=False),
              (dy, w, te)),
             (lambda x, dy, g: gg.tgmm(x, dy, g, block_m=bm, interpret=False), (x, dy, g)),
             # model.fp8: e4m3 operands, scaled epilogue, forward and dgrad (+ bf16 tgmm)
             (fp8_fwd_bwd, (x, w, te, g, dy))]
    for fn, args in cases:
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text()
      assert 'triton' in text
    assert 'moe_gmm_fp8' in text and 'moe_gmm_t_fp8' in text and 'f8E4M3FN' in text


@pytest.mark.parametrize('fp8', ['off', 'rowwise'])
def test_shapes_only_stand_in_holds_the_kernels_buffers_and_never_runs(fp8):
  """tools.plan's stand-in: within shapes_only the routed experts compile with the grouped
  layout's buffers but without the interpreter's loops (which copy the kernels' operands); a
  program traced within refuses to run, and a program traced outside runs the kernels."""
  from deepseek41.ops import expert_gemm, launch
  n, d, f, e, k = 512, 64, 32, 8, 2
  ks = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(ks[0], (n, d))
  idx = jax.lax.top_k(jax.random.normal(ks[1], (n, e)), k)[1]
  wt = jax.nn.softmax(jax.random.normal(ks[2], (n, k)))
  ws = [jax.random.normal(kk, s) / 8 for kk, s in zip(ks[3:], ((e, d, f), (e, d, f), (e, f, d)))]

  def grads(backend):
    def loss(x, wt, *ws):
      y, _ = expert_gemm.expert_ffn(x, idx, wt, jnp.ones(n, bool), *ws, swiglu_limit=10.0,
                                    backend=backend, fp8=fp8)
      return jnp.sum(y ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

  interpreted = grads('grouped').lower(x, wt, *ws).compile()
  traced_within = grads('grouped')
  with launch.shapes_only():
    compiled = traced_within.lower(x, wt, *ws).compile()
  hlo = compiled.as_text()
  # Three projections forward, then dgrad and wgrad of each: nine opaque kernels.
  assert hlo.count('custom_call_target="xla_python_cpu_callback"') + \
      hlo.count('custom_call_target="xla_ffi_python_cpu_callback"') == 9, hlo[:2000]
  m_pad = grouped_gemm.padded_rows(n * k, e, TILES.block_m)
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp >= m_pad * d * 4  # at least the layout's rows and their cotangent
  assert temp < interpreted.memory_analysis().temp_size_in_bytes
  with pytest.raises(Exception, match='compile-only stand-in'):
    jax.block_until_ready(traced_within(x, wt, *ws))
  got = grads('grouped')(x, wt, *ws)
  want = grads('reference')(x, wt, *ws)
  for g, w in zip(got, want):
    assert_close(g, w, rtol=1e-4 if fp8 == 'off' else 0.1)
