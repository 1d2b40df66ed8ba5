"""~3B-parameter V4.1 ablation model for one H200 at 8 x 4,096 tokens: configs/ablation_1b.py's
block structure (12 layers, the same CSA2 roles, FP4/FP8 caches, Engram ids 1 and 4, single-pass
mHC) at twice its width, where the GEMMs are a larger share of the step: the config on which
FP8 training GEMMs (`model.fp8`) are measured against bf16.

    python -m deepseek41.train --config=configs/ablation_3b.py --workdir=/tmp/ds41-3b \
        --config.data.synthetic=True [--config.model.fp8=rowwise]

Width 2,048 with 16 query heads of 512 (as the 1B: the attention's per-head shapes are the
released ones), a 1,024 query rank, 64 routed experts of 512 (top 6) and one shared expert.
Eight sequences of 4,096 tokens a step with remat on every layer: the short-context ablation
shape (`--config.data.seq_len=65536 --config.train.batch_size=1` for the long one). 3.05B
parameters (0.67B active per token); `python -m deepseek41.tools.plan
--config=configs/ablation_3b.py --devices=1` plans 74 GiB on one H200 (11.4 parameters, 22.7
AdamW moments, 11.4 gradients, 28.6 activations).
"""

import os

from deepseek41.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ablation_1b.py'))
  m = c.model
  m.d_model = 2048
  m.q_lora_rank = 1024
  m.o_lora_rank = 1024
  m.moe_intermediate_size = 512
  m.init_std = 0.0045

  c.data.seq_len = 4096
  c.train.batch_size = 8
  # [I] Not swept at 3B: the 1B config's rate scaled as AdamW's was (6e-4 -> 4.5e-4 there).
  c.train.lr = 1.8e-3
  c.train.remat = 'block_keep_attention'
  c.train.remat_layers = 0
  c.checkpoint.max_to_keep = 2
  return c
