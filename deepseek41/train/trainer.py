"""The training loop: config -> work directory -> mesh -> data -> model and optimizer -> state
(init or resume) -> update step -> checkpoints -> evaluations -> loop.

The units it uses: `objectives` (what is trained: the model, its steps and FLOPs), `workdir`
(start-up checks and the lock), `warm_start` (the state at the first step: resumed, or
initialised and loaded), `step_log` (metrics fetched one step late, checked finite, written),
`throughput` (timing), `evaluation` (held-out losses, task accuracy), `checkpoint` (verified
saves and restores), `stop` (SIGTERM / SIGINT).

Faults never lose work: a stop signal saves a checkpoint at the next step boundary and returns
(stopped_by_signal; before the first step there is nothing to save, and the run returns at once);
a failed or stuck save raises CheckpointSaveError, a metrics.jsonl that stops accepting lines
saves a checkpoint and raises MetricsWriteError; every complete checkpoint is kept throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import shutil
import signal
import time

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.config import RunConfig, format_role_table, resolve
from deepseek41.data.engram_vocab import model_fits_data
from deepseek41.data.pipeline import DataStreams, tokenizer_path_of
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import (CheckpointError, Checkpointer, complete_steps,
                                         saved_stream_count)
from deepseek41.train.compiled import CompiledStep
from deepseek41.train.evaluation import Evaluator, eval_config, make_task_step
from deepseek41.train.executable_store import ExecutableStore, run_context
from deepseek41.train.feed import abstract_batch, global_batch
from deepseek41.train.flops import device_peak_tflops
from deepseek41.train.metrics import MetricsWriteError, MetricsWriter, check_writable
from deepseek41.train.objectives import objective_for
from deepseek41.train.optimizer import SCHEDULE_KEYS, make_optimizer, schedule_values
from deepseek41.train.step_log import StepLog, TrainingDiverged
from deepseek41.train.stop import STOP, StopSignals
from deepseek41.train.throughput import Throughput
from deepseek41.train.warm_start import check_warm_starts, initial_state
from deepseek41.train.workdir import WorkdirLock, prepare_workdir

log = logging.getLogger('deepseek41')

__all__ = ['MetricsWriteError', 'TrainResult', 'TrainingDiverged', 'dry_run', 'train']


@dataclasses.dataclass
class TrainResult:
  step: int
  last_loss: float | None
  last_eval_loss: float | None
  stopped_by_signal: bool


class _StoppedBeforeStart(Exception):
  """A stop signal came before the first step: nothing was trained, so nothing is saved."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def _program_config_json(cfg: RunConfig) -> str:
  """The config as it decides the update step's program: without the schedule's numbers, which
  the step takes as an argument (the executable store's key)."""
  config = cfg.to_dict()
  for key in SCHEDULE_KEYS:
    del config['train'][key]
  return json.dumps(config, indent=2, sort_keys=True)


def _stop_before_start(stop: StopSignals, workdir: str) -> None:
  """During start-up: end the run here if a stop signal has come."""
  if stop.signal is None:
    return
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  steps = complete_steps(directory)
  raise _StoppedBeforeStart(
      f'stopped by {signal.Signals(stop.signal).name} during start-up, before the first step: '
      'nothing to save (this run has trained nothing); ' +
      (f'the next start resumes from checkpoint {steps[-1]} in {directory}' if steps else
       f'there is no checkpoint yet in {directory}, so the next start begins from step 0'),
      steps[-1] if steps else 0)


def train(config, workdir: str, *, stop_at_step: int | None = None) -> TrainResult:
  """Run (or resume) training as configured; `config` is an ml_collections.ConfigDict.

  `stop_at_step` ends this invocation early (with a checkpoint) at that step, without changing
  the schedule: the run continues from there when started again. Raises WorkdirError if the work
  directory (or its metrics.jsonl) is unusable or another trainer holds it.

  SIGTERM / SIGINT (from the start, in the main thread): at the next step boundary, save a
  checkpoint and return with stopped_by_signal; before the first step, return at once, nothing
  to save. A second signal is logged; a third exits the process at once (stop.py).
  """
  with STOP as stop:  # first of all: a stop signal at any moment of start-up counts
    try:
      _stop_before_start(stop, workdir)
      cfg: RunConfig = resolve(config)
      engram_map = model_fits_data(cfg.model, cfg.data)  # the tokenizer's checks, before anything
      primary = jax.process_index() == 0
      workdir = prepare_workdir(workdir)
      # Every process of a run locks its own file (process 0: .lock), so a second run started on
      # the directory is refused in each of its processes instead of some of them training on.
      with WorkdirLock(workdir, jax.process_index()), \
          CompilationCache(cfg.train.compilation_cache_dir) as compile_cache:
        if primary:
          check_writable(workdir)  # metrics.jsonl: now, not after minutes of compilation
        return _train(cfg, workdir, stop_at_step, primary, compile_cache, engram_map, stop)
    except _StoppedBeforeStart as e:
      log.warning('%s', e)
      return TrainResult(step=e.step, last_loss=None, last_eval_loss=None, stopped_by_signal=True)


