"""resolve(): a ConfigDict (a config file plus its overrides) -> the frozen RunConfig.

Every key is checked against the schema, converted to its declared type, its `auto` choice
resolved for the backend at hand (auto.py), and every section validated (checks.py) before
anything compiles; each error is a ConfigError starting with the key. What needs the data's
tokenizer is checked by the data package (data/engram_vocab.py), which the trainer calls next.
"""

from __future__ import annotations

import importlib.util
import math
import os
import typing
from typing import Any

import jax
import ml_collections

from deepseek41.config import checks
from deepseek41.config.keys import ConfigError, keys_of, require
from deepseek41.config.schema import (RENAMED_MODEL_KEYS, CheckpointConfig, DataConfig,
                                      DSparkConfig, ImageGeometry, LogConfig, MeshConfig,
                                      ModelConfig, RunConfig, Sources, TasksConfig, TrainConfig,
                                      base_config, upgrade_saved_model)
from deepseek41.config.tasks import TASK_NAMES


def replaced_key_hint(full: str) -> str | None:
  """What to set instead of `full` ('model.csa2'), a key that was replaced; None otherwise."""
  section, _, name = full.partition('.')
  if section != 'model' or name not in RENAMED_MODEL_KEYS:
    return None
  new, convert = RENAMED_MODEL_KEYS[name]
  return (f'config key {full!r} was replaced by model.{new}: set model.{new}='
          f'{convert(True)!r} for {name}=True, {convert(False)!r} for {name}=False '
          '(docs/architecture.md 3.8.1)')


def _check_keys(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict, prefix=''):
  for name in cfg.keys():
    full = f'{prefix}{name}'
    if name not in schema and replaced_key_hint(full):
      raise ConfigError(replaced_key_hint(full))
    if name not in schema:
      close = [k for k in schema.keys() if k.lower() == name.lower() or k.startswith(name[:3])]
      hint = f' (did you mean {", ".join(prefix + k for k in close)}?)' if close else ''
      raise ConfigError(f'unknown config key {full!r}{hint}')
    if isinstance(schema[name], ml_collections.ConfigDict):
      if not isinstance(cfg[name], ml_collections.ConfigDict):
        raise ConfigError(f'config key {full!r} must be a section, got {cfg[name]!r}')
      _check_keys(cfg[name], schema[name], full + '.')
  for name in schema.keys():
    if name not in cfg:
      raise ConfigError(f'config is missing key {prefix}{name}; start config files from '
                        'deepseek41.config.base_config()')


def _tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (list, tuple)) else (v,)


_CONVERT = {int: int, float: float, bool: bool, str: str,
            tuple[int, ...]: lambda v: tuple(int(x) for x in _tuple(v)),
            tuple[float, ...]: lambda v: tuple(float(x) for x in _tuple(v)),
            tuple[tuple[float, ...], ...]: lambda v: tuple(tuple(float(x) for x in _tuple(row))
                                                           for row in _tuple(v))}


def read_section(cls, section: ml_collections.ConfigDict, name: str,
                  backend: str | None = None) -> dict[str, Any]:
  """The section's keys converted to their declared types, choices checked, `auto` resolved.

  Keys whose declared type is not a plain value (data sources, mesh rules) are returned as
  written; their section's resolver parses them.
  """
  types = typing.get_type_hints(cls)
  out = {}
  for f in keys_of(cls):
    value, convert = section[f.name], _CONVERT.get(types[f.name])
    if convert is not None:
      try:
        value = convert(value)
      except (TypeError, ValueError):
        t = types[f.name]
        type_name = t.__name__ if isinstance(t, type) else str(t)
        raise ConfigError(f'{name}.{f.name}: must be {type_name}, got {value!r}') from None
    out[f.name] = value
  for f in keys_of(cls):
    choices, auto = f.metadata['choices'], f.metadata['auto']
    allowed = (('auto',) if auto else ()) + choices
    require(not allowed or out[f.name] in allowed, f'{name}.{f.name}',
            f'must be one of {allowed}, got {out[f.name]!r}')
    if out[f.name] == 'auto' and auto:
      out[f.name] = auto(out, backend)
  return out


def _resolve_model(section: ml_collections.ConfigDict, backend: str) -> ModelConfig:
  m = ModelConfig(**read_section(ModelConfig, section, 'model', backend))
  for check in checks.MODEL_CHECKS:
    check(m)
  checks.check_index_impl(m, backend)
  return m



