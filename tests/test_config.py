"""Config files build, validation names the culprit key, the role table follows ARCHITECTURE.md."""

import glob
import os
import subprocess
import sys

import jax
import pytest

from deepseek41.config import (FULL, REINDEX, REUSE, SWA, ConfigError, base_config,
                               layer_roles, load_config_file, resolve)
from deepseek41.train.state import abstract_state, count_params
from deepseek41.train.optimizer import make_optimizer
from tests.util import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_every_config_builds(path):
  config = load_config_file(path)
  sharded = any(config.mesh[a] > 1 for a in ('fsdp', 'expert', 'tensor', 'context'))
  cfg = resolve(config, num_devices=8 if sharded else 1, backend='cpu')
  abstract = abstract_state(cfg, make_optimizer(cfg.train))  # jax.eval_shape: no arrays
  n = count_params(abstract['params'])
  assert n > 0
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
  if os.path.basename(path) == 'ablation_1b.py':
    assert 0.9e9 < n < 1.4e9


def test_tiny_roles_match_the_reference_toy():
  cfg = resolve(load_config_file(os.path.join(ROOT, 'configs', 'tiny.py')), backend='cpu',
                num_devices=1)
  roles = layer_roles(cfg.model)
  assert [r.mode for r in roles] == [SWA, SWA, FULL, REUSE, FULL, REUSE, REINDEX, REUSE]
  assert [r.kv_source for r in roles] == [-1, -1, 2, 2, 4, 4, 4, 4]
  assert [r.index_source for r in roles] == [-1, -1, 2, 2, 4, 4, 6, 6]
  assert [r.publishes_candidates for r in roles].index(True) == 4
  assert [r.uses_candidates for r in roles] == [False] * 6 + [True, False]
  assert [r.engram for r in roles] == [False, True, False, True] + [False] * 4
  assert [r.rope for r in roles] == ['main'] * 2 + ['compress'] * 6
  assert [r.block for r in roles] == ['encoder'] * 4 + ['decoder'] * 4


@pytest.mark.parametrize('key, value, culprit', [
    ('model.o_groups', 3, 'model.o_groups'),
    ('model.compress_ratios', (0, 0, 1, 1), 'model.kv_source_layer_ids'),
    ('model.kv_source_layer_ids', (0, 2), 'model.kv_source_layer_ids'),
    ('model.index_topk', 64, 'model.index_topk'),
    ('model.num_experts_per_tok', 9, 'model.num_experts_per_tok'),
    ('model.moe_backend', 'fast', 'model.moe_backend'),
    ('model.rope_head_dim', 7, 'model.rope_head_dim'),
    ('train.grad_accum_steps', 3, 'train.grad_accum_steps'),
    ('train.schedule', 'linear', 'train.schedule'),
    ('mesh.fsdp', 3, 'mesh'),
    ('data.sources', 'a:-1', 'data.sources'),
    ('log.profile_steps', 0, 'log.profile_steps'),
    ('train.vision_lr_multiplier', 0.0, 'train.vision_lr_multiplier'),
    ('log.profile_start_step', -1, 'log.profile_start_step'),
])
def test_inconsistent_values_name_the_key(key, value, culprit):
  with pytest.raises(ConfigError, match=culprit.replace('.', r'\.')):
    resolve(small_config(**{key: value}), num_devices=8, backend='cpu')


def test_unknown_keys_are_rejected_with_their_name():
  c = small_config()
  c.model.num_layer = 3
  with pytest.raises(ConfigError, match=r"unknown config key 'model.num_layer'.*model.num_layers"):
    resolve(c, num_devices=1, backend='cpu')
  with pytest.raises(ConfigError, match='model.nope'):
    load_config_file(os.path.join(ROOT, 'configs', 'tiny.py'), {'model.nope': 1})


def test_batch_must_split_over_devices():
  with pytest.raises(ConfigError, match='train.batch_size'):
    resolve(small_config(**{'train.batch_size': 4, 'mesh.data': -1}), num_devices=8,
            backend='cpu')


