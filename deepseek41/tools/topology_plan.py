"""`python -m deepseek41.tools.plan --config=configs/v41_flash.py --topology=v5p:8x8x4 --mesh=fsdp=32,expert=8 [--batch=N] [--seq_len=T] [--per_layer] [--json]`
`python -m deepseek41.tools.plan --config=configs/ablation_1b.py --topology=h200:8 [--mesh=...]`

The plan from the target's own compiler, on a machine without the target: a TPU slice through
`libtpu` (the `tpu` extra), or Hopper GPUs through jax's CUDA plugin (optional, outside the
project's dependencies: tools/gpu_target.py says how to get it and what differs from the GPU's
own compile). Either compiles for a topology deviceless (`jax.experimental.topologies`), so the
train step is jitted as the trainer jits it (train/trainer.py: state shardings, batch sharding,
state donated) on a mesh of the topology's devices and compiled by the real compiler. Per device:

  parameters, optimizer, gradients  exact: the sharded abstract state (tools/plan.state_bytes)
  argument, output, alias, temp     the compiler's `memory_analysis()` of the whole step
                                    (temp holds the gradients, the activations and the
                                    collectives' buffers); peak = argument + temp + output - alias
  FLOPs                             the compiler's `cost_analysis()` of the per-device program

against the device's memory. The auto choices resolve for the target's backend (config.py: on
the TPU bf16 compute, ragged_dot experts with the ragged all-to-all, the XLA paths of the
attention ops; on the GPU the Pallas kernels, compiled for sm_90, and the grouped experts), so
nothing is stood in for as the CPU plan does. GPU topologies: `h200` (one), `h200:8` (one host of
eight), `h100:2x8` (two hosts of eight).

`--per_layer`: one layer of each role, the embedding, the head + loss and the optimizer update
are compiled apart (tools/plan.compile_programs) and assembled (tools/plan.assemble) as the CPU
plan does, now with the target compiler's buffers; FLOPs are the programs' sum (each role's
times its layer count, times 4/3 under block remat: `per_layer`). For the released model, where
the whole 40-layer step takes too long to compile on a small machine.

TPU meshes must lie on the slice's torus: jax.make_mesh (deepseek41/sharding.py) gives each mesh
axis a product of whole physical axes (split ones only on v5e), so e.g. fsdp=16,expert=8,tensor=4
is v5p:4x8x16, not v5p:8x8x8.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import jax
from jax.experimental import topologies

from deepseek41.config import MeshConfig, RunConfig, remat_label, remats_layer, resolve
from deepseek41.tools import gpu_target, memory_plan as cpu_plan
from deepseek41.tools.memory_plan import DEVICE_KINDS, over_hbm

GIB = 2**30

# HBM per device by `device_kind` (the topology's devices say which chip they are): what the TPU
# compiler of libtpu 0.0.48.1 gives a program ("available HBM" of its out-of-memory refusal),
# a little under the chip as sold (v5p 95, v5e 16, v6e 32 GiB). v4 topologies list each of a
# chip's two TensorCores as a device, with half the chip's 32 GiB.
HBM_BYTES = {'TPU v5': 95.73 * GIB, 'TPU v5p': 95.73 * GIB, 'TPU v5 lite': 15.75 * GIB,
             'TPU v5e': 15.75 * GIB, 'TPU v6 lite': 31.24 * GIB, 'TPU v6e': 31.24 * GIB,
             'TPU v4': 15.25 * GIB}
CHIP_NAMES = {'TPU v5': 'v5p', 'TPU v5p': 'v5p', 'TPU v5 lite': 'v5e', 'TPU v5e': 'v5e',
              'TPU v6 lite': 'v6e', 'TPU v6e': 'v6e', 'TPU v4': 'v4'}


def libtpu_available() -> bool:
  """Whether the TPU compiler is installed (`pip install -e '.[tpu]'`)."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


def topology_devices(name: str) -> list:
  """The devices of a TPU slice ('v5p:2x2x1', 'v5e:2x4', 'v6e:4x4') or of GPU hosts ('h200:8',
  tools/gpu_target.py); no TPU or GPU needed."""
  if gpu_target.parse_topology(name):
    return gpu_target.topology_devices(name)
  if not libtpu_available():
    raise RuntimeError('--topology needs the TPU compiler: pip install -e ".[tpu]"')
  # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) when it starts, meant for a host's
  # chips; compiling deviceless holds none, so parallel test workers and plans may share it.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  try:
    topo = topologies.get_topology_desc(platform='tpu', topology_name=name)
  except Exception as e:  # the message of libtpu's parse error is the useful part
    raise ValueError(f'--topology={name!r} is not a TPU topology libtpu knows '
                     f'(e.g. v5p:2x2x1, v5e:2x4, v6e:4x4): {str(e).splitlines()[0]}') from e
  return list(topo.devices)


