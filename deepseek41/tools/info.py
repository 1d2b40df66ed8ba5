"""`python -m deepseek41.tools.info --config=configs/ablation_1b.py`: what a config builds.

Prints the layer-role table, parameter counts (total, per component, active per token) and the
FLOP formula, all computed from the model itself through `jax.eval_shape` (no arrays allocated).
"""

from __future__ import annotations

import collections

import jax
from absl import app
from ml_collections import config_flags

from deepseek41.config import format_role_table, resolve
from deepseek41.train.flops import flops_per_token
from deepseek41.train.state import abstract_state, count_params
from deepseek41.train.optimizer import make_optimizer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a get_config() file.')


def parameter_breakdown(params) -> dict[str, int]:
  """Parameters grouped by the leaf's module name (attn, moe, embed, head, ...)."""
  groups: dict[str, int] = collections.Counter()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path]
    name = keys[2] if keys[0] == 'blocks' and len(keys) > 2 else keys[0]
    if name == 'moe' and keys[3] in ('w_gate', 'w_up', 'w_down'):
      name = 'moe.routed'
    elif name == 'moe':
      name = 'moe.shared+router'
    groups[name] += int(leaf.size)
  return dict(groups)


def describe(config) -> str:
  cfg = resolve(config, num_devices=None, backend='cpu')
  abstract = abstract_state(cfg, make_optimizer(cfg.train))
  total = count_params(abstract['params'])
  fpt = flops_per_token(cfg.model, cfg.data.seq_len)
  lines = ['layer roles:', format_role_table(cfg.model), '',
           f'parameters: {total:,}']
  for name, n in sorted(parameter_breakdown(abstract['params']).items()):
    lines.append(f'  {name:<20} {n:>16,}')
  lines += [f'active matmul parameters per token: {fpt.matmul_params:,}', fpt.formula]
  return '\n'.join(lines)


def main(argv):
  del argv
  print(describe(_CONFIG.value))


def run():
  """Console-script entry point (`ds41-info`)."""
  app.run(main)


if __name__ == '__main__':
  run()
