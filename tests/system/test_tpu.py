"""The TPU lowering, on a CPU-only machine: with libtpu (the `tpu` extra) the whole train step of
configs/tiny.py's shapes on four layers that hold every role is compiled deviceless by the TPU
compiler for a v5p slice of 8 chips, on a mesh with fsdp, expert and tensor parallelism (one
mesh axis per torus dimension: jax's mesh builder does not split a physical axis), as the
trainer jits it (tools/topology_plan.py).

Skipped where libtpu is not installed (`pip install -e '.[tpu]'`; .ci/run installs it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

pytest.importorskip('libtpu', reason="libtpu is not installed: pip install -e '.[tpu]'")

from deepseek41.tools import memory_plan, topology_plan  # noqa: E402
from deepseek41.train.flops import flops_per_token  # noqa: E402
from tests.helpers import four_layer_tiny

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

TOPOLOGY = 'v5p:2x2x2'
MESH = {'fsdp': 2, 'expert': 2, 'tensor': 2}


@pytest.fixture(scope='module')
def tiny_plan():
  config = four_layer_tiny(remat='none')  # tiny's remat; its 8 layers: twice the compile
  # AdamW: the FLOPs below are held against the model's, and Newton-Schulz is twice the toy
  # model's work (docs/performance.md section 33).
  config.train.optimizer = 'adamw'
  return config, topology_plan.topology_plan(config, TOPOLOGY, MESH)


def test_topology_and_its_chip():
  devices = topology_plan.topology_devices(TOPOLOGY)
  assert len(devices) == 8 and {d.platform for d in devices} == {'tpu'}
  assert devices[0].device_kind == 'TPU v5'
  assert topology_plan.hbm_bytes(devices[0].device_kind) == 95.73 * 2**30
  with pytest.raises(ValueError, match="--topology='v5p:banana'"):
    topology_plan.topology_devices('v5p:banana')


def test_the_compilers_refusal_is_read_as_does_not_fit():
  """A program larger than the chip is refused by the TPU compiler; the plan reads how large
  (here a 16 GiB outer product on a 15.75 GiB v5e)."""
  chip = NamedSharding(Mesh(np.array(topology_plan.topology_devices('v5e:2x2')[:1]), ('x',)), P())
  x = jax.ShapeDtypeStruct((2**16,), jnp.float32, sharding=chip)
  with pytest.raises(jax.errors.JaxRuntimeError) as refusal:
    jax.jit(lambda x: x[:, None] * x[None, :]).lower(x).compile()
  assert memory_plan.over_hbm(refusal.value) == {'temp': 16 * 2**30}
  assert memory_plan.refused_memory(refusal.value)['over_hbm']
  other = jax.errors.JaxRuntimeError('INVALID_ARGUMENT: something else')
  assert memory_plan.over_hbm(other) is None
  with pytest.raises(jax.errors.JaxRuntimeError):
    memory_plan.refused_memory(other)


def test_full_train_step_compiles_for_a_v5p_slice(tiny_plan):
  config, p = tiny_plan
  assert p['chips'] == 8 and p['chip'] == 'v5p' and p['mesh'] == MESH
  # The TPU's own choices, nothing stood in: bf16 compute, ragged_dot experts exchanged by the
  # ragged all-to-all, the XLA paths of the attention ops (config.py's auto for 'tpu').
  assert p['compute_dtype'] == 'bfloat16'
  assert p['impls'] == {'attention_impl': 'chunked', 'sparse_impl': 'gathered',
                        'index_impl': 'reference', 'selected_scores_impl': 'reference',
                        'select_impl': 'top_k',
                        'mhc_impl': 'reference', 'moe_backend': 'ragged_dot',
                        'expert_exchange': 'ragged'}
  s, c = p['state'], p['compiled']
  # The compiler holds our shards: the donated state (params, AdamW moments, router biases,
  # step and rng) is aliased to the new state. In the TPU's tiled layouts (8 x 128 tiles of the
  # two minor dims) tiny's narrow tensors (4 heads, 8 experts) take 1.6x their bytes; a state
  # replicated over any axis would take 2x or more.
  state = s['params'] + s['optimizer'] + s['router_bias'] + 4 + 8
  assert state <= c['alias'] < 1.8 * state, (c['alias'], state)
  assert c['alias'] < c['argument'] < c['alias'] + 64 * 1024  # + this chip's batch rows
  assert c['temp'] > s['gradients']  # the gradients are in the step's temporaries
  assert c['peak'] == c['argument'] + c['temp'] + c['output'] - c['alias']
  assert p['fits'] and c['peak'] < 2**30
  # The compiled per-chip FLOPs against the model's counted training FLOPs: forward + backward
  # of every token's matmuls, split over the 8 chips. The compiler also counts the elementwise
  # work (a large share at tiny's widths), the attention entries the selection leaves out and
  # what tensor parallelism replicates: 3.04e9 against 1.74e9 counted (1.75x) on all of tiny;
  # ablation_1b's 4K step on v6e-8 came out at 1.11x.
  tokens = p['batch'] * p['seq_len']
  m = topology_plan.topology_config(config, MESH).model
  counted = flops_per_token(m, p['seq_len']).total * tokens / p['chips']
  assert counted < c['flops'] < 3 * counted, (c['flops'], counted)
  text = topology_plan.report(p)
  assert 'fits, headroom' in text and 'TPU v5' in text and 'FLOPs' in text
