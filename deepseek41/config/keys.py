"""How a config key is declared: its default, its choices, its `auto` rule, whether it is
execution-only. The section dataclasses (schema.py) are built from these declarations."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


class ConfigError(ValueError):
  """A config value is unknown, out of range or inconsistent; the message names the key."""


def key(default: Any, *, choices: tuple[str, ...] = (),
        auto: Callable[[dict[str, Any], str], str] | None = None,
        execution_only: bool = False) -> Any:
  """Declare a config key: its default and, for a string key, the values it may take.

  `auto`, when given, also allows the value 'auto' and resolves it from the section's other
  values and the backend ('cpu', 'gpu', 'tpu'); the dataclass then holds the resolved choice.
  `execution_only`: the key changes how the model is computed, not what it computes or stores
  (a kernel, a chunk size, a precision of the arithmetic), so a checkpoint resumes across a
  change of it, e.g. a GPU run's checkpoint on the CPU (train/checkpoint.py).
  """
  return dataclasses.field(metadata={'default': default, 'choices': tuple(choices), 'auto': auto,
                                     'execution_only': execution_only})


def keys_of(cls) -> list[dataclasses.Field]:
  """The fields of a section that are config keys (the others are derived by resolve())."""
  return [f for f in dataclasses.fields(cls) if 'default' in f.metadata]


def require(cond: bool, name: str, msg: str) -> None:
  """Raise ConfigError('<name>: <msg>') unless `cond`."""
  if not cond:
    raise ConfigError(f'{name}: {msg}')