def test_auto_choices_resolve_by_backend():
  gpu = resolve(base_config(), num_devices=1, backend='gpu').model
  cpu = resolve(base_config(), num_devices=1, backend='cpu').model
  tpu = resolve(base_config(), num_devices=1, backend='tpu').model
  assert (gpu.compute_dtype, gpu.moe_backend) == ('bfloat16', 'capacity_einsum')
  assert (cpu.compute_dtype, cpu.moe_backend) == ('float32', 'capacity_einsum')
  assert tpu.moe_backend == 'ragged_dot'


def test_cli_rejects_unknown_override_and_missing_config(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-m', 'deepseek41.train', '--config=configs/tiny.py',
                        f'--workdir={tmp_path}', '--config.model.no_such_key=1'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and 'no_such_key' in out.stderr
  out = subprocess.run([sys.executable, '-m', 'deepseek41.train', '--config=configs/nope.py',
                        f'--workdir={tmp_path}'], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode != 0 and 'nope.py' in out.stderr


def test_released_config_parameter_accounting():
  """The model built from configs/v41_flash.py holds exactly the released backbone (s.6)."""
  cfg = resolve(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')), backend='cpu',
                num_devices=8)
  abstract = abstract_state(cfg, make_optimizer(cfg.train))
  layers, d = 40, 5120
  attention = 5120 * 1280 + 1280 + 1280 * 32768 + 5120 * 512 + 512 + 64 + 8 * 4096 * 1024 + 8192 * 5120
  assert attention == 126_617_408
  moe = 384 * 3 * 5120 * 2304 + 3 * 5120 * 2304 + 5120 * 384
  mhc = 2 * (24 * 4 * d + 24 + 3)
  assert mhc == 983_094 // 1 and layers * mhc == 39_323_760
  csa2 = (3 * 5_243_392 + 2_621_952     # ratio-2 / ratio-1 compressors (layers 2, 8, 14 / 20)
          + 8 * 5_406_720 + 4 * 65_664)  # index queries (8 index sources), index keys (4 KV sources)
  engram_projections = 2 * 157_327_360
  pad = lambda rows: -(-rows // 4096) * 4096 - rows  # noqa: E731 (engram_table_row_multiple)
  engram_tables = (384_006_168 + pad(384_006_168) + 384_016_682 + pad(384_016_682)) * 256
  params = layers * (attention + moe + mhc + 2 * d) + csa2 + engram_projections + \
      2 * 129280 * 5120 + d + engram_tables
  vision = count_params(abstract['params']['vision'])  # tests/test_vision.py has its arithmetic
  assert count_params(abstract['params']) - vision == params
  biases = layers * 2 * 384                # correction biases: state here, tensors in the release
  assert count_params(abstract['router_bias']) == biases
  assert params + biases - engram_tables == 551_880_835_184
  tables = abstract['params']['blocks'][14]['engram']['table']
  assert tables.get_value().shape[0] % 4096 == 0


def test_flop_accounting_counts_the_csa2_work():
  from deepseek41.train.flops import active_matmul_params, flops_per_token
  tiny = os.path.join(ROOT, 'configs', 'tiny.py')
  off = resolve(load_config_file(tiny, {'model.csa2': False}), num_devices=1, backend='cpu').model
  on = resolve(load_config_file(tiny), num_devices=1, backend='cpu').model
  # tiny: r=2 compressor at 2 (wkv + wgate 128x64 each; W_k 64x32 per 2 tokens), r=1 at 4
  # (wkv 128x64; W_k 64x32), index queries at 2, 4, 6 (W_qb 64x4x32, W_w 128x4)
  extra = 2 * 128 * 64 + 64 * 32 // 2 + 128 * 64 + 64 * 32 + 3 * (64 * 4 * 32 + 128 * 4)
  assert active_matmul_params(on) - active_matmul_params(off) == extra
  assert flops_per_token(on, 128).total > flops_per_token(off, 128).total + 6 * extra
  assert 'selected' in flops_per_token(on, 128).formula
