"""Fused mHC sites (Pallas, Triton backend): coefficients, collapse and expand in one pass over X.

The jnp reference is `deepseek41/model/mhc.py` (`MHCSite`, `sinkhorn`, `collapse`, `expand`;
docs/architecture.md section 3.2). There every site reads the streams X [B, T, n, D] several
times in many small XLA kernels (the RMS, the projection, the collapse, the expand, a Sinkhorn
loop of 20 iterations over [B, T, 4, 4]). Here one kernel streams a block of tokens' n*D values
once and does, per token and in registers:

    expand     X'[k] = post_k F + sum_j C[j, k] X[j]            (optional; X' written once)
    site       r = rms(X'), m = r * fn . X', pre/post/C with sigmoid, softmax + Sinkhorn (fp32)
    collapse   u = sum_k pre_k X'[k]   with a GIVEN pre (single pass: the previous site's; one
               pass) or the site's OWN pre (multi pass: a second walk over the block's tokens)

Which parts run is static (`_Spec`); the model's orders map onto it (transformer.py):
  single pass  layer start        site_collapse(X, site_a, pre_prev)           1 read of X
               after attention    expand_site_collapse(X, attn, post_a, C_a, site_f, pre_a)
                                                                               1 read, 1 write
               after the MoE      expand(X, moe, post_f, C_f)                  1 read, 1 write
  multi pass   the same calls with pre=None (a second walk for the collapse).
(The layer-end expand and the next layer's site_collapse are one `expand_site_collapse` when
no Engram layer sits between them; the model does not fuse across blocks yet.)

Backward (`jax.custom_vjp`, nothing big saved: X' is the op's own output, kept anyway as the
next op's input): a per-token kernel turns d(pre, post, C) into d(pre-activations), the Sinkhorn
backward recomputing the forward rounds in registers (O(iters^2) tiny 4x4 steps, no saved
iterations); then one streaming kernel per op recomputes X' from X and F and writes dX, dF and
the per-token reductions (d pre of the given collapse, d post, dC) in one walk. The multi-pass
own collapse adds one reduction walk (<du, X'[k]>) before the coefficient backward. fn's
gradient, a [24, n*D] sum over every token, is an XLA matmul over the site's input (one more
read of X per site). The backward's W term runs as a matmul in the streams' dtype (bf16 MMA for
bf16 streams: the rounding of the bf16 dX it feeds).

Held equal to mhc.py on the CPU (tests/kernels/test_mhc_kernel.py: the interpreter, and every kernel
lowered for Triton) and on the H200 (benchmarks/bench_mhc.py --check; docs/performance.md 10.1).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from deepseek41.ops import launch
from deepseek41.ops.contracts import MIN_DOT
from deepseek41.ops.launch import pad_axis
from deepseek41.ops.parallel.per_device import batch_local

_COEF_BLOCK = 128  # tokens per program of the per-token coefficient backward


# ---------------------------------------------------------------------------------------------
# Per-token coefficient math on lists of [tokens] vectors: the same code runs in jnp (tests) and
# inside the kernels (a 4x4 matrix per token is 16 vectors; no reshapes, no dynamic indexing).


def _sigmoid(a):
  return 1.0 / (1.0 + jnp.exp(-a))


def _softmax_rows(z, n):
  out = []
  for j in range(n):
    row = z[j * n:(j + 1) * n]
    mx = functools.reduce(jnp.maximum, row)
    e = [jnp.exp(v - mx) for v in row]
    s = functools.reduce(jnp.add, e)
    out += [v / s for v in e]
  return out


def _rows(c, n, eps):
  """c[j, k] / (sum_k c[j, k] + eps) on a flat row-major list."""
  out = []
  for j in range(n):
    s = functools.reduce(jnp.add, c[j * n:(j + 1) * n]) + eps
    out += [v / s for v in c[j * n:(j + 1) * n]]
  return out


def _cols(c, n, eps):
  """c[j, k] / (sum_j c[j, k] + eps)."""
  s = [functools.reduce(jnp.add, c[k::n]) + eps for k in range(n)]
  return [c[i] / s[i % n] for i in range(n * n)]


def _rows_vjp(c, dy, n, eps):
  """Cotangent of the row normalisation at input c: (dy - <dy, y>_row) / (rowsum + eps)."""
  out = []
  for j in range(n):
    row, drow = c[j * n:(j + 1) * n], dy[j * n:(j + 1) * n]
    s = functools.reduce(jnp.add, row) + eps
    dot = functools.reduce(jnp.add, [dv * v for dv, v in zip(drow, row)]) / s
    out += [(dv - dot) / s for dv in drow]
  return out


def _cols_vjp(c, dy, n, eps):
  s = [functools.reduce(jnp.add, c[k::n]) + eps for k in range(n)]
  dot = [functools.reduce(jnp.add, [dy[i] * c[i] for i in range(k, n * n, n)]) / s[k]
         for k in range(n)]
  return [(dy[i] - dot[i % n]) / s[i % n] for i in range(n * n)]


def sinkhorn_flat(z, n, iters, eps):
  """`mhc.sinkhorn` on a flat row-major list of n*n vectors (logits z[j*n + k])."""
  c = _cols([v + eps for v in _softmax_rows(z, n)], n, eps)
  rounds = lambda _, c: tuple(_cols(_rows(list(c), n, eps), n, eps))  # noqa: E731
  return list(jax.lax.fori_loop(0, iters - 1, rounds, tuple(c)))


def sinkhorn_flat_vjp(z, dc, n, iters, eps):
  """d logits from d C, by recomputing the forward rounds (nothing of the iterations saved).

  Round i (1..iters-1) maps C_{i-1} -> C_i; its backward needs C_{i-1}, recomputed from C_0 by a
  fixed-length masked loop (static trip counts keep the Triton lowering simple).
  """
  sm = _softmax_rows(z, n)
  s0 = [v + eps for v in sm]
  c0 = tuple(_cols(s0, n, eps))

  def back(t, dc):
    i = iters - 1 - t

    def fwd(j, c):
      new = _cols(_rows(list(c), n, eps), n, eps)
      return tuple(jnp.where(j < i - 1, a, b) for a, b in zip(new, c))
    c_prev = list(jax.lax.fori_loop(0, max(iters - 2, 0), fwd, c0))
    r = _rows(c_prev, n, eps)
    dr = _cols_vjp(r, list(dc), n, eps)
    return tuple(_rows_vjp(c_prev, dr, n, eps))
  dc0 = list(jax.lax.fori_loop(0, iters - 1, back, tuple(dc)))
  ds0 = _cols_vjp(s0, dc0, n, eps)
  dz = []
  for j in range(n):
    y, dy = sm[j * n:(j + 1) * n], ds0[j * n:(j + 1) * n]
    dot = functools.reduce(jnp.add, [a * b for a, b in zip(dy, y)])
    dz += [b * (a - dot) for a, b in zip(dy, y)]
  return dz


def coefficients_flat(a, n, iters, eps):
  """(pre, post, comb) lists from the (2+n)n pre-activations a = scale * m + base."""
  pre = [_sigmoid(v) + eps for v in a[:n]]
  post = [2.0 * _sigmoid(v) for v in a[n:2 * n]]
  return pre, post, sinkhorn_flat(a[2 * n:], n, iters, eps)


def coefficients_flat_vjp(a, dpre, dpost, dcomb, n, iters, eps):
  """d a (a list of (2+n)n vectors) from the cotangents of pre, post and comb."""
  s = [_sigmoid(v) for v in a[:2 * n]]
  da = [dpre[k] * s[k] * (1.0 - s[k]) for k in range(n)]
  da += [2.0 * dpost[k] * s[n + k] * (1.0 - s[n + k]) for k in range(n)]
  return da + sinkhorn_flat_vjp(a[2 * n:], dcomb, n, iters, eps)


# ---------------------------------------------------------------------------------------------
# Kernels


class _Spec(NamedTuple):
  n: int
  d: int
  expand: bool
  site: bool
  collapse: str            # 'none' | 'given' (pre passed in) | 'own' (the site's pre)
  iters: int
  eps: float
  norm_eps: float
  block_t: int
  block_d: int
  num_warps: int
  block_t_bwd: int
  block_d_bwd: int
  num_warps_bwd: int
  num_stages: int          # Triton software pipelining of the walks' loads (1 = none)
  prefetch: bool           # issue the next D chunk's loads before this chunk's work (`_walk`)
  interpret: bool
  rows: int = 0            # the call's token rows (the forward's last block may be partial)
  splits: int = 1          # the forward's programs per row block, each over D / splits columns

  @property
  def ragged(self):
    """Whether the forward's last block reaches past the rows (its loads and stores masked)."""
    return self.rows % self.block_t != 0

  def backward(self):
    """The spec the backward kernel runs with (its own block sizes)."""
    return self._replace(block_t=self.block_t_bwd, block_d=self.block_d_bwd,
                         num_warps=self.num_warps_bwd, splits=1)

  @property
  def cols(self):  # the (2+n)n coefficient columns + r, padded to a power of two >= 16
    return max(MIN_DOT, pl.next_power_of_2((2 + self.n) * self.n + 1))

  @property
  def nc(self):
    return (2 + self.n) * self.n


