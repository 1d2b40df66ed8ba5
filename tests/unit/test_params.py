"""Parameter groups are variable types; model.param_dtype stores every parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.model.params import EngramTable, RouterBias, VisionParam, const_param, normal_param
from deepseek41.sharding import make_mesh
from deepseek41.train import state as state_lib
from deepseek41.train.optimizer import decay_mask, engram_table_mask, make_optimizer, vision_mask
from deepseek41.train.step import make_train_step
from tests.helpers import packed_batch, resolved

GROUPS = {'model.engram': True, 'model.vision': True}


class _Named(nnx.Module):
  """Names that a path parser would take for the groups, on parameters that are not in them."""

  def __init__(self, rngs):
    self.engram = nnx.Dict(table=normal_param(rngs, (4, 2), (None, None), 1.0))
    self.vision = normal_param(rngs, (2, 2), (None, None), 1.0)
    self.rows = normal_param(rngs, (4, 2), (None, None), 1.0, EngramTable)
    self.patch = const_param(0.0, (2,), (None,), VisionParam)


def _selected(mask) -> set[str]:
  flat = jax.tree_util.tree_flatten_with_path(mask)[0]
  return {jax.tree_util.keystr(path) for path, keep in flat if keep}


def test_groups_are_read_from_the_variable_type_not_the_path():
  params = nnx.state(_Named(nnx.Rngs(0)), nnx.Param)
  assert _selected(engram_table_mask(params)) == {"['rows'].value"}
  assert _selected(vision_mask(params)) == {"['patch'].value"}


def test_groups_of_the_model_are_the_tables_and_the_vision_tower():
  cfg = resolved(**GROUPS)
  params = state_lib.abstract_state(cfg, make_optimizer(cfg.train))['params']
  assert _selected(engram_table_mask(params)) == {"['blocks'][1]['engram']['table'].value"}
  vision = _selected(vision_mask(params))
  every = _selected(jax.tree.map(lambda _: True, params))
  assert vision == {p for p in every if p.startswith("['vision']")} and len(vision) >= 10


def test_weight_decay_skips_elementwise_weights_of_any_rank():
  cfg = resolved(**GROUPS)
  params = state_lib.abstract_state(cfg, make_optimizer(cfg.train))['params']
  decayed = _selected(decay_mask(params))
  engram = "['blocks'][1]['engram']"
  assert f"{engram}['proj'].value" in decayed and f"{engram}['table'].value" in decayed
  # The Engram query/key norm weights are [n, D] but scale elementwise, like the 1-D norms.
  assert f"{engram}['q_weight'].value" not in decayed
  assert f"{engram}['k_weight'].value" not in decayed
  assert not any('norm' in p or 'sink' in p or "['b_" in p for p in decayed)


def test_a_group_mask_of_bare_arrays_is_an_error():
  with pytest.raises(ValueError, match='variable types'):
    vision_mask({'w': jnp.zeros((2, 2))})


def _dtypes(tree) -> set[str]:
  return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_param_dtype_stores_every_parameter_and_the_optimizer_follows(dtype):
  cfg = resolved(**GROUPS, **{'model.param_dtype': dtype})
  abstract = state_lib.abstract_state(cfg, make_optimizer(cfg.train))
  assert _dtypes(abstract['params']) == {dtype}
  mu_nu = [x for x in jax.tree.leaves(abstract['opt']) if x.ndim]  # not the step counts
  assert {str(x.dtype) for x in mu_nu} == {dtype}
  # The sign rule's small steps would round away in bf16 (model/params.py cast_params).
  assert _dtypes(abstract['router_bias']) == {'float32'}
  assert all(isinstance(v, RouterBias) for v in jax.tree.leaves(
      abstract['router_bias'], is_leaf=lambda x: isinstance(x, nnx.Variable)))


def test_a_bfloat16_parameter_train_step_runs():
  cfg = resolved(**{'model.param_dtype': 'bfloat16'})
  tx = make_optimizer(cfg.train)
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  state, _ = state_lib.init_state(cfg, tx, mesh, cfg.mesh.rules)
  assert _dtypes(state['params']) == {'bfloat16'}
  new_state, metrics = jax.jit(make_train_step(cfg, state_lib.model_def(cfg, tx)))(
      state, packed_batch(seed=1))
  assert np.isfinite(float(metrics['loss'])) and float(metrics['grad_norm']) > 0
  assert _dtypes(new_state['params']) == {'bfloat16'}
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.any(a != b), state['params'],
                                       new_state['params']))
  assert sum(bool(x) for x in moved) > len(moved) // 2
