"""NVIDIA Hopper GPUs as a compile target on a machine without one.

jax's CUDA plugin (optional, outside the project's dependencies: `bash
benchmarks/get_gpu_compiler.sh DIR`, then `PYTHONPATH=DIR`) can compile for a GPU topology that
no process holds (`jax.experimental.topologies`), given the GPU's description: the fusions,
layouts, copies and buffers are XLA's GPU compiler's own, and the Pallas Triton kernels lower
for sm_90 as they do on the GPU. `tools.plan --topology=h200:8` plans from it
(tools/topology_plan.py); `benchmarks/compile_for_gpu.py` lists the compiled kernels.

What differs from the GPU's own compile: no autotuning (GEMM and fusion tilings take XLA's
defaults) and no CUB sort tables (XLA's fallback sort), so a fusion's kernel choice can differ;
the Mosaic GPU kernels are built to machine code only when a program loads on a device.
XLA schedules for the target's memory, so a program is the named chip's: against the H200
(docs/performance.md section 46) the 1B step's peak came out 74.0 GB at 8 x 4,096 without remat
(68.9 measured; 65.1 compiled for an H100) and 80.3 at 1 x 65,536 as shipped (75.2 measured).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re

from jax._src.pallas.triton import gpu_info, pallas_call_registration
from jax.experimental import topologies

# XLA's GpuTargetConfig (text format) of each chip: what its compiler reads to choose fusions,
# tiles and launch shapes. Hopper SXM parts; the H200 differs in memory size and bandwidth only.
TARGETS = {
    'h100': dict(name='NVIDIA H100 80GB HBM3', memory=84_942_979_072,
                 bandwidth=3_352_320_000_000, triton=gpu_info.GpuVersion.H100),
    'h200': dict(name='NVIDIA H200', memory=150_754_820_096, bandwidth=4_800_000_000_000,
                 triton=gpu_info.GpuVersion.H200),
}
_TARGET_CONFIG = '''gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a"
  name: "{name}" driver_version: "13.0.0" runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0" dnn_version: "9.10.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{name}"
'''
_TOPOLOGY = re.compile(r'^(h100|h200)(?::(?:(\d+)x)?(\d+))?$')
SETUP = ('bash benchmarks/get_gpu_compiler.sh DIR, then run with PYTHONPATH=DIR (jax\'s CUDA '
         'plugin and the NVIDIA libraries it loads, about 4 GB, outside the venv)')


def parse_topology(name: str) -> tuple[str, int, int] | None:
  """'h200' (one GPU), 'h200:8' (one host of 8), 'h100:2x8' (2 hosts of 8) -> (chip, hosts,
  GPUs per host); None for a name that is not a GPU's (a TPU slice's)."""
  m = _TOPOLOGY.match(name.strip().lower())
  if not m:
    return None
  chip, hosts, per_host = m.group(1), int(m.group(2) or 1), int(m.group(3) or 1)
  if hosts < 1 or not 1 <= per_host <= 8:
    raise ValueError(f'--topology={name!r}: hosts of 1-8 GPUs each, e.g. {chip}:8 or '
                     f'{chip}:2x8')
  return chip, hosts, per_host


def compiler_available() -> bool:
  """Whether jax's CUDA plugin is importable (see SETUP)."""
  if importlib.util.find_spec('jax_plugins') is None:
    return False
  return any(importlib.util.find_spec(f'jax_plugins.xla_cuda{v}') is not None
             for v in (13, 12))


def target_config(chip: str) -> str:
  return _TARGET_CONFIG.format(**TARGETS[chip])


def topology_devices(name: str) -> list:
  """The devices of a GPU topology (see parse_topology); no GPU needed."""
  parsed = parse_topology(name)
  if parsed is None:
    raise ValueError(f'--topology={name!r} is not a GPU topology (h100|h200[:[HOSTSx]GPUS])')
  chip, hosts, per_host = parsed
  if not compiler_available():
    raise RuntimeError(f'--topology={name} needs the GPU compiler: {SETUP}')
  topo = topologies.get_topology_desc(platform='cuda', topology=f'1x{hosts}x{per_host}',
                                      target_config=target_config(chip))
  return list(topo.devices)


@contextlib.contextmanager
def triton_lowers_for(chip: str):
  """Within: the Pallas Triton kernels lower for this chip (sm_90). Pallas asks the local GPU
  which one it is; a deviceless compile has none to ask."""
  info = gpu_info.GpuInfo(gpu_version=TARGETS[chip]['triton'], arch_name='sm_90',
                          compute_capability=90)
  registry = pallas_call_registration.gpu_info_lib
  saved = registry.get_gpu_info
  registry.get_gpu_info = lambda *a, **k: info
  try:
    yield
  finally:
    registry.get_gpu_info = saved
