"""tools.gpu_target and `tools.plan --topology=h200...`: the GPU topologies it takes, its refusals
(the command line's: tests/system/test_plan.py), and (only where jax's CUDA plugin is installed,
never in CI: it is 4 GB outside the project's dependencies) a step compiled for an H200."""

import math

import pytest

from deepseek41.tools import gpu_target, topology_plan
from deepseek41.tools.memory_plan import DEVICE_KINDS
from tests.helpers import REPO_ROOT


@pytest.mark.parametrize('name, parsed', [
    ('h200', ('h200', 1, 1)), ('H100', ('h100', 1, 1)), ('h200:8', ('h200', 1, 8)),
    ('h100:2x8', ('h100', 2, 8)), ('v5p:2x2x1', None), ('v5e:2x4', None), ('a100:8', None)])
def test_topology_names(name, parsed):
  assert gpu_target.parse_topology(name) == parsed


def test_a_host_holds_at_most_eight_gpus():
  with pytest.raises(ValueError, match=r"--topology='h200:16'.*h200:2x8"):
    gpu_target.parse_topology('h200:16')
  with pytest.raises(ValueError, match='not a GPU topology'):
    gpu_target.topology_devices('v5p:2x2x1')


def test_device_memory_is_the_cpu_plans_figure():
  for chip, spec in gpu_target.TARGETS.items():
    assert topology_plan.hbm_bytes(spec['name']) == DEVICE_KINDS[chip][0]
  assert 'device_memory_size: 150754820096' in gpu_target.target_config('h200')


@pytest.mark.skipif(gpu_target.compiler_available(), reason='jax\'s CUDA plugin is installed')
def test_without_the_cuda_plugin_it_says_how_to_get_it():
  with pytest.raises(RuntimeError, match='--topology=h200:8 needs the GPU compiler: bash '
                     'benchmarks/get_gpu_compiler.sh'):
    gpu_target.topology_devices('h200:8')


@pytest.mark.skipif(not gpu_target.compiler_available(),
                    reason='needs jax\'s CUDA plugin: bash benchmarks/get_gpu_compiler.sh DIR')
def test_tiny_step_compiles_for_an_h200():
  from deepseek41.config import load_config_file
  config = load_config_file(f'{REPO_ROOT}/configs/tiny.py')
  p = topology_plan.topology_plan(config, 'h200')
  c = p['compiled']
  assert p['compiler'] == 'GPU compiler' and p['chip'] == 'h200' and p['fits']
  assert p['impls']['moe_backend'] == 'grouped'  # the GPU's choices, nothing stood in
  assert c['argument'] >= p['state']['params'] + p['state']['optimizer']
  assert c['peak'] == c['argument'] + c['temp'] + c['output'] - c['alias']
  assert math.isnan(c['flops'])
  assert 'not counted by the GPU compiler' in topology_plan.report(p)
