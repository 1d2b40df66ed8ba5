"""train.compilation_cache_dir: a second run loads the programs the first one compiled."""

import json
import logging
import os
import re

import jax

from deepseek41.config import resolve
from deepseek41.train.optimizer import learning_rate_schedule
from deepseek41.train.trainer import CompilationCache, train
from tests.helpers import small_config

# One window-attention layer: the test is about the cache, and every layer is compile time.
ONE_LAYER = {'model.num_layers': 1, 'model.num_encoder_layers': 0, 'model.compress_ratios': (0,),
             'model.kv_source_layer_ids': (), 'model.index_source_layer_ids': (),
             'model.candidate_source_layer_id': -1, 'model.engram_layer_ids': ()}


def _run(workdir, cache_dir, caplog, **overrides):
  caplog.clear()
  with caplog.at_level(logging.INFO, logger='deepseek41'):
    train(small_config(**ONE_LAYER, **{'train.steps': 2,
                                       'train.compilation_cache_dir': str(cache_dir),
                                       **overrides}),
          str(workdir))
  first_step = [r.getMessage() for r in caplog.records if 'first step' in r.getMessage()]
  losses = [json.loads(line)['loss'] for line in open(workdir / 'metrics.jsonl')]
  return first_step, losses


def _phase(text, name):
  return float(re.search(rf'{name} ([0-9.]+) s', text).group(1))


def _entries(cache_dir):
  return {f for f in os.listdir(cache_dir) if f.endswith('-cache')}


def _stored(cache_dir):
  store = cache_dir / 'deepseek41-executables'
  return sorted(os.listdir(store)) if store.is_dir() else []


def test_second_run_loads_what_the_first_compiled(tmp_path, caplog, monkeypatch):
  # Whatever this machine's compile speed (the steps take seconds here, tens on the GPU).
  monkeypatch.setattr(CompilationCache, 'MIN_COMPILE_SECS', 0.0)
  before = jax.config.jax_compilation_cache_dir
  cache = tmp_path / 'cache'
  log1, losses1 = _run(tmp_path / 'a', cache, caplog)
  written = _entries(cache)
  assert written, 'the first run wrote nothing to the cache'
  # By its first step the first run compiled the initialisation and the update step (and,
  # with no floor on compile time, the eager ops before them) and wrote them all; the update
  # step's executable also went to the executable store (train/executable_store.py).
  n_first = int(re.search(r'(\d+) compiled and written', log1[0]).group(1))
  assert n_first >= 2 and '0 program(s) loaded' in log1[0]
  assert len(_stored(cache)) == 1

  log2, losses2 = _run(tmp_path / 'b', cache, caplog)
  messages = [r.getMessage() for r in caplog.records]
  assert _entries(cache) == written and len(_stored(cache)) == 1  # nothing compiled anew
  # the update step from the store, untraced; everything else from the persistent cache
  assert any('train_step loaded from the executable store' in m for m in messages), messages
  assert f'{n_first - 1} program(s) loaded' in log2[0] and '0 compiled and written' in log2[0]
  assert losses2 == losses1  # the same training

  # train.store_executables=False: the persistent cache alone, which serves the update step too
  log3, losses3 = _run(tmp_path / 'c', cache, caplog, **{'train.store_executables': False})
  assert f'{n_first} program(s) loaded' in log3[0] and '0 compiled and written' in log3[0]
  assert not any('executable store' in r.getMessage() for r in caplog.records)
  assert losses3 == losses1

  # Another schedule (lr, length, warm-up, decay): the update step takes its numbers as an
  # argument (train/optimizer.py SCHEDULE_KEYS), so it is the stored executable again, and it
  # trains with the new schedule.
  sweep = {'train.lr': 3e-3, 'train.steps': 3, 'train.warmup_steps': 2, 'train.min_lr_ratio': 0.5}
  _, losses4 = _run(tmp_path / 'd', cache, caplog, **sweep)
  messages = [r.getMessage() for r in caplog.records]
  assert any('train_step loaded from the executable store' in m for m in messages), messages
  assert len(_stored(cache)) == 1
  assert losses4[0] == losses1[0] and losses4[1] != losses1[1]  # the first update differs
  schedule = learning_rate_schedule(resolve(small_config(**ONE_LAYER, **sweep)).train)
  logged = [json.loads(line)['lr'] for line in open(tmp_path / 'd' / 'metrics.jsonl')]
  assert logged == [float(schedule(c)) for c in range(3)]
  assert jax.config.jax_compilation_cache_dir == before  # the process's own settings are back