def _columns(mat, count):
  """[tb, C] -> `count` [tb] columns (masked sums: Triton cannot slice register arrays)."""
  col = jax.lax.broadcasted_iota(jnp.int32, mat.shape, 1)
  return [jnp.sum(jnp.where(col == c, mat, 0.0), axis=1) for c in range(count)]


def _matrix(vecs, width):
  """A list of [tb] vectors -> [tb, width] (zeros past the list)."""
  shape = (vecs[0].shape[0], width)
  col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  out = jnp.zeros(shape, jnp.float32)
  for c, v in enumerate(vecs):
    out = jnp.where(col == c, v[:, None], out)
  return out


def _row_mask(spec):
  """[tb, 1]: which of this program's token rows exist, or None when every one does.

  A decode step has one token a row: padding its arrays to a whole block cost a pad kernel per
  operand and call (about 12 a layer), so the forward takes the rows as they are and masks.
  """
  if not spec.ragged:
    return None
  tb = spec.block_t
  row = pl.program_id(0) * tb + jax.lax.broadcasted_iota(jnp.int32, (tb, 1), 0)
  return row < spec.rows


def _at(ref, idx):
  # Integer indices as arrays: the interpreter's masked loads take no Python ints.
  idx = idx if isinstance(idx, tuple) else (idx,)
  return ref.at[tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)]


def _get(ref, idx, rows):
  """ref[idx] for a row-blocked ref, rows past the array read as zeros."""
  return ref[idx] if rows is None else plt.load(_at(ref, idx), mask=rows, other=0)


def _put(ref, idx, val, rows):
  if rows is None:
    ref[idx] = val
  else:
    plt.store(_at(ref, idx), val, mask=rows)


