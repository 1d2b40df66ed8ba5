"""The training loop: config -> mesh -> data -> state (init or resume) -> steps -> checkpoints.

Reads top to bottom in sections. Metrics are fetched one step late: step n+1 is dispatched before
step n's scalars are pulled to the host, so the device never waits for logging.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.batch import batch_keys
from deepseek41.config import RunConfig, format_role_table, resolve
from deepseek41.data.pipeline import make_dataset, vocab_size_of
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.checkpoint import Checkpointer
from deepseek41.train.flops import device_peak_tflops, flops_per_token
from deepseek41.train.metrics import MetricsWriter
from deepseek41.train.optimizer import make_optimizer
from deepseek41.train.step import make_eval_step, make_train_step

log = logging.getLogger('deepseek41')


class TrainingDiverged(RuntimeError):
  """A non-finite loss; the message names the step. Checkpoints before it are kept intact."""


@dataclasses.dataclass
class TrainResult:
  step: int
  last_loss: float | None
  last_eval_loss: float | None
  stopped_by_signal: bool


class _StopFlag:
  """SIGTERM / SIGINT request a save-and-exit at the next step boundary."""

  def __init__(self):
    self.signal: int | None = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signal is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C aborts without waiting for the save
    self.signal = signum
    log.warning('received %s: saving a checkpoint at the next step boundary, then exiting',
                signal.Signals(signum).name)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


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


def _global_batch(local: dict[str, np.ndarray], sharding: NamedSharding,
                  engram_map: np.ndarray | None = None, *, vision: bool = False,
                  blank_images: bool = False) -> dict[str, jax.Array]:
  """The process-local batch as global arrays; with an Engram compression map, also the
  compressed ids (`engram_tokens`) the Engram hashes read. `blank_images` replaces every image
  by a uniform black one (the caption evaluation's control)."""
  local = dict(local)
  if engram_map is not None:
    local['engram_tokens'] = engram_map[np.asarray(local['tokens'])]
  if blank_images:
    local['image_patches'] = np.zeros_like(local['image_patches'])
  keys = batch_keys(vision) + (('engram_tokens',) if engram_map is not None else ())
  # Pixels stay uint8 on the way to the device (4x less transfer); the model normalises them.
  return {k: jax.make_array_from_process_local_data(
              sharding, np.asarray(local[k], np.uint8 if k == 'image_patches' else np.int32))
          for k in keys}


def _engram_compression(cfg) -> np.ndarray | None:
  """old id -> compressed id from the data's tokenizer when model.engram_compressed_vocab_size
  asks for compression (ARCHITECTURE.md 3.12); None to hash raw ids."""
  m = cfg.model
  if not (m.engram and m.engram_layer_ids and m.engram_compressed_vocab_size):
    return None
  from deepseek41.config import ConfigError
  from deepseek41.data.pipeline import tokenizer_path_of
  from deepseek41.model.engram_hash import compress_vocab, vocab_strings
  if cfg.data.synthetic:
    raise ConfigError('model.engram_compressed_vocab_size: synthetic data has no tokenizer to '
                      'compress; set it to 0')
  path = tokenizer_path_of(cfg.data)
  import tokenizers
  mapping, count = compress_vocab(*vocab_strings(tokenizers.Tokenizer.from_file(path)))
  if count != m.engram_compressed_vocab_size:
    raise ConfigError(f'model.engram_compressed_vocab_size: {m.engram_compressed_vocab_size}, but '
                      f'the tokenizer {path} compresses to {count} ids')
  return mapping.astype(np.int32)


def _load_scalars(load_lme: np.ndarray, bias_lme: np.ndarray) -> dict[str, float]:
  """Per layer and modality: max/mean expert load (1.0 = perfectly balanced; only where the
  modality had tokens) and the spread (max - min) of that modality's correction bias."""
  out = {}
  for l, (load_me, bias_me) in enumerate(zip(load_lme, bias_lme)):
    for m, name in enumerate(('text', 'image')):
      total = load_me[m].sum()
      if total > 0:
        out[f'expert_load_max_over_mean/layer{l}/{name}'] = float(load_me[m].max() / load_me[m].mean())
      out[f'router_bias_spread/layer{l}/{name}'] = float(bias_me[m].max() - bias_me[m].min())
  return out


def _peak_device_memory_gb() -> float | None:
  """Peak bytes in use on this process's devices since start (GPU/TPU; None where unreported)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use') for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


def train(config, workdir: str, *, stop_at_step: int | None = None) -> TrainResult:
  """Run (or resume) training as configured; `config` is an ml_collections.ConfigDict.

  `stop_at_step` ends this invocation early (with a checkpoint) at that step, without changing
  the schedule: the run continues from there when started again.
  """
  # ---- config and work directory -----------------------------------------------------------
  cfg: RunConfig = resolve(config)
  primary = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if primary:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(cfg.to_json())

  # ---- mesh --------------------------------------------------------------------------------
  mesh = make_mesh(cfg.mesh)
  rules = cfg.mesh.rules
  log.info('mesh %s over %d %s device(s)', dict(mesh.shape), jax.device_count(),
           jax.devices()[0].device_kind)
  log.info('layer roles (%s):\n%s',
           'CSA2 on: ratio>0 layers add their selected compressed entries to the window'
           if cfg.model.csa2 else 'CSA2 off: every layer attends over its sliding window only',
           format_role_table(cfg.model))

  # ---- data --------------------------------------------------------------------------------
  if not cfg.data.synthetic:
    vocab = vocab_size_of(cfg.data)
    if vocab > cfg.model.vocab_size:
      from deepseek41.config import ConfigError
      raise ConfigError(f'model.vocab_size: {cfg.model.vocab_size} is smaller than the '
                        f'tokenizer vocabulary of the data ({vocab})')
  engram_map = _engram_compression(cfg)
  n_proc = jax.process_count()
  local_batch = cfg.train.batch_size // n_proc
  train_ds = make_dataset(cfg.data, split='train', batch_size=local_batch, seed=cfg.train.seed,
                          process_index=jax.process_index(), process_count=n_proc,
                          synthetic_vocab_size=cfg.model.vocab_size)
  train_iter = iter(train_ds)
  bsharding = batch_sharding(mesh, rules)

  # ---- model, optimizer, state -------------------------------------------------------------
  tx = make_optimizer(cfg.train)
  md = state_lib.model_def(cfg, tx)
  abstract = state_lib.abstract_state(cfg, tx)
  shardings = state_lib.state_shardings(abstract, mesh, rules)
  layout = state_lib.state_layout(abstract)
  n_params = state_lib.count_params(abstract['params'])
  fpt = flops_per_token(cfg.model, cfg.data.seq_len)
  peak = device_peak_tflops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
  log.info('parameters: %s total, %s active matmul per token', f'{n_params:,}',
           f'{fpt.matmul_params:,}')
  log.info('%s', fpt.formula)
  log.info('peak: %s', f'{peak:g} TFLOP/s per device (bf16 dense)' if peak else
           'unknown for this device: MFU not reported (set train.peak_tflops)')

  ckpt = Checkpointer(workdir, cfg.checkpoint)
  start = ckpt.latest_step()
  if start is not None:
    for w in ckpt.validate(start, layout, cfg.to_dict()):
      log.warning('config differs from checkpoint %d: %s', start, w)
    state = ckpt.restore(start, state_lib.with_shardings(abstract, shardings), train_iter)
    log.info('resumed from %s', ckpt.step_dir(start))
  else:
    state, _ = state_lib.init_state(cfg, tx, mesh, rules)
    start = 0
  if int(jax.device_get(state['step'])) != start:
    raise RuntimeError(f'checkpoint {start} holds state step {int(state["step"])}')

  replicated = NamedSharding(mesh, P())
  with jax.set_mesh(mesh):
    train_step = jax.jit(make_train_step(cfg, md), in_shardings=(shardings, bsharding),
                         out_shardings=(shardings, replicated), donate_argnums=(0,))
    eval_step = jax.jit(make_eval_step(md), in_shardings=(shardings, bsharding),
                        out_shardings=replicated)

  writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard,
                         progress_bar=cfg.log.progress_bar, total_steps=cfg.train.steps,
                         start_step=start, enabled=primary)
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  config_dict = cfg.to_dict()

  # ---- evaluation --------------------------------------------------------------------------
  vision = cfg.model.vision

  def held_out_losses(state, kinds=('text', 'image'),
                      blanks=(False,)) -> list[float | None]:
    """Mean held-out CE per entry of `blanks` (False: the batch as read, True: black images),
    all over the same batches, which are read and decoded once."""
    # An endless unshuffled stream: every process gets the same number of batches, and each
    # evaluation sees the same eval_batches batches.
    # In-process: worker start-up would cost more than the few evaluation batches.
    ds = make_dataset(dataclasses.replace(cfg.data, num_workers=0), split='heldout',
                      batch_size=local_batch, seed=cfg.train.seed,
                      process_index=jax.process_index(), process_count=n_proc, repeat=True,
                      shuffle=False, kinds=kinds)
    sums = np.zeros((len(blanks), 2))  # (ce_sum, tokens) per variant
    it = iter(ds)
    try:
      for _, local in zip(range(cfg.train.eval_batches), it):
        for i, blank in enumerate(blanks):
          batch = _global_batch(local, bsharding, engram_map, vision=vision, blank_images=blank)
          with jax.set_mesh(mesh):
            out = jax.device_get(eval_step(state, batch))
          sums[i] += (float(out['ce_sum']), float(out['tokens']))
    finally:
      if hasattr(it, 'close'):
        it.close()
    return [ce / n if n else None for ce, n in sums]

  def evaluate(state) -> dict[str, float]:
    """Held-out losses: `eval_loss` over the whole mixture; with image sources also the
    caption loss (the text of the image samples) with the real images and with blank ones."""
    if cfg.data.synthetic:
      return {}
    out = {'eval_loss': held_out_losses(state)[0]}
    if cfg.data.image_sources:
      out['eval_caption_loss_image'], out['eval_caption_loss_blank'] = held_out_losses(
          state, ('image',), blanks=(False, True))
    return {k: v for k, v in out.items() if v is not None}

  # ---- the loop ----------------------------------------------------------------------------
  pending: list[tuple[int, Any, float]] = []   # (step, device metrics, data wait seconds)
  eval_losses: dict[int, dict[str, float]] = {}  # written with that step's training metrics
  carry: dict[str, float] = {}                  # written with the next logged step
  window = {'t0': time.perf_counter(), 'steps': 0, 'wait': 0.0, 'images': 0}
  last = {'loss': None, 'eval_loss': None}

  def drain(keep_last: bool):
    """Fetch metrics of dispatched steps (all but the newest when keep_last)."""
    while len(pending) > (1 if keep_last else 0):
      step, metrics, wait = pending.pop(0)
      loss, grad_norm = float(metrics['loss']), float(metrics['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(
            f'non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; stopping. '
            f'The newest checkpoint before it ({ckpt.latest_step()}) is intact in '
            f'{ckpt.directory}.')
      last['loss'] = loss
      if window['t0'] is not None:
        window['steps'] += 1
        window['wait'] += wait
      writer.advance(step, loss)
      if step % cfg.log.every_steps == 0 or step == cfg.train.steps or step in eval_losses:
        host = jax.device_get(metrics)
        timed = window['t0'] is not None and window['steps'] > 0
        step_time = ((time.perf_counter() - window['t0']) / window['steps']) if timed else math.nan
        tps = tokens_per_step / step_time
        scalars = {
            'loss': loss, 'balance_loss': float(host['balance_loss']),
            'grad_norm': float(host['grad_norm']), 'lr': float(host['lr']),
            'step_time_s': step_time, 'tokens_per_s': tps,
            'model_tflops_per_s': tps * fpt.total / 1e12,
            'data_wait_s': window['wait'] / window['steps'] if timed else math.nan,
            'dropped_frac': float(host['dropped']) / max(
                float(host['routed_tokens']) * cfg.model.num_experts_per_tok * cfg.model.num_layers,
                1.0),
        }
        if cfg.model.csa2:
          scalars['indexer_loss'] = float(host['indexer_loss'])
          scalars['indexer_recall'] = float(host['indexer_recall'])
        if peak:
          scalars['mfu'] = scalars['model_tflops_per_s'] / (peak * jax.device_count())
        peak_gb = _peak_device_memory_gb()
        if peak_gb is not None:
          scalars['peak_memory_gb'] = peak_gb
        if vision and timed:
          scalars['images_per_s'] = window['images'] * n_proc / (step_time * window['steps'])
        scalars.update(_load_scalars(np.asarray(host['load_lme']), np.asarray(host['bias_lme'])))
        if step in eval_losses:
          scalars.update(eval_losses.pop(step))
        scalars.update(carry)
        carry.clear()
        writer.write(step, scalars)
        window.update(t0=time.perf_counter(), steps=0, wait=0.0, images=0)

  def save(step: int, force: bool = False):
    drain(keep_last=False)  # never checkpoint a state whose loss was not seen to be finite
    t0 = time.perf_counter()
    ckpt.save(step, state, train_iter, config_dict, layout, force=force)
    saved_steps.add(step)
    blocked = time.perf_counter() - t0  # async: only the device-to-host copy blocks the loop
    carry['checkpoint_block_s'] = blocked  # reported with the next logged step
    window['t0'] = window['t0'] and window['t0'] + blocked

  step = start
  stopped = False
  saved_steps = {start}  # the checkpoint resumed from (or nothing to save at step 0)
  if start == 0 and cfg.train.eval_every_steps:
    evals = evaluate(state)  # the starting point of the held-out curve
    if evals:
      last['eval_loss'] = evals.get('eval_loss')
      writer.write(0, {'loss': None, 'tokens_per_s': None, **evals})
  end = cfg.train.steps if stop_at_step is None else min(stop_at_step, cfg.train.steps)
  profiler = _StepProfiler(cfg, workdir, start, end, primary)
  try:
    with _StopFlag() as stop:
      while step < end:
        profiler.before(step + 1, state)
        t_wait = time.perf_counter()
        local = next(train_iter)
        batch = _global_batch(local, bsharding, engram_map, vision=vision)
        wait = time.perf_counter() - t_wait
        if vision:  # images this process fed (summed over processes by the x n_proc below)
          window['images'] += int((local['image_grid'][..., 0] > 0).sum())
        with jax.set_mesh(mesh), jax.profiler.StepTraceAnnotation('train', step_num=step + 1):
          state, metrics = train_step(state, batch)  # the annotation marks steps for xprof
        step += 1
        pending.append((step, metrics, wait))
        stopping = profiler.after(step, (state, metrics))
        if window['t0'] is not None:  # writing the trace is not training time
          window['t0'] += stopping
        if step == start + 1:  # keep compilation out of the throughput numbers
          jax.block_until_ready(metrics)
          log.info('first step (compilation included) took %.1f s', time.perf_counter() - t_wait)
          window['t0'] = None
          drain(keep_last=False)
          window.update(t0=time.perf_counter(), steps=0, wait=0.0, images=0)
        drain(keep_last=True)

        if cfg.train.eval_every_steps and (step % cfg.train.eval_every_steps == 0
                                           or step == cfg.train.steps):
          jax.block_until_ready(pending[-1][1] if pending else state['step'])
          t_eval = time.perf_counter()  # the step itself is not evaluation time
          evals = evaluate(state)
          if window['t0'] is not None:  # keep evaluation out of the training throughput
            window['t0'] += time.perf_counter() - t_eval
          if evals:
            last['eval_loss'] = evals.get('eval_loss')
            eval_losses[step] = evals
          drain(keep_last=False)
          if step in eval_losses:  # the step was already written (the first step of a run)
            writer.write(step, {'loss': last['loss'], 'tokens_per_s': None,
                                **eval_losses.pop(step)})
          window.update(t0=time.perf_counter(), steps=0, wait=0.0, images=0)
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
          save(step)
        if stop.signal is not None:
          save(step, force=True)
          stopped = True
          log.warning('saved checkpoint %d after %s; exiting', step,
                      signal.Signals(stop.signal).name)
          break
      else:
        if step not in saved_steps:
          save(step, force=True)
      drain(keep_last=False)
  finally:
    profiler.close()
    writer.close()
    ckpt.close()
    if hasattr(train_iter, 'close'):
      train_iter.close()
  return TrainResult(step=step, last_loss=last['loss'], last_eval_loss=last['eval_loss'],
                     stopped_by_signal=stopped)
