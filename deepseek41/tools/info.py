"""`python -m deepseek41.tools.info --config=configs/v41_flash.py [--mesh=fsdp=64,expert=8] [--json]`

What a config builds, read from the model itself through `jax.eval_shape` (no arrays allocated)
and walked by deepseek41/model/inventory.py, the walk train/flops.py counts MFU with: the
layer-role table; parameters by component (the text backbone, the Engram tables and the vision
encoder + aligner apart); active parameters per token in decode and in CED prefill; training
FLOPs per token (of what the config trains: its objective's, train/objectives/) and per image;
global KV bytes per token from the cache formats and the SWA bytes per live request; with --mesh,
parameter + optimizer bytes per device under the config's sharding rules. The DSpark drafter
(model/dspark.py, docs/architecture.md section 3.14) is counted apart, whatever the config
trains: it is trained after pretraining and is not in the backbone total.

Active parameters count every weight a token multiplies, with routed experts at K/E of their
size; embedding rows and Engram table rows are lookups and are not counted (nor is the vision
path, which runs once per image rather than per token); the LM head counts in decode only. CED
prefill runs the encoder layers on every prompt token plus the first decoder layer's compressor
and index keys (the decoder's global KV); the decoder runs only on a short tail. With dense decoder
layers (model.attention_variant='dense') that tail is the whole prompt, so CED saves nothing.

The KV bytes follow the variant (docs/architecture.md 3.8.1): CSA2's KV sources keep their
compressed entries and index keys per token; a dense layer keeps its latent of every token (in
model.swa_quant) and no window ring; window-only layers keep their ring only.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Sequence


import jax
from absl import app, flags
from ml_collections import config_flags

from deepseek41.config import MeshConfig, format_role_table, layer_roles, resolve
from deepseek41.model import inventory
from deepseek41.model.ced import UNBOUNDED, tail_reach
from deepseek41.model.engram import layer_addresses
from deepseek41.sharding import fitted_spec
from deepseek41.train.flops import attention_flops_per_layer, decode_attention_flops
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.state import abstract_state, count_params

# Public: tools/plan.py takes the same --config, --json and --mesh (absl refuses a second
# definition of a flag name in one process).
CONFIG_FLAG = config_flags.DEFINE_config_file('config', None, 'Path to a get_config() file.')
JSON_FLAG = flags.DEFINE_bool('json', False, 'Print one JSON object instead of the report.')
MESH_FLAG = flags.DEFINE_string('mesh', '', 'Mesh sizes for per-device bytes, e.g. '
                                'fsdp=64,expert=8 (axes: ' + ', '.join(MeshConfig.AXES) + ').')

# Bytes per stored value of a cache format: payload + block scales (docs/architecture.md 3.9,
# 3.16).
CACHE_BYTES_PER_VALUE = {'fp4_e4m3_16': 0.5 + 1 / 16, 'fp4_ue8m0_32': 0.5 + 1 / 32,
                         'fp8_ue8m0_32': 1 + 1 / 32, 'none': 2.0}


def parameter_breakdown(leaves: Sequence[inventory.Leaf], biases) -> dict[str, int]:
  groups: dict[str, int] = collections.Counter()
  for leaf in leaves:
    groups[leaf.component] += leaf.size
  groups['router'] += count_params(biases)  # correction biases: tensors of the release
  return dict(groups)


def ced_saves(m) -> bool:
  """Whether CED prefill skips decoder work: an encoder/decoder split whose decoder reaches back
  a bounded distance (no dense decoder layer)."""
  return 0 < m.num_encoder_layers < m.num_layers and tail_reach(m) != UNBOUNDED


def active_parameters(cfg, leaves: Sequence[inventory.Leaf], biases) -> dict[str, float]:
  """Per token: decode (every layer + head) and CED prefill (encoder + the decoder's KV source)."""
  m = cfg.model
  frac = m.num_experts_per_tok / m.n_routed_experts
  roles = layer_roles(m)
  first_decoder = m.num_encoder_layers if ced_saves(m) else None
  decode = prefill = 0.0
  for leaf in leaves:
    comp = leaf.component
    if comp in inventory.LOOKUPS or comp.startswith('vision'):
      continue  # lookups; the vision path runs per image, not per token
    n = leaf.size * (frac if comp == 'experts.routed' else 1.0)
    decode += n
    layer = leaf.layer
    if layer is None:
      continue
    if first_decoder is None or layer < first_decoder:
      prefill += n
    elif layer == first_decoder and comp in ('compressors', 'indexers') and \
        leaf.keys[4] in ('compressor', 'index_keys') and roles[layer].kv_source == layer:
      prefill += n
  router_bias = count_params(biases) / max(m.num_layers, 1)
  decode += router_bias * m.num_layers
  prefill += router_bias * (first_decoder or m.num_layers)
  if first_decoder is None:
    prefill = decode - m.d_model * m.vocab_size  # no CED split: every layer, no head
  return {'decode': decode, 'prefill': prefill}


DECODE_CONTEXTS = (4096, 65536, 1 << 20)


def decode_flops(cfg, active) -> dict[int, float]:
  """Forward FLOPs of one decoded token after 4K, 64K and 1M tokens of context: the decode
  weights (every layer and the head) plus each layer's attention and index scoring there
  (train/flops.py `decode_attention_flops`)."""
  return {context: 2 * active['decode'] + sum(decode_attention_flops(cfg.model, context))
          for context in DECODE_CONTEXTS}


def prefill_flops(cfg, active) -> dict[str, float]:
  """Forward FLOPs per prompt token at data.seq_len: every layer on every token (full) vs the
  encoder on every token plus the decoder's KV source (CED; the decoder's short tail is
  amortised over the prompt and left out). Neither computes the LM head."""
  m = cfg.model
  attn = attention_flops_per_layer(m, cfg.data.seq_len)
  head = m.d_model * m.vocab_size
  encoder = m.num_encoder_layers if ced_saves(m) else m.num_layers
  return {'full': 2 * (active['decode'] - head) + sum(attn),
          'ced': 2 * active['prefill'] + sum(attn[:encoder]), 'seq_len': cfg.data.seq_len}


def kv_cache_bytes(cfg) -> dict[str, float]:
  m = cfg.model
  global_bytes = 0.0
  latent = m.head_dim * CACHE_BYTES_PER_VALUE[m.swa_quant]
  dense_layers = sum(role.mode != 'SWA' for role in layer_roles(m)) if m.dense else 0
  if m.csa2:
    for role in layer_roles(m):
      if role.mode != 'SWA' and role.kv_source == role.layer:
        entry = (m.head_dim * CACHE_BYTES_PER_VALUE[m.kv_quant] +
                 m.index_head_dim * CACHE_BYTES_PER_VALUE[m.index_quant])
        global_bytes += entry / role.ratio
  global_bytes += dense_layers * latent  # a dense layer keeps every token's latent
  swa = (m.num_layers - dense_layers) * m.sliding_window * latent
  return {'global_bytes_per_token': global_bytes, 'swa_bytes_per_request': swa}


class _Shape:
  def __init__(self, sizes):
    self.shape = sizes


def bytes_per_device(abstract, rules, mesh_sizes: dict[str, int]) -> dict[str, float]:
  """Parameter (trained, and frozen where the objective holds some fixed), optimizer and router
  bias bytes on one device under the sharding rules."""
  mesh = _Shape({a: mesh_sizes.get(a, 1) for a in MeshConfig.AXES})
  out = collections.Counter()

  def visit(section, tree):
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, 'get_metadata'))[0]
    for _, leaf in leaves:
      meta = leaf.get_metadata() if hasattr(leaf, 'get_metadata') else {}
      value = leaf.get_value() if hasattr(leaf, 'get_value') else leaf
      axes = meta.get('logical_axes')
      shards = 1
      if axes is not None:  # the same spec the trainer uses, axes that do not divide dropped
        for entry in fitted_spec(tuple(axes), value.shape, rules, mesh):
          for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None:
              shards *= mesh.shape[a]
      out[section] += value.size * value.dtype.itemsize / shards
  visit('params', abstract['params'])
  if 'frozen' in abstract:  # parameters the objective holds fixed (the frozen DSpark backbone)
    visit('frozen', abstract['frozen'])
  visit('optimizer', abstract['opt'])
  visit('router_bias', abstract['router_bias'])
  return dict(out)


