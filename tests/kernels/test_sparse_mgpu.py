"""Mosaic GPU sparse forward (ops/gpu/sparse_mgpu.py) against `compressed_partial`'s reference, in
the Mosaic GPU interpreter on the CPU; and its lowering for the GPU, which needs no GPU.

bf16 inputs; per query distinct random entries of N = 37 or 45 rows (no multiple of anything),
valid slots scattered through the row (not a prefix), a query with no valid slot and one whose
valid slots all lie in its second 64-slot block; H = 64 (one query per CTA), 16 (padded to 64)
and 128 (two CTAs per query); d = 128 and the model's 512; K = 64 and 128 (and 96, padded);
the interpreter's race detector over the three warpgroups.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from deepseek41.ops.gpu.sparse_mgpu import sparse_forward_mgpu
from deepseek41.ops.sparse_attention import compressed_partial
from tests.helpers import assert_partial_close

ATOL_O = 3e-2    # bf16 outputs (as test_sparse_kernel.py's bf16 tolerance)
ATOL_LSE = 2e-3  # fp32 statistics of bf16 scores


def selection(rng, b, t, n, k, p_valid=0.6):
  """(idx [B,T,K] int32, valid [B,T,K] bool): distinct random entries per query, each slot valid
  with probability p_valid (invalid slots hold 0, as `select_topk` leaves them); query (0, 0)
  sees nothing and, where K > 64, query (0, 1) only slots of its second block."""
  idx = np.zeros((b, t, k), np.int32)
  valid = np.zeros((b, t, k), bool)
  for bi in range(b):
    for ti in range(t):
      m = min(k, n)
      slots = rng.choice(k, m, replace=False)  # the filled slots scattered over the row
      idx[bi, ti, slots] = rng.choice(n, m, replace=False)
      valid[bi, ti, slots] = rng.random(m) < p_valid
  valid[0, 0] = False
  if k > 64 and t > 1:
    valid[0, 1, :64] = False
    valid[0, 1, 64] = True
  return np.where(valid, idx, 0), valid


def compare(h, d, k, n=37, b=2, t=3, seed=0, scale=None, interpret=None, garbage=False):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((b, n, d)), jnp.bfloat16)
  idx, valid = selection(rng, b, t, n, k)
  if garbage:  # what invalid slots hold must not matter, even out of range
    idx = np.where(valid, idx, rng.integers(-5, 10 * n, idx.shape))
  idx, valid = jnp.asarray(idx), jnp.asarray(valid)
  # interpret None: ops/launch.py's rule, the interpreter on this CPU
  o, lse = sparse_forward_mgpu(q, kv, idx, valid, scale=scale, interpret=interpret)
  o_ref, lse_ref = compressed_partial(q, kv, idx, valid, impl='reference', scale=scale)
  return assert_partial_close(o, lse, o_ref, lse_ref, ~np.asarray(valid).any(-1), atol_o=ATOL_O,
                              atol_lse=ATOL_LSE)


def test_sixty_four_heads_one_block():
  compare(64, 128, 64)


def test_sixty_four_heads_two_blocks_and_a_padded_tail():
  # K = 128: two steps (query (0, 1) sees only the second); K = 96 pads to 128 with invalid.
  compare(64, 128, 128, n=45, seed=1)
  compare(64, 128, 96, n=45, b=1, t=2, seed=2)


def test_sixteen_heads_padded_to_sixty_four():
  compare(16, 128, 64, seed=3, scale=0.3)


def test_hundred_twenty_eight_heads_two_tiles():
  compare(128, 128, 64, b=1, t=2, seed=4)


def test_model_width():
  compare(64, 512, 64, b=1, t=2, seed=5)


def test_invalid_slots_content_does_not_matter():
  compare(64, 128, 64, b=1, t=2, seed=6, garbage=True)


def test_no_races_between_the_warpgroups():
  """The interpreter's race detector over the row gather, the repack, the exchange of maxima
  and P between the consumers, and the output staging."""
  interpret_gpu = pytest.importorskip('jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call')
  compare(64, 128, 128, n=45, b=1, t=2, seed=7,
          interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert not interpret_gpu.get_races().races_found


@pytest.mark.parametrize('name,shapes', [
    ('q_bthd', ((2, 4, 64), (2, 9, 128), (2, 4, 16), (2, 4, 16))),
    ('kv_bnd', ((2, 4, 64, 128), (2, 9, 256), (2, 4, 16), (2, 4, 16))),
    ('idx_btk', ((2, 4, 64, 128), (2, 9, 128), (2, 5, 16), (2, 5, 16))),
    ('valid_btk', ((2, 4, 64, 128), (2, 9, 128), (2, 4, 16), (2, 4, 8))),
    ('d must', ((2, 4, 64, 96), (2, 9, 96), (2, 4, 16), (2, 4, 16))),
    ('H must', ((2, 4, 96, 128), (2, 9, 128), (2, 4, 16), (2, 4, 16))),
])
def test_shape_errors_name_the_argument(name, shapes):
  q, kv, idx, valid = (jnp.zeros(s, dt) for s, dt in
                       zip(shapes, (jnp.bfloat16, jnp.bfloat16, jnp.int32, jnp.bool_)))
  with pytest.raises(ValueError, match=name):
    sparse_forward_mgpu(q, kv, idx, valid)


def test_float32_kv_is_refused():
  q, kv = jnp.zeros((1, 2, 64, 128), jnp.float32), jnp.zeros((1, 8, 128), jnp.float32)
  idx, valid = jnp.zeros((1, 2, 64), jnp.int32), jnp.ones((1, 2, 64), jnp.bool_)
  with pytest.raises(ValueError, match='kv_bnd'):
    sparse_forward_mgpu(q, kv, idx, valid)


@pytest.mark.parametrize('h,k', [(64, 512), (16, 2048)])
def test_lowers_for_the_gpu_without_one(h, k):
  """The model's shapes lower to a Mosaic GPU kernel on this CPU (the lowering checks layouts,
  TMA boxes and indexing, and the shared memory against the Hopper budget; PTX and registers
  are made on the GPU)."""
  b, t, n, d = 1, 64, 16, 512
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, n, d), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((b, t, k), jnp.int32)
  valid = jax.ShapeDtypeStruct((b, t, k), jnp.bool_)
  fn = jax.jit(lambda *a: sparse_forward_mgpu(*a, interpret=False))
  text = fn.trace(q, kv, idx, valid).lower(lowering_platforms=('cuda',)).as_text()
  assert re.search(r'custom_call @mosaic_gpu', text)