def hbm_bytes(device_kind: str) -> float:
  for chip, spec in gpu_target.TARGETS.items():  # the CPU plan's figure for the same GPU
    if device_kind == spec['name']:
      return DEVICE_KINDS[chip][0]
  if device_kind not in HBM_BYTES:
    raise ValueError(f'no HBM size known for TPU device kind {device_kind!r} '
                     f'(known: {sorted(HBM_BYTES)}); pass --hbm_gib')
  return HBM_BYTES[device_kind]


def topology_config(config, mesh_sizes: dict[str, int], *, batch: int | None = None,
                    seq_len: int | None = None, backend: str = 'tpu') -> RunConfig:
  """The config on this mesh at this batch and length, the auto choices resolved for the
  target's backend ('tpu' or 'gpu')."""
  return cpu_plan.planned_config(config, mesh_sizes, batch=batch, seq_len=seq_len,
                                 backend=backend, compile_for=backend)[0]





def full_step(cfg: RunConfig, devices) -> dict:
  """The whole train step compiled for the topology: memory_analysis, FLOPs, seconds."""
  t0 = time.perf_counter()
  lowered, options = cpu_plan.lowered_train_step(cfg, devices)
  t1 = time.perf_counter()
  try:
    compiled = lowered.compile(options)
  except jax.errors.JaxRuntimeError as e:  # refused: larger than the chip's HBM
    over = over_hbm(e)
    if over is None:
      raise
    state = cpu_plan.state_bytes(cfg)
    held = state['params'] + state['optimizer'] + state.get('router_bias', 0)
    peak = over.get('used', over.get('temp', 0.0) + held)
    return {'temp': over.get('temp', peak - held), 'argument': held, 'output': held,
            'alias': held, 'peak': peak, 'flops': float('nan'), 'over_hbm': True,
            'lower_seconds': t1 - t0, 'compile_seconds': time.perf_counter() - t1}
  mem = cpu_plan._memory(compiled)  # noqa: SLF001 - the plan's one reading of memory_analysis
  mem['peak'] = mem['argument'] + mem['temp'] + mem['output'] - mem['alias']
  return {**mem, 'lower_seconds': t1 - t0,
          'compile_seconds': time.perf_counter() - t1}


def per_layer(cfg: RunConfig, devices, state: dict) -> dict:
  """One layer of each role (+ embedding, head, optimizer) compiled for the topology and
  assembled; FLOPs summed over the layers.

  A layer program runs its block's forward once and its backward (about twice the forward);
  under block remat the step runs each forward twice (the forward pass, and the recompute in
  the backward), so the layers' FLOPs count 4/3 of their programs'. Checked on ablation_1b at
  4K on v6e-8: the uncorrected sum came out 24% under the whole step's cost_analysis; 4/3 on
  the layers closes that gap exactly if they are 94% of the sum (the head, embedding and
  optimizer the remaining 0.5 TFLOP, about what the LM head alone counts there).
  """
  programs = cpu_plan.compile_programs(cfg, devices)
  assembled = cpu_plan.assemble(state, programs)
  roles = programs['roles']
  t = cfg.train

  def recompute(layer):  # the TPU's paths name no kernel outputs: remat recomputes it all
    return 4 / 3 if remats_layer(t.remat, t.remat_layers, layer) else 1.0
  role_flops = {l: r['fwd_bwd']['flops'] * recompute(int(l)) for l, r in roles.items()}
  flops = (sum(f * len(roles[l]['layers']) for l, f in role_flops.items()) +
           programs['head']['fwd_bwd']['flops'] + programs['embed']['fwd_bwd']['flops'] +
           programs['optimizer']['update']['flops'])
  mems = [r['fwd_bwd'] for r in roles.values()] + [programs[k]['fwd_bwd'] for k in
                                                    ('head', 'embed')]
  mems.append(programs['optimizer']['update'])
  return {'peak': assembled['total'], 'activations': assembled['activations'],
          'kept_by_layers': assembled['kept_by_layers'], 'peak_stage': assembled['peak_stage'],
          'peak_stage_bytes': assembled['peak_stage_bytes'], 'stages': assembled['stages'],
          'flops': flops,
          'over_hbm': any(m.get('over_hbm') for m in mems),
          'compile_seconds': programs['compile_seconds'], 'role_flops': role_flops,
          'roles': {l: r['layers'] for l, r in roles.items()}}


def config_mesh(config, chips: int, *, batch: int | None = None,
                backend: str = 'tpu') -> dict[str, int]:
  """The mesh the trainer would build from the config on this many chips (-1 filled in)."""
  config = config.copy_and_resolve_references()
  if batch is not None:
    config.train.batch_size = batch
  cfg = resolve(config, num_devices=chips, backend=backend)
  return {a: getattr(cfg.mesh, a) for a in MeshConfig.AXES if getattr(cfg.mesh, a) > 1}


