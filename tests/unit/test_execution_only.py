"""Execution-only keys (config/schema.py marks them): a checkpoint resumes across a change of any
of them, and a change of any other model key is refused naming it (a real resume across them:
tests/system/test_training_runs.py)."""

import dataclasses
import json
import typing

import jax
import pytest

from deepseek41.config import SECTIONS, ModelConfig, execution_only_keys, resolve
from deepseek41.config.keys import keys_of
from deepseek41.train.checkpoint import CheckpointError, Checkpointer
from deepseek41.train.warm_start import check_fits
from tests.helpers import small_config

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

MODEL_KEYS = [f.name for f in keys_of(ModelConfig)]
EXECUTION_ONLY = sorted(execution_only_keys('model'))


def _another_value(name: str, value):
  """A value of `name` other than `value` that its declaration allows."""
  field = next(f for f in keys_of(ModelConfig) if f.name == name)
  choices = field.metadata['choices']
  kind = typing.get_type_hints(ModelConfig)[name]
  if choices:
    return next(c for c in choices if c != value)
  if kind is bool:
    return not value
  if kind is int:
    return value + 2
  if kind is float:
    return value * 2 + 1
  if kind == tuple[int, ...]:
    return tuple(value) + (value[-1],) if value else (1,)
  return f'{value}-changed'


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A checkpoint of a small CSA2 model: its directory and the config it was written with."""
  cfg = resolve(small_config(**{'model.attention_variant': 'csa2'}), num_devices=1, backend='cpu')
  ck = Checkpointer(str(tmp_path_factory.mktemp('ck')), cfg.checkpoint)
  ck.save(1, {'x': jax.numpy.ones(3)}, None, cfg.to_dict(), {})
  ck.close()
  return ck, cfg.to_dict()


def test_the_schema_marks_the_execution_choices():
  """The kernels, chunk sizes and arithmetic precisions; and no key that shapes the state."""
  assert {'moe_backend', 'attention_impl', 'sparse_impl', 'index_impl', 'compute_dtype',
          'sparse_chunk', 'span_chunk', 'index_topk_block', 'merged_backward'} \
      <= set(EXECUTION_ONLY)
  assert not {'d_model', 'num_layers', 'vocab_size', 'param_dtype', 'compress_ratios',
              'engram_table_row_multiple', 'attention_variant'} & set(EXECUTION_ONLY)
  assert execution_only_keys('train') == frozenset()  # other sections only warn on a change


@pytest.mark.parametrize('name', EXECUTION_ONLY)
def test_a_resume_may_change_an_execution_only_key(saved, name):
  ck, written = saved
  now = json.loads(json.dumps(written))
  now['model'][name] = _another_value(name, written['model'][name])
  warnings = check_fits(ck, 1, {}, now)
  assert any(w.startswith(f'model.{name}:') for w in warnings), warnings


@pytest.mark.parametrize('name', sorted(set(MODEL_KEYS) - set(EXECUTION_ONLY)))
def test_a_resume_that_changes_a_model_key_is_refused_naming_it(saved, name):
  ck, written = saved
  now = json.loads(json.dumps(written))
  now['model'][name] = _another_value(name, written['model'][name])
  with pytest.raises(CheckpointError, match=rf'does not fit the configured model:\n  '
                                            rf'model\.{name}: checkpoint'):
    check_fits(ck, 1, {}, now)


def test_every_section_is_declared_with_the_mark():
  """The mark is part of every key's declaration, so a new key states it (default False)."""
  for cls in SECTIONS.values():
    for f in keys_of(cls):
      assert isinstance(f.metadata['execution_only'], bool), f'{cls.__name__}.{f.name}'
  assert all(dataclasses.is_dataclass(cls) for cls in SECTIONS.values())
