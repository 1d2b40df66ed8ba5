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

Nor does the handler write: a signal can arrive while the main thread is inside a write to the
log's stream, and a second write into the same buffered stream from the handler raises
"reentrant call" (once seen in CI: the message lost, a logging traceback in its place). The
handler queues its lines (`queue.SimpleQueue.put` is safe there) and a logging thread writes
them; the third signal waits a moment for its line, then writes it to the raw file descriptor.

Signal handlers belong to the process, so there is one `StopSignals`, `STOP`, entered by the
command line before its imports and by `train()`: a signal at any moment of start-up counts.
`train()` installs the handler again: jax.distributed.initialize() hands SIGTERM to its own
preemption notifier, which logs it and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
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
    # (level, message, an event set once written or None): the handler's lines, for the
    # logging thread.
    self._lines: queue.SimpleQueue = queue.SimpleQueue()
    self._writer: threading.Thread | None = None
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
    if self._writer is None:
      self._writer = threading.Thread(target=self._write_lines, name='stop-signal-log',
                                      daemon=True)
      self._writer.start()
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
      self._written(None, '', timeout_s=2.0)  # every line the handler queued is out

  def _write_lines(self):
    while True:
      level, message, done = self._lines.get()
      try:
        if message:
          log.log(level, '%s', message)
      finally:
        if done is not None:
          done.set()

  def _say(self, level: int, message: str) -> None:
    """From the handler: queue the line (the logging thread writes it)."""
    self._lines.put((level, message, None))

  def _written(self, level, message: str, timeout_s: float) -> bool:
    """Queue a line and wait until the logging thread has written it (and all before it)."""
    done = threading.Event()
    self._lines.put((level, message, done))
    return done.wait(timeout_s)

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
        self._say(logging.WARNING, f'received {name}: saving a checkpoint at the next step '
                  'boundary (after a save in progress), then exiting; a third signal exits at '
                  'once without it')
      else:
        self._say(logging.WARNING, f'received {name} during start-up: stopping before the '
                  'first step')
    elif self.count == 2:
      self._say(logging.WARNING, f'received {name} again: still stopping (a checkpoint save can '
                'take a while); a third signal exits at once without waiting for it')
    else:
      self.exit_now(signum)

  def exit_now(self, signum: int) -> None:
    """The third signal: one line, then the process ends (status 128 + signum)."""
    status = 128 + signum
    try:
      kept = self.describe_checkpoints()
    except Exception as e:  # noqa: BLE001 - leaving must not depend on reading the disk
      kept = f'the checkpoints could not be listed ({type(e).__name__}: {e})'
    line = (f'received {signal.Signals(signum).name} three times: exiting now (status '
            f'{status}) without waiting for any save; {kept}; a save cut short is left as '
            '<step>.orbax-checkpoint-tmp*, which a new start skips')
    # The logging thread writes it unless this thread was stopped inside the log's own write
    # (holding its handler's lock): then straight to the descriptor, past the stream's buffer.
    if not self._writer or not self._written(logging.ERROR, line, timeout_s=2.0):
      try:
        os.write(sys.stderr.fileno(), f'\nERROR {line}\n'.encode())
      except Exception:  # noqa: BLE001 - leaving must not depend on the stream
        pass
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
