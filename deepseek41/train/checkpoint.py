"""Orbax checkpoints of a work directory: WORKDIR/checkpoints/<step>/{state,data,config,meta}.

- `state`: the train state pytree (params, optimizer state, step, router biases, RNG), saved
  sharded and restored onto whatever mesh the current run uses.
- `data`: the Grain iterator positions, one JSON per input stream, `process_<k>-of-<S>.json`
  for stream k of S (the file names of Grain's own handler: with one stream per process, the
  default, stream k is process k's). Each process writes the streams it reads, so the item holds
  every process's position, and a restore reads the streams the restoring process reads, which
  need not be the ones it wrote (pipeline.DataStreams; README, "Several processes on one host").
- `config`: the resolved run config; `meta`: the layout version and every leaf's shape/dtype.

- `checksums.json`: size and CRC-32 of every other file of the step, written by the primary
  process once the save has committed. Restore verifies it before reading anything: a corrupt
  checkpoint stops the run with a CheckpointError naming it (it is never used silently, and the
  trainer does not fall back on its own: move the directory aside to resume from the previous
  one). A checkpoint without the file (written before checksums were recorded, or a run killed
  between the commit and the manifest) restores with a note that it was not verified.

Before a restore reads any array, train/warm_start.py checks `meta` and `config` against the
current model, so a mismatch is reported as a list of differences instead of a shape error deep
inside Orbax.
Nothing here ever deletes a complete checkpoint except Orbax's own retention policy
(max_to_keep / keep_period) after a newer save has committed. A failed save raises
CheckpointSaveError (naming the directory and the complete checkpoints kept) as soon as it is
seen, and removes the partial `<step>.orbax-checkpoint-tmp*` directory it left (or says that it
could not: a new start skips it). The step directories are created in the caller's thread, so a
checkpoints tree that became unwritable fails the save at once; Orbax's background creation
would leave the writers waiting 300 s for a directory that never comes. A save that has not
finished checkpoint.save_timeout_s after it began is reported the same way and abandoned
(its threads are not waited for again; the command line then exits without joining them).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from typing import Any

import grain
import orbax.checkpoint as ocp
from orbax.checkpoint._src.futures import future as ocp_future

from deepseek41.config import LAYOUT_VERSION, CheckpointConfig, execution_only_keys
from deepseek41.train import checksums
from deepseek41.train.workdir import WorkdirError

log = logging.getLogger(__name__)

# Model keys that change how the model is executed, not what it computes or stores, as the
# schema marks them (config/schema.py). Several resolve from 'auto' per backend, so they must
# not block resuming a GPU checkpoint on the CPU (the rule: train/warm_start.py
# `model_differences`, its one reader).
EXECUTION_ONLY_MODEL_KEYS = execution_only_keys('model')

MANIFEST = 'checksums.json'

_POLL_S = 0.1  # signal handlers run between polls
_DETAIL_CHARS = 300
# The thread class of Orbax's background writers (private: nothing public lists them).
_ORBAX_WRITER = getattr(ocp_future, '_SignalingThread', ())
_WRITERS_WAIT_S = 10  # then a failed save's directory is left for a new start to skip


def _stream_file(stream: int, total: int) -> str:
  return f'process_{stream}-of-{total}.json'  # Grain's own handler's name for process k of S


class DataStreamsHandler(grain.checkpoint.CheckpointHandler):
  """Orbax handler of the `data` item: one Grain iterator state per input stream."""

  def save(self, directory, item=None, args=None):
    item = item if item is not None else args.item
    if not hasattr(item, 'stream_states'):  # a plain Grain iterator: Grain's own layout
      return super().save(directory, item=item)
    for k, state in item.stream_states().items():
      (directory / _stream_file(k, item.total)).write_text(json.dumps(state, indent=4))

  def restore(self, directory, item=None, args=None):
    item = item if item is not None else args.item
    if not hasattr(item, 'stream_states'):
      return super().restore(directory, item=item)
    states = {}
    for k in item.streams:
      path = directory / _stream_file(k, item.total)
      if not path.exists():
        raise CheckpointError(f'{path} is missing: the data position of stream {k} of '
                              f'{item.total} was not saved')
      states[k] = json.loads(path.read_text())
    item.set_stream_states(states)
    return item


@ocp.args.register_with_handler(DataStreamsHandler, for_save=True)
@dataclasses.dataclass
class DataStreamsSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(DataStreamsHandler, for_restore=True)
@dataclasses.dataclass
class DataStreamsRestore(ocp.args.CheckpointArgs):
  item: Any


def saved_stream_count(data_dir: str) -> int | None:
  """S of the `process_<k>-of-<S>.json` files in a checkpoint's data item (None: no files);
  raises CheckpointError if the files disagree or some stream is missing."""
  if not os.path.isdir(data_dir):
    return None
  found = {}
  for name in os.listdir(data_dir):
    m = re.fullmatch(r'process_(\d+)-of-(\d+)\.json', name)
    if m:
      found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
  if not found:
    return None
  if len(found) > 1:
    raise CheckpointError(f'{data_dir} holds data positions of different stream counts '
                          f'{sorted(found)}; it is not a checkpoint of one run')
  (total, streams), = found.items()
  missing = sorted(set(range(total)) - streams)
  if missing:
    raise CheckpointError(f'{data_dir} lacks the data position of stream(s) {missing} of {total} '
                          '(a process did not save its part). Move that checkpoint aside to '
                          'resume from the previous one.')
  return total


def complete_steps(directory: str) -> list[int]:
  """Steps with a committed checkpoint in `directory` (Orbax names a save `<step>` only once it
  has committed; an unfinished one is `<step>.orbax-checkpoint-tmp*`)."""
  try:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  except OSError:  # not created yet
    return []


class CheckpointError(RuntimeError):
  """A checkpoint cannot be used; the message names the step directory and what is wrong."""


class CheckpointSaveError(RuntimeError):
  """A save failed (unwritable or full disk, ...); the message names the directory."""


def file_checksums(step_dir: str) -> dict[str, list[int]]:
  """{path relative to step_dir: [size, crc32]} of every file but the manifest."""
  sums = checksums.file_checksums(step_dir)
  sums.pop(MANIFEST, None)
  return sums


def _normalise(x):
  return json.loads(json.dumps(x))


class _ManifestWriter(threading.Thread):
  """Writes a committed step's checksums.json (atomically); keeps the error for the caller."""

  def __init__(self, step: int, step_dir: str):
    super().__init__(name=f'checksums-{step}', daemon=True)
    self.step, self.step_dir = step, step_dir
    self.error: OSError | None = None

  def run(self) -> None:
    path = os.path.join(self.step_dir, MANIFEST)
    tmp = f'{path}.{uuid.uuid4().hex}.tmp'
    try:
      sums = file_checksums(self.step_dir)  # before the manifest's own tmp file exists
      with open(tmp, 'w') as f:
        json.dump(sums, f, indent=0)
      os.replace(tmp, path)
    except OSError as e:
      self.error = e


