"""The unit tier runs in-process: a test that starts a Python program (the package's command
lines, a worker process) belongs in tests/system. Other programs (git) may run."""

import os
import subprocess
import sys

import pytest


def _is_python(args) -> bool:
  program = str(args[0] if isinstance(args, (list, tuple)) else args).split()[0]
  return (os.path.basename(program).startswith('python')
          or os.path.realpath(program) == os.path.realpath(sys.executable))


@pytest.fixture(autouse=True)
def _in_process_only(monkeypatch):
  real_init = subprocess.Popen.__init__

  def init(self, args, *rest, **kwargs):
    if _is_python(args):
      raise AssertionError(f'the unit tier runs in-process, and this test started {args!r}: '
                           'call the entry point, or move the test to tests/system')
    real_init(self, args, *rest, **kwargs)
  monkeypatch.setattr(subprocess.Popen, '__init__', init)