def dry_run(config) -> dict:
  """Resolve the config and build the mesh against the visible devices; log the process /
  device / mesh banner and the per-device bytes of parameters + optimizer state from the
  abstract state and its shardings. Compiles and allocates nothing; returns the numbers."""
  cfg: RunConfig = resolve(config)
  mesh = make_mesh(cfg.mesh)
  tx = make_optimizer(cfg.train)
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, cfg.mesh.rules)
  n_proc, local = jax.process_count(), jax.local_devices()
  streams = cfg.data.streams or n_proc
  per_device = {'params': 0, 'opt': 0, 'other': 0}
  for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                          jax.tree.leaves(shardings)):
    shard = s.shard_shape(a.shape)
    part = str(getattr(path[0], 'key', path[0])) if path else ''
    per_device[part if part in per_device else 'other'] += \
        int(np.prod(shard, dtype=np.int64)) * np.dtype(a.dtype).itemsize
  kinds = sorted({d.device_kind for d in jax.devices()})
  info = {
      'process_index': jax.process_index(), 'process_count': n_proc,
      'local_devices': len(local), 'global_devices': jax.device_count(), 'device_kinds': kinds,
      'mesh': dict(mesh.shape), 'params': state_lib.count_params(abstract['params']),
      'per_device_bytes': per_device, 'data_streams': streams,
      'local_batch': cfg.train.batch_size // n_proc,
  }
  gib = 1 << 30
  log.info('dry run: process %d of %d; %d local / %d global device(s) (%s); mesh %s; '
           '%s parameters; per device: %.3f GiB parameters + %.3f GiB optimizer state + '
           '%.3f GiB other = %.3f GiB; %d data stream(s), %d rows per process; not compiled',
           info['process_index'], n_proc, len(local), jax.device_count(), ', '.join(kinds),
           info['mesh'], f'{info["params"]:,}', per_device['params'] / gib,
           per_device['opt'] / gib, per_device['other'] / gib, sum(per_device.values()) / gib,
           streams, info['local_batch'])
  if streams % n_proc or cfg.train.batch_size % streams:
    log.warning('%d data stream(s) do not split over %d processes and a batch of %d rows',
                streams, n_proc, cfg.train.batch_size)
  return info


