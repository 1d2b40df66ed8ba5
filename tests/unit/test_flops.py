"""MFU's FLOP count comes from the model's own parameters (deepseek41/model/inventory.py)."""

import dataclasses
import os

import pytest

from deepseek41.config import load_config_file, resolve
from deepseek41.tools.info import describe
from deepseek41.train.flops import active_matmul_params, flops_per_token, vision_flops_per_image
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def _model(name: str, **overrides):
  return resolve(load_config_file(os.path.join(ROOT, 'configs', name), overrides), num_devices=1,
                 backend='cpu').model


def test_active_matmul_params_of_tiny():
  # d=128, 8 layers, 4 heads x 64, q/o LoRA 64 (2 groups), 8 experts (top-2 + 1 shared, 128
  # wide), vocab 512, single-pass mHC over 4 streams, Engram (2 n-gram sizes x 2 heads x 16)
  # at layers 1 and 3, CSA2 KV sources at 2 (ratio 2) and 4 (ratio 1), index sources 2, 4, 6.
  attention = 128 * 64 + 64 * 4 * 64 + 128 * 64 + 4 * 64 * 64 + 2 * 64 * 128      # 65,536
  moe = 128 * 8 + (2 + 1) * 3 * 128 * 128                                           # 148,480
  mhc = 2 * (2 + 4) * 4 * (4 * 128)                                                 # 24,576
  engram = 2 * 2 * 16 * (4 + 1) * 128                                               # 40,960
  csa2 = (2 * 128 * 64 + 64 * 32 // 2) + (128 * 64 + 64 * 32) + 3 * (64 * 4 * 32 + 128 * 4)
  expected = 8 * (attention + moe + mhc) + 128 * 512 + 2 * engram + csa2
  assert expected == 2_109_952
  fpt = flops_per_token(_model('tiny.py'), 128)
  assert active_matmul_params(_model('tiny.py')) == fpt.matmul_params == expected
  assert fpt.total == pytest.approx(3 * (2 * expected + fpt.attention))
  assert fpt.vision_per_image == 0.0 and 'vision' not in fpt.formula


def test_a_changed_dimension_changes_the_count():
  base = active_matmul_params(_model('tiny.py'))
  narrow = active_matmul_params(_model('tiny.py', **{'model.moe_intermediate_size': 64}))
  assert base - narrow == 8 * (2 + 1) * 3 * 128 * 64  # layers x (top-k + shared) x 3 matrices
  more_heads = active_matmul_params(_model('tiny.py', **{'model.index_n_heads': 8}))
  assert more_heads - base == 3 * (64 * 4 * 32 + 128 * 4)  # the three index query sources


def test_vision_flops_per_image_of_tiny_multimodal():
  m = _model('tiny_multimodal.py')
  # ViT: 64 wide, 2 layers, 4 heads, SwiGLU 128, 4x4 patches, 3x3 merge, 16 merged tokens
  # = 144 patches; aligner 576 -> 128 -> 128. Biases, norms and delimiters are not matmuls.
  encoder = 48 * 64 + 2 * (64 * 3 * 64 + 64 * 64 + 3 * 64 * 128)                   # 84,992
  aligner = 9 * 64 * 128 + 128 * 128                                                 # 90,112
  patches, tokens = 9 * 16, 16
  attention = 4 * 2 * patches * patches * 64
  expected = 3 * (2 * (encoder * patches + aligner * tokens) + attention)
  assert expected == 113_934_336
  assert vision_flops_per_image(m) == flops_per_token(m, 128).vision_per_image == expected
  assert 'vision' in flops_per_token(m, 128).formula
  wider = dataclasses.replace(m, vision_mlp=256)
  assert vision_flops_per_image(wider) - expected == 3 * 2 * patches * 2 * 3 * 64 * 128
  assert vision_flops_per_image(dataclasses.replace(m, vision=False)) == 0.0


def test_info_reports_the_same_count():
  config = load_config_file(os.path.join(ROOT, 'configs', 'tiny_multimodal.py'))
  info = describe(config)
  cfg = resolve(config, num_devices=1, backend='cpu')
  fpt = flops_per_token(cfg.model, cfg.data.seq_len)
  assert info['train_flops_per_token'] == fpt.total
  assert info['train_flops_per_image'] == fpt.vision_per_image == 113_934_336