def parse_mesh(text: str) -> dict[str, int]:
  sizes = {}
  for item in filter(None, text.split(',')):
    name, _, value = item.partition('=')
    if name not in MeshConfig.AXES or not value.isdigit():
      raise app.UsageError(f'--mesh: {item!r} is not AXIS=SIZE with AXIS in {MeshConfig.AXES}')
    sizes[name] = int(value)
  return sizes


def _resolved(config, mesh_sizes: dict[str, int] | None):
  """The config on the given mesh (default: one device): only the state's layout depends on it."""
  config = config.copy_and_resolve_references()
  devices = math.prod((mesh_sizes or {}).values())
  for axis in MeshConfig.AXES:
    config.mesh[axis] = (mesh_sizes or {}).get(axis, 1)
  config.train.batch_size = math.lcm(config.train.batch_size, devices)  # the batch is irrelevant
  return resolve(config, num_devices=devices, backend='cpu')


def describe(config, mesh_sizes: dict[str, int] | None = None) -> dict:
  cfg = _resolved(config, mesh_sizes)
  _, biases = inventory.abstract_params(cfg.model)
  leaves = inventory.model_leaves(cfg.model)
  flops = objective_for(cfg).flops_per_token()
  groups = parameter_breakdown(leaves, biases)
  tables = sum(a.rows for a in layer_addresses(cfg.model).values()) * cfg.model.engram_head_dim \
      if cfg.model.engram else 0
  padding = groups.get('engram.tables', 0) - tables  # rows added for sharding, never addressed
  vision = sum(n for name, n in groups.items() if name.startswith('vision'))
  total = sum(groups.values())  # every parameter and router bias, once
  info = {
      'params': {'backbone': total - tables - padding - vision, 'engram_tables': tables,
                 'engram_table_padding': padding, 'vision': vision, 'total': total - padding,
                 'by_component': dict(sorted(groups.items())),
                 'dspark': inventory.dspark_parameters(cfg)},  # apart: not in 'total'
      'active_params': active_parameters(cfg, leaves, biases),
      'attention_variant': cfg.model.attention_variant,
      'kv_cache': kv_cache_bytes(cfg),
      'train_flops_per_token': flops.total,
      'train_flops_per_image': flops.vision_per_image,
  }
  info['prefill_flops_per_token'] = prefill_flops(cfg, info['active_params'])
  info['decode_flops_per_token'] = decode_flops(cfg, info['active_params'])
  if mesh_sizes:
    abstract = abstract_state(cfg, make_optimizer(cfg.train))
    per_device = bytes_per_device(abstract, cfg.mesh.rules, mesh_sizes)
    info['bytes_per_device'] = {'mesh': mesh_sizes, **per_device,
                                'total': sum(per_device.values())}
  return info