def test_empty_dir_turns_the_cache_off():
  before = jax.config.jax_compilation_cache_dir
  with CompilationCache('') as cache:
    assert jax.config.jax_compilation_cache_dir is None
    jax.jit(lambda x: x + 1)(1)
  text = cache.describe()
  assert text.startswith('persistent compilation cache off; tracing ')
  # the jit above was traced, lowered and compiled (milliseconds: the log rounds them to 0.0),
  # and nothing was read from a cache
  phases = cache.phase_s
  assert phases['tracing'] > 0 and phases['lowering'] > 0 and phases['compiling or loading'] > 0
  assert phases['cache reads'] == 0 and _phase(text, 'cache reads') == 0
  assert jax.config.jax_compilation_cache_dir == before


def test_a_restart_loads_the_update_step_it_compiled_before(tmp_path, caplog, monkeypatch):
  # A resumed run (same config, restored state) must hit the cache: a preempted job's restart is
  # where start-up time matters most.
  monkeypatch.setattr(CompilationCache, 'MIN_COMPILE_SECS', 0.0)
  cache = tmp_path / 'cache'
  overrides = {**ONE_LAYER, 'train.steps': 4, 'train.compilation_cache_dir': str(cache),
               'checkpoint.every_steps': 2}
  with caplog.at_level(logging.INFO, logger='deepseek41'):
    train(small_config(**overrides), str(tmp_path / 'a'), stop_at_step=2)
    written = _entries(cache)
    caplog.clear()
    train(small_config(**overrides), str(tmp_path / 'a'))
  first_step = [r.getMessage() for r in caplog.records if 'first step' in r.getMessage()]
  assert any('resumed' in r.getMessage() for r in caplog.records)
  assert '0 compiled and written' in first_step[0], first_step[0]
  assert _entries(cache) == written
  # the update step was loaded from the executable store ahead of its first call, so neither
  # traced nor lowered, and nothing else needed compiling (train/executable_store.py)
  assert '0 program(s) loaded' in first_step[0] and _phase(first_step[0], 'lowering') == 0
  messages = [r.getMessage() for r in caplog.records]
  assert any('train_step loaded from the executable store' in m for m in messages), messages
  assert not any('differ from those compiled ahead' in m for m in messages)


def test_nothing_else_traces_while_the_update_step_traces_ahead(tmp_path, monkeypatch):
  """Two threads tracing at once can each trace the same inner jit and lower a module of other
  bytes, so another persistent-cache key (train/compiled.py): a fresh run of configs/tiny.py
  wrote an update step that its restart did not find. So the initialisation (fresh) and what
  follows the restore start only once the compile ahead has lowered its program."""
  from deepseek41.train import trainer  # noqa: PLC0415
  steps, seen = [], []
  compile_ahead = trainer.CompiledStep.compile_ahead

  def recording(self, *args):
    steps.append(self)
    compile_ahead(self, *args)

  def lowered():
    return all(a.lowered.is_set() for s in steps for a in s._ahead.values())

  def initial_state(*args, **kwargs):
    seen.append(('initial_state', lowered()))
    return original(*args, **kwargs)

  def evaluator(*args, **kwargs):
    seen.append(('evaluator', lowered()))
    return original_evaluator(*args, **kwargs)
  original, original_evaluator = trainer.initial_state, trainer.Evaluator
  monkeypatch.setattr(trainer.CompiledStep, 'compile_ahead', recording)
  monkeypatch.setattr(trainer, 'initial_state', initial_state)
  monkeypatch.setattr(trainer, 'Evaluator', evaluator)
  overrides = {**ONE_LAYER, 'train.steps': 2, 'checkpoint.every_steps': 1}
  train(small_config(**overrides), str(tmp_path), stop_at_step=1)  # fresh
  train(small_config(**overrides), str(tmp_path))                   # restored
  assert [s.name for s in steps] == ['train_step', 'train_step']
  # fresh: initialised after it lowered; restored: beside it, nothing traced after
  assert [seen[i] for i in (0, 1, 3)] == [('initial_state', True), ('evaluator', True),
                                          ('evaluator', True)]
  assert seen[2][0] == 'initial_state'