def _split_weight(entry: str, key: str) -> tuple[str, float]:
  """'path[:weight]' -> (path, weight); a colon inside a path (one that exists, or followed by
  a '/') is part of the path."""
  path, sep, tail = entry.rpartition(':')
  if not sep or '/' in tail or os.path.exists(entry):
    return entry, 1.0
  try:
    weight = float(tail)
  except ValueError:
    raise ConfigError(f'{key}: the weight of entry {entry!r} is {tail!r}, not a number '
                      '(entries are path[:weight], weights > 0)') from None
  require(bool(path), key, f'entry {entry!r} has a weight but no path')
  require(math.isfinite(weight) and weight > 0, key,
          f'the weight of entry {entry!r} must be a number > 0, got {tail}')
  return path, weight


def parse_sources(spec: str, key: str = 'data.sources') -> Sources:
  """'a:0.7,b:0.3' -> (('a', 0.7), ('b', 0.3)); an entry without a weight weighs 1."""
  return tuple(_split_weight(entry, key)
               for entry in (p.strip() for p in spec.split(',')) if entry)



def _check_source_paths(d: DataConfig):
  """Entries that exist but cannot be what their key reads (missing ones are prepared or
  reported by the data pipeline, which knows how to make them)."""
  for path, _ in d.sources:
    require(path == 'default' or path in TASK_NAMES or not os.path.isfile(path), 'data.sources',
            f'entry {path!r} is a file; a text source is a directory written by '
            '`python -m deepseek41.data.prepare` (or `default`, the embedded corpus, or a '
            f'task: {", ".join(TASK_NAMES)})')
  for path, _ in d.image_sources:
    require(path == 'shapes' or not os.path.isfile(path) or path.endswith('.jsonl'),
            'data.image_sources', f'entry {path!r} is a file but not .jsonl; an image source is '
            '`shapes`, a directory of image + caption pairs or a .jsonl file')



def _resolve_data(section: ml_collections.ConfigDict, m: ModelConfig,
                  tasks: TasksConfig) -> DataConfig:
  values = read_section(DataConfig, section, 'data')
  images = ImageGeometry(
      patch_size=m.vision_patch, merge=m.vision_merge, max_image_tokens=m.vision_max_image_tokens,
      min_pixels=m.vision_min_pixels, image_token_id=m.image_token_id,
      max_images_per_row=values['max_images_per_row']) if m.vision else None
  d = DataConfig(**{**values, 'sources': parse_sources(values['sources'], 'data.sources'),
                    'image_sources': parse_sources(values['image_sources'], 'data.image_sources'),
                    'images': images, 'tasks': tasks})
  checks.check_data(d, m)
  checks.check_images(d, m)
  _check_source_paths(d)
  return d