class CompilationCache:
  """JAX's persistent compilation cache in `directory` ('' = off) while the run lasts, and a count
  of what it served.

  Runtime, not model behaviour, so it is set here, once, before anything compiles, and the
  previous settings come back on exit (train() may run inside a process that has its own). Only
  compilations of at least MIN_COMPILE_SECS are written: the update and evaluation steps and the
  sharded initialisation (tens of seconds at the 1B shapes), not the hundred-odd small programs
  (eager ops, metrics) that compile in tens of milliseconds each. On the GPU, JAX also keeps
  XLA's per-fusion autotuning results under the directory, another large part of a compile.
  """

  MIN_COMPILE_SECS = 1.0
  _SETTINGS = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
               'jax_persistent_cache_min_entry_size_bytes')
  _EVENTS = {'/jax/compilation_cache/compile_requests_use_cache': 'requests',
             '/jax/compilation_cache/cache_hits': 'loaded',
             '/jax/compilation_cache/cache_misses': 'written'}
  # Where a first step's time goes before it runs (every program of the process so far): with
  # the cache warm, tracing and lowering are still paid, and the backend's part includes the
  # cache key (a hash of the serialized module) and the read.
  _PHASES = {'/jax/core/compile/jaxpr_trace_duration': 'tracing',
             '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lowering',
             '/jax/core/compile/backend_compile_duration': 'compiling or loading',
             '/jax/compilation_cache/cache_retrieval_time_sec': 'cache reads'}

  def __init__(self, directory: str):
    self.directory = os.path.abspath(os.path.expanduser(directory)) if directory else ''
    self.counts = dict.fromkeys(self._EVENTS.values(), 0)
    self.saved_s = 0.0
    self.phase_s = dict.fromkeys(self._PHASES.values(), 0.0)
    self._before = {}

  def __enter__(self):
    self._before = {name: getattr(jax.config, name) for name in self._SETTINGS}
    if self.directory:
      try:  # private to the user on creation: JAX runs what it loads from here
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
      except OSError as e:
        log.warning('persistent compilation cache off: cannot create %s (%s)', self.directory, e)
        self.directory = ''
    jax.config.update('jax_compilation_cache_dir', self.directory or None)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', self.MIN_COMPILE_SECS)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)  # no size floor
    compilation_cache.reset_cache()  # JAX opens its cache once; reopen it at the new directory
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    if self.directory:
      log.info('persistent compilation cache: %s', self.directory)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    for name, value in self._before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()

  def _on_event(self, event: str, **kwargs):
    del kwargs
    if event in self._EVENTS:
      self.counts[self._EVENTS[event]] += 1

  def _on_duration(self, event: str, duration: float, **kwargs):
    del kwargs
    if event == '/jax/compilation_cache/compile_time_saved_sec':
      self.saved_s += duration
    elif event in self._PHASES:
      self.phase_s[self._PHASES[event]] += duration

  def describe(self) -> str:
    """What the cache did so far and where the compilations' time went, for the log."""
    phases = ', '.join(f'{name} {secs:.1f} s' for name, secs in self.phase_s.items())
    if not self.directory:
      return f'persistent compilation cache off; {phases}'
    return (f"persistent compilation cache: {self.counts['loaded']} program(s) loaded "
            f'(~{self.saved_s:.1f} s of compilation saved), {self.counts["written"]} compiled '
            f'and written, of {self.counts["requests"]} compilations; {phases}')


