"""The DSpark stage on the tiny backbone (CPU, minutes): the drafter of docs/architecture.md
section 3.14 trained on a frozen, pretrained configs/tiny.py model.

    python -m deepseek41.train --config=configs/tiny.py --workdir=runs/tiny
    python -m deepseek41.train --config=configs/tiny_dspark.py --workdir=runs/tiny-dspark

(the backbone: runs/tiny/checkpoints/300; another with --config.dspark.backbone_checkpoint=DIR).

The backbone's model section is tiny.py's (the checkpoint's is checked against it); the drafter
is shrunk to the toy's scale: 2 draft blocks of 8 experts top-2, Markov rank 32, 5 slots.
"""

import os

from deepseek41.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tiny.py'))
  d = c.dspark
  d.stage = 'frozen'
  d.backbone_checkpoint = 'runs/tiny/checkpoints/300'  # the README's tiny run (relative to cwd)
  d.num_blocks = 2
  d.block_size = 5
  d.target_layer_ids = (5, 6, 7)
  d.markov_rank = 32
  d.n_routed_experts = 8
  d.num_experts_per_tok = 2
  d.anchors_per_sequence = 16

  c.train.steps = 200
  # The drafter's recipe as measured (docs/performance.md section 15): AdamW at 3e-3.
  c.train.optimizer = 'adamw'
  c.train.lr = 3e-3
  c.train.warmup_steps = 20
  c.train.eval_every_steps = 50
  c.train.eval_batches = 4
  c.checkpoint.every_steps = 100
  return c