def _cols_of(ref, count, loads=False, rows=None):
  """[tb, 1] columns of a small per-token ref. The backward loads them inside its D loop
  (L1 hits) rather than keeping 20+ per-token vectors live across it (fewer registers: ptxas
  for sm_90); the forward loads them once before its loop (there that used fewer)."""
  if ref is None:
    return None
  if loads:
    return [ref[:, pl.ds(i, 1)].astype(jnp.float32) for i in range(count)]
  return [v[:, None] for v in _columns(_get(ref, slice(None), rows).astype(jnp.float32), count)]


def _pop(refs, count):
  return tuple(refs.pop(0) for _ in range(count))


def _load(spec, x_ref, f_ref, d0, *extra, rows=None):
  """One D chunk's tiles as stored: the n X tiles, F's (expand), then `extra` refs' tiles
  ([tb, n, D] refs give n tiles, [tb, D] refs one); `rows`: `_row_mask`'s."""
  bd = spec.block_d
  tiles = [_get(x_ref, (slice(None), k, pl.ds(d0, bd)), rows) for k in range(spec.n)]
  if spec.expand:
    tiles.append(_get(f_ref, (slice(None), pl.ds(d0, bd)), rows))
  for ref in extra:
    tiles += ([ref[:, k, pl.ds(d0, bd)] for k in range(spec.n)] if len(ref.shape) == 3
              else [ref[:, pl.ds(d0, bd)]])
  return tuple(tiles)


def _walk(spec, load, body, init):
  """fori_loop over the D chunks: body(d0, tiles, carry) with tiles = load(d0).

  With `spec.prefetch` the next chunk's loads are issued before this chunk's work and carried
  in registers, so they are in flight while it computes: each program otherwise waits out a
  full memory latency per chunk, which bounded the kernels at a third of the copy bandwidth
  (docs/performance.md 10.1, 24), and Triton's own pipelining (`num_stages`) does not apply to
  loads that feed no dot.
  """
  bd, span = spec.block_d, spec.d // spec.splits
  steps = span // bd
  start = pl.program_id(1) * span if spec.splits > 1 else 0  # this program's D columns
  def at(ci):
    d0 = start + ci * bd
    return d0 if isinstance(d0, int) else pl.multiple_of(d0, bd)
  if not spec.prefetch:
    return jax.lax.fori_loop(0, steps, lambda ci, c: body(at(ci), load(at(ci)), c), init)

  def step(ci, carry):
    tiles, c = carry
    ahead = load(at(jnp.minimum(ci + 1, steps - 1)))
    return ahead, body(at(ci), tiles, c)
  return jax.lax.fori_loop(0, steps, step, (load(at(0)), init))[1]


def _chunk(spec, tiles, post, comb, dtype):
  """(X chunks fp32, X' chunks fp32 as stored, X' chunks fp32 unrounded, F chunk) from one
  chunk's tiles (`_load`); post and comb are lists of [tb, 1] columns."""
  n = spec.n
  xs = [v.astype(jnp.float32) for v in tiles[:n]]
  if not spec.expand:
    return xs, xs, xs, None
  f = tiles[n].astype(jnp.float32)
  xp = []
  for k in range(n):
    acc = post[k] * f
    for j in range(n):
      acc = acc + comb[j * n + k] * xs[j]
    xp.append(acc)
  # The site and the collapse read X' as stored (the reference reads the cast array).
  xq = [v.astype(dtype).astype(jnp.float32) for v in xp]
  return xs, xq, xp, f


def _site_rows(spec, base_ref, scale_ref):
  """[1, cols] scale and base of each coefficient column (scale_pre, _post, _comb by group),
  read from the site's own parameters: zeros past the (2+n)n columns."""
  n, nc, cols = spec.n, spec.nc, spec.cols
  col = jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1)
  brow = plt.load(base_ref.at[pl.ds(0, cols)], mask=col[0] < nc, other=0)
  s = [scale_ref[pl.ds(i, 1)].astype(jnp.float32)[None, :] for i in range(3)]
  srow = jnp.where(col < n, s[0], jnp.where(col < 2 * n, s[1], jnp.where(col < nc, s[2], 0.0)))
  return srow, brow.astype(jnp.float32)[None, :]


