"""train/executable_store.py: a compiled step kept on disk and loaded without tracing, keyed so
that a change to what decides it is a miss; corrupt, unloadable or unrunnable files are reported
and never used; what the persistent cache served is not stored."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.train import executable_store
from deepseek41.train.compiled import CompiledStep, signature
from deepseek41.train.executable_store import ExecutableStore, run_context

MESH = jax.make_mesh((1,), ('data',))
REPLICATED = NamedSharding(MESH, P())
ARGS = [jax.ShapeDtypeStruct((8,), jnp.float32, sharding=REPLICATED)] * 2


_CACHE_SETTINGS = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
                   'jax_persistent_cache_min_entry_size_bytes')


@pytest.fixture(autouse=True)
def persistent_cache(request):
  """The suite's persistent cache off (it would serve these programs on a second run, and what it
  serves is not stored); `persistent_cache.on(dir)` turns a fresh one on."""
  before = {k: getattr(jax.config, k) for k in _CACHE_SETTINGS}

  class Settings:
    @staticmethod
    def on(directory):
      jax.config.update('jax_compilation_cache_dir', str(directory))
      jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
      jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
      compilation_cache.reset_cache()
  jax.config.update('jax_compilation_cache_dir', None)
  compilation_cache.reset_cache()
  yield Settings
  for k, v in before.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


def _step(scale=3.0):
  traces = []

  def step(x, y):
    traces.append(x.shape)
    return {'out': x * scale + y, 'sum': jnp.sum(x)}
  return jax.jit(step, in_shardings=(REPLICATED, REPLICATED)), traces


def _store(tmp_path, context='ctx', **kw):
  return ExecutableStore(str(tmp_path / 'store'), context, **kw)


def _ahead(store, scale=3.0):
  """A CompiledStep compiled ahead with `store`, and its traces once the compile is done."""
  jitted, traces = _step(scale)
  step = CompiledStep(jitted, 'step', mesh=MESH, store=store)
  step.compile_ahead(*ARGS)
  for ahead in step._ahead.values():
    ahead.wait()
    ahead._thread.join()  # its save, after the result is handed over
  return step, traces


def _files(store):
  return sorted(n for n in os.listdir(store.directory)) if os.path.isdir(store.directory) else []


def test_a_compiled_step_is_stored_and_loaded_without_tracing(tmp_path, caplog):
  store = _store(tmp_path)
  first, traces = _ahead(store)
  assert traces == [(8,)] and len(_files(store)) == 1
  x = jax.device_put(jnp.arange(8.0), REPLICATED)
  expected = first(x, x)
  second, traces = _ahead(store)
  assert traces == []  # loaded: never traced
  with caplog.at_level(logging.INFO):
    got = second(x, x)
  np.testing.assert_array_equal(got['out'], expected['out'])
  np.testing.assert_array_equal(got['sum'], expected['sum'])
  assert any('step loaded from the executable store' in r.getMessage() for r in caplog.records)


def test_the_key_is_the_context_name_and_signature(tmp_path):
  a, b = _store(tmp_path, 'ctx-a'), _store(tmp_path, 'ctx-b')
  sig = signature(ARGS)
  assert a.path('step', sig) == _store(tmp_path, 'ctx-a').path('step', sig)
  assert a.path('step', sig) != b.path('step', sig)
  assert a.path('step', sig) != a.path('eval', sig)
  other = signature([jax.ShapeDtypeStruct((9,), jnp.float32, sharding=REPLICATED)] * 2)
  assert a.path('step', sig) != a.path('step', other)
  # another context never finds this one's executable: it compiles (traces) its own
  _ahead(a, scale=3.0)
  _, traces = _ahead(b, scale=5.0)
  assert traces == [(8,)]


def test_the_run_context_holds_what_decides_the_program(monkeypatch):
  devices = jax.devices()
  base = run_context('{"a": 1}', devices)
  assert run_context('{"a": 1}', devices) == base
  assert run_context('{"a": 2}', devices) != base
  monkeypatch.setenv('XLA_FLAGS', '--xla_some_flag=true')
  assert run_context('{"a": 1}', devices) != base
  monkeypatch.delenv('XLA_FLAGS')
  monkeypatch.setattr(executable_store, 'source_digest', lambda: 'edited')
  assert run_context('{"a": 1}', devices) != base
  for needed in ('jax==', 'jaxlib==', 'platform cpu', 'jax_enable_x64='):
    assert needed in base, needed


def test_the_source_digest_follows_every_python_file(tmp_path):
  pkg = tmp_path / 'pkg'
  (pkg / 'sub').mkdir(parents=True)
  (pkg / 'a.py').write_text('x = 1\n')
  (pkg / 'sub' / 'b.py').write_text('y = 2\n')
  before = executable_store.source_digest(str(pkg))
  (pkg / 'sub' / 'b.py').write_text('y = 3\n')
  assert executable_store.source_digest(str(pkg)) != before
  (pkg / 'sub' / 'b.py').write_text('y = 2\n')
  assert executable_store.source_digest(str(pkg)) == before
  (pkg / 'sub' / 'b.py').rename(pkg / 'sub' / 'c.py')
  assert executable_store.source_digest(str(pkg)) != before


@pytest.mark.parametrize('damage', ['flip', 'truncate', 'empty'])
def test_a_corrupt_file_is_reported_removed_and_compiled_again(tmp_path, caplog, damage):
  store = _store(tmp_path)
  _ahead(store)
  (name,) = _files(store)
  path = os.path.join(store.directory, name)
  blob = open(path, 'rb').read()
  blob = {'flip': blob[:-100] + bytes([blob[-100] ^ 1]) + blob[-99:],
          'truncate': blob[:len(blob) // 2], 'empty': b''}[damage]
  open(path, 'wb').write(blob)
  with caplog.at_level(logging.WARNING):
    _, traces = _ahead(store)
  assert traces == [(8,)]  # compiled, not loaded
  assert any('is corrupt' in r.getMessage() and name in r.getMessage() for r in caplog.records)
  assert _files(store) == [name]  # and stored afresh
  assert open(path, 'rb').read() != blob


def test_an_executable_that_fails_at_its_first_call_is_removed(tmp_path, caplog, monkeypatch):
  store = _store(tmp_path)
  _ahead(store)
  second, _ = _ahead(store)
  (ahead,) = second._ahead.values()
  assert ahead.loaded

  def broken(*args):
    raise RuntimeError("NOT_FOUND: Function fusion not found")
  monkeypatch.setattr(ahead, 'result', broken)
  x = jax.device_put(jnp.arange(8.0), REPLICATED)
  with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match='not found'):
    second(x, x)
  assert _files(store) == []
  assert any('failed at its first call' in r.getMessage() for r in caplog.records)


def test_a_failed_save_leaves_no_file_and_the_step_runs(tmp_path, caplog, monkeypatch):
  store = _store(tmp_path)

  def full_disk(*args, **kwargs):
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(executable_store.os, 'fsync', full_disk)
  with caplog.at_level(logging.WARNING):
    step, _ = _ahead(store)
  assert _files(store) == []  # not even a partial file
  assert any('executable not stored' in r.getMessage() and 'No space left' in r.getMessage()
             for r in caplog.records)
  x = jax.device_put(jnp.arange(8.0), REPLICATED)
  np.testing.assert_array_equal(step(x, x)['out'], np.arange(8.0) * 4)


def test_only_the_newest_are_kept_and_partial_files_expire(tmp_path):
  store = _store(tmp_path, keep=2)
  os.makedirs(store.directory)
  stale, fresh = (os.path.join(store.directory, f'.tmp-{n}.exe') for n in ('old', 'new'))
  for p in (stale, fresh):
    open(p, 'wb').write(b'partial')
  os.utime(stale, (0, 0))
  for scale in (2.0, 3.0, 4.0):
    _ahead(ExecutableStore(store.directory, f'ctx-{scale}', keep=2), scale=scale)
  names = _files(store)
  assert len([n for n in names if not n.startswith('.tmp-')]) == 2
  assert '.tmp-new.exe' in names and '.tmp-old.exe' not in names


def test_what_the_persistent_cache_served_is_not_stored(tmp_path, persistent_cache):
  # One the cache gave back serializes again without all of its code on the CPU (compiled.py).
  persistent_cache.on(tmp_path / 'jax-cache')
  _ahead(None, scale=7.0)  # compiled, written to the persistent cache only
  store = _store(tmp_path)
  _, traces = _ahead(store, scale=7.0)  # served by the persistent cache
  assert traces == [(8,)] and _files(store) == []
  # a program it had not seen is compiled, and stored
  _ahead(store, scale=9.0)
  assert len(_files(store)) == 1