def report(config, info: dict) -> str:
  cfg = _resolved(config, None)
  p, a, kv = info['params'], info['active_params'], info['kv_cache']
  lines = ['layer roles:', format_role_table(cfg.model), '',
           f"parameters: {p['total']:,} = backbone {p['backbone']:,} + Engram tables "
           f"{p['engram_tables']:,}" + (f" + vision {p['vision']:,}" if p['vision'] else '')]
  for name, n in p['by_component'].items():
    lines.append(f'  {name:<20} {n:>18,}')
  d = p['dspark']
  lines.append(f"DSpark drafter (trained after pretraining): {d['total']:,} = {d['num_blocks']} x "
               f"{d['per_block']:,} (blocks) + main_proj {d['main_proj']:,} + Markov "
               f"{d['markov']:,} + confidence {d['confidence']:,} + norms "
               f"{d['main_norm'] + d['final_norm']:,} + router biases {d['router_bias']:,}; "
               f"not in the total above")
  for name, n in d['blocks_by_component'].items():
    lines.append(f'  dspark.{name:<13} {n:>18,}')
  lines.append(f"  DSpark active per drafted token {d['active_per_draft_token']:,.0f} (routed "
               f"experts {cfg.dspark.num_experts_per_tok} of {cfg.dspark.n_routed_experts}; the "
               f"backbone's LM head not counted), per context token {d['per_context_token']:,}")
  decode = info['decode_flops_per_token']
  lines += [f"active parameters per token: decode {a['decode'] / 1e9:.2f}B, "
            f"CED prefill {a['prefill'] / 1e9:.2f}B",
            f"prefill FLOPs per prompt token at {info['prefill_flops_per_token']['seq_len']:,} "
            f"tokens: full forward {info['prefill_flops_per_token']['full']:.3g}, CED "
            f"{info['prefill_flops_per_token']['ced']:.3g}",
            'decode FLOPs per token by context: ' + ', '.join(
                f'{c:,}: {f:.4g}' for c, f in decode.items())
            + f' (1M / 4K: {decode[1 << 20] / decode[4096]:.2f}x)',
            f"global KV cache: {kv['global_bytes_per_token']:g} bytes per token; SWA "
            f"{kv['swa_bytes_per_request'] / 1e6:.2f} MB per live request",
            objective_for(cfg).flops_per_token().formula]
  if 'bytes_per_device' in info:
    b = info['bytes_per_device']
    lines.append(f"per device on {b['mesh']}: params {b['params'] / 2**30:.2f} GiB + optimizer "
                 f"{b['optimizer'] / 2**30:.2f} GiB = {b['total'] / 2**30:.2f} GiB")
  return '\n'.join(lines)


def main(argv):
  del argv
  mesh_sizes = parse_mesh(MESH_FLAG.value)
  info = describe(CONFIG_FLAG.value, mesh_sizes)
  print(json.dumps(info, default=float) if JSON_FLAG.value else report(CONFIG_FLAG.value, info))


def run():
  """Console-script entry point (`ds41-info`)."""
  app.run(main)


if __name__ == '__main__':
  run()