def _mesh_sizes(sizes: dict[str, int], num_devices: int | None) -> dict[str, int]:
  """Fill the one -1 axis from the device count (1 without one); check the product."""
  fill = [a for a, s in sizes.items() if s == -1]
  require(len(fill) <= 1, 'mesh', f'at most one axis may be -1, got {fill}')
  for a, s in sizes.items():
    require(s == -1 or s >= 1, f'mesh.{a}', f'must be >= 1 or -1, got {s}')
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if num_devices is None:
    return {a: 1 if s == -1 else s for a, s in sizes.items()}
  if fill:
    require(num_devices % fixed == 0, f'mesh.{fill[0]}',
            f'cannot fill: {num_devices} devices are not divisible by the other axes ({fixed})')
    return {**sizes, fill[0]: num_devices // fixed}
  require(fixed == num_devices, 'mesh',
          f'axes multiply to {fixed} but {num_devices} devices are present; set one axis to -1')
  return sizes


def mesh_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """(('batch', 'data,fsdp'), ...) -> (('batch', ('data', 'fsdp')), ...), axes checked."""
  out = []
  for i, rule in enumerate(rules):
    require(isinstance(rule, (tuple, list)) and len(rule) == 2, f'mesh.rules[{i}]',
            f'must be a (logical_axis, "mesh_axis[,mesh_axis]") pair, got {rule!r}')
    name, axes = rule
    listed = axes if isinstance(axes, (tuple, list)) else str(axes).split(',')  # or resolved
    axes_t = tuple(a.strip() for a in listed if a.strip())
    for a in axes_t:
      require(a in MeshConfig.AXES, f'mesh.rules[{i}]', f'unknown mesh axis {a!r} for {name!r}')
    out.append((str(name), axes_t))
  return tuple(out)


def _resolve_mesh(section: ml_collections.ConfigDict, num_devices: int | None) -> MeshConfig:
  values = read_section(MeshConfig, section, 'mesh')
  sizes = _mesh_sizes({a: values[a] for a in MeshConfig.AXES}, num_devices)

  return MeshConfig(**sizes, sequence_parallel=values['sequence_parallel'],
                    rules=mesh_rules(values['rules']))



def _resolve_dspark(section: ml_collections.ConfigDict, m: ModelConfig) -> DSparkConfig:
  values = read_section(DSparkConfig, section, 'dspark')
  if values['noise_token_id'] == -1:
    values['noise_token_id'] = m.vocab_size - 1
  return DSparkConfig(**values)


def resolve(cfg: ml_collections.ConfigDict, *, num_devices: int | None = None,
            backend: str | None = None) -> RunConfig:
  """Validate `cfg` against the schema and the devices; return the frozen RunConfig.

  `backend` ('cpu', 'gpu', 'tpu') resolves the `auto` choices; it and `num_devices` default to
  JAX's (asking JAX starts its backend; pass both to validate without a device).
  """
  _check_keys(cfg, base_config())
  backend = backend or jax.default_backend()
  if num_devices is None:
    num_devices = jax.device_count()
  model = _resolve_model(cfg.model, backend)
  mesh = _resolve_mesh(cfg.mesh, num_devices)
  tasks = TasksConfig(**read_section(TasksConfig, cfg.tasks, 'tasks'))
  data = _resolve_data(cfg.data, model, tasks)
  train = TrainConfig(**read_section(TrainConfig, cfg.train, 'train', backend))
  checks.check_train(train)
  checks.check_tasks(tasks, data, train, model, mesh)
  checks.check_remat_layers(train, model)
  checks.check_batch_split(train, mesh)
  checks.check_expert_split(model, mesh)
  checks.check_context_split(data, model, mesh)
  checkpoint = CheckpointConfig(**read_section(CheckpointConfig, cfg.checkpoint, 'checkpoint'))
  checks.check_checkpoint(checkpoint)
  log = LogConfig(**read_section(LogConfig, cfg.log, 'log'))
  checks.check_log(log)
  dspark = _resolve_dspark(cfg.dspark, model)
  checks.check_dspark(dspark, model, mesh, train)
  return RunConfig(model=model, data=data, train=train, mesh=mesh, checkpoint=checkpoint, log=log,
                   dspark=dspark, tasks=tasks)


def config_from_saved(saved: dict, sections: tuple[str, ...] | None = None
                      ) -> ml_collections.ConfigDict:
  """The ConfigDict of a resolved config saved as JSON (a checkpoint's `config` item): the
  declared keys only (derived fields are rebuilt by `resolve`), lists back to tuples, source
  lists back to their 'dir:weight,...' form. `sections`: only these are read, the others keep
  their defaults. Replaced model keys are read as their successors (`upgrade_saved_model`), so
  a checkpoint written before a rename resolves to the same model."""
  def tuples(v):
    return tuple(tuples(x) for x in v) if isinstance(v, list) else v
  if 'model' in saved:
    saved = {**saved, 'model': upgrade_saved_model(saved['model'])}
  c = base_config()
  for section in (sections or c.keys()):
    for name in c[section].keys():
      if name not in saved.get(section, {}):
        continue
      value = tuples(saved[section][name])
      if isinstance(c[section][name], str) and isinstance(value, tuple):  # data sources
        value = ','.join(f'{path}:{weight:g}' for path, weight in value)
      c[section][name] = value
  return c


def load_config_file(path: str,
                     overrides: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Load a `get_config()` file (for tests and tools; the CLI uses absl config_flags)."""
  if not os.path.isfile(path):
    raise ConfigError(f'config file {path!r} does not exist')
  spec = importlib.util.spec_from_file_location('_ds41_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  for name, value in (overrides or {}).items():
    node = cfg
    *parents, leaf = name.split('.')
    for p in parents:
      if p not in node:
        raise ConfigError(f'unknown config key {name!r}')
      node = node[p]
    if leaf not in node:
      raise ConfigError(f'unknown config key {name!r}')
    node[leaf] = value
  return cfg