class Checkpointer:
  """One CheckpointManager per work directory."""

  def __init__(self, workdir: str, cfg: CheckpointConfig, *, primary: bool = True):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    self.primary = primary  # writes the checksum manifests and removes failed saves
    self.async_save = cfg.async_save
    self.save_timeout_s = cfg.save_timeout_s  # the bound on one save (wait)
    self._pending: int | None = None  # an async save not yet seen to commit
    self._started = 0.0  # time.monotonic() when the pending save began
    self._abandoned = False  # a save timed out: its threads may never end
    self._manifest: _ManifestWriter | None = None  # checksums of the newest committed save
    try:  # at start-up, not at the first save hours later
      os.makedirs(self.directory, exist_ok=True)
      if primary:
        self._probe()
    except OSError as e:
      raise WorkdirError(f'checkpoint directory {self.directory} is not usable: '
                         f'{e.strerror or e}') from e
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.max_to_keep,
        keep_period=cfg.keep_period or None,
        enable_async_checkpointing=cfg.async_save,
        # Orbax's bound a little later than ours, so that ours, with its message, ends a wait.
        async_options=ocp.AsyncOptions(timeout_secs=int(cfg.save_timeout_s) + 60,
                                       create_directories_asynchronously=False),
        create=True,
    )
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={'state': ocp.PyTreeCheckpointHandler(use_compression=cfg.compress),
                       'config': ocp.JsonCheckpointHandler(),
                       'meta': ocp.JsonCheckpointHandler(),
                       'data': DataStreamsHandler()})

  # -- discovery -------------------------------------------------------------------------------

  def unfinished_saves(self) -> list[str]:
    return sorted(n for n in os.listdir(self.directory)
                  if re.match(r'^\d+\..*tmp', n) or n.endswith('.tmp'))

  def complete_steps(self) -> list[int]:
    return complete_steps(self.directory)

  def describe_kept(self) -> str:
    """The checkpoints a process leaves if it ends now. An async save's commit is a rename in
    Orbax's thread, which may land between this listing and the exit: that step is named."""
    pending = self._pending
    kept = self.complete_steps()
    text = f'complete checkpoints in {self.directory}: {kept or "none"}'
    if pending is not None and pending not in kept:
      text += (f'; the save of step {pending} was in flight (complete only if it committed '
               'before the exit)')
    return text

  def latest_step(self) -> int | None:
    for name in self.unfinished_saves():
      log.warning('skipping unfinished checkpoint save %s (interrupted while writing)',
                  os.path.join(self.directory, name))
    self.manager.reload()
    return self.manager.latest_step()

  # -- save ------------------------------------------------------------------------------------

  def save(self, step: int, state, data_iter, config_dict: dict, layout: dict,
           force: bool = False) -> bool:
    """Start saving `step` (async: returns after the device-to-host copy); False if that step
    is already saved (a stop signal right after a periodic save). Raises CheckpointSaveError
    for this save's failure, or for the previous async one's."""
    self.wait()  # the previous save has committed (or its failure is raised) before this one
    if step in self.manager.all_steps():
      return False
    self._check_writable(step)
    t0 = time.monotonic()
    args = {
        'state': ocp.args.PyTreeSave(state),
        'config': ocp.args.JsonSave(_normalise(config_dict)),
        'meta': ocp.args.JsonSave({'layout_version': LAYOUT_VERSION, 'step': int(step),
                                   'layout': layout}),
    }
    if data_iter is not None:
      args['data'] = DataStreamsSave(data_iter)
    try:
      saved = self.manager.save(step, args=ocp.args.Composite(**args), force=force)
    except Exception as e:  # noqa: BLE001 - any failure of the save is reported the same way
      self._fail(step, e)
    if saved:
      self._pending, self._started = step, t0
      if not self.async_save:
        self._commit_pending()
    return saved

  def poll(self) -> None:
    """Between steps: raise promptly if a background save failed; record committed saves."""
    if self._pending is not None and not self.manager.is_saving_in_progress():
      self.wait()
    if self._manifest is not None and not self._manifest.is_alive():
      self._finish_manifest()

  def wait(self) -> None:
    """Block until the pending save has committed and its checksums are written; raise
    CheckpointSaveError if it failed or has not finished checkpoint.save_timeout_s after it
    began."""
    if self._pending is not None:
      step = self._pending
      # A poll, not Orbax's join: it is bounded, and the stop signals' handler runs between.
      while self.manager.is_saving_in_progress():
        if time.monotonic() - self._started > self.save_timeout_s:
          self._pending, self._abandoned = None, True
          # Its threads may still write into the tmp directory: it is left for a new start to skip.
          self._fail(step, 'it did not finish within checkpoint.save_timeout_s = '
                     f'{self.save_timeout_s:g} s', remove=False)
        time.sleep(_POLL_S)
      try:
        self.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001
        self._pending = None  # reported once: close() does not report it again
        self._fail(step, e)
      self._commit_pending()
    self._finish_manifest()

  def close(self) -> None:
    """Finish the pending save; never raises (it runs while another exception may be raised)."""
    try:
      self.wait()
    except CheckpointSaveError as e:
      log.error('%s', e)
    if self._abandoned:
      return  # closing the manager would wait for the stuck save's threads
    try:
      self.manager.close()
    except Exception:  # noqa: BLE001 - a save failure was already reported
      log.exception('closing the checkpoint manager failed')

  def _commit_pending(self) -> None:
    step, self._pending = self._pending, None
    try:
      self.manager.check_for_errors()
    except Exception as e:  # noqa: BLE001
      self._fail(step, e)
    if not os.path.isdir(self.step_dir(step)):
      # Orbax logs a failure of its finalize thread and leaves only the tmp directory.
      self._fail(step, 'the save did not commit (the Orbax error is logged above)')
    if self.primary:  # hashing a large checkpoint takes a while: off the training thread
      self._manifest = _ManifestWriter(step, self.step_dir(step))
      self._manifest.start()

  def _finish_manifest(self) -> None:
    if self._manifest is None:
      return
    writer, self._manifest = self._manifest, None
    writer.join(timeout=max(self.save_timeout_s - (time.monotonic() - self._started), _POLL_S))
    if writer.is_alive():
      self._abandoned = True
      self._fail(writer.step, 'its checksums were not written within checkpoint.save_timeout_s '
                 f'= {self.save_timeout_s:g} s', committed=True)
    if writer.error is not None:
      self._fail(writer.step, writer.error, committed=True)

  @staticmethod
  def _writers_done() -> bool:
    """Wait (a little) for Orbax's writer threads of a failed save: it reports the first error
    while the other items' writers go on, and a directory removed under them is made again.
    False if some are still running."""
    writers = [t for t in threading.enumerate()
               if isinstance(t, _ORBAX_WRITER) and t is not threading.current_thread()]
    deadline = time.monotonic() + _WRITERS_WAIT_S
    for t in writers:
      t.join(timeout=max(deadline - time.monotonic(), 0.0))
    return not any(t.is_alive() for t in writers)

  def _check_writable(self, step: int) -> None:
    """An unwritable checkpoints directory fails here, before the state is copied to the
    host for a save that could not be written."""
    if not self.primary:
      return
    try:
      self._probe()
    except OSError as e:
      self._fail(step, e)

  def _probe(self) -> None:
    probe = os.path.join(self.directory, f'.write-probe-{uuid.uuid4().hex}')
    with open(probe, 'w'):
      pass
    os.remove(probe)

  def _fail(self, step: int, cause, committed: bool = False, remove: bool = True):
    partial = glob.glob(os.path.join(self.directory, f'{step}.orbax-checkpoint-tmp*'))
    if self.primary and not committed and remove and partial and self._writers_done():
      for path in partial:
        shutil.rmtree(path, ignore_errors=True)
      partial = [p for p in partial if os.path.exists(p)]
    detail = f'{type(cause).__name__}: {cause}' if isinstance(cause, BaseException) else cause
    detail = ' '.join(str(detail).split())  # one line, whatever the library's message
    if len(detail) > _DETAIL_CHARS:  # tensorstore appends its whole spec; the log has it all
      detail = detail[:_DETAIL_CHARS] + ' ...'
    left = (f' The unfinished save {", ".join(partial)} is left in place; a new start skips it.'
            if partial and not committed else '')
    raise CheckpointSaveError(
        f'saving checkpoint {step} to {self.directory} failed ({detail}); stopping. Complete '
        f'checkpoints are kept: {self.complete_steps() or "none"}.{left} Free space or fix the '
        'directory\'s permissions, then start again to resume.') from (
            cause if isinstance(cause, BaseException) else None)

  # -- restore ---------------------------------------------------------------------------------

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def verify(self, step: int) -> bool:
    """True if the step's files match its checksums, False if it has none (an older
    checkpoint); raises CheckpointError naming the files that differ."""
    path = os.path.join(self.step_dir(step), MANIFEST)
    if not os.path.exists(path):
      return False
    try:
      with open(path) as f:
        recorded = json.load(f)
    except (OSError, ValueError) as e:
      raise CheckpointError(f'checkpoint {self.step_dir(step)}: unreadable {MANIFEST} ({e}). '
                            'Move that directory aside to resume from the previous '
                            'checkpoint.') from e
    now = file_checksums(self.step_dir(step))
    bad = sorted(f for f in set(recorded) | set(now) if recorded.get(f) != now.get(f))
    if bad:
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} is corrupt: {len(bad)} file(s) differ from the '
          f'checksums recorded when it was saved ({", ".join(bad[:5])}'
          f'{", ..." if len(bad) > 5 else ""}). Move that directory aside to resume from the '
          'previous checkpoint.')
    return True

  def describe_newest(self) -> str:
    """One sentence on the newest checkpoint, calling it intact only if it was verified."""
    try:
      self.wait()
    except CheckpointSaveError as e:
      return str(e)
    step = self.latest_step()
    if step is None:
      return f'No checkpoint was saved in {self.directory}.'
    try:
      verified = self.verify(step)
    except CheckpointError as e:
      return str(e)
    if verified:
      return f'The newest checkpoint, {self.step_dir(step)}, is intact (checksums verified).'
    return f'The newest checkpoint is {self.step_dir(step)} (not verified: it has no checksums).'

  def read_json_item(self, step: int, item: str) -> dict:
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          **{item: ocp.args.JsonRestore()}))
      value = restored[item]
    except Exception as e:  # orbax raises many types for missing / truncated files
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} is corrupt or incomplete: cannot read its '
          f'{item!r} item ({type(e).__name__}: {e}). Move that directory aside to resume from '
          'the previous checkpoint.') from e
    if not isinstance(value, dict):
      raise CheckpointError(f'checkpoint {self.step_dir(step)}: {item!r} item is not a JSON object')
    return value

  def restore_parts(self, step: int, target: dict):
    """Only the top-level state entries `target` names (ShapeDtypeStructs with shardings), e.g.
    the parameters and router biases without the optimizer state: what a reader (generation,
    export) needs, at a third of a full restore's memory."""
    args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    try:
      return self.manager.restore(step, args=ocp.args.Composite(state=args))['state']
    except Exception as e:
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} could not be restored ({type(e).__name__}: {e}). '
          'Move that directory aside to use the previous checkpoint.') from e

  def restore(self, step: int, target, data_iter):
    """Restore the state into `target` (ShapeDtypeStructs with the current shardings)."""
    args = {'state': ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))}
    if data_iter is not None:
      if not os.path.isdir(os.path.join(self.step_dir(step), 'data')):
        if step != 0:
          raise CheckpointError(f'checkpoint {self.step_dir(step)} has no data iterator state')
        # Step 0 (an imported checkpoint) has read no data: the input starts at its beginning.
        log.info('checkpoint %s has no data iterator state: step 0, the input starts at its '
                 'beginning', self.step_dir(step))
      else:
        args['data'] = DataStreamsRestore(data_iter)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**args))
    except CheckpointError:
      raise
    except Exception as e:
      raise CheckpointError(
          f'checkpoint {self.step_dir(step)} could not be restored ({type(e).__name__}: {e}). '
          'Move that directory aside to resume from the previous checkpoint.') from e
    return restored['state']
