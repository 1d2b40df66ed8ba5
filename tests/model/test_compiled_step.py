"""train/compiled.py: a step compiled ahead from abstract values runs as that executable; other
arguments compile where they are called; a failed compile ahead is reported and redone; and the
trainer's abstract batch is what the input pipeline feeds (else every restart compiles twice)."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from deepseek41.config import load_config_file, resolve
from deepseek41.data.pipeline import DataStreams
from deepseek41.sharding import batch_sharding, make_mesh
from deepseek41.train.compiled import CompiledStep, signature
from deepseek41.train.feed import abstract_batch, global_batch
from tests.helpers import REPO_ROOT

MESH = jax.make_mesh((1,), ('data',))
REPLICATED = NamedSharding(MESH, P())


def _counting_step():
  traces = []

  def step(x, y):
    traces.append(x.shape)
    return x * 2 + y
  return jax.jit(step, in_shardings=(REPLICATED, REPLICATED)), traces


def test_a_signature_is_the_tree_shapes_dtypes_weak_types_and_shardings():
  x = jax.device_put(jnp.ones((4, 8), jnp.bfloat16), REPLICATED)
  assert signature((x,)) == signature((jax.ShapeDtypeStruct((4, 8), jnp.bfloat16,
                                                            sharding=REPLICATED),))
  assert signature((x,)) != signature((jax.ShapeDtypeStruct((4, 8), jnp.float32,
                                                            sharding=REPLICATED),))
  assert signature((x,)) != signature(([x],))
  strong, weak = (jax.ShapeDtypeStruct((), jnp.float32, weak_type=w) for w in (False, True))
  assert signature((strong,)) != signature((weak,))


def test_the_first_call_runs_what_was_compiled_ahead(caplog):
  jitted, traces = _counting_step()
  step = CompiledStep(jitted, 'step', mesh=MESH)
  step.compile_ahead(jax.ShapeDtypeStruct((4,), jnp.float32, sharding=REPLICATED),
                     jax.ShapeDtypeStruct((4,), jnp.float32, sharding=REPLICATED))
  step.wait_lowered()
  assert traces == [(4,)]  # traced in the background
  x = jax.device_put(jnp.arange(4.0), REPLICATED)
  with caplog.at_level(logging.INFO):
    for _ in range(3):
      np.testing.assert_array_equal(step(x, x), np.arange(4.0) * 3)
  assert traces == [(4,)]  # never traced again
  assert any('step compiled ahead' in r.getMessage() for r in caplog.records)
  # arguments of another signature compile at their call (once), as jit would
  y = jax.device_put(jnp.ones(6), REPLICATED)
  np.testing.assert_array_equal(step(y, y), np.full(6, 3.0))
  np.testing.assert_array_equal(step(y, y), np.full(6, 3.0))
  assert traces == [(4,), (6,)] and len(step.compiled) == 2


def test_first_arguments_unlike_the_abstract_ones_are_compiled_and_said(caplog):
  jitted, traces = _counting_step()
  step = CompiledStep(jitted, 'step', mesh=MESH)
  step.compile_ahead(*[jax.ShapeDtypeStruct((4,), jnp.float32, sharding=REPLICATED)] * 2)
  x = jax.device_put(jnp.ones(5), REPLICATED)
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(step(x, x), np.full(5, 3.0))
  assert any('differ from those compiled ahead' in r.getMessage() for r in caplog.records)


def test_a_failed_compile_ahead_is_reported_and_the_call_raises_its_error(caplog):
  def step(x):
    if x.shape[0] == 3:
      raise ValueError('three rows are refused')
    return x + 1
  compiled = CompiledStep(jax.jit(step), 'step', mesh=MESH)
  compiled.compile_ahead(jax.ShapeDtypeStruct((3,), jnp.float32, sharding=REPLICATED))
  compiled.wait_lowered()
  with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match='three rows'):
    compiled(jax.device_put(jnp.ones(3), REPLICATED))
  assert any('compile ahead failed (ValueError: three rows are refused)' in r.getMessage()
             for r in caplog.records)


@pytest.mark.parametrize('config,engram', [('tiny.py', False), ('tiny.py', True),
                                           ('tiny_multimodal.py', False)])
def test_the_abstract_batch_is_what_the_input_feeds(config, engram):
  cfg = resolve(load_config_file(os.path.join(REPO_ROOT, 'configs', config)),
                num_devices=jax.device_count(), backend='cpu')
  mesh = make_mesh(cfg.mesh)
  sharding = batch_sharding(mesh, cfg.mesh.rules)
  streams = DataStreams(cfg.data, split='train', batch_size=cfg.train.batch_size,
                        seed=cfg.train.seed, total=1, process_index=0, process_count=1,
                        synthetic_vocab_size=cfg.model.vocab_size)
  try:
    local = next(streams)
  finally:
    streams.close()
  engram_map = np.arange(cfg.model.vocab_size, dtype=np.int32) if engram else None
  fed = global_batch(local, sharding, engram_map, vision=cfg.model.vision)
  assert signature(fed) == signature(abstract_batch(cfg, sharding=sharding, engram=engram))