def _train(cfg: RunConfig, workdir: str, stop_at_step: int | None, primary: bool,
           compile_cache: CompilationCache, engram_map: np.ndarray | None,
           stop: StopSignals) -> TrainResult:
  # ---- mesh --------------------------------------------------------------------------------
  mesh = make_mesh(cfg.mesh)
  rules = cfg.mesh.rules
  log.info('mesh %s over %d %s device(s)%s', dict(mesh.shape), jax.device_count(),
           jax.devices()[0].device_kind,
           f'; process {jax.process_index()} of {jax.process_count()} with '
           f'{jax.local_device_count()}' if jax.process_count() > 1 else '')
  log.info('layer roles:\n%s', format_role_table(cfg.model))

  # ---- input -------------------------------------------------------------------------------
  n_proc = jax.process_count()
  local_batch = cfg.train.batch_size // n_proc
  bsharding = batch_sharding(mesh, rules)

  # ---- model and optimizer -----------------------------------------------------------------
  objective = objective_for(cfg)  # what is trained: the model, its steps, its FLOPs
  tx = make_optimizer(cfg.train)
  md = state_lib.model_def(cfg, tx)
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, rules)
  layout = state_lib.state_layout(abstract)
  fpt = objective.flops_per_token()
  peak = device_peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
  log.info('parameters: %s %s, %s active matmul per token',
           f'{state_lib.count_params(abstract["params"]):,}',
           'total' if 'frozen' not in abstract else
           f'trained (DSpark) + {state_lib.count_params(abstract["frozen"]):,} frozen (backbone)',
           f'{fpt.matmul_params:,}')
  log.info('%s', fpt.formula)
  log.info('peak: %s', f'{peak:g} TFLOP/s per device (bf16 dense)' if peak else
           'unknown for this device: MFU not reported (set train.peak_tflops)')

  check_warm_starts(cfg, workdir)

  # ---- update step -----------------------------------------------------------------------
  # Compiled in the background from the abstract state and batch from here on, while the input
  # opens and the checkpoint restores (train/compiled.py).
  replicated = NamedSharding(mesh, P())
  together = n_proc > 1
  store = None
  if compile_cache.directory and cfg.train.store_executables:
    store = ExecutableStore(os.path.join(compile_cache.directory, 'deepseek41-executables'),
                            run_context(_program_config_json(cfg), list(mesh.devices.flat)))
  # The learning-rate schedule's numbers, an argument of the update step (train/optimizer.py
  # SCHEDULE_KEYS): a run that changes only them compiles no new step.
  schedule = {k: jax.make_array_from_callback((), replicated, lambda _, v=v: v)
              for k, v in schedule_values(cfg.train).items()}  # each process's devices
  with jax.set_mesh(mesh):
    train_step = CompiledStep(
        jax.jit(objective.make_train_step(md), in_shardings=(shardings, bsharding, replicated),
                out_shardings=(shardings, replicated), donate_argnums=(0,)),
        'train_step', mesh=mesh, together=together, store=store)
    # Evaluation never drops expert assignments, whatever the training backend.
    eval_md = state_lib.model_def(eval_config(cfg), tx)
    if cfg.model.eval_moe_backend != cfg.model.moe_backend:
      log.info('routed experts: %s in training, %s (dropless) in evaluation',
               cfg.model.moe_backend, cfg.model.eval_moe_backend)
    eval_step = CompiledStep(
        jax.jit(objective.make_eval_step(eval_md), in_shardings=(shardings, bsharding),
                out_shardings=replicated), 'eval_step', mesh=mesh, together=together)
    # train.eval_tasks: the backbone's argmax and answer CE on the tasks' documents
    task_step = CompiledStep(
        jax.jit(make_task_step(objective, eval_md.graphdef), in_shardings=(shardings, bsharding),
                out_shardings=replicated), 'task_step', mesh=mesh, together=together)
    # Last: nothing else may trace until it has lowered (CompiledStep.wait_lowered).
    train_step.compile_ahead(state_lib.with_shardings(abstract, shardings),
                             abstract_batch(cfg, sharding=bsharding,
                                            engram=engram_map is not None), schedule)

  # Closed in reverse order however the run ends: profiler, writer, checkpoints, input.
  with contextlib.ExitStack() as cleanup:
    cleanup.callback(train_step.close)  # last of all: the executable store's write
    inputs = cleanup.enter_context(contextlib.ExitStack())  # closed after a pending save
    ckpt = Checkpointer(workdir, cfg.checkpoint, primary=primary)
    cleanup.callback(ckpt.close)
    stop.describe_checkpoints = ckpt.describe_kept  # for a third signal's last line
    # The checkpoint decides how the input is split (its stream count), so the input comes second.
    streams = _stream_count(ckpt, cfg.data.streams, n_proc)
    train_iter = DataStreams(cfg.data, split='train', batch_size=cfg.train.batch_size,
                             seed=cfg.train.seed, total=streams,
                             process_index=jax.process_index(), process_count=n_proc,
                             synthetic_vocab_size=cfg.model.vocab_size)
    inputs.callback(train_iter.close)
    if streams != n_proc:
      log.info('input: %d data streams, %d per process (streams %d-%d here)', streams,
               streams // n_proc, train_iter.first, train_iter.first + streams // n_proc - 1)
    if ckpt.latest_step() is None:  # the initialisation traces: only once the step has
      train_step.wait_lowered()
    _stop_before_start(stop, workdir)
    state, start = initial_state(cfg, ckpt, tx, mesh, abstract, shardings, layout, train_iter)
    train_step.wait_lowered()  # what follows may trace (the evaluation's set-up)
    _stop_before_start(stop, workdir)  # the initialisation or restore may have taken minutes
    if primary:  # only now: a start rejected by the checkpoint leaves the old config.json
      with open(os.path.join(workdir, 'config.json'), 'w') as f:
        f.write(cfg.to_json())
      _keep_tokenizer(cfg, workdir)

    # ---- metrics, evaluation, checkpoints ----------------------------------------------------
    writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard,
                           progress_bar=cfg.log.progress_bar, total_steps=cfg.train.steps,
                           start_step=start, enabled=primary,
                           wandb_project=cfg.log.wandb_project, wandb_mode=cfg.log.wandb_mode,
                           run_config=cfg.to_dict())
    cleanup.callback(writer.close)
    throughput = Throughput(tokens_per_step=cfg.train.batch_size * cfg.data.seq_len,
                            flops_per_token=fpt, peak_tflops=peak,
                            device_count=jax.device_count(), process_count=n_proc,
                            vision=cfg.model.vision)
    step_log = StepLog(cfg, writer, throughput, ckpt.describe_newest)
    evaluate = Evaluator(cfg, eval_step, mesh, bsharding, engram_map, local_batch, task_step)

    save = _Saver(ckpt, step_log, throughput, train_iter, cfg.to_dict(), layout)

    # ---- loop --------------------------------------------------------------------------------
    if start == 0 and cfg.train.eval_every_steps and cfg.train.eval_at_start:
      _evaluate(evaluate, step_log, throughput, 0, state)  # the start of the held-out curve
    end = cfg.train.steps if stop_at_step is None else min(stop_at_step, cfg.train.steps)
    profiler = _StepProfiler(cfg, workdir, start, end, primary)
    cleanup.callback(profiler.close)
    step = start
    stopped = False
    with stop.loop():
      while step < end:
        if step == start:  # the step-0 evaluation may have taken a while
          _stop_before_start(stop, workdir)
        profiler.before(step + 1, state)
        t_wait = time.perf_counter()
        local = next(train_iter)
        batch = global_batch(local, bsharding, engram_map, vision=cfg.model.vision)
        data_wait = time.perf_counter() - t_wait
        if cfg.model.vision:
          throughput.count_images(int((local['image_grid'][..., 0] > 0).sum()))
        with jax.set_mesh(mesh), jax.profiler.StepTraceAnnotation('train', step_num=step + 1):
          state, metrics = train_step(state, batch, schedule)  # annotated for xprof
        step += 1
        step_log.push(step, metrics, data_wait)
        throughput.exclude(profiler.after(step, (state, metrics)))  # writing the trace
        if step == start + 1:  # keep compilation out of the throughput numbers
          jax.block_until_ready(metrics)
          log.info('first step (compilation included) took %.1f s; %s',
                   time.perf_counter() - t_wait, compile_cache.describe())
          throughput.pause()
          step_log.drain(keep_last=False)
          throughput.begin_run()
        step_log.drain(keep_last=True)
        ckpt.poll()  # a failed background save stops the run here, not one interval later

        if cfg.train.eval_every_steps and (step % cfg.train.eval_every_steps == 0
                                           or step == cfg.train.steps):
          t_ready = time.perf_counter()
          jax.block_until_ready(metrics)
          # How long the host waited for this step before evaluating: about a step's time when
          # the device ran one step ahead, as it should (the windows around an evaluation shift
          # a step's time between them on the GPU: docs/performance.md section 39).
          step_log.carry['eval_step_wait_s'] = time.perf_counter() - t_ready
          _evaluate(evaluate, step_log, throughput, step, state)
          step_log.drain(keep_last=False)
          throughput.start()
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
          save(step, state)
        if stop.signal is not None or writer.error is not None:
          save(step, state)  # a no-op if the periodic save above just wrote this step
          stopped = writer.error is None
          if stopped:
            log.warning('saved checkpoint %d after %s; exiting', step,
                        signal.Signals(stop.signal).name)
          break
      else:
        if step != start and cfg.checkpoint.save_at_end:
          save(step, state)
      step_log.drain(keep_last=False)
      ckpt.wait()  # the last save has committed and is verified, or its failure is raised
      if writer.error is not None:  # this step's checkpoint has committed: stop here
        raise MetricsWriteError(
            f'{writer.error}; saved checkpoint {step} ({ckpt.step_dir(step)}) and stopped. Free '
            'space or fix the file, then start again to resume; the missing step lines are in '
            'the log')
  return TrainResult(step=step, last_loss=step_log.last_loss,
                     last_eval_loss=step_log.last_eval_loss,
                     stopped_by_signal=stopped)


