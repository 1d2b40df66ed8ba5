"""tools.info on every config, its numbers pinned (docs/architecture.md sections 3.9 and 6)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from deepseek41.config import load_config_file
from deepseek41.tools.info import describe
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def test_released_numbers():
  info = describe(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')),
                  {'fsdp': 64, 'expert': 8})
  assert info['params']['backbone'] == 551_880_835_184
  assert info['params']['engram_tables'] == 196_613_849_600
  # The vision encoder + aligner: 485,273,600 (tests/unit/test_vision.py has the arithmetic).
  assert info['params']['vision'] == 485_273_600
  assert info["params"]["total"] == 551_880_835_184 + 196_613_849_600 + 485_273_600
  # Each table's rows rounded up to a multiple of 4096 (engram_table_row_multiple), 256 wide.
  assert info['params']['engram_table_padding'] == \
      (-384_006_168 % 4096 + -384_016_682 % 4096) * 256 == 1_490_432
  assert info['active_params'] == {'decode': 16_130_588_784, 'prefill': 7_895_563_064}
  assert info['kv_cache']['global_bytes_per_token'] == 890
  assert info['kv_cache']['swa_bytes_per_request'] == 40 * 128 * 528
  by = info['params']['by_component']
  assert by['mhc'] == 40 * 983_094 and by['engram.projections'] == 2 * 157_327_360
  assert by['vision.encoder'] + by['vision.aligner'] == 485_273_600
  # Sharded state on 512 devices under muon_hybrid (the default): fp32 parameters, one moment
  # per matrix and token table, and the vectors' AdamW second moment (3 MB a device) + counts.
  per_device = info['bytes_per_device']
  assert per_device['params'] == 20_353_382_400
  assert per_device['optimizer'] == 20_356_500_240
  assert 0 < per_device['optimizer'] - per_device['params'] < 4e6
  assert per_device['router_bias'] == 40 * 2 * 384 * 4
  # Under AdamW: two moments of everything and two int32 counts.
  config = load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py'))
  config.train.optimizer = 'adamw'
  adamw = describe(config, {'fsdp': 64, 'expert': 8})['bytes_per_device']
  assert adamw['optimizer'] == 2 * per_device['params'] + 2 * 4


def test_released_dspark_numbers():
  """The DSpark drafter (docs/architecture.md section 3.14), counted apart from the backbone."""
  info = describe(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')))
  d = info['params']['dspark']
  assert d['main_proj'] == 3 * 5120 * 5120 == 78_643_200
  assert d['markov'] == 2 * 129280 * 256 == 66_191_360
  assert d['confidence'] == 5120 + 256 and d['main_norm'] == d['final_norm'] == 5120
  assert d['router_bias'] == 3 * 2 * 128
  assert 4.6e9 <= d['per_block'] <= 4.75e9 and d['per_block'] == 4_693_503_862
  assert d['blocks'] == 3 * d['per_block'] == 14_080_511_586
  assert d['total'] == d['blocks'] + 78_643_200 + 66_191_360 + 5376 + 2 * 5120 + 768
  assert 14.2e9 <= d['total'] <= 14.3e9 and d['total'] == 14_225_362_530  # released: 14.23B
  by = d['blocks_by_component']
  assert by['experts.routed'] == 3 * 128 * 3 * 5120 * 2304
  assert by['experts.shared'] == 3 * 3 * 5120 * 2304
  assert by['router'] == 3 * 128 * 5120
  assert sum(by.values()) == d['blocks']
  # Per drafted row: routed experts at 3/128, Markov output table, confidence, final norm.
  assert d['active_per_draft_token'] == 842_578_530
  assert d['per_context_token'] == 78_643_200 + 5120
  # Not in the backbone total (pinned in test_released_numbers).
  assert info['params']['total'] == 551_880_835_184 + 196_613_849_600 + 485_273_600


def test_released_decode_flops_by_context():
  """Decode FLOPs of one token after L tokens, from the released layout written out by hand
  (docs/architecture.md sections 1 and 3.7): 40 layers of 64 heads x 512, window 128; 18 ratio-2
  and 20 ratio-1 CSA2 layers selecting top-512; index scoring (2 x 32 x 128 per entry) over the
  whole history at layers 2, 8, 14 (ratio 2) and 20, inside the 2,048 x 8 pool at 24-36; plus
  2 x the 16,130,588,784 decode weights (test_released_numbers)."""
  info = describe(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')))
  head = 4 * 64 * 512
  for context, got in info['decode_flops_per_token'].items():
    t = context + 1
    window = 40 * head * min(t, 128)
    selected = 18 * head * min(512, t // 2) + 20 * head * min(512, t)
    scoring = 2 * 32 * 128 * (3 * (t // 2) + t + 4 * min(2048 * 8, t))
    assert got == 2 * 16_130_588_784 + window + selected + scoring, context
  decode = info['decode_flops_per_token']
  assert sorted(decode) == [4096, 65536, 1 << 20]
  assert 1.6 < decode[1 << 20] / decode[4096] < 1.62  # the report says +25%: docs/performance.md


def test_report_prints_dspark_line():
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.info',
                        f'--config={ROOT}/configs/v41_flash.py'], capture_output=True, text=True,
                       cwd=ROOT, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'DSpark drafter (trained after pretraining): 14,225,362,530 = 3 x 4,693,503,862 ' \
      '(blocks) + main_proj 78,643,200 + Markov 66,191,360' in out.stdout


# What tools.info prints for each shipped config (tests/unit/test_flops.py derives tiny's matmul
# weights by hand; the released config's numbers are test_released_numbers').
EXPECTED = {
    'ablation_1b.py': dict(backbone=1_108_058_696, engram_tables=153_855_616, vision=0,
                           decode=270_246_472, prefill=130_994_596, global_kv=534.0,
                           swa=811_008),
    'ablation_3b.py': dict(backbone=2_892_308_040, engram_tables=153_855_616, vision=0,
                           decode=669_326_920, prefill=326_340_004, global_kv=534.0,
                           swa=811_008),
    'ablation_longctx.py': dict(backbone=139_331_440, engram_tables=25_640_576, vision=0,
                                decode=42_862_448, prefill=18_041_848, global_kv=267.0,
                                swa=270_336),
    'tiny.py': dict(backbone=4_541_840, engram_tables=131_424, vision=0, decode=2_117_008,
                    prefill=1_077_736, global_kv=79.5, swa=16_896),
    'tiny_multimodal.py': dict(backbone=4_935_056, engram_tables=131_424, vision=176_768,
                               decode=2_313_616, prefill=1_077_736, global_kv=79.5, swa=16_896),
    'v41_flash.py': dict(backbone=551_880_835_184, engram_tables=196_613_849_600,
                         vision=485_273_600, decode=16_130_588_784, prefill=7_895_563_064,
                         global_kv=890.0, swa=40 * 128 * 528),
}
# The DSpark stages' configs describe their (frozen) backbone.
EXPECTED['ablation_1b_dspark.py'] = EXPECTED['ablation_1b.py']
EXPECTED['tiny_dspark.py'] = EXPECTED['tiny.py']


def test_every_config_is_pinned():
  assert sorted(EXPECTED) == sorted(os.path.basename(p) for p in glob.glob(
      os.path.join(ROOT, 'configs', '*.py')))


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_runs_on_every_config_with_json(name):
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.info',
                        f'--config={ROOT}/configs/{name}', '--json'], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert out.returncode == 0, out.stderr[-2000:]
  info, want = json.loads(out.stdout), EXPECTED[name]
  p = info['params']
  assert (p['backbone'], p['engram_tables'], p['vision']) == \
      (want['backbone'], want['engram_tables'], want['vision'])
  assert p['total'] == want['backbone'] + want['engram_tables'] + want['vision']
  assert info['active_params'] == {'decode': want['decode'], 'prefill': want['prefill']}
  assert info['kv_cache'] == {'global_bytes_per_token': want['global_kv'],
                              'swa_bytes_per_request': want['swa']}


def test_bad_mesh_flag_is_named():
  out = subprocess.run([sys.executable, '-m', 'deepseek41.tools.info',
                        f'--config={ROOT}/configs/tiny.py', '--mesh=fsdp=two'],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert out.returncode != 0 and '--mesh' in out.stderr
