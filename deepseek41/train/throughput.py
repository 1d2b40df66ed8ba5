"""Throughput over a window of logged steps: step time, tokens/s, model TFLOP/s, MFU, data wait.

The window opens after a step's metrics were written and closes at the next logged step. Time
that is not training (compilation, evaluation, checkpoint blocking, writing a profile) is
excluded; the compile step is not timed at all. Beside the window, the run so far: every step
since the compile step over the training time since it (`run_tokens_per_s`, `run_mfu`), the
figure a whole run's windows should average to, and what wall time / tokens gives.

Each step's own time is the interval between the host seeing two consecutive steps finish (the
trainer fetches a step's loss one step late, so the device always holds the next step): the
window's shortest and longest (`step_time_min_s`, `step_time_max_s`) tell a window whose steps
really ran faster from one that lost or gained a step's time in its bookkeeping.
"""

from __future__ import annotations

import math
import time


class Throughput:
  """Timing bookkeeping for one run; `scalars()` reports the current window."""

  def __init__(self, *, tokens_per_step: int, flops_per_token, peak_tflops: float | None,
               device_count: int, process_count: int, vision: bool):
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token.total
    self.flops_per_image = flops_per_token.vision_per_image  # 0 without the vision tower
    self.peak_tflops = peak_tflops
    self.device_count = device_count
    self.process_count = process_count
    self.vision = vision
    self.t0: float | None = None  # None: not timing (the compile step)
    self.steps = 0
    self.wait_s = 0.0
    self.local_images = 0
    self.run_t0: float | None = None  # the end of the compile step, once `begin_run` saw it
    self.last_seen: float | None = None  # when the previous counted step was seen finished
    self.step_min_s, self.step_max_s = math.inf, 0.0
    self.run_steps = 0
    self.run_excluded_s = 0.0
    self.run_images = 0

  def start(self) -> None:
    """Open a new window now."""
    self.t0 = time.perf_counter()
    self.steps, self.wait_s, self.local_images = 0, 0.0, 0
    self.last_seen = self.t0
    self.step_min_s, self.step_max_s = math.inf, 0.0

  def begin_run(self) -> None:
    """Start the run's count now (after the compile step) and open a window."""
    self.run_t0, self.run_steps, self.run_excluded_s, self.run_images = \
        time.perf_counter(), 0, 0.0, 0
    self.start()

  def pause(self) -> None:
    """Stop timing until the next start() (the compile step is not throughput)."""
    self.t0 = None

  def exclude(self, seconds: float) -> None:
    """Leave `seconds` of non-training time (evaluation, saving, profiling) out of the window."""
    if self.t0 is not None:
      self.t0 += seconds
      self.last_seen += seconds
    if self.run_t0 is not None:
      self.run_excluded_s += seconds

  def count_step(self, data_wait_s: float) -> None:
    """A step seen finished now (its loss fetched)."""
    if self.t0 is not None:
      now = time.perf_counter()
      self.step_min_s = min(self.step_min_s, now - self.last_seen)
      self.step_max_s = max(self.step_max_s, now - self.last_seen)
      self.last_seen = now
      self.steps += 1
      self.wait_s += data_wait_s
      if self.run_t0 is not None:
        self.run_steps += 1

  def count_images(self, local_images: int) -> None:
    """Images this process fed to a step (summed over processes in scalars())."""
    self.local_images += local_images
    if self.run_t0 is not None:
      self.run_images += local_images

  def _model_flops(self, steps: int, local_images: int) -> float:
    return (steps * self.tokens_per_step * self.flops_per_token
            + local_images * self.process_count * self.flops_per_image)

  def scalars(self) -> dict[str, float]:
    now = time.perf_counter()
    timed = self.t0 is not None and self.steps > 0
    elapsed = now - self.t0 if timed else math.nan
    step_time = elapsed / self.steps if timed else math.nan
    images = self.local_images * self.process_count
    flops = self._model_flops(self.steps, self.local_images)
    out = {
        'step_time_s': step_time,
        'tokens_per_s': self.tokens_per_step / step_time,
        'model_tflops_per_s': flops / elapsed / 1e12 if timed else math.nan,
        'data_wait_s': self.wait_s / self.steps if timed else math.nan,
        'step_time_min_s': self.step_min_s if timed else math.nan,
        'step_time_max_s': self.step_max_s if timed else math.nan,
    }
    if self.peak_tflops:
      out['mfu'] = out['model_tflops_per_s'] / (self.peak_tflops * self.device_count)
    if self.vision and timed:
      out['images_per_s'] = images / elapsed
    if self.run_t0 is not None and self.run_steps > 0:
      run_s = now - self.run_t0 - self.run_excluded_s
      out['run_s'] = run_s
      out['run_tokens_per_s'] = self.run_steps * self.tokens_per_step / run_s
      if self.peak_tflops:
        out['run_mfu'] = (self._model_flops(self.run_steps, self.run_images) / run_s / 1e12
                          / (self.peak_tflops * self.device_count))
    return out