class _Saver:
  """Checkpoints the state at a step, keeping the save's blocking time out of the throughput."""

  def __init__(self, ckpt: Checkpointer, step_log: StepLog, throughput: Throughput, train_iter,
               config_dict: dict, layout: dict):
    self.ckpt, self.step_log, self.throughput = ckpt, step_log, throughput
    self.train_iter, self.config_dict, self.layout = train_iter, config_dict, layout

  def __call__(self, step: int, state) -> None:
    self.step_log.drain(keep_last=False)  # never checkpoint a state whose loss was not seen finite
    t0 = time.perf_counter()
    # A no-op when this step is already saved (a stop signal right after a periodic save).
    self.ckpt.save(step, state, self.train_iter, self.config_dict, self.layout, force=True)
    blocked = time.perf_counter() - t0  # async: only the device-to-host copy blocks
    self.step_log.carry['checkpoint_block_s'] = blocked  # reported with the next logged step
    self.throughput.exclude(blocked)


def _evaluate(evaluate: Evaluator, step_log: StepLog, throughput: Throughput, step: int,
              state) -> None:
  t0 = time.perf_counter()
  evals = evaluate(state)
  if evals:  # {} on synthetic data: no evaluation line
    evals['eval_s'] = time.perf_counter() - t0
  step_log.add_eval(step, evals)
  throughput.exclude(time.perf_counter() - t0)  # evaluation is not training time


