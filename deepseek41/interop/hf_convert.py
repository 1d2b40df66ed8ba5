"""Import a HF `deepseek_v41` checkpoint into a deepseek41 work directory, and export one back
(docs/hf_interop.md; the command line is deepseek41/tools/convert.py).

Import streams: each parameter is read from its memory-mapped byte range, dequantized, put into
our layout and straight onto its target sharding (`jax.device_put`), so the host holds about one
tensor at a time (the largest: a layer's stacked experts). The optimizer state is created on the
devices (zeros) and Orbax writes the sharded state. Everything goes to a temporary directory
beside the output, moved into place only when complete: a failed import leaves nothing.

Export restores a checkpoint onto the devices and writes one tensor at a time (fetched, laid out,
optionally quantized, appended to the current shard file).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from deepseek41 import config as config_lib
from deepseek41.interop import hf_config, hf_layout, storage
from deepseek41.interop.hf_config import HFConfigError
from deepseek41.interop.safetensors_io import CheckpointReader, SafetensorsError, ShardedWriter
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.state import named_leaves
from deepseek41.train.warm_start import check_fits

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'tokenizer.model')
FP32_STORAGE = 'fp32'
EXPORT_DTYPES = ('fp32', 'bf16', 'fp8')


class ConvertError(ValueError):
  """The conversion cannot proceed; the message names the tensor, field or path."""


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _replace_leaves(tree, values: dict[str, Any]):
  """`tree` with each leaf `values[its dotted name]` (state_lib.named_leaves' names)."""
  return jax.tree.unflatten(jax.tree.structure(tree), [values[k] for k in named_leaves(tree)])


def _progress(total: int, desc: str, enabled: bool):
  return tqdm(total=total, desc=desc, unit='tensor', disable=not enabled, leave=False)


def _staging_dir(final: str) -> str:
  final = os.path.abspath(final)
  if os.path.exists(final) and (not os.path.isdir(final) or os.listdir(final)):
    raise ConvertError(f'{final} exists and is not empty: give a new directory')
  parent = os.path.dirname(final)
  os.makedirs(parent, exist_ok=True)
  return os.path.join(parent, f'.{os.path.basename(final)}.partial-{uuid.uuid4().hex[:8]}')


def _publish(staging: str, final: str) -> None:
  final = os.path.abspath(final)
  if os.path.isdir(final):
    os.rmdir(final)  # empty (checked up front)
  os.replace(staging, final)


def _apply(section: ml_collections.ConfigDict, values: dict[str, Any], name: str) -> None:
  for key, value in values.items():
    if key not in section:
      raise ConvertError(f'{name}.{key}: no such config key')
    section[key] = tuple(value) if isinstance(value, list) else value


def parse_mesh(text: str) -> dict[str, int]:
  """'fsdp=4,expert=2' -> {'fsdp': 4, 'expert': 2}."""
  out = {}
  for part in filter(None, (p.strip() for p in text.split(','))):
    key, _, value = part.partition('=')
    if not value:
      raise ConvertError(f'--mesh: {part!r} is not AXIS=SIZE')
    out[key.strip()] = int(value)
  return out


def config_file_text(c: ml_collections.ConfigDict, header: str) -> str:
  """A get_config() file that reproduces `c` (only the keys that differ from the defaults)."""
  base = config_lib.base_config()
  lines = [f'"""{header}"""', '', 'from deepseek41.config import base_config', '', '',
           'def get_config():', '  c = base_config()']
  for section in base:
    for key in base[section]:
      value = c[section][key]
      if value != base[section][key]:
        lines.append(f'  c.{section}.{key} = {value!r}')
  lines += ['  return c', '']
  return '\n'.join(lines)


def _state_pieces(run):
  tx = make_optimizer(run.train)
  abstract = state_lib.abstract_state(run, tx)
  mesh = make_mesh(run.mesh)
  shardings = state_lib.state_shardings(abstract, mesh, run.mesh.rules)
  return tx, abstract, mesh, shardings


# ---------------------------------------------------------------------------------------------
# Import


def _scale_of(reader: CheckpointReader, name: str) -> str | None:
  for cand in (f'{name}_scale_inv', name[:-len('weight')] + 'scale' if name.endswith('weight')
               else None):
    if cand and cand in reader:
      return cand
  return None


def _tile(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...],
          block: int | None) -> int:
  """The scale tile of an FP8 weight: config.json's `weight_block_size`, else the one size that
  gives this scale shape and divides every side (without the config, a side that is not a
  multiple of the tile leaves it ambiguous)."""
  sizes = np.array([block]) if block else np.arange(1, max(shape) + 1)
  fits = sizes[np.all([-(-d // sizes) == n for d, n in zip(shape, scale_shape)], axis=0)]
  if not block:
    fits = fits[np.all([d % fits == 0 for d in shape], axis=0)]
  if len(fits) != 1:
    raise ConvertError(
        f'tensor {name!r}: its scales {list(scale_shape)} ' +
        (f'do not tile its shape {list(shape)} in blocks of {block}' if block else
         f'do not tell the tile of its shape {list(shape)}; give '
         'quantization_config.weight_block_size in config.json'))
  return int(fits[0])


def read_dequantized(reader: CheckpointReader, name: str, shape: tuple[int, ...],
                     used: set[str], block: int | None = None) -> np.ndarray:
  """One HF tensor as fp32 in its HF shape: FP8 / FP4 elements decoded with their scales
  (`block`: the dense FP8 scale tile, from config.json's quantization_config)."""
  ref = reader.ref(name)
  used.add(name)
  scale_name = _scale_of(reader, name)
  if scale_name:
    used.add(scale_name)
  if ref.dtype == storage.E4M3:
    if scale_name is None:
      raise ConvertError(f'tensor {name!r} is FP8 but the checkpoint has no {name}_scale_inv')
    q, s = ref.read(), reader.read(scale_name)
    if name.endswith('engram.embed.weight'):  # one scale per 32 along each row
      value = storage.decode_rows(q, s)
    else:  # one scale per block x block tile
      value = storage.decode_fp8_blocks(q, s, _tile(name, q.shape, s.shape, block))
  elif ref.dtype in (np.uint8, np.int8) and len(shape) == 2 and \
      ref.shape == (shape[0], shape[1] // 2):
    if scale_name is None:
      raise ConvertError(f'tensor {name!r} is packed FP4 but the checkpoint has no scale for it')
    value = storage.decode_fp4_experts(ref.read().view(np.uint8), reader.read(scale_name))
  else:
    if ref.shape != tuple(shape):
      raise ConvertError(f'tensor {name!r} has shape {list(ref.shape)}, the model expects '
                         f'{list(shape)}')
    value = ref.read().astype(np.float32, copy=False)
  if value.shape != tuple(shape):
    raise ConvertError(f'tensor {name!r} has shape {list(value.shape)}, the model expects '
                       f'{list(shape)}')
  return value


def imported_arrays(reader: CheckpointReader, model: config_lib.ModelConfig,
                    abstract_leaves: dict[str, Any], used: set[str] | None = None,
                    block: int | None = None) -> Iterator[tuple[hf_layout.Entry, np.ndarray]]:
  """(entry, our array) one parameter at a time, in our dtype: the streaming core of import."""
  used = set() if used is None else used
  for entry in hf_layout.entries(model):
    key = entry.ours if entry.group == 'params' else f'router_bias:{entry.ours}'
    target = abstract_leaves[key]
    missing = [n for n in entry.hf if n not in reader]
    if missing:
      more = f' and {len(missing) - 1} more' if len(missing) > 1 else ''
      raise ConvertError(f'the checkpoint lacks tensor {missing[0]!r} (for our '
                         f'{entry.ours}){more}')
    shapes = hf_layout.hf_shapes(entry, tuple(target.shape))
    arrays = [read_dequantized(reader, n, s, used, block) for n, s in zip(entry.hf, shapes)]
    value = hf_layout.to_ours(entry, arrays, tuple(target.shape))
    del arrays
    out = np.ascontiguousarray(value).astype(target.dtype, copy=False)
    del value  # only `out` stays alive while the consumer holds it
    yield entry, out
    del out


def _check_leftovers(reader: CheckpointReader, used: set[str], say: Callable[[str], None]):
  unmapped: dict[str, int] = {}
  for name in sorted(set(reader.tensors) - used):
    kind = next((v for k, v in hf_layout.UNMAPPED_PREFIXES.items() if name.startswith(k)), None)
    if kind is None and name.endswith('engram.embed.scale'):
      continue  # the unused scale of a float (not FP8) table
    if kind is None:
      raise ConvertError(f'the checkpoint has tensor {name!r}, which the configured model has no '
                         'place for (config.json and the tensors disagree)')
    unmapped[kind] = unmapped.get(kind, 0) + 1
  for kind, n in unmapped.items():
    say(f'not imported: {n} tensors of the {kind} (the HF deepseek_v41 implementation defines '
        'no layout for them, so there is no verified mapping)')
  return unmapped


def _weight_block(hf_cfg: dict) -> int | None:
  q = hf_cfg.get('quantization_config') or hf_config.text_config(hf_cfg)[0].get(
      'quantization_config') or {}
  size = q.get('weight_block_size')
  if size is None:
    return None
  if len(size) != 2 or size[0] != size[1]:
    raise ConvertError(f'config.json quantization_config.weight_block_size={size}: only square '
                       'tiles are supported')
  return int(size[0])


def build_run_config(hf_cfg: dict, base: ml_collections.ConfigDict | None = None,
                     mesh: dict[str, int] | None = None):
  """(ConfigDict, notes) of a run of the checkpoint's model: `base`'s other sections."""
  model_over, dspark_over, notes = hf_config.model_from_hf(hf_cfg)
  c = ml_collections.ConfigDict(base.to_dict()) if base is not None else config_lib.base_config()
  _apply(c.model, model_over, 'model')
  c.model.vision = False
  _apply(c.dspark, dspark_over, 'dspark')
  _apply(c.mesh, mesh or {}, 'mesh')
  if hf_cfg.get('vision_config') is not None:
    notes.append('vision_config present: the HF deepseek_v41 format defines no vision tower '
                 'tensors yet, so the import is the text model (model.vision=False)')
  return c, notes


def import_hf(hf_dir: str, workdir: str, *, base: ml_collections.ConfigDict | None = None,
              mesh: dict[str, int] | None = None, progress: bool = True,
              say: Callable[[str], None] = print) -> str:
  """Convert `hf_dir` into a new work directory; returns its step-0 checkpoint directory."""
  path = os.path.join(hf_dir, 'config.json')
  try:
    with open(path) as f:
      hf_cfg = json.load(f)
  except (OSError, ValueError) as e:
    raise ConvertError(f'{path}: cannot read it ({e})') from e
  c, notes = build_run_config(hf_cfg, base, mesh)
  try:
    run = config_lib.resolve(c)
  except config_lib.ConfigError as e:
    raise ConvertError(f'config.json maps to an invalid deepseek41 config: {e}') from e
  hf_config.check_engram_rows(run.model, hf_config.text_config(hf_cfg)[0])
  for note in notes:
    say(note)
  reader = CheckpointReader(hf_dir)
  staging = _staging_dir(workdir)
  os.makedirs(staging)
  try:
    tx, abstract, mesh_obj, shardings = _state_pieces(run)
    targets = {**named_leaves(abstract['params']), **{
        f'router_bias:{k}': v for k, v in named_leaves(abstract['router_bias']).items()}}
    shard_of = {**named_leaves(shardings['params']), **{
        f'router_bias:{k}': v for k, v in named_leaves(shardings['router_bias']).items()}}
    placed, used = {}, set()
    entries = hf_layout.entries(run.model)
    with _progress(len(entries), 'import', progress) as bar:
      for entry, value in imported_arrays(reader, run.model, targets, used,
                                          _weight_block(hf_cfg)):
        key = entry.ours if entry.group == 'params' else f'router_bias:{entry.ours}'
        placed[key] = jax.device_put(value, shard_of[key])
        del value
        bar.update(1)
    unmapped = _check_leftovers(reader, used, say)
    params = _replace_leaves(abstract['params'], placed)
    biases = _replace_leaves(abstract['router_bias'],
                             {k.split(':', 1)[1]: v for k, v in placed.items()
                              if k.startswith('router_bias:')})
    with jax.set_mesh(mesh_obj):
      opt = jax.jit(tx.init, out_shardings=shardings['opt'])(params)
    state = {'params': params, 'router_bias': biases, 'opt': opt,
             'step': jax.device_put(jnp.zeros((), jnp.int32), shardings['step']),
             'rng': jax.device_put(jax.random.key_data(jax.random.key(run.train.seed + 1)),
                                   shardings['rng'])}
    ckpt = Checkpointer(staging, run.checkpoint)
    try:
      ckpt.save(0, state, None, run.to_dict(), state_lib.state_layout(abstract), force=True)
      ckpt.wait()
    finally:
      ckpt.close()
    del state, params, opt, placed
    with open(os.path.join(staging, 'config.json'), 'w') as f:
      f.write(run.to_json())
    with open(os.path.join(staging, 'config.py'), 'w') as f:
      f.write(config_file_text(c, f'The run config of the checkpoint imported from {hf_dir}.'))
    copied = _copy_tokenizer(hf_dir, os.path.join(staging, 'tokenizer'))
    with open(os.path.join(staging, 'import_report.json'), 'w') as f:
      json.dump({'source': os.path.abspath(hf_dir), 'notes': notes, 'not_imported': unmapped,
                 'tokenizer_files': copied, 'tensors_read': len(used)}, f, indent=2)
    _publish(staging, workdir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  step_dir = os.path.join(os.path.abspath(workdir), 'checkpoints', '0')
  say(f'imported {len(entries)} parameters into {step_dir}'
      + (f'; tokenizer files {copied} in {workdir}/tokenizer' if copied else
         '; the checkpoint has no tokenizer files'))
  return step_dir


def _copy_tokenizer(src: str, dst: str) -> list[str]:
  names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
  if names:
    os.makedirs(dst, exist_ok=True)
    for n in names:
      shutil.copy2(os.path.join(src, n), os.path.join(dst, n))
  return names


# ---------------------------------------------------------------------------------------------
# Export


def saved_run_config(saved: dict) -> ml_collections.ConfigDict:
  """A ConfigDict of a checkpoint's saved (resolved) run config. The mesh and logging keep their
  defaults (they do not shape the state)."""
  return config_lib.config_from_saved(saved, ('model', 'train', 'checkpoint', 'dspark', 'data'))


def encoded(entry: hf_layout.Entry, name: str, value: np.ndarray, dtype: str, block: int
            ) -> list[tuple[str, np.ndarray]]:
  """The HF tensors of one of `entry`'s arrays in the requested storage."""
  if entry.storage == FP32_STORAGE or dtype == 'fp32':
    return [(name, np.ascontiguousarray(value, np.float32))]
  try:
    if dtype == 'fp8' and entry.storage == 'fp8':
      q, s = storage.encode_fp8_blocks(value, block)
      return [(name, q), (f'{name}_scale_inv', s)]
    if dtype == 'fp8' and entry.storage == 'fp4':
      packed, s = storage.encode_fp4_experts(value)
      return [(name, packed), (f'{name}_scale_inv', s)]
    if dtype == 'fp8' and entry.storage == 'engram':
      q, s = storage.encode_fp8_rows(value)
      return [(name, q), (name[:-len('weight')] + 'scale', s)]
  except ValueError as e:
    raise ConvertError(f'tensor {name!r} (our {entry.ours}) cannot be stored as '
                       f'{entry.storage}: {e}') from e
  return [(name, np.ascontiguousarray(value).astype(jnp.bfloat16))]


def exported_tensors(model: config_lib.ModelConfig, fetch: Callable[[hf_layout.Entry], np.ndarray],
                     dtype: str, block: int = 32
                     ) -> Iterator[tuple[hf_layout.Entry, list[tuple[str, np.ndarray]]]]:
  """(entry, its HF (name, array) pairs), one parameter fetched at a time."""
  for entry in hf_layout.entries(model):
    value = np.asarray(fetch(entry), np.float32)
    out = []
    for name, arr in zip(entry.hf, hf_layout.to_hf(entry, value)):
      out += encoded(entry, name, arr, dtype, block)
    if entry.kind == 'table' and dtype != 'fp8':  # HF's module always has a scale parameter
      name = entry.hf[0][:-len('weight')] + 'scale'
      out.append((name, np.ones((entry.rows, value.shape[1] // storage.FP4_BLOCK), np.float32)))
    del value
    yield entry, out


def quantization_config(block: int) -> dict:
  return {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
          'weight_block_size': [block, block], 'scale_fmt': 'ue8m0', 'expert_dtype': 'fp4'}


def export_hf(workdir: str, hf_out: str, *, step: int | None = None, dtype: str = 'bf16',
              block: int = 32, tokenizer: str | None = None, mesh: dict[str, int] | None = None,
              shard_bytes: int = 2 << 30, progress: bool = True,
              say: Callable[[str], None] = print) -> str:
  """Write checkpoint `step` (default: the newest) of `workdir` as a HF deepseek_v41 directory:
  its backbone, as its objective holds it (a DSpark stage's drafter has no HF tensors: left out)."""
  if dtype not in EXPORT_DTYPES:
    raise ConvertError(f'--dtype={dtype!r}: one of {EXPORT_DTYPES}')
  ckpt = Checkpointer(workdir, config_lib.CheckpointConfig(
      **config_lib.base_config().checkpoint.to_dict()), primary=False)
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None or not os.path.isdir(ckpt.step_dir(step)):
      raise ConvertError(f'{workdir}: no checkpoint {"" if step is None else step} to export')
    c = saved_run_config(ckpt.read_json_item(step, 'config'))
    _apply(c.mesh, mesh or {}, 'mesh')
    run = config_lib.resolve(c)
    objective = objective_for(run)
    hf_cfg = hf_config.hf_from_model(run.model, quantization=quantization_config(block)
                                     if dtype == 'fp8' else None)
    for line in hf_config.numeric_differences(run.model):
      say(f'warning: the HF implementation will not reproduce this model exactly: {line}')
    tx, abstract, mesh_obj, shardings = _state_pieces(run)
    check_fits(ckpt, step, state_lib.state_layout(abstract), run.to_dict())
    ckpt.verify(step)
    target = state_lib.with_shardings(abstract, shardings)
    backbone = objective.backbone_weights(
        ckpt.restore_parts(step, {k: target[k] for k in objective.model_entries}))
  finally:
    ckpt.close()
  if objective.has_drafter:
    say(f'step {step} of {workdir} holds a DSpark drafter: the HF format has no drafter '
        'tensors, so only its backbone is exported')
  leaves = {**named_leaves(backbone['params']), **{
      f'router_bias:{k}': v for k, v in named_leaves(backbone['router_bias']).items()}}

  def fetch(entry):
    return np.asarray(jax.device_get(leaves[entry.ours if entry.group == 'params'
                                            else f'router_bias:{entry.ours}']))
  staging = _staging_dir(hf_out)
  os.makedirs(staging)
  try:
    entries = hf_layout.entries(run.model)
    writer = ShardedWriter(staging, shard_bytes)
    with _progress(len(entries), 'export', progress) as bar:
      for _, tensors in exported_tensors(run.model, fetch, dtype, block):
        for name, arr in tensors:
          writer.add(name, arr)
        del tensors
        bar.update(1)
    writer.close()
    with open(os.path.join(staging, 'config.json'), 'w') as f:
      json.dump(hf_cfg, f, indent=2)
    if tokenizer is None:  # the trainer keeps WORKDIR/tokenizer.json; an import, tokenizer/
      tokenizer = next((d for d in (workdir, os.path.join(workdir, 'tokenizer'))
                        if os.path.isfile(os.path.join(d, 'tokenizer.json'))), None)
    copied = _copy_tokenizer(tokenizer, staging) if tokenizer else []
    _publish(staging, hf_out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  say(f'exported step {step} of {workdir} to {hf_out} ({dtype}'
      + (f', tokenizer files {copied}' if copied else ', no tokenizer given (--tokenizer)') + ')')
  return hf_out


__all__ = ['ConvertError', 'HFConfigError', 'SafetensorsError', 'import_hf', 'export_hf']
