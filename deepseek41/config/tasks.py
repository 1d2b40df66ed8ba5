"""Names of the long-context tasks and the "task@length" specs that ask for them.

The tasks themselves are the data package's (data/tasks/); their names are reserved source
names in data.sources (like `default`), and train.eval_tasks and the eval command name a task
at a context length: 'passkey@4k' (4,096 tokens), 'mqar@256'.
"""

from __future__ import annotations

import dataclasses
import re

from deepseek41.config.keys import ConfigError

TASK_NAMES = ('mqar', 'passkey', 'needle')
DEPTH_TASKS = ('passkey', 'needle')  # the tasks that hide their answer at a depth

_SPEC = re.compile(r'^([a-z_]+)@(\d+)([kK]?)$')


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One long-context evaluation: a task at a context length in tokens."""
  name: str
  length: int

  @property
  def label(self) -> str:
    """'passkey@4k' (a multiple of 1024), 'mqar@256': the metric and table name."""
    size = f'{self.length // 1024}k' if self.length % 1024 == 0 else str(self.length)
    return f'{self.name}@{size}'

  @property
  def has_depth(self) -> bool:
    return self.name in DEPTH_TASKS


def parse_task_specs(spec: str, key: str) -> tuple[TaskSpec, ...]:
  """'passkey@4k,mqar@256' -> (TaskSpec('passkey', 4096), TaskSpec('mqar', 256)); `key` (a
  config key or a flag) names the culprit of any error."""
  out = []
  for entry in (p.strip() for p in spec.split(',')):
    if not entry:
      continue
    m = _SPEC.match(entry)
    if not m:
      raise ConfigError(f'{key}: {entry!r} is not task@length (e.g. passkey@4k, mqar@256)')
    name, digits, k = m.groups()
    if name not in TASK_NAMES:
      raise ConfigError(f'{key}: unknown task {name!r} in {entry!r} (known: '
                        f'{", ".join(TASK_NAMES)})')
    length = int(digits) * (1024 if k else 1)
    if length < 2:
      raise ConfigError(f'{key}: {entry!r}: the length must be at least 2 tokens')
    spec_ = TaskSpec(name, length)
    if spec_ in out:
      raise ConfigError(f'{key}: {entry!r} is listed twice')
    out.append(spec_)
  return tuple(out)
