"""The TPU kernels (Pallas, Mosaic backend) and what each hot op takes on the TPU.

- ops/tpu/grouped_gemm.py (megablox's grouped GEMM) equals jax.lax.ragged_dot, forward and both
  gradients, with an empty expert and rows past the groups; ops/tpu/index_scores.py equals the
  jnp indexer scores on every visible entry and writes 0 on tiles past the causal limit. Both in
  the Pallas interpreter, on the CPU.
- Both compile for v5p and v6e with the TPU compiler, deviceless (needs libtpu, the tpu extra),
  at the 1B ablation's expert and indexer shapes, and report their FLOPs to cost_analysis.
- config.py's `auto` on backend 'tpu': which path each hot op takes there.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from deepseek41.config import load_config_file, resolve
from deepseek41.ops.index_scores import index_scores_reference
from deepseek41.ops.tpu.grouped_gemm import grouped_dot, tiling_for
from deepseek41.ops.tpu.index_scores import index_scores_tpu
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def test_grouped_dot_equals_ragged_dot_in_interpret_mode():
  a, d, f = 200, 256, 384
  x_ad = jax.random.normal(jax.random.key(0), (a, d), jnp.float32)
  w_edf = jax.random.normal(jax.random.key(1), (4, d, f), jnp.float32) / 16
  counts_e = jnp.array([50, 0, 90, 40], jnp.int32)  # an empty expert; rows 180..199 past them
  cos_f = jnp.cos(jnp.arange(f, dtype=jnp.float32))

  def loss(dot):
    return lambda x, w: jnp.sum(dot(x, w) * cos_f)
  ours = lambda x, w: grouped_dot(x, w, counts_e, tiling=(128, 128, 128),  # noqa: E731
                                  interpret=True)
  ref = lambda x, w: jax.lax.ragged_dot(x, w, counts_e)  # noqa: E731
  np.testing.assert_allclose(ours(x_ad, w_edf), ref(x_ad, w_edf), atol=1e-5)
  assert not np.any(np.asarray(ours(x_ad, w_edf))[180:])
  g_ours = jax.grad(loss(ours), argnums=(0, 1))(x_ad, w_edf)
  g_ref = jax.grad(loss(ref), argnums=(0, 1))(x_ad, w_edf)
  for got, want in zip(g_ours, g_ref):
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_tiling_fits_small_problems():
  assert tiling_for(200, 256, 384) == (200, 256, 384)
  assert tiling_for(8192, 1024, 384) == (512, 512, 384)
  assert tiling_for(5, 100, 50) == (8, 128, 128)


def test_index_scores_tpu_equals_reference_in_interpret_mode():
  b, t, h, c, n = 2, 200, 4, 128, 300
  keys = jax.random.split(jax.random.key(0), 3)
  q_bthc = jax.random.normal(keys[0], (b, t, h, c))
  k_bnc = jax.random.normal(keys[1], (b, n, c))
  w_bth = jax.random.normal(keys[2], (b, t, h))
  # Row 0 causal from entry 1; row 1 sees 100 entries more (a later chunk of the sequence).
  limit_bt = jnp.minimum(jnp.arange(1, t + 1)[None] + jnp.array([[0], [100]]), n)
  got = index_scores_tpu(q_bthc, w_bth, k_bnc, limit_bt, block_q=64, block_n=128,
                         interpret=True)
  want = index_scores_reference(q_bthc, w_bth, k_bnc)
  visible = np.arange(n)[None, None] < np.asarray(limit_bt)[..., None]
  np.testing.assert_allclose(np.where(visible, got, 0), np.where(visible, want, 0),
                             atol=1e-4, rtol=1e-5)
  # Query tile 0 of row 0 sees at most 64 entries: key tiles 1 and 2 are skipped, written 0.
  assert not np.any(np.asarray(got)[0, :64, 128:]) and np.any(np.asarray(want)[0, :64, 128:])
  with pytest.raises(ValueError, match='index_head_dim'):
    index_scores_tpu(q_bthc[..., :64], w_bth, k_bnc[..., :64], limit_bt, interpret=True)


@pytest.mark.parametrize('topology', ['v5p:2x2x1', 'v6e:2x2'])
def test_kernels_compile_for_tpu_deviceless(topology):
  pytest.importorskip('libtpu', reason="libtpu is not installed: pip install -e '.[tpu]'")
  from deepseek41.tools.topology_plan import topology_devices
  one_chip = NamedSharding(Mesh(np.array(topology_devices(topology)[:1]), ('x',)), P())

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=one_chip)

  def compile_(fn, *args):
    with jax.set_mesh(one_chip.mesh):  # the launch rule (ops/launch.py) reads the mesh: the TPU
      compiled = jax.jit(fn).lower(*args).compile()
    assert 'tpu_custom_call' in compiled.as_text()  # the Mosaic kernel, not an XLA fallback
    return compiled.cost_analysis()['flops']

  # ablation_1b's routed experts: 4096 tokens x top-6 rows, d 1024 -> 384, 64 experts.
  a, d, f, e = 4096 * 6, 1024, 384, 64
  grads = jax.grad(lambda x, w, n: jnp.sum(grouped_dot(x, w, n).astype(jnp.float32)),
                   argnums=(0, 1))
  flops = compile_(grads, spec((a, d), jnp.bfloat16), spec((e, d, f), jnp.bfloat16),
                   spec((e,), jnp.int32))
  assert flops >= 2 * (2 * a * d * f)  # dx and dw, each one A x D x F GEMM
  # ablation_1b's indexer: 16 heads x 128 over 2048 ratio-2 entries of a 4096-token chunk.
  t, h, c, n = 4096, 16, 128, 2048
  flops = compile_(index_scores_tpu, spec((1, t, h, c), jnp.bfloat16),
                   spec((1, t, h), jnp.float32), spec((1, n, c), jnp.bfloat16),
                   spec((1, t), jnp.int32))
  assert flops >= 2 * t * n * h * c


def test_what_each_hot_op_takes_on_the_tpu():
  """auto on backend 'tpu' (config.py): bf16, ragged_dot experts over the ragged all-to-all, and
  the XLA paths of the attention ops, the Mosaic indexer kernel ('mosaic', index_head_dim 128).
  The GPU kernels ('fused', 'threshold', 'grouped') are Triton."""
  config = load_config_file(os.path.join(ROOT, 'configs', 'ablation_1b.py'))
  m = resolve(config, num_devices=1, backend='tpu').model
  assert (m.compute_dtype, m.moe_backend, m.expert_exchange, m.eval_moe_backend) == \
      ('bfloat16', 'ragged_dot', 'ragged', 'ragged_dot')
  assert (m.attention_impl, m.sparse_impl, m.index_impl, m.select_impl, m.mhc_impl) == \
      ('chunked', 'gathered', 'mosaic', 'top_k', 'reference')


def test_the_model_dispatch_runs_the_mosaic_indexer():
  """model.index_impl='mosaic' (SCORERS): interpreted on the CPU it equals the reference on the
  visible entries; under a TPU slice's mesh, deviceless, it compiles to the Mosaic kernel on each
  device's rows."""
  from deepseek41.ops.index_scores import SCORERS
  b, t, h, c, n = 2, 64, 2, 128, 96
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, w = (jax.random.normal(keys[0], (b, t, h, c)), jax.random.normal(keys[1], (b, n, c)),
             jax.random.normal(keys[2], (b, t, h)))
  limit = jnp.minimum(jnp.arange(1, t + 1)[None].repeat(b, 0) + 20, n)
  got, want = SCORERS['mosaic'](q, w, k, limit), index_scores_reference(q, w, k)
  visible = np.arange(n)[None, None] < np.asarray(limit)[..., None]
  np.testing.assert_allclose(np.where(visible, got, 0), np.where(visible, want, 0), atol=1e-4,
                             rtol=1e-5)
  pytest.importorskip('libtpu', reason="libtpu is not installed: pip install -e '.[tpu]'")
  from deepseek41.tools.topology_plan import topology_devices
  mesh = Mesh(np.array(topology_devices('v5p:2x2x1')).reshape(4), ('data',))
  rows = NamedSharding(mesh, P('data'))
  args = [jax.ShapeDtypeStruct((4, *x.shape[1:]), x.dtype, sharding=rows) for x in (q, w, k)]
  args.append(jax.ShapeDtypeStruct((4, t), jnp.int32, sharding=rows))
  with jax.set_mesh(mesh):
    compiled = jax.jit(SCORERS['mosaic']).lower(args[0], args[1], args[2], args[3]).compile()
  assert 'tpu_custom_call' in compiled.as_text()


def test_a_mesh_with_more_axes_than_the_torus():
  """sharding.make_mesh on a v5p slice (a 3-D torus) with five axes > 1: jax.make_mesh cannot
  place it without splitting physical axes; make_mesh then splits them."""
  pytest.importorskip('libtpu', reason="libtpu is not installed: pip install -e '.[tpu]'")
  from deepseek41.config import MeshConfig
  from deepseek41.sharding import make_mesh
  from deepseek41.tools.topology_plan import topology_devices
  mc = MeshConfig(data=2, fsdp=2, expert=2, tensor=2, context=2,
                  sequence_parallel=True, rules=())
  mesh = make_mesh(mc, topology_devices('v5p:2x4x4'))
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'expert': 2, 'tensor': 2, 'context': 2}
  assert len({d.id for d in mesh.devices.flat}) == 32
