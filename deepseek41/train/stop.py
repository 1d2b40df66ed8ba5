"""Stop signals of a training run (SIGTERM, SIGINT).

The first asks for a checkpoint at the next step boundary and a clean exit (before the first
step: an exit with nothing to save); the second is acknowledged while that save goes on; the
third exits at once, status 128 + signal number, without waiting for anything.

The handler only records the signal and never raises. A handler that raises (Python's default
KeyboardInterrupt) loses the signal when the interpreter happens to be running a garbage-collection
callback, a finalizer or a weakref callback, which report the exception and drop it: JAX runs
one on every collection, so a Ctrl-C during start-up was lost about one time in four and the run
trained to the end. Raised inside a blocking JAX call (fetching a loss waits on the running
step) it unwound out of the program while XLA and Orbax threads were still working, and the C++
runtime aborted at exit ('terminate called without an active exception'). The third signal
therefore ends the process with os._exit: no unwinding through library code, no interpreter
shutdown under running threads. Files on disk are as a kill leaves them: complete checkpoints
untouched, a save it cut short left under its `<step>.orbax-checkpoint-tmp*` name, which a new
start skips.

Signal handlers belong to the process, so there is one `StopSignals`, `STOP`, entered by the
command line before its imports and by `train()`: a signal at any moment of start-up counts.
`train()` installs the handler again: jax.distributed.initialize() hands SIGTERM to its own
preemption notifier, which logs it and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

log = logging.getLogger('deepseek41')

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
  """Records stop signals while entered (re-entrant: the outermost entry saves the previous
  handlers and its exit restores them; every entry, in the main thread only, installs the
  handler again, since jax.distributed.initialize() between two entries gives SIGTERM to its
  preemption notifier, which would swallow it)."""

  def __init__(self):
    self._old = {}
    self._depth = 0
    self._reset()

  def _reset(self):
    self.signal: int | None = None  # the first stop signal received
    self.count = 0
    self.training = False  # the loop has begun: a first signal saves at the next step boundary
    # One sentence on the checkpoints a third signal leaves (the trainer sets it).
    self.describe_checkpoints: Callable[[], str] = lambda: 'this run has saved nothing yet'

  def __enter__(self):
    if self._depth == 0:
      self._reset()
    old = self.reinstall()
    if self._depth == 0:
      self._old = old
    self._depth += 1
    return self

  def reinstall(self) -> dict:
    """Install the handler (main thread only); returns the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
      return {}
    return {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

  def __exit__(self, *exc):
    self._depth -= 1
    if self._depth == 0:
      for sig, old in self._old.items():
        signal.signal(sig, old)
      self._old = {}

  @contextlib.contextmanager
  def loop(self):
    """While the training loop runs: a first signal asks for a save at the next step boundary."""
    self.training = True
    try:
      yield self
    finally:
      self.training = False

  def _handle(self, signum, frame):
    del frame
    self.count += 1
    name = signal.Signals(signum).name
    if self.count == 1:
      self.signal = signum
      if self.training:
        log.warning('received %s: saving a checkpoint at the next step boundary (after a save '
                    'in progress), then exiting; a third signal exits at once without it', name)
      else:
        log.warning('received %s during start-up: stopping before the first step', name)
    elif self.count == 2:
      log.warning('received %s again: still stopping (a checkpoint save can take a while); a '
                  'third signal exits at once without waiting for it', name)
    else:
      self.exit_now(signum)

  def exit_now(self, signum: int) -> None:
    """The third signal: one line, then the process ends (status 128 + signum)."""
    status = 128 + signum
    try:
      kept = self.describe_checkpoints()
    except Exception as e:  # noqa: BLE001 - leaving must not depend on reading the disk
      kept = f'the checkpoints could not be listed ({type(e).__name__}: {e})'
    log.error('received %s three times: exiting now (status %d) without waiting for any save; '
              '%s; a save cut short is left as <step>.orbax-checkpoint-tmp*, which a new start '
              'skips', signal.Signals(signum).name, status, kept)
    for handler in logging.getLogger().handlers + log.handlers:
      try:
        handler.flush()
      except Exception:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001
        pass
    os._exit(status)


STOP = StopSignals()
