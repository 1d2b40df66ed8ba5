"""Where the suite's time goes: each test's wall time with JAX's own compile-time events.

    .venv/bin/python -m pytest -p tests.timing_plugin --test-times=/tmp/times.jsonl -n 2 tests/system

Every worker appends one JSON line a test (`test`, `wall` with its fixtures' set-up, and the
seconds of each `jax.monitoring` duration event in it: `backend_compile_duration` is XLA,
`jaxpr_trace_duration` and `jaxpr_to_mlir_module_duration` tracing and lowering,
`compilation_cache/compile_time_saved_sec` the persistent cache's hits); the run ends with the
worker seconds by file. Events of the trainers the system tier starts as subprocesses are not
seen. Not loaded by default (docs/performance.md section 66 used it).
"""

import collections
import json
import os
import time

import pytest
from jax import monitoring

_PREFIXES = ('/jax/core/compile/', '/jax/')
_events: collections.Counter = collections.Counter()


def _record(event: str, duration: float, **_) -> None:
  _events[event] += duration


def pytest_addoption(parser):
  parser.addoption('--test-times', default='', help='append per-test timings to this file')


def pytest_configure(config):
  if config.getoption('--test-times'):
    monitoring.register_event_duration_secs_listener(_record)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  path = item.config.getoption('--test-times')
  _events.clear()
  t0 = time.perf_counter()
  yield
  if not path:
    return
  row = {'test': item.nodeid, 'wall': round(time.perf_counter() - t0, 2)}
  for event, seconds in _events.items():
    name = next((event[len(p):] for p in _PREFIXES if event.startswith(p)), event)
    row[name] = round(seconds, 2)
  with open(path, 'a') as f:  # one short line a write: the workers' lines do not interleave
    f.write(json.dumps(row) + '\n')


def pytest_terminal_summary(terminalreporter, config):
  path = config.getoption('--test-times')
  if not path or hasattr(config, 'workerinput') or not os.path.exists(path):
    return
  by_file = collections.defaultdict(lambda: [0.0, 0.0, 0])
  with open(path) as f:
    for row in map(json.loads, f):
      entry = by_file[row['test'].split('::')[0]]
      entry[0] += row['wall']
      entry[1] += row.get('backend_compile_duration', 0.0)
      entry[2] += 1
  terminalreporter.write_sep('=', f'worker seconds by file ({path})')
  for name, (wall, compile_s, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:30]:
    terminalreporter.write_line(f'{wall:8.1f} s  XLA {compile_s:7.1f} s  {n:4d} tests  {name}')
