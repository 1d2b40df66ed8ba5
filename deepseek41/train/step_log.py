"""Per-step metrics, fetched one step late: step n's scalars are pulled to the host after step
n+1 was dispatched, so the device never waits for logging. Every fetched loss is checked to be
finite before anything (a log line, a checkpoint) relies on it."""

from __future__ import annotations

import collections
import math
from typing import Any, Callable

import jax
import numpy as np

from deepseek41.train.metrics import MetricsWriter
from deepseek41.train.throughput import Throughput


class TrainingDiverged(RuntimeError):
  """A non-finite loss; the message names the step and the state of the newest checkpoint."""


def load_scalars(load_lme: np.ndarray, bias_lme: np.ndarray) -> dict[str, float]:
  """Per layer and modality: max/mean expert load (1.0 = perfectly balanced; only where the
  modality had tokens) and the spread (max - min) of that modality's correction bias."""
  out = {}
  for l, (load_me, bias_me) in enumerate(zip(load_lme, bias_lme)):
    for m, name in enumerate(('text', 'image')):
      total = load_me[m].sum()
      if total > 0:
        out[f'expert_load_max_over_mean/layer{l}/{name}'] = float(load_me[m].max()
                                                                  / load_me[m].mean())
      out[f'router_bias_spread/layer{l}/{name}'] = float(bias_me[m].max() - bias_me[m].min())
  return out


def peak_device_memory_gb() -> float | None:
  """Peak bytes in use on this process's devices since start (GPU/TPU; None where unreported)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use') for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


class StepLog:
  """Dispatched steps' device metrics until they are fetched, checked and written."""

  def __init__(self, cfg, writer: MetricsWriter, throughput: Throughput,
               describe_checkpoint: Callable[[], str]):
    self.cfg = cfg
    self.writer = writer
    self.throughput = throughput
    self.describe_checkpoint = describe_checkpoint
    self.pending: collections.deque[tuple[int, Any, float]] = collections.deque()
    self.evals: dict[int, dict[str, float]] = {}  # written with that step's training metrics
    self.carry: dict[str, float] = {}             # written with the next logged step
    self.last_loss: float | None = None
    self.last_eval_loss: float | None = None

  def push(self, step: int, metrics, data_wait_s: float) -> None:
    self.pending.append((step, metrics, data_wait_s))

  def drain(self, keep_last: bool) -> None:
    """Fetch, check and write the dispatched steps (all but the newest when keep_last)."""
    while len(self.pending) > (1 if keep_last else 0):
      self._fetch(*self.pending.popleft())

  def add_eval(self, step: int, evals: dict[str, float]) -> None:
    """Held-out losses of `step`: on that step's line, or on their own line if it was written."""
    if not evals:
      return
    self.last_eval_loss = evals.get('eval_loss')
    if not any(s == step for s, _, _ in self.pending):  # already written (a run's 1st step)
      self.writer.write(step, {'loss': self.last_loss, 'tokens_per_s': None, **evals})
    else:
      self.evals[step] = evals

  def _fetch(self, step: int, metrics, data_wait_s: float) -> None:
    loss, grad_norm = float(metrics['loss']), float(metrics['grad_norm'])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      raise TrainingDiverged(
          f'non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; stopping. '
          f'{self.describe_checkpoint()}')
    self.last_loss = loss
    self.throughput.count_step(data_wait_s)
    self.writer.advance(step, loss)
    if not (step % self.cfg.log.every_steps == 0 or step == self.cfg.train.steps
            or step in self.evals):
      return
    m = self.cfg.model
    host = jax.device_get(metrics)
    scalars = {'loss': loss, 'balance_loss': float(host['balance_loss']),
               'grad_norm': float(host['grad_norm']), 'lr': float(host['lr'])}
    timing = self.throughput.scalars()
    scalars.update({k: timing[k] for k in ('step_time_s', 'tokens_per_s', 'model_tflops_per_s',
                                           'data_wait_s', 'step_time_min_s', 'step_time_max_s')})
    scalars['dropped_frac'] = float(host['dropped']) / max(
        float(host['routed_tokens']) * m.num_experts_per_tok * m.num_layers, 1.0)
    engram_layers = len(m.engram_layer_ids) if m.engram else 0
    if engram_layers:  # lookups past the table exchange's chunks (ops/parallel/engram_lookup.py)
      scalars['engram_dropped_frac'] = float(host['engram_dropped']) / max(
          float(host['routed_tokens']) * (m.engram_max_ngram - 1) * m.engram_n_heads
          * engram_layers, 1.0)
    if m.csa2:
      scalars['indexer_loss'] = float(host['indexer_loss'])
      scalars['indexer_recall'] = float(host['indexer_recall'])
    scalars.update({k: timing[k] for k in ('mfu', 'images_per_s', 'run_s', 'run_tokens_per_s',
                                           'run_mfu')
                    if k in timing})
    scalars.update({k: float(v) for k, v in host.get('extra', {}).items()})  # a stage's own
    peak_gb = peak_device_memory_gb()
    if peak_gb is not None:
      scalars['peak_memory_gb'] = peak_gb
    scalars.update(load_scalars(np.asarray(host['load_lme']), np.asarray(host['bias_lme'])))
    scalars.update(self.evals.pop(step, {}))
    scalars.update(self.carry)
    self.carry.clear()
    self.writer.write(step, scalars)
    self.throughput.start()
