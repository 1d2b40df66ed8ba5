"""Compile the training step (or the optimizer update alone) for an H100 or H200 on a machine
without a GPU, and report what the GPU program is: its memory analysis, and its kernels by scope
with the bytes each moves (benchmarks/hlo_kernels.py). XLA's GPU compiler runs here, deviceless,
through jax's topology API; the Pallas kernels are lowered and compiled for sm_90 as on the GPU.
No kernel runs, so nothing is timed: use it to see what a change does to the program (kernel
counts, layout copies, bytes, peak memory) before spending device time on it.

Setup, once (about 4 GB of wheels matching the installed jax, outside the venv):
    bash benchmarks/get_gpu_compiler.sh /tmp/gpu-compiler
Then:
    PYTHONPATH=/tmp/gpu-compiler .venv/bin/python benchmarks/compile_for_gpu.py \
        --config=configs/ablation_1b.py --config.data.seq_len=4096 --config.train.batch_size=8 \
        [--program=step|optimizer] [--target=h100|h200] [--depth=3] [--hlo_out=FILE]

What differs from the GPU's own compile: no autotuning (GEMM and fusion tilings take XLA's
defaults) and sorts without the device's CUB tables (XLA warns and uses its fallback sort), so
kernel choices inside a fusion can differ; the fusions, layouts, copies and buffers are the
compiler's own. Measured against the GPU (docs/performance.md section 44): the muon_hybrid
update on the 1B model compiles to 2,010 kernels (the H100 profile: 2,117 a step), the 1B step
at 8 x 4,096 to a 65.1 GB peak (71.2 GB measured on the H200, allocator and library workspaces
included).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
from absl import app, flags

jax.config.update('jax_platforms', 'cpu')  # the GPU is only a compile target here

from jax.experimental import topologies  # noqa: E402
from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_kernels  # noqa: E402  (benchmarks/hlo_kernels.py)
from deepseek41.config import resolve  # noqa: E402
from deepseek41.ops import launch  # noqa: E402
from deepseek41.tools.info import CONFIG_FLAG  # noqa: E402  (--config and its overrides)
from deepseek41.sharding import make_mesh  # noqa: E402
from deepseek41.tools.memory_plan import (  # noqa: E402
    compiled_optimizer_update, lowered_train_step, program_memory)

# The GPUs' descriptions for XLA's compiler (GpuTargetConfig, text format): what it reads to
# choose fusions, tiles and launch shapes. Hopper SXM parts; the H200 differs in memory size and
# bandwidth only.
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

_PROGRAM = flags.DEFINE_enum('program', 'step', ['step', 'optimizer'],
                             'The whole train step, or the optimizer update alone.')
_TARGET = flags.DEFINE_enum('target', 'h100', sorted(TARGETS), 'The GPU to compile for.')
_DEPTH = flags.DEFINE_integer('depth', 3, 'Scope components in the kernel table.')
_TOP = flags.DEFINE_integer('top', 30, 'Rows of the kernel table.')
_HLO_OUT = flags.DEFINE_string('hlo_out', '', 'Write the optimized HLO text here.')


def gpu_topology(target: str):
  spec = TARGETS[target]
  try:
    return topologies.get_topology_desc(platform='cuda', topology='1x1x1',
                                        target_config=_TARGET_CONFIG.format(**spec))
  except Exception as e:  # no CUDA plugin on the path: say how to get one
    raise SystemExit(f'no deviceless CUDA compiler ({type(e).__name__}: {e}); run '
                     '`bash benchmarks/get_gpu_compiler.sh DIR` and put DIR on PYTHONPATH')


def compile_step(cfg, devices):
  lowered, options = lowered_train_step(cfg, devices)
  return lowered.compile(options)


def compile_optimizer(cfg, devices):
  from flax import nnx
  from deepseek41.model.params import RouterBias
  from deepseek41.train.state import build_model
  _, params, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, RouterBias)
  return compiled_optimizer_update(cfg, make_mesh(cfg.mesh, devices), params)


def main(argv):
  del argv
  topology = gpu_topology(_TARGET.value)
  # The kernels are compiled (not interpreted) and their Triton lowering targets this GPU.
  launch.platform = lambda: 'gpu'
  triton_gpu = gpu_info.GpuInfo(gpu_version=TARGETS[_TARGET.value]['triton'], arch_name='sm_90',
                                compute_capability=90)
  pallas_call_registration.gpu_info_lib.get_gpu_info = lambda *a, **k: triton_gpu
  cfg = resolve(CONFIG_FLAG.value, num_devices=1, backend='gpu')
  t0 = time.perf_counter()
  compiled = (compile_step if _PROGRAM.value == 'step' else compile_optimizer)(
      cfg, topology.devices)
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  if _HLO_OUT.value:
    with open(_HLO_OUT.value, 'w') as f:
      f.write(text)
  mem = program_memory(compiled)
  rows = hlo_kernels.kernels(text)
  kinds = {}
  for k in rows:
    kinds[k.kind] = kinds.get(k.kind, 0) + 1
  summary = dict(program=_PROGRAM.value, target=_TARGET.value,
                 lower_and_compile_s=round(seconds, 1),
                 **{f'{part}_gb': mem[part] / 1e9
                    for part in ('argument', 'temp', 'output', 'alias', 'peak')},
                 kernels=len(rows), gb_moved=sum(k.bytes for k in rows) / 1e9,
                 copies=kinds.get('%copy', 0),
                 transposing=sum(n for kind, n in kinds.items() if 'transpose' in kind))
  print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in summary.items()}))
  print(f'{"GB moved":>9} {"kernels":>8}  scope (depth {_DEPTH.value})')
  for scope, n, b in hlo_kernels.by_scope(rows, _DEPTH.value)[:_TOP.value]:
    print(f'{b / 1e9:9.2f} {n:8d}  {scope}')


if __name__ == '__main__':
  app.run(main)
