"""tools.info on every config; the released numbers pinned (ARCHITECTURE.md sections 3.9 and 6)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from deepseek41.config import load_config_file
from deepseek41.tools.info import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_released_numbers():
  info = describe(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')),
                  {'fsdp': 64, 'expert': 8})
  assert info['params']['backbone'] == 551_880_835_184
  assert info['params']['engram_tables'] == 196_613_849_600
  # The vision encoder + aligner: 485,273,600 (tests/test_vision.py has the arithmetic).
  assert info['params']['vision'] == 485_273_600
  assert info["params"]["total"] == 551_880_835_184 + 196_613_849_600 + 485_273_600
  assert round(info['params']['vision'] / 1e6) == 485                # about 0.485B
  assert 0 < info["params"]["engram_table_padding"] < 2 * 4096 * 256
  assert round(info['active_params']['decode'] / 1e8) == 161       # about 16.1B
  assert round(info['active_params']['prefill'] / 1e8) == 79       # about 7.9B
  assert info['kv_cache']['global_bytes_per_token'] == 890
  assert info['kv_cache']['swa_bytes_per_request'] == 40 * 128 * 528
  by = info['params']['by_component']
  assert by['mhc'] == 40 * 983_094 and by['engram.projections'] == 2 * 157_327_360
  # Sharded state: 512 devices hold 1/512 of the experts and tables, and all of what is replicated.
  per_device = info['bytes_per_device']
  assert per_device['params'] * 512 > 4 * info['params']['total'] * 0.99
  assert per_device['params'] < 4 * info['params']['total'] / 64  # experts, tables, embed split
  assert per_device['optimizer'] == pytest.approx(2 * per_device['params'], rel=1e-3)


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))))
def test_runs_on_every_config_with_json(path):
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.info', f'--config={path}',
                        '--json'], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert out.returncode == 0, out.stderr[-2000:]
  info = json.loads(out.stdout)
  for key in ('backbone', 'engram_tables', 'total'):
    assert info['params'][key] >= 0
  assert 0 < info['active_params']['prefill'] <= info['active_params']['decode']
  assert info['kv_cache']['global_bytes_per_token'] >= 0


def test_bad_mesh_flag_is_named():
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.info',
                        f'--config={ROOT}/configs/tiny.py', '--mesh=fsdp=two'],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert out.returncode != 0 and '--mesh' in out.stderr
