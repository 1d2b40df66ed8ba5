"""A jitted step run as an executable compiled once per argument signature: ahead of time where
the arguments' shapes are known before they exist, and in step with the other processes.

Ahead of time: a restart spends seconds restoring the checkpoint and as many tracing, lowering
and loading the update step from the persistent cache (docs/performance.md section 52: 8 s and
15.7 s of a 29 s restart of configs/ablation_1b.py on an H100). `compile_ahead` does the second
from the state's and the batch's abstract values in a background thread while the first runs;
the first call with arguments of that signature waits for it and runs its executable. Arguments
of another signature (or a failed compile ahead, logged) compile where they are called, as jit
would. With an executable store (train/executable_store.py), the compile ahead is a load where
the store has the step, without tracing or lowering it.

Together: with several processes, a step runs only once every process has compiled it (a
barrier of the jax.distributed coordination service). Process 0 may load a program from the
persistent cache in seconds that another process compiles for a minute (JAX writes the cache
from process 0 only, and the others do not find their programs there), and on the CPU a gloo
collective gives its peers 30 s to join: run at once, the first step failed with 'Gloo context
initialization failed: DEADLINE_EXCEEDED'.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np
from jax._src import distributed  # the coordination client's barrier

from deepseek41.train.executable_store import ExecutableStore, remove_quietly

log = logging.getLogger(__name__)


def signature(args) -> tuple:
  """What an executable is compiled for: the tree, and each leaf's shape, dtype, weak type and
  sharding (arrays and ShapeDtypeStructs alike)."""
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple((tuple(x.shape), np.dtype(x.dtype), bool(getattr(x, 'weak_type', False)),
                         getattr(x, 'sharding', None)) for x in leaves)


class _Ahead:
  """One compile in a daemon thread: a process that fails before its first step (a corrupt
  checkpoint, a signal) exits with its own error instead of waiting for it. With a `store`, the
  executable is loaded from it when there (no tracing, no lowering) and written to it when
  compiled, after the result is handed over."""

  def __init__(self, jitted, args, mesh, name: str, store: ExecutableStore | None = None):
    self.result, self.error, self.seconds, self.loaded = None, None, 0.0, False
    self.lowered = threading.Event()
    self._done = threading.Event()
    path = self.path = store.path(name, signature(args)) if store is not None else None
    self._thread = threading.Thread(target=self._compile, args=(jitted, args, mesh, store, path),
                                     name=f'compile-ahead-{name}', daemon=True)
    self._thread.start()

  def _compile(self, jitted, args, mesh, store, path):
    t0 = time.perf_counter()
    hits = _CacheHits()
    try:
      with jax.set_mesh(mesh):  # the mesh context is the thread's own
        self.result = store.load(path) if path else None
        self.loaded = self.result is not None
        if not self.loaded:
          lowered = jitted.trace(*args).lower()
          self.lowered.set()
          with hits:
            self.result = lowered.compile()
    except Exception as e:  # noqa: BLE001 - reported where the step is first called
      self.error = e
    finally:
      self.seconds = time.perf_counter() - t0
      self.lowered.set()
      self._done.set()
    # Only an executable XLA compiled here: one the persistent cache gave back serializes again
    # without all of its code on the CPU (it failed at its first call: 'Function ... not found').
    if path and self.error is None and not self.loaded and not hits.count:
      store.save(path, self.result)

  def wait(self) -> float:
    """Seconds spent waiting for the compile to finish."""
    t0 = time.perf_counter()
    self._done.wait()
    return time.perf_counter() - t0


class _CacheHits:
  """Counts the persistent-cache hits of compilations in this thread (JAX reports them in the
  thread that compiles)."""

  _EVENT = '/jax/compilation_cache/cache_hits'
  count = 0

  def __enter__(self):
    self.count, self._thread = 0, threading.get_ident()
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_listener(self._on_event)

  def _on_event(self, event: str, **kwargs):
    del kwargs
    if event == self._EVENT and threading.get_ident() == self._thread:
      self.count += 1


class CompiledStep:
  """`jitted` (a jax.jit) called as its compiled executables (module docstring)."""

  BARRIER_TIMEOUT_S = 3600  # one process compiling a large model while the others wait
  _barriers = 0

  def __init__(self, jitted, name: str, *, mesh, together: bool = False,
               store: ExecutableStore | None = None):
    self.jitted, self.name, self.mesh, self.together = jitted, name, mesh, together
    self.store = store
    self.compiled: dict[tuple, object] = {}
    self._ahead: dict[tuple, _Ahead] = {}
    self._untried: dict[tuple, str] = {}  # loaded from the store, not yet run: its file
    self._finished: list[_Ahead] = []  # handed over, perhaps still writing to the store

  def compile_ahead(self, *abstract_args) -> None:
    """Start compiling for arguments like `abstract_args` (ShapeDtypeStructs with shardings)."""
    key = signature(abstract_args)
    if key not in self.compiled and key not in self._ahead:
      self._ahead[key] = _Ahead(self.jitted, abstract_args, self.mesh, self.name, self.store)

  def wait_lowered(self) -> None:
    """Wait until every compile ahead has traced and lowered its program: from then on the caller
    may trace programs of its own. Two threads tracing at once can each trace the same inner jit
    (jnp.clip's, say) and so lower a module of other bytes, whose persistent-cache key differs:
    a fresh run's update step traced beside the initialisation was not the program its restarts
    looked up (on this CPU, every restart compiled it again)."""
    for ahead in self._ahead.values():
      ahead.lowered.wait()

  def __call__(self, *args):
    key = signature(args)
    executable = self.compiled.get(key)
    if executable is None:
      executable = self.compiled[key] = self._compile(key, args)
    path = self._untried.pop(key, None)
    if path is None:
      return executable(*args)
    try:
      return executable(*args)
    except Exception:
      # A stored executable that cannot run must not fail every restart after this one.
      log.error('%s: the executable loaded from %s failed at its first call; removed it, so the '
                'next start compiles the step', self.name, path)
      remove_quietly(path)
      raise

  def close(self, timeout_s: float = 120.0) -> None:
    """Let the executables being written to the store finish (their threads are daemons: a run
    that ends first would leave its restart nothing to load)."""
    deadline = time.monotonic() + timeout_s
    for ahead in self._finished:
      ahead._thread.join(max(0.0, deadline - time.monotonic()))

  def _compile(self, key, args):
    ahead = self._ahead.pop(key, None)
    if ahead is not None:
      self._finished.append(ahead)
      waited = ahead.wait()
      if ahead.error is None:
        if ahead.loaded:
          self._untried[key] = ahead.path
        log.info('%s %s in %.1f s, beside the start-up; its first call waited %.1f s for it',
                 self.name, 'loaded from the executable store' if ahead.loaded else
                 'compiled ahead', ahead.seconds, waited)
        return self._together(ahead.result)
      log.warning('%s: the compile ahead failed (%s: %s); compiling at its first call',
                  self.name, type(ahead.error).__name__, ahead.error)
    elif self._ahead:
      log.warning('%s: the first arguments differ from those compiled ahead; compiling for them',
                  self.name)
    with jax.set_mesh(self.mesh):
      return self._together(self.jitted.lower(*args).compile())

  def _together(self, executable):
    if not self.together:
      return executable
    CompiledStep._barriers += 1
    t0 = time.perf_counter()
    distributed.global_state.client.wait_at_barrier(
        f'deepseek41-compiled-{self.name}-{CompiledStep._barriers}',
        self.BARRIER_TIMEOUT_S * 1000)
    log.info('%s compiled; waited %.1f s for the other processes', self.name,
             time.perf_counter() - t0)
    return executable