def _stream_count(ckpt: Checkpointer, requested: int, n_proc: int) -> int:
  """The number of input streams: the newest checkpoint's, else `requested` (data.streams), else
  n_proc (requested 0).

  The data-position rule: a resumed run continues every stream where the checkpoint left it,
  on any process count that divides the stream count (each process reads streams / processes
  of them); another count is refused, naming the counts that fit.
  """
  step = ckpt.latest_step()
  saved = saved_stream_count(os.path.join(ckpt.step_dir(step), 'data')) \
      if step is not None else None
  if saved is None:
    streams = requested or n_proc
    if streams % n_proc:
      raise CheckpointError(f'data.streams={streams} cannot be split evenly over {n_proc} '
                            'processes; use a multiple of the process count')
    return streams
  if requested and requested != saved:
    raise CheckpointError(f'data.streams={requested}, but checkpoint {ckpt.step_dir(step)} '
                          f'holds the data position of {saved} streams; the stream count of a '
                          'run is fixed at its first start (leave data.streams at 0 or set it '
                          f'to {saved})')
  if saved % n_proc:
    fits = [d for d in range(1, saved + 1) if saved % d == 0]
    raise CheckpointError(f'checkpoint {ckpt.step_dir(step)} holds the data position of '
                          f'{saved} streams, which {n_proc} processes cannot split evenly; '
                          f'resume on {", ".join(map(str, fits))} process(es)')
  return saved


class _StepProfiler:
  """A jax.profiler trace of steps [log.profile_start_step, + log.profile_steps) on process 0.

  Writes `<workdir>/profile/plugins/profile/<time>/` (xplane.pb, trace.json.gz and
  perfetto_trace.json.gz); `benchmarks/trace_summary.py` summarises it.
  """

  def __init__(self, cfg, workdir: str, start: int, end: int, primary: bool):
    self.first = cfg.log.profile_start_step
    # A run that ends inside the window stops there, before its final checkpoint.
    self.last = min(self.first + cfg.log.profile_steps - 1, end)
    self.directory = os.path.join(workdir, 'profile')
    # A resumed run already past the first profiled step does not trace.
    self.enabled = primary and self.first > start
    self.compile_included = self.first == start + 1
    self.active = False

  def before(self, step: int, state) -> None:
    """Called before `step` runs: starts the trace on an idle device at the first step."""
    if not self.enabled or step != self.first:
      return
    jax.block_until_ready(state)  # the previous step's kernels stay out of the trace
    jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
    self.active = True
    log.info('profiling steps %d-%d into %s; their step times and tokens/s include tracing '
             'overhead%s', self.first, self.last, self.directory,
             ' and compilation (the first step of this run)' if self.compile_included else '')

  def after(self, step: int, outputs) -> float:
    """Called after `step` was dispatched; stops after the last one. Returns seconds stopping."""
    if not self.active or step != self.last:
      return 0.0
    jax.block_until_ready(outputs)  # the trace holds the whole steps
    t0 = time.perf_counter()
    self.stop()
    return time.perf_counter() - t0

  def stop(self) -> None:
    jax.profiler.stop_trace()
    self.active = False
    runs = glob.glob(os.path.join(self.directory, 'plugins', 'profile', '*'))
    log.info('wrote the profile of steps %d-%d to %s (summary: python '
             'benchmarks/trace_summary.py %s)', self.first, self.last,
             max(runs, key=os.path.getmtime) if runs else self.directory, self.directory)

  def close(self) -> None:
    """Stop a trace the run left open (an exception or a signal inside the window)."""
    if self.active:
      try:
        self.stop()
      except Exception:  # never mask the exception that ended the run
        log.exception('stopping the profiler trace failed')
        self.active = False


def _keep_tokenizer(cfg, workdir: str):
  """A copy of the data's tokenizer in the work directory: generation reads it there, however
  the data cache moves later."""
  if cfg.data.synthetic:
    return
  target = os.path.join(workdir, 'tokenizer.json')
  shutil.copyfile(tokenizer_path_of(cfg.data), target + '.tmp')
  os.replace(target + '.tmp', target)
