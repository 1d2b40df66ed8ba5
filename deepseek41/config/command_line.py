"""The config part of a command line: `--config=FILE` and its `--config.a.b=c` overrides,
checked against the schema before absl parses them (the trainer's CLI calls it first)."""

from __future__ import annotations

import os

from deepseek41.config.resolve import replaced_key_hint
from deepseek41.config.schema import base_config


def check_command_line(argv: list[str]) -> str | None:
  """The problem of a command line's --config file (missing) or `--config.a.b=c` overrides
  (a key the schema does not declare, or one it replaced), named before absl turns it into a
  long traceback; None if there is none."""
  config_file = _config_file(argv)
  if config_file is not None and not os.path.isfile(config_file.split(':', 1)[0]):
    return f'--config file {config_file!r} does not exist'
  schema = base_config()
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    key = arg[len('--config.'):].split('=', 1)[0]
    node = schema
    for i, part in enumerate(key.split('.')):
      if not hasattr(node, 'keys') or part not in node:
        if replaced_key_hint(key):
          return f'{replaced_key_hint(key)}; in {arg!r}'
        known = ', '.join(sorted(node.keys())) if hasattr(node, 'keys') else ''
        where = '.'.join(key.split('.')[:i]) or 'the config'
        return (f'unknown config key {key!r} in {arg!r}' +
                (f'; {where} has: {known}' if known else ''))
      node = node[part]
  return None


def _config_file(argv: list[str]) -> str | None:
  """The value of --config in argv (`--config=F` or `--config F`), or None."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith('--config='):
      return arg[len('--config='):]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None
