"""How long the training step takes to trace and to lower for the GPU, before any compile: what a
restart pays even when the persistent compilation cache holds the program (its key is the
lowered module). Runs on any machine: the Pallas kernels are lowered for an H200 (sm_90)
without one, nothing is compiled.

    python benchmarks/bench_lowering.py --config=configs/ablation_1b.py \
        [--config.data.seq_len=4096 ...] [--no_memo]

--no_memo lowers every Pallas call afresh (deepseek41/ops/gpu/lowering_memo.py off). Prints one
JSON line: trace and lower seconds, Pallas calls in the program, distinct kernels lowered.
"""

import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from jax._src.pallas.triton import gpu_info, pallas_call_registration
from ml_collections import config_flags

from deepseek41.config import resolve
from deepseek41.ops import launch
from deepseek41.ops.gpu import LOWERING_MEMO
from deepseek41.ops.gpu.lowering_memo import _triton_lowering
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import make_optimizer

H200 = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name='sm_90',
                        compute_capability=90)


_CONFIG = config_flags.DEFINE_config_file('config', None, 'A get_config() file.')
_NO_MEMO = flags.DEFINE_bool('no_memo', False, 'Lower every Pallas call afresh.')


def main(argv):
  del argv
  if _NO_MEMO.value and LOWERING_MEMO is not None:
    _triton_lowering.lower_jaxpr_to_triton_module = LOWERING_MEMO.lower
  # The kernels compile for the GPU (not the interpreter) and their lowering asks for an H200.
  launch.platform = lambda: 'gpu'
  pallas_call_registration.gpu_info_lib.get_gpu_info = lambda *a, **k: H200
  cfg = resolve(_CONFIG.value, num_devices=1, backend='gpu')
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  abstract = state_lib.abstract_state(cfg, tx)
  md = state_lib.model_def(cfg, tx)
  shape = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len), jnp.int32)
  batch = {k: shape for k in ('tokens', 'targets', 'segment_ids', 'positions', 'loss_mask',
                              'modality')}
  step = jax.jit(objective_for(cfg).make_train_step(md))
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    traced = step.trace(abstract, batch)
    t1 = time.perf_counter()
    text = traced.lower(lowering_platforms=('cuda',)).as_text()
    t2 = time.perf_counter()
  memo = None if _NO_MEMO.value else LOWERING_MEMO
  print(json.dumps(dict(batch=cfg.train.batch_size, seq_len=cfg.data.seq_len, memo=memo is not None,
                        trace_s=round(t1 - t0, 2), lower_s=round(t2 - t1, 2),
                        pallas_calls=text.count('__gpu$xla.gpu.triton'),
                        kernels_lowered=memo.misses if memo else None)))


if __name__ == '__main__':
  app.run(main)
