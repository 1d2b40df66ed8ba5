"""Mosaic GPU window forward (ops/gpu/window_mgpu.py) against `swa_partial`'s reference, in the
Mosaic GPU interpreter on the CPU; and its lowering for the GPU, which needs no GPU.

bf16 inputs, several documents per row with a padding tail, T not a multiple of the 64-row
blocks, windows shorter and longer than a 64-key block, H = 4, 16 and 64 (64 / H queries per
block), d = 128 (the kernel's smallest: two 64-column halves) and the model's 512; the
interpreter's race detector over the two warpgroups' exchange.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from deepseek41.ops.gpu.window_mgpu import window_forward_mgpu
from deepseek41.ops.swa_attention import swa_partial
from tests.helpers import assert_partial_close, documents

ATOL_O = 3e-2    # bf16 outputs (as test_window_kernel.py)
ATOL_LSE = 2e-3  # fp32 statistics of bf16 scores


def compare(h, d, window, seg, seed=0, interpret=None):
  b, t = seg.shape
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16)
  seg = jnp.asarray(seg)
  # interpret None: ops/launch.py's rule, the interpreter on this CPU
  o, lse = window_forward_mgpu(q, kv, seg, window=window, interpret=interpret)
  o_ref, lse_ref = swa_partial(q, kv, seg, window=window, impl='reference')
  return assert_partial_close(o, lse, o_ref, lse_ref, np.asarray(seg) == 0, atol_o=ATOL_O,
                              atol_lse=ATOL_LSE)


def test_sixteen_heads_window_longer_than_a_key_block():
  # T = 100: 4 queries per block, padded to 128; window 72 > 64 keys: 2-3 key blocks per walk.
  compare(16, 128, 72, documents(100, ((30, 41, 20), (64, 30))))


def test_sixteen_heads_window_shorter_than_a_key_block():
  compare(16, 128, 24, documents(100, ((9, 50, 33),)), seed=1)


@pytest.mark.parametrize('window', [40, 100])
def test_four_heads(window):
  # 16 queries per block; T = 150 is no multiple of them or of the key block.
  compare(4, 128, window, documents(150, ((70, 3, 60), (149,))), seed=window)


def test_sixty_four_heads():
  # One query per block (the V4.1 shape's).
  compare(64, 128, 8, documents(20, ((7, 10),)), seed=2)


def test_model_width():
  compare(16, 512, 16, documents(40, ((25, 12),)), seed=3)


@pytest.mark.parametrize('window', [1, 500])
def test_window_of_one_and_longer_than_the_sequence(window):
  compare(4, 128, window, documents(40, ((17, 20), (39,))), seed=4)


def test_no_races_between_the_warpgroups():
  """The interpreter's race detector over the TMA loads, the partial-score exchange of the two
  warpgroups and the output staging (it does flag a dropped `s_ready` wait)."""
  interpret_gpu = pytest.importorskip('jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call')
  compare(16, 128, 20, documents(40, ((15, 20),)), seed=5,
          interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert not interpret_gpu.get_races().races_found


def test_image_spans_are_refused():
  q, kv = jnp.zeros((1, 8, 4, 128), jnp.bfloat16), jnp.zeros((1, 8, 128), jnp.bfloat16)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match='image spans'):
    window_forward_mgpu(q, kv, seg, window=4, span_ids_bt=seg)


@pytest.mark.parametrize('h', [16, 64])
def test_lowers_for_the_gpu_without_one(h):
  """The model's shapes lower to a Mosaic GPU kernel on this CPU (the lowering checks layouts,
  TMA indexing and the shared memory against the Hopper budget; PTX is made on the GPU)."""
  t, d = 256, 512
  q = jax.ShapeDtypeStruct((2, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, t, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, t), jnp.int32)
  fn = jax.jit(lambda q, kv, seg: window_forward_mgpu(q, kv, seg, window=128, interpret=False))
  text = fn.trace(q, kv, seg).lower(lowering_platforms=('cuda',)).as_text()
  assert re.search(r'custom_call @mosaic_gpu', text)


def test_shapes_only_holds_the_kernels_buffers_and_never_runs():
  """tools.plan's stand-in (ops/launch.py): within shapes_only the kernel is an opaque call of
  its results, and raises if what was traced there runs."""
  from deepseek41.ops import launch  # noqa: PLC0415
  q, kv = jnp.ones((1, 24, 4, 128), jnp.bfloat16), jnp.ones((1, 24, 128), jnp.bfloat16)
  seg = jnp.ones((1, 24), jnp.int32)
  fn = lambda q, kv: window_forward_mgpu(q, kv, seg, window=8)
  with launch.shapes_only():
    jaxpr = str(jax.make_jaxpr(fn)(q, kv))
    out = jax.eval_shape(fn, q, kv)
    assert 'pure_callback' in jaxpr and 'swa_window_fwd_mgpu' not in jaxpr
    assert [(x.shape, x.dtype) for x in out] == [((1, 24, 4, 128), jnp.bfloat16),
                                                 ((1, 24, 4), jnp.float32)]
    with pytest.raises(Exception, match='stand-in of a kernel ran'):
      jax.block_until_ready(fn(q, kv))
