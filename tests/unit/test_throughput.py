"""Model FLOP/s counts the vision tower's work per image beside the LM's per token."""

import types

import pytest

from deepseek41.train import throughput as throughput_lib


def test_model_flops_count_tokens_and_images(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(throughput_lib.time, 'perf_counter', lambda: now[0])
  fpt = types.SimpleNamespace(total=1e6, vision_per_image=5e8)
  t = throughput_lib.Throughput(tokens_per_step=1000, flops_per_token=fpt, peak_tflops=1.0,
                                device_count=2, process_count=2, vision=True)
  t.start()
  for _ in range(4):  # 4 steps in 2 s; each process fed 3 images a step
    t.count_step(data_wait_s=0.1)
    t.count_images(3)
  now[0] += 2.0
  s = t.scalars()
  images = 4 * 3 * 2  # summed over the 2 processes
  flops = 4 * 1000 * 1e6 + images * 5e8
  assert s['model_tflops_per_s'] == pytest.approx(flops / 2.0 / 1e12)
  assert s['mfu'] == pytest.approx(flops / 2.0 / 1e12 / 2.0)
  assert s['tokens_per_s'] == pytest.approx(2000.0)
  assert s['images_per_s'] == pytest.approx(12.0)
  assert s['data_wait_s'] == pytest.approx(0.1)


def test_the_compile_step_is_not_timed():
  fpt = types.SimpleNamespace(total=1.0, vision_per_image=0)
  t = throughput_lib.Throughput(tokens_per_step=1, flops_per_token=fpt, peak_tflops=None,
                                device_count=1, process_count=1, vision=False)
  t.pause()
  t.count_step(data_wait_s=1.0)
  s = t.scalars()
  assert s['step_time_s'] != s['step_time_s']  # nan: nothing timed
  assert 'mfu' not in s and 'images_per_s' not in s


def test_the_run_figure_counts_every_step_since_compilation_over_training_time(monkeypatch):
  """Two windows (4 steps in 2 s, then 2 steps in 2 s with 1 s of evaluation left out): each
  window's tokens/s is its own; the run's is all 6 steps over the 3 s of training since the
  compile step, which is not counted."""
  now = [10.0]
  monkeypatch.setattr(throughput_lib.time, 'perf_counter', lambda: now[0])
  fpt = types.SimpleNamespace(total=1e6, vision_per_image=0)
  t = throughput_lib.Throughput(tokens_per_step=1000, flops_per_token=fpt, peak_tflops=1.0,
                                device_count=1, process_count=1, vision=False)
  t.pause()
  t.count_step(data_wait_s=0.0)  # the compile step
  now[0] += 30.0
  t.begin_run()
  for _ in range(4):
    t.count_step(data_wait_s=0.0)
  now[0] += 2.0
  first = t.scalars()
  assert first['tokens_per_s'] == first['run_tokens_per_s'] == pytest.approx(2000.0)
  t.start()
  now[0] += 1.0
  t.exclude(1.0)  # an evaluation
  for _ in range(2):
    t.count_step(data_wait_s=0.0)
  now[0] += 1.0
  second = t.scalars()
  assert second['tokens_per_s'] == pytest.approx(2000.0)   # 2 steps in the window's 1 s
  assert second['run_tokens_per_s'] == pytest.approx(6000 / 3.0)
  assert second['run_mfu'] == pytest.approx(6000 * 1e6 / 3.0 / 1e12)


def test_each_step_is_timed_between_two_finishes_with_exclusions_left_out(monkeypatch):
  """Steps seen finished 0.5, 0.3 (after 1 s of evaluation left out) and 0.4 s apart: the
  window's shortest and longest step, and its mean, agree."""
  now = [0.0]
  monkeypatch.setattr(throughput_lib.time, 'perf_counter', lambda: now[0])
  fpt = types.SimpleNamespace(total=1.0, vision_per_image=0)
  t = throughput_lib.Throughput(tokens_per_step=10, flops_per_token=fpt, peak_tflops=None,
                                device_count=1, process_count=1, vision=False)
  t.begin_run()
  now[0] += 0.5
  t.count_step(data_wait_s=0.0)
  now[0] += 1.3
  t.exclude(1.0)
  t.count_step(data_wait_s=0.0)
  now[0] += 0.4
  t.count_step(data_wait_s=0.0)
  s = t.scalars()
  assert s['step_time_min_s'] == pytest.approx(0.3)
  assert s['step_time_max_s'] == pytest.approx(0.5)
  assert s['step_time_s'] == pytest.approx(1.2 / 3)
  assert s['run_s'] == pytest.approx(1.2)
