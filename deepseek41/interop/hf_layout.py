"""The name and layout map between our parameters and the HF `deepseek_v41` state dict
(docs/hf_interop.md, "Tensor map", has the same table).

One `Entry` per parameter of ours: the HF tensor(s) it is made of, how the layout changes, and
how the released format stores it. Layout kinds (ours <-> HF):

    copy         the same array
    linear       ours [in, out]           HF `weight` [out, in]                  (transpose)
    heads        ours [in, H, d]          HF [H*d, in]
    wo_a         ours [G, (H/G)*d, R]     HF [G*R, (H/G)*d]   (block-diagonal grouped projection)
    experts      ours [E, in, out]        HF E tensors `experts.{e}.wN.weight` [out, in]
    router_bias  ours [2, E] (text, image)  HF `gate.bias`, `gate.bias_vl` [E] each
    table        ours [rows padded, d]    HF [rows, d] (our padding rows are never addressed)

Storage (export `--dtype=fp8`, docs/architecture.md section 3.16): `fp8` dense e4m3 with block
scales, `fp4` routed experts, `engram` FP8 table rows, `half` stored in the checkpoint's float
dtype (bf16), `fp32` always fp32 (mHC parameters, sinks, router biases, as released).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deepseek41.config import SWA, ModelConfig, layer_roles
from deepseek41.interop.hf_config import HFConfigError
from deepseek41.model.engram import layer_addresses


@dataclasses.dataclass(frozen=True)
class Entry:
  ours: str                  # dotted path under the state's 'params' (or 'router_bias')
  hf: tuple[str, ...]        # HF tensor names, in the order `kind` combines them
  kind: str
  storage: str
  group: str = 'params'
  rows: int = 0              # kind 'table': the HF row count


def _one(ours, hf, kind, storage, **kw):
  return Entry(ours, (hf,), kind, storage, **kw)


def entries(m: ModelConfig) -> list[Entry]:
  """Every parameter and router bias of the text backbone, in state order."""
  if m.residual != 'mhc_single_pass' or not m.csa2:
    raise HFConfigError(f'model.residual={m.residual!r}, model.attention_variant='
                        f'{m.attention_variant!r}: the HF format holds single-pass mHC and CSA2 '
                        'models only')
  if m.vision:
    raise HFConfigError('model.vision: the HF deepseek_v41 format defines no vision tower '
                        'tensors yet; export the text model (model.vision=False)')
  not_index = [l for l in m.kv_source_layer_ids if l not in m.index_source_layer_ids]
  if not_index:
    raise HFConfigError(f'model.kv_source_layer_ids {not_index} are not index sources: in the '
                        'HF format the index keys live on the indexer of an index-source layer')
  if m.n_shared_experts != 1:
    raise HFConfigError(f'model.n_shared_experts={m.n_shared_experts}: the HF format has one')
  out = [_one('embed', 'model.embed.weight', 'copy', 'half')]
  rows = {l: a.rows for l, a in layer_addresses(m).items()} if m.engram else {}
  for role in layer_roles(m):
    p, h = f'blocks.{role.layer}', f'model.layers.{role.layer}'
    if role.layer in rows:
      out += [
          _one(f'{p}.engram.table', f'{h}.engram.embed.weight', 'table', 'engram',
               rows=rows[role.layer]),
          _one(f'{p}.engram.proj', f'{h}.engram.wkv.weight', 'linear', 'fp8'),
          _one(f'{p}.engram.q_weight', f'{h}.engram.q_weight', 'copy', 'half'),
          _one(f'{p}.engram.k_weight', f'{h}.engram.k_weight', 'copy', 'half'),
      ]
    a, ha = f'{p}.attn', f'{h}.attn'
    out += [
        _one(f'{a}.wq_a', f'{ha}.wq_a.weight', 'linear', 'fp8'),
        _one(f'{a}.q_norm.scale', f'{ha}.q_norm.weight', 'copy', 'half'),
        _one(f'{a}.wq_b', f'{ha}.wq_b.weight', 'heads', 'fp8'),
        _one(f'{a}.wkv', f'{ha}.wkv.weight', 'linear', 'fp8'),
        _one(f'{a}.kv_norm.scale', f'{ha}.kv_norm.weight', 'copy', 'half'),
        _one(f'{a}.sink', f'{ha}.attn_sink', 'copy', 'fp32'),
        _one(f'{a}.wo_a', f'{ha}.wo_a.weight', 'wo_a', 'fp8'),
        _one(f'{a}.wo_b', f'{ha}.wo_b.weight', 'linear', 'fp8'),
    ]
    if role.mode != SWA:
      c = f'{a}.csa2'
      if role.kv_source == role.layer:
        out += [_one(f'{c}.compressor.wkv', f'{ha}.compressor.wkv.weight', 'linear', 'fp8')]
        if role.ratio > 1:
          out += [_one(f'{c}.compressor.wgate', f'{ha}.compressor.wgate.weight', 'linear', 'half')]
        out += [
            _one(f'{c}.compressor.kv_norm.scale', f'{ha}.compressor.norm.weight', 'copy', 'half'),
            _one(f'{c}.index_keys.wk', f'{ha}.indexer.wk.weight', 'linear', 'half'),
            _one(f'{c}.index_keys.k_norm.scale', f'{ha}.indexer.k_norm.weight', 'copy', 'half'),
        ]
      if role.index_source == role.layer:
        out += [
            _one(f'{c}.index_query.wq_b', f'{ha}.indexer.wq_b.weight', 'heads', 'fp8'),
            _one(f'{c}.index_query.weights_proj', f'{ha}.indexer.weights_proj.weight', 'linear',
                 'half'),
        ]
    out += [_one(f'{p}.attn_norm.scale', f'{h}.attn_norm.weight', 'copy', 'half'),
            _one(f'{p}.ffn_norm.scale', f'{h}.ffn_norm.weight', 'copy', 'half')]
    for site in ('attn', 'ffn'):
      out += [_one(f'{p}.{site}_site.{k}', f'{h}.hc_{site}_{k}', 'copy', 'fp32')
              for k in ('fn', 'base', 'scale')]
    f, hf = f'{p}.moe', f'{h}.ffn'
    e = range(m.n_routed_experts)
    out += [
        _one(f'{f}.w_router', f'{hf}.gate.weight', 'linear', 'half'),
        Entry(f'{f}.router_bias', (f'{hf}.gate.bias', f'{hf}.gate.bias_vl'), 'router_bias',
              'fp32', group='router_bias'),
        Entry(f'{f}.w_gate', tuple(f'{hf}.experts.{i}.w1.weight' for i in e), 'experts', 'fp4'),
        Entry(f'{f}.w_up', tuple(f'{hf}.experts.{i}.w3.weight' for i in e), 'experts', 'fp4'),
        Entry(f'{f}.w_down', tuple(f'{hf}.experts.{i}.w2.weight' for i in e), 'experts', 'fp4'),
        _one(f'{f}.shared_gate', f'{hf}.shared_experts.w1.weight', 'linear', 'fp8'),
        _one(f'{f}.shared_up', f'{hf}.shared_experts.w3.weight', 'linear', 'fp8'),
        _one(f'{f}.shared_down', f'{hf}.shared_experts.w2.weight', 'linear', 'fp8'),
    ]
  out += [_one('final_norm.scale', 'model.norm.weight', 'copy', 'half'),
          _one('head', 'lm_head.weight', 'linear', 'half')]
  return out


def hf_shapes(entry: Entry, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
  """The HF tensor shapes of `entry`, given our parameter's shape."""
  k = entry.kind
  if k == 'copy':
    return [shape]
  if k == 'linear':
    return [(shape[1], shape[0])]
  if k == 'heads':
    return [(shape[1] * shape[2], shape[0])]
  if k == 'wo_a':
    return [(shape[0] * shape[2], shape[1])]
  if k == 'experts':
    return [(shape[2], shape[1])] * shape[0]
  if k == 'router_bias':
    return [(shape[1],)] * 2
  if k == 'table':
    return [(entry.rows, shape[1])]
  raise ValueError(k)