def _fwd_kernel(*refs, spec: _Spec):
  n, bd, nc, d = spec.n, spec.block_d, spec.nc, spec.d
  refs = list(refs)
  x_ref = refs.pop(0)
  f_ref, post_ref, comb_ref = _pop(refs, 3) if spec.expand else (None,) * 3
  pin_ref = refs.pop(0) if spec.collapse == 'given' else None
  fn_ref, base_ref, scale_ref = _pop(refs, 3) if spec.site else (None,) * 3
  xo_ref = refs.pop(0) if spec.expand else None
  u_ref = refs.pop(0) if spec.collapse != 'none' else None
  site_refs = refs  # pre, post, comb, m; or, split over D, this program's partial sums
  tb = x_ref.shape[0]
  rows = _row_mask(spec)
  post, comb = _cols_of(post_ref, n, rows=rows), _cols_of(comb_ref, n * n, rows=rows)
  pin = _cols_of(pin_ref, n, rows=rows)
  # fn [(2+n)n, n*D] as the site holds it, read in [cols, block_d] tiles (rows past (2+n)n as
  # zeros): no per-call copy into the kernel's layout, which a decode step paid every token.
  fn_rows = jax.lax.broadcasted_iota(jnp.int32, (spec.cols, 1), 0) < nc

  def load(d0):
    tiles = _load(spec, x_ref, f_ref, d0, rows=rows)
    if spec.site:
      tiles += tuple(plt.load(fn_ref.at[:, pl.ds(k * d + d0, bd)], mask=fn_rows, other=0)
                     for k in range(n))
    return tiles

  def walk1(d0, tiles, carry):
    sumsq, proj = carry
    _, xq, xp, _ = _chunk(spec, tiles, post, comb, x_ref.dtype)
    w = tiles[n + spec.expand:]
    if spec.expand:
      for k in range(n):
        _put(xo_ref, (slice(None), k, pl.ds(d0, bd)), xp[k].astype(xo_ref.dtype), rows)
    if spec.site:
      for k in range(n):
        sumsq = sumsq + jnp.sum(xq[k] * xq[k], axis=1)
        proj = proj + jax.lax.dot_general(  # X'_k [tb, bd] . fn_k [cols, bd]^T
            xq[k], w[k].astype(jnp.float32), (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32)
    if spec.collapse == 'given':
      u = functools.reduce(jnp.add, [pin[k] * xq[k] for k in range(n)])
      _put(u_ref, (slice(None), pl.ds(d0, bd)), u.astype(u_ref.dtype), rows)
    return sumsq, proj
  init = (jnp.zeros((tb,), jnp.float32), jnp.zeros((tb, spec.cols), jnp.float32))
  sumsq, proj = _walk(spec, load, walk1, init)
  if not spec.site:
    return
  if spec.splits > 1:  # [1, tb, cols]: the projection's partial sums, sumsq in column nc
    col = jax.lax.broadcasted_iota(jnp.int32, proj.shape, 1)
    _put(site_refs[0], (0, slice(None), slice(None)),
         jnp.where(col == nc, sumsq[:, None], proj), rows)
    return
  pre = _site_outputs(spec, sumsq, proj, base_ref, scale_ref, *site_refs, rows)
  if spec.collapse == 'own':
    def walk2(d0, tiles, carry):
      _, xq, _, _ = _chunk(spec, tiles, post, comb, x_ref.dtype)
      u = functools.reduce(jnp.add, [pre[k][:, None] * xq[k] for k in range(n)])
      _put(u_ref, (slice(None), pl.ds(d0, bd)), u.astype(u_ref.dtype), rows)
      return carry
    _walk(spec, lambda d0: _load(spec, x_ref, f_ref, d0, rows=rows), walk2, 0)


def _site_outputs(spec, sumsq, proj, base_ref, scale_ref, pre_ref, posto_ref, combo_ref, m_ref,
                  rows):
  """From a token block's sum of squares [tb] and projection fn . X' [tb, cols]: m (with r in
  column nc) and the coefficients, stored; the pre columns returned."""
  n, nc = spec.n, spec.nc
  r = 1.0 / jnp.sqrt(sumsq / (n * spec.d) + spec.norm_eps)
  m_mat = proj * r[:, None]
  col = jax.lax.broadcasted_iota(jnp.int32, m_mat.shape, 1)
  every = slice(None)
  _put(m_ref, every, jnp.where(col == nc, r[:, None], m_mat), rows)
  srow, brow = _site_rows(spec, base_ref, scale_ref)
  a = _columns(m_mat * srow + brow, nc)
  pre, post_o, comb_o = coefficients_flat(a, n, spec.iters, spec.eps)
  _put(pre_ref, every, _matrix(pre, n), rows)
  _put(posto_ref, every, _matrix(post_o, n), rows)
  _put(combo_ref, every, _matrix(comb_o, n * n), rows)
  return pre


def _coef_kernel(part_ref, base_ref, scale_ref, pre_ref, posto_ref, combo_ref, m_ref, *,
                 spec: _Spec):
  """The site's coefficients from the D-split forward's partial sums [splits, tb, cols]."""
  rows = _row_mask(spec)
  total = functools.reduce(jnp.add, [_get(part_ref, (s, slice(None), slice(None)), rows)
                                     for s in range(spec.splits)])
  sumsq = _columns(total, spec.nc + 1)[spec.nc]
  _site_outputs(spec, sumsq, total, base_ref, scale_ref, pre_ref, posto_ref, combo_ref, m_ref,
                rows)


def _coef_bwd_kernel(m_ref, sb_ref, dpre_ref, dpost_ref, dcomb_ref, da_ref, *, spec: _Spec):
  """Per token: d(pre-activations) from d(pre, post, comb), the Sinkhorn backward included.

  Its own small kernel (one token per thread): inside the streaming kernel the Sinkhorn
  backward's ~60 live per-token values pushed it into spills (ptxas, sm_90).
  """
  # [tb, 1] column loads: a layout with one token per thread (the columns of a loaded [tb, 32]
  # tile are replicated over the threads of a row group: 8 registers a value at 128 x 32).
  n, nc = spec.n, spec.nc
  a = [m_ref[:, pl.ds(c, 1)] * sb_ref[pl.ds(0, 1), pl.ds(c, 1)] + sb_ref[pl.ds(1, 1), pl.ds(c, 1)]
       for c in range(nc)]
  da = coefficients_flat_vjp(a, _cols_of(dpre_ref, n, True), _cols_of(dpost_ref, n, True),
                             _cols_of(dcomb_ref, n * n, True), n, spec.iters, spec.eps)
  for c in range(spec.cols):
    da_ref[:, pl.ds(c, 1)] = da[c] if c < nc else jnp.zeros_like(da[0])


def _own_kernel(*refs, spec: _Spec):
  """Multi pass: the collapse's share of d pre, <du, X'[k]> per token (X' recomputed)."""
  n = spec.n
  refs = list(refs)
  x_ref = refs.pop(0)
  f_ref, post_ref, comb_ref = _pop(refs, 3) if spec.expand else (None,) * 3
  du_ref, o_ref = refs

  def walk0(d0, tiles, acc):
    _, xq, _, _ = _chunk(spec, tiles, _cols_of(post_ref, n, True),
                         _cols_of(comb_ref, n * n, True), x_ref.dtype)
    du = tiles[-1].astype(jnp.float32)
    return tuple(acc[k] + jnp.sum(du * xq[k], axis=1) for k in range(n))
  zeros = jnp.zeros((x_ref.shape[0],), jnp.float32)
  load = lambda d0: _load(spec, x_ref, f_ref, d0, du_ref)  # noqa: E731
  own = _walk(spec, load, walk0, (zeros,) * n)
  o_ref[...] = _matrix(list(own), n)


def _bwd_kernel(*refs, spec: _Spec):
  n, bd, nc = spec.n, spec.block_d, spec.nc
  refs = list(refs)
  x_ref = refs.pop(0)
  f_ref, post_ref, comb_ref = _pop(refs, 3) if spec.expand else (None,) * 3
  pin_ref = refs.pop(0) if spec.collapse != 'none' else None   # 'own': the site's forward pre
  w_ref, sb_ref, m_ref, da_ref = (refs.pop(0), refs.pop(0), refs.pop(0), refs.pop(0)) \
      if spec.site else (None,) * 4
  dxo_ref = refs.pop(0) if spec.expand else None
  du_ref = refs.pop(0) if spec.collapse != 'none' else None
  dx_ref = refs.pop(0)
  df_ref, dposti_ref, dcombi_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if spec.expand \
      else (None,) * 3
  dpin_ref = refs.pop(0) if spec.collapse == 'given' else None
  assert not refs
  tb = x_ref.shape[0]
  f32 = jnp.float32
  zeros = jnp.zeros((tb,), f32)

  if spec.site:
    mp = m_ref[...]
    r = _columns(mp, nc + 1)[nc]
    dm_mat = da_ref[...] * sb_ref[pl.ds(0, 1), :]
    # d/dX' of m = r * fn . X': r fn^T dm - (r^2 / (n D)) (dm . m) X'
    shrink = r * r * jnp.sum(dm_mat * mp, axis=1) / (n * spec.d)   # mp's r column meets dm 0
    rdm = (dm_mat * r[:, None]).astype(w_ref.dtype)  # bf16 streams: a bf16 MMA, fp32 sums

  streams = [r for r in (dxo_ref, du_ref) if r is not None]

  def load(d0):
    tiles = _load(spec, x_ref, f_ref, d0, *streams)
    if spec.site:
      tiles += tuple(w_ref[k, :, pl.ds(d0, bd)] for k in range(n))
    return tiles

  def walk(d0, tiles, carry):
    dpin, dpost, dcomb = carry
    post, comb = _cols_of(post_ref, n, True), _cols_of(comb_ref, n * n, True)
    xs, xq, _, f = _chunk(spec, tiles, post, comb, x_ref.dtype)
    rest = list(tiles[n + spec.expand:])
    pre_c = _cols_of(pin_ref, n, True) if spec.collapse != 'none' else None
    if spec.expand:
      g = [rest.pop(0).astype(f32) for _ in range(n)]
    else:
      g = [jnp.zeros_like(xq[0]) for _ in range(n)]
    if spec.collapse != 'none':
      du = rest.pop(0).astype(f32)
      g = [g[k] + pre_c[k] * du for k in range(n)]
      if spec.collapse == 'given':
        dpin = tuple(dpin[k] + jnp.sum(du * xq[k], axis=1) for k in range(n))
    if spec.site:
      g = [g[k] + jnp.dot(rdm, rest[k], preferred_element_type=f32) - shrink[:, None] * xq[k]
           for k in range(n)]
    if spec.expand:
      dpost = tuple(dpost[k] + jnp.sum(g[k] * f, axis=1) for k in range(n))
      dcomb = tuple(dcomb[i] + jnp.sum(xs[i // n] * g[i % n], axis=1) for i in range(n * n))
      for j in range(n):
        dxj = functools.reduce(jnp.add, [comb[j * n + k] * g[k] for k in range(n)])
        dx_ref[:, j, pl.ds(d0, bd)] = dxj.astype(dx_ref.dtype)
      df = functools.reduce(jnp.add, [post[k] * g[k] for k in range(n)])
      df_ref[:, pl.ds(d0, bd)] = df.astype(df_ref.dtype)
    else:
      for k in range(n):
        dx_ref[:, k, pl.ds(d0, bd)] = g[k].astype(dx_ref.dtype)
    return dpin, dpost, dcomb
  init = ((zeros,) * n, (zeros,) * n, (zeros,) * (n * n))
  dpin, dpost, dcomb = _walk(spec, load, walk, init)
  if spec.expand:
    dposti_ref[...] = _matrix(list(dpost), n)
    dcombi_ref[...] = _matrix(list(dcomb), n * n)
  if spec.collapse == 'given':
    dpin_ref[...] = _matrix(list(dpin), n)


# ---------------------------------------------------------------------------------------------
# pallas_call plumbing and the custom VJP (arrays here: tokens flattened; the backward pads them
# to whole blocks)


def _params(spec):
  return plt.CompilerParams(num_warps=spec.num_warps, num_stages=spec.num_stages)


def _launch_rows(kernel, spec, blocks, in_specs, out_shape, out_specs, name: str, args):
  """The kernel over `blocks` row tiles (an int; or a grid tuple whose first axis is the row
  tiles); its outputs as a list (popped in order by the caller)."""
  return list(launch.pallas_call(
      functools.partial(kernel, spec=spec), out_shape=out_shape,
      grid=blocks if isinstance(blocks, tuple) else (blocks,),
      in_specs=in_specs, out_specs=out_specs, compiler_params=_params(spec),
      interpret=spec.interpret, name=name)(*args))


def _row_spec(tb, *tail):
  zeros = (0,) * len(tail)
  return pl.BlockSpec((tb,) + tail, lambda i, *_: (i,) + zeros)


def _whole(shape):
  zeros = (0,) * len(shape)
  return pl.BlockSpec(shape, lambda *_: zeros)


def _site_tables(spec, fn, base, scale):
  """The backward's fn as [n, cols, D] and [2, cols] scale/base rows."""
  n, d, nc, cols = spec.n, spec.d, spec.nc, spec.cols
  w_cnd = jnp.pad(fn.astype(jnp.float32).reshape(nc, n, d), ((0, cols - nc), (0, 0), (0, 0)))
  w_ncd = jnp.transpose(w_cnd, (1, 0, 2))
  scale32 = scale.astype(jnp.float32)
  srow = jnp.concatenate([jnp.full((n,), scale32[0]), jnp.full((n,), scale32[1]),
                          jnp.full((n * n,), scale32[2]), jnp.zeros((cols - nc,), jnp.float32)])
  brow = jnp.pad(base.astype(jnp.float32), (0, cols - nc))
  return w_ncd, jnp.stack([srow, brow])


def _forward(spec, x, f, post, comb, pin, fn, base, scale):
  n, d, tb, cols = spec.n, spec.d, spec.block_t, spec.cols
  rows = x.shape[0]
  args, in_specs, out_shape, out_specs = [x], [_row_spec(tb, n, d)], [], []
  if spec.expand:
    args += [f, post, comb]
    in_specs += [_row_spec(tb, d), _row_spec(tb, n), _row_spec(tb, n * n)]
    out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    out_specs.append(_row_spec(tb, n, d))
  if spec.collapse == 'given':
    args.append(pin)
    in_specs.append(_row_spec(tb, n))
  if spec.site:  # as the site holds them; blocks past their ends read masked (`_fwd_kernel`)
    args += [fn, base, scale]
    in_specs += [_whole((cols, n * d)), _whole((cols,)), _whole((4,))]
  if spec.collapse != 'none':
    out_shape.append(jax.ShapeDtypeStruct((rows, d), x.dtype))
    out_specs.append(_row_spec(tb, d))
  site_shape = [jax.ShapeDtypeStruct((rows, w), jnp.float32)
                for w in (n, n, n * n, cols)]  # pre, post, comb, m (+ r)
  site_specs = [_row_spec(tb, w) for w in (n, n, n * n, cols)]
  blocks = pl.cdiv(rows, tb)
  if spec.site and spec.splits > 1:  # partial sums here, the coefficients in `_coef_kernel`
    out_shape.append(jax.ShapeDtypeStruct((spec.splits, rows, cols), jnp.float32))
    out_specs.append(pl.BlockSpec((1, tb, cols), lambda i, j: (j, i, 0)))
  elif spec.site:
    out_shape += site_shape
    out_specs += site_specs
  grid = (blocks, spec.splits) if spec.splits > 1 else blocks
  outs = _launch_rows(_fwd_kernel, spec, grid, in_specs, out_shape, out_specs, 'mhc_fused_fwd',
                      args)
  xo = outs.pop(0) if spec.expand else None
  u = outs.pop(0) if spec.collapse != 'none' else None
  if spec.site and spec.splits > 1:
    outs = _launch_rows(
        _coef_kernel, spec, blocks,
        [pl.BlockSpec((spec.splits, tb, cols), lambda i: (0, i, 0)), _whole((cols,)),
         _whole((4,))], site_shape, site_specs, 'mhc_fused_coef', [outs[0], base, scale])
  pre, post_o, comb_o, m = outs if spec.site else (None,) * 4
  return (xo, u, pre, post_o, comb_o), m


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(spec, x, f, post, comb, pin, fn, base, scale):
  return _forward(spec, x, f, post, comb, pin, fn, base, scale)[0]


def _fused_fwd(spec, x, f, post, comb, pin, fn, base, scale):
  outs, m = _forward(spec, x, f, post, comb, pin, fn, base, scale)
  site_in = outs[0] if spec.expand else x
  pin_res = outs[2] if spec.collapse == 'own' else pin   # the own collapse read the site's pre
  return outs, (x, f, post, comb, pin_res, fn, base, scale, m, site_in if spec.site else None)


def _fused_bwd(spec, res, cts):
  """The backward on the rows padded to whole blocks (zero cotangents there: zero gradients),
  sliced back to the call's rows."""
  spec = spec.backward()
  rows = spec.rows
  pad_to = max(spec.block_t, min(_COEF_BLOCK, max(MIN_DOT, pl.next_power_of_2(rows))))
  pad = lambda a: pad_axis(a, 0, pad_to)  # noqa: E731  (tree.map passes None through)
  res, cts = jax.tree.map(pad, res[:5]) + res[5:8] + jax.tree.map(pad, res[8:]), \
      jax.tree.map(pad, cts)
  grads = _padded_bwd(spec, res, cts)
  return tuple(g[:rows] if i < 5 and g is not None else g for i, g in enumerate(grads))


def _padded_bwd(spec, res, cts):
  x, f, post, comb, pin, fn, base, scale, m, site_in = res
  dxo, du, dpre, dpost, dcomb = cts
  n, d, tb, cols, nc = spec.n, spec.d, spec.block_t, spec.cols, spec.nc
  rows = x.shape[0]
  stream_args, stream_specs = [x], [_row_spec(tb, n, d)]
  if spec.expand:
    stream_args += [f, post, comb]
    stream_specs += [_row_spec(tb, d), _row_spec(tb, n), _row_spec(tb, n * n)]
  da = None
  if spec.site:
    w_ncd, sb = _site_tables(spec, fn, base, scale)
    if spec.collapse == 'own':  # fold the collapse's d pre in before the coefficient backward
      dpre = dpre + launch.pallas_call(
          functools.partial(_own_kernel, spec=spec),
          out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32), grid=(rows // tb,),
          in_specs=stream_specs + [_row_spec(tb, d)], out_specs=_row_spec(tb, n),
          compiler_params=_params(spec), interpret=spec.interpret,
          name='mhc_fused_own')(*stream_args, du.astype(x.dtype))
    tc = min(_COEF_BLOCK, rows)
    da = launch.pallas_call(
        functools.partial(_coef_bwd_kernel, spec=spec),
        out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32), grid=(rows // tc,),
        in_specs=[_row_spec(tc, cols), _whole((2, cols)), _row_spec(tc, n), _row_spec(tc, n),
                  _row_spec(tc, n * n)],
        out_specs=_row_spec(tc, cols), compiler_params=_params(spec._replace(num_warps=4)),
        interpret=spec.interpret, name='mhc_fused_coef_bwd')(m, sb, dpre, dpost, dcomb)
  args, in_specs = list(stream_args), list(stream_specs)
  if spec.collapse != 'none':
    args.append(pin)
    in_specs.append(_row_spec(tb, n))
  if spec.site:
    # W in the streams' dtype: bf16 streams get a bf16 MMA and half the W bytes per tile (W is
    # re-read by every token block); its rounding is that of the bf16 dX it feeds.
    args += [w_ncd.astype(x.dtype), sb, m, da]
    in_specs += [_whole((n, cols, d)), _whole((2, cols)), _row_spec(tb, cols),
                 _row_spec(tb, cols)]
  if spec.expand:
    args.append(dxo.astype(x.dtype))
    in_specs.append(_row_spec(tb, n, d))
  if spec.collapse != 'none':
    args.append(du.astype(x.dtype))
    in_specs.append(_row_spec(tb, d))
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
  out_specs = [_row_spec(tb, n, d)]
  widths = []
  if spec.expand:
    out_shape.append(jax.ShapeDtypeStruct((rows, d), f.dtype))
    out_specs.append(_row_spec(tb, d))
    widths += [n, n * n]
  if spec.collapse == 'given':
    widths.append(n)
  for w in widths:
    out_shape.append(jax.ShapeDtypeStruct((rows, w), jnp.float32))
    out_specs.append(_row_spec(tb, w))
  outs = _launch_rows(_bwd_kernel, spec, rows // tb, in_specs, out_shape, out_specs,
                      'mhc_fused_bwd', args)
  dx = outs.pop(0)
  df, dpost_i, dcomb_i = (outs.pop(0), outs.pop(0), outs.pop(0)) if spec.expand else (None,) * 3
  dpin = outs.pop(0) if spec.collapse == 'given' else None
  dfn = dbase = dscale = None
  if spec.site:
    da = da[:, :nc]
    r = m[:, nc]
    dm_r = da * sb[0, :nc] * r[:, None]
    dfn = jnp.einsum('rc,rf->cf', dm_r, site_in.reshape(rows, n * d),
                     preferred_element_type=jnp.float32).astype(fn.dtype)
    dbase = jnp.sum(da, axis=0).astype(base.dtype)
    dam = jnp.sum(da * m[:, :nc], axis=0)
    dscale = jnp.stack([jnp.sum(dam[:n]), jnp.sum(dam[n:2 * n]),
                        jnp.sum(dam[2 * n:])]).astype(scale.dtype)
  cast = lambda g, p: None if g is None else g.astype(p.dtype)  # noqa: E731
  return (dx, cast(df, f) if spec.expand else None, cast(dpost_i, post) if spec.expand else None,
          cast(dcomb_i, comb) if spec.expand else None,
          cast(dpin, pin) if spec.collapse == 'given' else None, dfn, dbase, dscale)


_fused.defvjp(_fused_fwd, _fused_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry points ([B, T, ...] shapes, as mhc.py and transformer.py use them)


def _run(x_btnd, f_btd, post_btn, comb_btjk, pre_btn, fn, base, scale, **kw):
  """The kernels on each device's batch rows (ops/parallel/per_device.py); fn, base, scale
  replicated."""
  return batch_local(functools.partial(_run_local, **kw), x_btnd, f_btd, post_btn, comb_btjk,
                     pre_btn, fn, base, scale, replicated=(5, 6, 7))


def _fit_block_d(d, block):
  """The widest power of two <= block that divides d (d_model 48 walks 16 columns at a time)."""
  v = block
  while v > MIN_DOT and (v > d or d % v):
    v //= 2
  return v


def _splits(requested: int, rows: int, tb: int, d: int, bd: int, collapse: str) -> int:
  """The forward's programs per row block: `requested` (`decode_splits`) for a call of one row
  block, narrowed to a power of two whose D share is whole chunks; 1 for larger calls and for
  the own collapse, which needs the site's pre before its walk."""
  if rows > tb or collapse == 'own':
    return 1
  s = 1
  while s * 2 <= requested and d % (s * 2 * bd) == 0:
    s *= 2
  return s


def _run_local(x_btnd, f_btd, post_btn, comb_btjk, pre_btn, fn, base, scale, *, site, collapse,
               iters, eps, norm_eps, block_t, block_d, num_warps, block_t_bwd, block_d_bwd,
               num_warps_bwd, num_stages, prefetch, interpret, decode_splits):
  b, t, n, d = x_btnd.shape
  if n & (n - 1):
    raise ValueError(f'the fused mHC kernels need a power-of-two hc_mult, got {n}')
  bd, bd_b = _fit_block_d(d, block_d), _fit_block_d(d, block_d_bwd or block_d)
  for v in (bd, bd_b):
    if d % v or v < MIN_DOT or v & (v - 1):
      raise ValueError(f'd_model {d} must be a multiple of a power-of-two block_d >= 16 ({v})')
  interpret = launch.interpreted(interpret)
  rows = b * t
  cap = max(MIN_DOT, pl.next_power_of_2(rows))
  tb, tb_b = min(block_t, cap), min(block_t_bwd or block_t, cap)
  expand = f_btd is not None
  spec = _Spec(n, d, expand, site, collapse, iters, float(eps), float(norm_eps), tb, bd,
               num_warps, tb_b, bd_b, num_warps_bwd or num_warps, num_stages, bool(prefetch),
               bool(interpret), rows, _splits(decode_splits, rows, tb, d, bd, collapse))
  def flat(a, *tail):
    return None if a is None else a.reshape((rows,) + tail)
  outs = _fused(spec, flat(x_btnd, n, d), flat(f_btd, d), flat(post_btn, n),
                flat(comb_btjk, n * n), flat(pre_btn, n), fn, base, scale)
  xo, u, pre, post, comb = outs
  unflat = lambda a, *tail: None if a is None else a.reshape((b, t) + tail)  # noqa: E731
  return (unflat(xo, n, d), unflat(u, d), unflat(pre, n), unflat(post, n), unflat(comb, n, n))


# Block sizes from GPU sweeps of one layer's forward + backward (benchmarks/bench_mhc.py,
# docs/performance.md 24): with look-ahead loads, 128 tokens x 32 columns x 8 warps forward and
# 64 x 32 x 8 backward were fastest (16 warps, wider or narrower chunks all slower). fn's tile
# [32 cols, block_d] is re-read by every token block, so block_t also sets its L2 traffic
# relative to X's (fp32 W in the forward at 128 tokens: 0.5x). Nsight Compute: the forward
# kernels hold one 8-warp block per SM (registers), the backward two; DRAM at 21-44% of peak.
# decode_splits: a decode step's one token block is one program walking d_model alone (18-60 us
# a site on an H100, 1.47 ms of a 1B token's 4.4: section 54); split over D, the walk runs on
# that many SMs at once: 1.45x a decoded token at S = 16 on an H100, the model's default
# (model.mhc_decode_splits; docs/performance.md section 59). 0 here: a direct call is one program.
MHC_TOKEN_BLOCK = 128  # the forward's tokens a program (block_t)
_KNOBS = dict(iters=20, eps=1e-6, norm_eps=1e-6, block_t=MHC_TOKEN_BLOCK, block_d=32, num_warps=8,
              block_t_bwd=64, block_d_bwd=32, num_warps_bwd=8, num_stages=1, prefetch=True,
              interpret=None, decode_splits=0)


def site_collapse(x_btnd, fn, base, scale, pre_btn=None, **kw):
  """(u_btd, pre_btn, post_btn, comb_btjk) of one site on X, in one pass over X.

  u = collapse(X, pre_btn) if given (single pass: the previous site's pre), else
  collapse(X, this site's pre) (multi pass: a second walk). fn [(2+n)n, n*D], base, scale as
  `MHCSite` holds them; keyword knobs: iters, eps, norm_eps (the config's hc_sinkhorn_iters,
  hc_eps, rms_norm_eps), block_t, block_d, num_warps (forward) and block_t_bwd, block_d_bwd,
  num_warps_bwd (backward), num_stages and prefetch (both: Triton pipelining, look-ahead loads),
  interpret (None: ops/launch.py's rule, on only on the CPU), decode_splits (a call of one
  token block, e.g. a decode step, walks D in that many programs at once, the coefficients in a
  second small kernel; 0 or 1: one program walks all of D).
  """
  kw = {**_KNOBS, **kw}
  _, u, pre, post, comb = _run(x_btnd, None, None, None, pre_btn, fn, base, scale, site=True,
                               collapse='given' if pre_btn is not None else 'own', **kw)
  return u, pre, post, comb


def expand_site_collapse(x_btnd, f_btd, post_btn, comb_btjk, fn, base, scale, pre_btn=None,
                         **kw):
  """(x'_btnd, u_btd, pre, post, comb): X' = expand(X, F, post, comb) written once, and the next
  site's coefficients and collapse computed from X' on chip (`site_collapse(X', ...)`)."""
  kw = {**_KNOBS, **kw}
  xo, u, pre, post, comb = _run(x_btnd, f_btd, post_btn, comb_btjk, pre_btn, fn, base, scale,
                                site=True, collapse='given' if pre_btn is not None else 'own',
                                **kw)
  return xo, u, pre, post, comb


def expand_fused(x_btnd, f_btd, post_btn, comb_btjk, **kw):
  """`mhc.expand` in one pass: read X and F once, write X' once."""
  kw = {**_KNOBS, **kw}
  return _run(x_btnd, f_btd, post_btn, comb_btjk, None, None, None, None, site=False,
              collapse='none', **kw)[0]


def collapse_fused(x_btnd, pre_btn, **kw):
  """`mhc.collapse` (e.g. the single-pass final read-out)."""
  kw = {**_KNOBS, **kw}
  return _run(x_btnd, None, None, None, pre_btn, None, None, None, site=False, collapse='given',
              **kw)[1]
