"""Compiled update steps kept on disk, keyed by everything that decides them, so that a restart
loads its executable without tracing or lowering the model.

JAX's persistent compilation cache keys a program by its lowered module, so a restart still
traces and lowers the whole step to find it: 9 s of a 24 s restart of configs/ablation_1b.py on
an H100 (docs/performance.md section 59). This store keys the executable by what produces that
module instead: the package's source, the resolved run config, the argument signature (shapes,
dtypes, shardings), the devices, every installed distribution's version, JAX's configuration
and the XLA/JAX environment. A change to any of them is a different key, so a stale executable
is never found; a file whose checksum does not match is reported and compiled afresh.

What is stored is jax's own serialized executable (`jax.experimental.serialize_executable`, the
bytes the persistent cache holds) with the call's tree structures. JAX runs what it loads from
here, so the store lives in the compilation cache directory, which only its user can write.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import sys
import tempfile
import time

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_MAGIC = b'deepseek41 executable 1\n'
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV_PREFIXES = ('XLA_', 'JAX_', 'LIBTPU', 'TPU_', 'NCCL_', 'CUDA_', 'TF_')


def source_digest(package_dir: str = _PACKAGE_DIR) -> str:
  """sha256 over every Python file of the package, by relative path and content."""
  h = hashlib.sha256()
  for root, dirs, files in os.walk(package_dir):
    dirs[:] = sorted(d for d in dirs if d != '__pycache__')
    for name in sorted(files):
      if name.endswith('.py'):
        path = os.path.join(root, name)
        h.update(os.path.relpath(path, package_dir).encode() + b'\0')
        with open(path, 'rb') as f:
          h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()


def run_context(config_json: str, devices) -> str:
  """What decides a run's executables beside their arguments (module docstring)."""
  dists = sorted(f'{d.metadata["Name"]}=={d.version}'
                 for d in importlib.metadata.distributions())
  env = sorted(f'{k}={v}' for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
  jax_config = sorted(f'{k}={v!r}' for k, v in jax.config.values.items())
  devs = [(d.id, d.process_index, d.platform, d.device_kind) for d in devices]
  client = devices[0].client
  return '\n'.join([
      f'python {sys.version}', f'source {source_digest()}', f'config {config_json}',
      f'devices {devs}', f'process {jax.process_index()} of {jax.process_count()}',
      f'platform {client.platform} {client.platform_version}', *dists, *env, *jax_config])


class ExecutableStore:
  """`directory`'s executables for one run context (`run_context`). Keeps the newest `keep`."""

  def __init__(self, directory: str, context: str, keep: int = 8):
    self.directory, self.keep = directory, keep
    self._context = hashlib.sha256(context.encode()).hexdigest()

  def path(self, name: str, signature) -> str:
    """The file of `name` compiled for arguments of `signature` (train/compiled.py)."""
    key = hashlib.sha256(f'{self._context}\n{name}\n{signature!r}'.encode()).hexdigest()[:32]
    return os.path.join(self.directory, f'{name}-{key}.exe')

  def load(self, path: str):
    """The stored executable at `path` as a jax Compiled, or None (absent, unreadable or corrupt:
    reported, and a corrupt file removed, so the caller compiles)."""
    try:
      with open(path, 'rb') as f:
        blob = f.read()
    except FileNotFoundError:
      return None
    except OSError as e:
      log.warning('stored executable %s unreadable (%s); compiling', path, e)
      return None
    head = len(_MAGIC) + 32
    if (len(blob) < head or not blob.startswith(_MAGIC)
        or hashlib.sha256(blob[head:]).digest() != blob[len(_MAGIC):head]):
      log.warning('stored executable %s is corrupt (checksum); removed, compiling', path)
      remove_quietly(path)
      return None
    try:
      serialized, in_tree, out_tree, device_ids = pickle.loads(blob[head:])
      by_id = {d.id: d for d in jax.devices()}
      compiled = serialize_executable.deserialize_and_load(
          serialized, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception as e:  # noqa: BLE001 - e.g. a runtime that cannot load it: compile instead
      log.warning('stored executable %s could not be loaded (%s: %s); compiling', path,
                  type(e).__name__, e)
      return None
    os.utime(path)  # recently used: kept by the pruning
    return compiled

  def save(self, path: str, compiled) -> None:
    """Write `compiled` to `path` atomically; a failure (a full disk, an executable jax cannot
    serialize) is logged and leaves no partial file."""
    try:
      serialized, in_tree, out_tree = serialize_executable.serialize(compiled)
      # The devices it was compiled for, in order: loading for others (jax's default: every
      # device) fails at the first call.
      device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
      payload = pickle.dumps((serialized, in_tree, out_tree, device_ids),
                             protocol=pickle.HIGHEST_PROTOCOL)
      os.makedirs(self.directory, mode=0o700, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=self.directory, prefix='.tmp-', suffix='.exe')
      try:
        with os.fdopen(fd, 'wb') as f:
          f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
          f.flush()
          os.fsync(f.fileno())
        os.replace(tmp, path)
      except BaseException:
        remove_quietly(tmp)
        raise
    except Exception as e:  # noqa: BLE001 - the run goes on; its restart compiles
      log.warning('executable not stored at %s (%s: %s)', path, type(e).__name__, e)
      return
    self._prune()

  def _prune(self) -> None:
    """Keep the `keep` most recently used executables; drop partial files a killed process left
    (older than an hour, so that another process's write in progress is not one of them)."""
    try:
      entries = [os.path.join(self.directory, n) for n in os.listdir(self.directory)]
      done = sorted((p for p in entries if p.endswith('.exe') and
                     not os.path.basename(p).startswith('.tmp-')),
                    key=os.path.getmtime, reverse=True)
      stale = [p for p in entries if os.path.basename(p).startswith('.tmp-')
               and time.time() - os.path.getmtime(p) > 3600]
    except OSError:
      return
    for p in done[self.keep:] + stale:
      remove_quietly(p)


def remove_quietly(path: str) -> None:
  """os.remove, where a file already gone (or not removable) is not an error."""
  try:
    os.remove(path)
  except OSError:
    pass