def to_hf(entry: Entry, value: np.ndarray) -> list[np.ndarray]:
  """Our array -> the HF arrays (views where the layout allows)."""
  k = entry.kind
  if k == 'copy':
    return [value]
  if k == 'linear':
    return [value.T]
  if k == 'heads':
    return [value.reshape(value.shape[0], -1).T]
  if k == 'wo_a':
    g, f, r = value.shape
    return [value.transpose(0, 2, 1).reshape(g * r, f)]
  if k == 'experts':
    return [value[i].T for i in range(value.shape[0])]
  if k == 'router_bias':
    return [value[0], value[1]]
  if k == 'table':
    return [value[:entry.rows]]
  raise ValueError(k)


def to_ours(entry: Entry, arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
  """The HF arrays (already dequantized, shapes checked) -> our array of `shape`."""
  k = entry.kind
  if k == 'copy':
    return arrays[0]
  if k == 'linear':
    return arrays[0].T
  if k == 'heads':
    return arrays[0].T.reshape(shape)
  if k == 'wo_a':
    g, f, r = shape
    return arrays[0].reshape(g, r, f).transpose(0, 2, 1)
  if k == 'experts':
    out = np.empty(shape, arrays[0].dtype)
    for i, a in enumerate(arrays):
      out[i] = a.T
    return out
  if k == 'router_bias':
    return np.stack(arrays)
  if k == 'table':
    out = np.zeros(shape, arrays[0].dtype)
    out[:entry.rows] = arrays[0]
    return out
  raise ValueError(k)


# Checkpoint prefixes the HF implementation does not build (its `_keys_to_ignore_on_load_
# unexpected`): the DSpark blocks and the vision tower. Their tensor layout is not defined by
# the HF code, so they are reported, not imported.
UNMAPPED_PREFIXES = {'mtp.': 'DSpark drafter', 'vision.': 'vision tower',
                     'aligner.': 'vision aligner', 'image_start': 'image delimiters',
                     'image_end': 'image delimiters', 'image_newline': 'image delimiters'}
