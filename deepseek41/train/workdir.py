"""The work directory: checked at start-up, and locked so that only one trainer writes to it.

The lock is `fcntl.flock` on WORKDIR/.lock, which holds the owner's pid, host and start time;
process i > 0 of a multi-process run locks WORKDIR/.lock.<i> (every process of a second run on
the directory is then refused, not just its process 0).
The kernel releases a flock when its process exits, however it exits (kill -9 included), so the
lock of a dead process never blocks a new start; the stale text in the file is just overwritten.
flock is advisory and per open file: it does not protect a work directory on a network file
system that does not support it (most NFS setups emulate it with POSIX locks, which works).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket


class WorkdirError(RuntimeError):
  """The work directory cannot be used; the message names it and why."""


LOCK_NAME = '.lock'


def prepare_workdir(workdir: str) -> str:
  """Create `workdir` if needed; raise WorkdirError if it is a file or cannot be written."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f'--workdir {path} is a file, not a directory')
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f'--workdir {path} cannot be created: {e.strerror or e}') from e
  return path


class WorkdirLock:
  """Exclusive lock of a work directory for the lifetime of one run (a context manager)."""

  def __init__(self, workdir: str, process_index: int = 0):
    self.path = os.path.join(workdir, LOCK_NAME if process_index == 0 else
                             f'{LOCK_NAME}.{process_index}')
    self._fd: int | None = None

  def acquire(self) -> None:
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # read-only file system, no permission, ...
      raise WorkdirError(f'work directory {os.path.dirname(self.path)} is not writable: cannot '
                         f'create {self.path} ({e.strerror or e})') from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read_holder(fd)
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise WorkdirError(f'cannot lock {self.path}: {e.strerror or e}') from e
      raise WorkdirError(
          f'work directory {os.path.dirname(self.path)} is in use by another trainer '
          f'(pid {holder.get("pid", "?")} on host {holder.get("host", "?")}, started '
          f'{holder.get("started", "?")}); stop it or choose another --workdir') from None
    try:  # the holder's identity, for the message a second start prints
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps({
          'pid': os.getpid(), 'host': socket.gethostname(),
          'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      }).encode() + b'\n', 0)
    except OSError as e:
      os.close(fd)
      raise WorkdirError(f'work directory {os.path.dirname(self.path)} is not writable: cannot '
                         f'write {self.path} ({e.strerror or e})') from e
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the descriptor drops the flock
      self._fd = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()


def _read_holder(fd: int) -> dict:
  try:
    return json.loads(os.pread(fd, 4096, 0).decode() or '{}')
  except (OSError, ValueError):
    return {}
