"""`python -m deepseek41.tools.plan --config=configs/v41_flash.py --devices=256 --mesh=fsdp=32,expert=8 --batch=256 --seq_len=4096 --device_kind=h200 [--search] [--json]`

The command line of the memory planner (tools/memory_plan.py says what it counts and how):
one mesh (`--mesh`), every mesh of a device count that fits (`--search`), or a TPU slice or GPU
hosts with the target's own compiler, deviceless (`--topology`, tools/topology_plan.py).
Planning needs as many devices as the mesh has: without them here the plan runs in a worker
process with that many fake CPU devices.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import ml_collections
from absl import app, flags

from deepseek41.tools import info, topology_plan
from deepseek41.tools.info import parse_mesh
from deepseek41.tools.memory_plan import DEVICE_KINDS, GIB, candidate_meshes, plan, report

# --config, --mesh and --json are tools.info's flags (absl refuses a second definition).
_CONFIG, _MESH, _JSON = info.CONFIG_FLAG, info.MESH_FLAG, info.JSON_FLAG
_DEVICES = flags.DEFINE_integer('devices', None, 'Device count (default: the mesh product).')
_BATCH = flags.DEFINE_integer('batch', None, 'Global batch in sequences (default: the config).')
_SEQ_LEN = flags.DEFINE_integer('seq_len', None, 'Sequence length (default: the config).')
_KIND = flags.DEFINE_enum('device_kind', 'h200', list(DEVICE_KINDS), 'Device preset: HBM and '
                          'the backend the auto choices (dtypes) resolve for.')
_HBM = flags.DEFINE_float('hbm_gib', None, 'Device memory in GiB (overrides the preset).')
_CHECK = flags.DEFINE_bool('check_full_step', False, 'Also compile the whole train step on the '
                           'same mesh and compare (small models: it is the whole program).')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'A TPU slice (v5p:8x8x4; needs the tpu extra) '
                                'or GPU hosts (h200, h200:8, h100:2x8; needs jax\'s CUDA plugin, '
                                'tools/gpu_target.py): compile the step for it with its own '
                                'compiler, deviceless (tools/topology_plan.py). --mesh defaults '
                                'to the config\'s mesh.')
_PER_LAYER = flags.DEFINE_bool('per_layer', False, 'With --topology: compile one layer of each '
                               'role and assemble, instead of the whole step (large models).')
_SEARCH = flags.DEFINE_bool('search', False, 'Plan every fsdp x expert x tensor mesh of the '
                            'device count (data = 1) and rank those that fit.')

_WORKER_ENV = 'DS41_PLAN_WORKER'


def _in_subprocess(config, kwargs: dict, devices: int) -> dict:
  """Run `plan` where jax can see `devices` fake CPU devices (set before jax starts)."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', _WORKER_ENV: '1',
         'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}'}
  payload = json.dumps({'config': config.to_json(), 'kwargs': kwargs})
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.plan'], input=payload,
                       capture_output=True, text=True, env=env)
  if out.returncode:
    raise RuntimeError(f'plan worker failed:\n{out.stderr[-4000:]}')
  return json.loads(out.stdout.splitlines()[-1])


def plan_anywhere(config, mesh_sizes, **kwargs) -> dict:
  """`plan` in this process if jax has the devices, else in a worker process that has them."""
  n = math.prod(mesh_sizes.values())
  if jax.device_count() >= n and jax.default_backend() == 'cpu':
    return plan(config, mesh_sizes, devices=jax.devices()[:n], **kwargs)
  return _in_subprocess(config, {'mesh_sizes': mesh_sizes, **kwargs}, n)


def _worker():
  spec = json.loads(sys.stdin.read())
  config = ml_collections.ConfigDict(json.loads(spec['config']))
  kw = spec['kwargs']
  result = plan(config, kw.pop('mesh_sizes'), **kw)
  print(json.dumps(result, default=float))


def main(argv):
  del argv
  config = _CONFIG.value
  devices = _DEVICES.value
  mesh = parse_mesh(_MESH.value)
  if _TOPOLOGY.value:
    _main_topology(config, mesh)
    return
  if devices is None and not mesh:
    raise app.UsageError('give --devices, --mesh or both')
  devices = devices or math.prod(mesh.values())
  if not mesh and not _SEARCH.value:
    mesh = {'fsdp': devices}  # every device on fsdp
  if mesh and math.prod(mesh.values()) != devices:
    raise app.UsageError(f'--mesh {mesh} has {math.prod(mesh.values())} devices, --devices '
                         f'{devices}')
  kwargs = {'batch': _BATCH.value, 'seq_len': _SEQ_LEN.value, 'device_kind': _KIND.value,
            'hbm_bytes': _HBM.value * GIB if _HBM.value else None,
            'check_full_step': _CHECK.value}
  if _SEARCH.value:
    meshes = candidate_meshes(devices, config.model)
    results = []
    for sizes in meshes:
      try:
        results.append(plan_anywhere(config, sizes, **kwargs))
      except Exception as e:  # noqa: BLE001 - a mesh the config cannot take is reported, not fatal
        results.append({'mesh': sizes, 'error': str(e).splitlines()[-1]})
    ok = sorted((r for r in results if 'error' not in r), key=lambda r: r['per_device']['total'])
    if _JSON.value:
      print(json.dumps(results, default=float))
      return
    for r in ok:
      print(report(r))
    for r in results:
      if 'error' in r:
        print(f"mesh {r['mesh']}: {r['error']}")
    return
  result = plan_anywhere(config, mesh, **kwargs)
  print(json.dumps(result, default=float) if _JSON.value else report(result))


def _main_topology(config, mesh: dict[str, int]):
  """--topology: the target compiler's plan (tools/topology_plan.py); exits 1 when it does not
  fit."""
  # The topology is compiled for without its backend: never take a TPU or GPU this host has.
  jax.config.update('jax_platforms', 'cpu')
  try:
    result = topology_plan.topology_plan(
        config, _TOPOLOGY.value, mesh or None, batch=_BATCH.value, seq_len=_SEQ_LEN.value,
        per_layer_programs=_PER_LAYER.value, hbm=_HBM.value * GIB if _HBM.value else None)
  except (RuntimeError, ValueError) as e:
    if '--topology' not in str(e) and '--mesh' not in str(e):
      raise
    raise app.UsageError(str(e)) from None
  print(json.dumps(result, default=float) if _JSON.value else topology_plan.report(result))
  if not result['fits']:
    sys.exit(1)


def run():
  """Console-script entry point (`ds41-plan`)."""
  app.run(main)


if __name__ == '__main__':
  if os.environ.get(_WORKER_ENV):
    _worker()
  else:
    run()
