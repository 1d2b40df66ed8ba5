"""The DSpark stage on the 1B ablation backbone (one H200): the drafter of docs/architecture.md
section 3.14 trained on a frozen configs/ablation_1b.py checkpoint.

    python -m deepseek41.train --config=configs/ablation_1b.py --workdir=runs/1b
    python -m deepseek41.train --config=configs/ablation_1b_dspark.py --workdir=runs/1b-dspark

(the backbone: runs/1b/checkpoints/2000; another with --config.dspark.backbone_checkpoint=DIR).

The released drafter's proportions at the 1B scale [I]: 3 draft blocks fed by the last three
layers, a third of the backbone's experts (64 -> 32, top-3), Markov rank 64, 5 slots; 256 anchors
per 65,536-token row.
"""

import os

from deepseek41.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ablation_1b.py'))
  d = c.dspark
  d.stage = 'frozen'
  d.backbone_checkpoint = 'runs/1b/checkpoints/2000'  # the command above (relative to cwd)
  d.num_blocks = 3
  d.block_size = 5
  d.target_layer_ids = (9, 10, 11)
  d.markov_rank = 64
  d.n_routed_experts = 32
  d.num_experts_per_tok = 3
  d.anchors_per_sequence = 256

  # The drafter's recipe as measured (docs/performance.md section 15): AdamW at the 1B config's
  # former rate; the backbone it drafts for may have trained under either optimizer.
  c.train.optimizer = 'adamw'
  c.train.lr = 6e-4
  c.train.steps = 1000
  c.train.warmup_steps = 100
  c.train.eval_every_steps = 200
  c.checkpoint.every_steps = 250
  return c
