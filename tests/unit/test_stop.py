"""train/stop.py in-process: a stop signal that arrives while the log is being written. Signals
sent to a training run (first, second and third, during start-up and steps): tests/system/
test_faults.py and test_train.py."""

import logging
import signal
import threading

from deepseek41.train.stop import StopSignals


class _Recording(logging.Handler):
  """Keeps (thread, message); the message 'raise' raises SIGINT in the middle of its own write."""

  def __init__(self):
    super().__init__()
    self.lines = []

  def emit(self, record):
    if record.getMessage() == 'raise':
      signal.raise_signal(signal.SIGINT)  # the handler runs here, inside this write
    self.lines.append((threading.current_thread().name, record.getMessage()))


def test_a_signal_inside_a_log_write_is_recorded_and_said_after_it():
  """The handler never writes (once seen in CI: a second write into the stream it interrupted
  raised 'reentrant call', and its line was lost): the signal is recorded at once and its line
  written by the logging thread after the write it interrupted."""
  log = logging.getLogger('deepseek41')
  handler, level = _Recording(), log.level
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  stop = StopSignals()
  try:
    with stop, stop.loop():
      log.info('raise')
      assert stop.signal == signal.SIGINT and stop.count == 1
      log.info('raise')
      assert stop.count == 2
  finally:
    log.removeHandler(handler)
    log.setLevel(level)
  assert signal.getsignal(signal.SIGINT) is not stop._handle  # the previous handler is back
  main = threading.main_thread().name
  said = [line for line in handler.lines if line[0] != main]
  assert [line for line in handler.lines if line[0] == main] == [(main, 'raise')] * 2
  assert len(said) == 2 and {thread for thread, _ in said} == {'stop-signal-log'}
  assert said[0][1].startswith('received SIGINT: saving a checkpoint at the next step boundary')
  assert said[1][1].startswith('received SIGINT again: still stopping')
  # Each line after the write it interrupted (the context's exit waits for the thread).
  assert handler.lines.index(said[0]) > 0