def topology_plan(config, topology: str, mesh_sizes: dict[str, int] | None = None, *,
                  batch: int | None = None, seq_len: int | None = None,
                  per_layer_programs=False, hbm: float | None = None) -> dict:
  """The plan of one config on one TPU slice or set of GPU hosts (default mesh: the config's,
  as the trainer builds it on the topology's devices)."""
  gpu = gpu_target.parse_topology(topology)
  backend = 'gpu' if gpu else 'tpu'
  devices = topology_devices(topology)
  mesh_sizes = dict(mesh_sizes or config_mesh(config, len(devices), batch=batch,
                                              backend=backend))
  if math.prod(mesh_sizes.values()) != len(devices):
    raise ValueError(f'--mesh {mesh_sizes} has {math.prod(mesh_sizes.values())} devices, '
                     f'topology {topology} has {len(devices)}')
  kind = devices[0].device_kind
  hbm = hbm_bytes(kind) if hbm is None else hbm
  cfg = topology_config(config, mesh_sizes, batch=batch, seq_len=seq_len, backend=backend)
  state = cpu_plan.state_bytes(cfg)
  kernels = gpu_target.triton_lowers_for(gpu[0]) if gpu else contextlib.nullcontext()
  with kernels:
    compiled = per_layer(cfg, devices, state) if per_layer_programs else full_step(cfg, devices)
  batch_shards = math.prod(getattr(cfg.mesh, a) for name, axes in cfg.mesh.rules
                           if name == 'batch' for a in axes)
  m = cfg.model
  return {
      'topology': topology, 'device_kind': kind, 'compiler': f'{backend.upper()} compiler',
      'chip': gpu[0] if gpu else CHIP_NAMES.get(kind, kind),
      'chips': len(devices), 'hbm_bytes': hbm, 'mesh': mesh_sizes,
      'batch': cfg.train.batch_size, 'seq_len': cfg.data.seq_len,
      'per_chip_batch': cfg.train.batch_size // cfg.train.grad_accum_steps / batch_shards,
      'remat': remat_label(cfg.train), 'compute_dtype': m.compute_dtype, 'param_dtype': m.param_dtype,
      'impls': {k: getattr(m, k) for k in ('attention_impl', 'sparse_impl', 'index_impl',
                                          'selected_scores_impl', 'select_impl', 'mhc_impl',
                                          'moe_backend', 'expert_exchange')},
      'method': 'per-layer programs, assembled' if per_layer_programs else 'whole step',
      'state': state, 'compiled': compiled,
      # A program the compiler refused for HBM does not fit, whatever the sum says.
      'fits': bool(compiled['peak'] <= hbm and not compiled.get('over_hbm')),
      'headroom_bytes': hbm - compiled['peak'],
  }


def _size(x: float) -> str:
  return f'{x / GIB:9.2f} GiB' if abs(x) >= GIB / 10 else f'{x / 2**20:9.2f} MiB'


def report(p: dict) -> str:
  s, c = p['state'], p['compiled']
  g = _size
  comp = p.get('compiler', 'TPU compiler')
  mesh = ','.join(f'{k}={v}' for k, v in p['mesh'].items()) or '(one device)'
  lines = [
      f"topology {p['topology']} ({p['chips']} x {p['device_kind']}, {p['hbm_bytes'] / GIB:g} "
      f"GiB HBM); mesh {mesh}; batch {p['batch']} x {p['seq_len']} tokens "
      f"({p['per_chip_batch']:g} sequence(s) per chip); remat {p['remat']}; compute "
      f"{p['compute_dtype']}, params {p['param_dtype']}",
      f"  parameters   {g(s['params'])}   exact (abstract state, fitted specs)",
      f"  optimizer    {g(s['optimizer'])}   exact (the optimizer's moments + counts)",
      f"  gradients    {g(s['gradients'])}   exact (param-shaped; inside the compiled temp)",
  ]
  if 'temp' in c:
    lines += [f"  argument     {g(c['argument'])}   {comp} (state + batch)",
              f"  temp         {g(c['temp'])}   {comp} (gradients, activations, "
              f"collectives)",
              f"  output       {g(c['output'])}   {comp}, {c['alias'] / GIB:.2f} GiB of it "
              f"aliased to the donated state"]
  else:
    lines += [f"  activations  {g(c['activations'])}   {comp}, per-layer programs: kept by "
              f"the layers below it {c['kept_by_layers'] / GIB:.2f} GiB + peak stage ({c['peak_stage']}) "
              f"{c['peak_stage_bytes'] / GIB:.2f} GiB"]
  if c.get('over_hbm'):
    lines.append(f'  (the {comp} refused a program as larger than its memory: its sizes are those '
                 'of the refusal, a lower bound)')
  lines += [
      f"  peak         {g(c['peak'])}   of {p['hbm_bytes'] / GIB:.2f} GiB: " +
      ('fits, headroom ' if p['fits'] else 'DOES NOT FIT, short by ') +
      f"{abs(p['headroom_bytes']) / GIB:.2f} GiB",
      (f"  FLOPs        {c['flops']:.4g} per chip per step ({comp} cost_analysis)"
       if math.isfinite(c['flops']) else f"  FLOPs        not counted by the {comp}"),
      f"  compiled ({p['method']}) in {c['compile_seconds']:.0f} s; ops: " +
      ', '.join(f'{k}={v}' for k, v in p['impls'].items()),
  ]
  return '\n'.join(lines)
