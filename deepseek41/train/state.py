"""The train state pytree, its shardings, and sharded initialisation.

    state = {'params': nnx.State[Param], 'router_bias': nnx.State[RouterBias],
             'opt': optax state, 'step': int32[], 'rng': uint32[2]}
    (+ 'frozen': nnx.State[Param] the objective holds fixed, e.g. the frozen DSpark backbone)

What the model is and how its variables split into these entries is the objective's
(train/objectives/): this module shapes, shards and initialises whatever it returns.

Parameters are stored in `model.param_dtype` (fp32 master weights by default; the optimizer's
moments follow it); modules cast them to the compute dtype at use. The router biases sit beside
the parameters, so the optimizer (and weight decay) never sees them, and stay fp32.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from deepseek41.config import RunConfig
from deepseek41.model.params import cast_params, dtype_of
from deepseek41.sharding import variable_sharding
from deepseek41.train.objectives import objective_for
from deepseek41.train.step import ModelDef

log = logging.getLogger(__name__)


def build_model(cfg: RunConfig, seed: int | None = None) -> nnx.Module:
  """The objective's model with every parameter stored in `model.param_dtype` (the one place it
  applies)."""
  seed = cfg.train.seed if seed is None else seed
  model = objective_for(cfg).build_model(nnx.Rngs(params=seed))
  return cast_params(model, dtype_of(cfg.model.param_dtype))


def _init_fn(cfg: RunConfig, tx):
  objective = objective_for(cfg)

  def init():
    _, params, fixed, biases = objective.split(build_model(cfg))
    state = {
        'params': params,
        'router_bias': biases,
        'opt': tx.init(params),
        'step': jnp.zeros((), jnp.int32),
        'rng': jax.random.key_data(jax.random.key(cfg.train.seed + 1)),
    }
    if fixed is not None:  # parameters the objective holds fixed: no optimizer state
      state['frozen'] = fixed
    return state
  return init


def abstract_state(cfg: RunConfig, tx):
  return jax.eval_shape(_init_fn(cfg, tx))


def state_shardings(abstract, mesh: Mesh, rules):
  """Variables follow their logical axes; everything else (step, rng, optimizer counts) is replicated."""
  replicated = NamedSharding(mesh, P())

  def leaf_sharding(x):
    if isinstance(x, nnx.Variable):
      return x.replace(variable_sharding(x, rules, mesh))
    return replicated
  return jax.tree.map(leaf_sharding, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))


def with_shardings(abstract, shardings):
  """ShapeDtypeStructs carrying concrete shardings: the restore target for Orbax."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def model_def(cfg: RunConfig, tx) -> ModelDef:
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(cfg)))
  return ModelDef(graphdef=graphdef, tx=tx)


def init_state(cfg: RunConfig, tx, mesh: Mesh, rules, *, replicated: bool | None = None):
  """Initialise into the target shardings: no full copy lives on a device unless it fits.

  A split state whose whole fits comfortably in one device's memory (`replicated_init_pays`,
  or `replicated=True`) is drawn whole on every device with the GPU's threefry kernel, then
  sliced to its shardings (a local slice, no communication): the same values (threefry is
  partitionable, and the kernel draws what XLA's lowering draws), for a program that compiles
  in seconds instead of a minute or more (docs/performance.md section 19).
  """
  abstract = abstract_state(cfg, tx)
  shardings = state_shardings(abstract, mesh, rules)
  unsplit = prng_kernel_pays(shardings)
  if replicated is None:
    replicated = replicated_init_pays(abstract, shardings, _device_bytes())
  with jax.set_mesh(mesh):
    if replicated and not unsplit:
      log.info('initialisation: the split state drawn whole on each device, then sliced')
      whole = jax.tree.map(lambda s: NamedSharding(mesh, P()), shardings)
      with _prng_kernel(True):
        state = jax.jit(_init_fn(cfg, tx), out_shardings=whole)()
      return jax.jit(lambda s: s, out_shardings=shardings)(state), shardings
    with _prng_kernel(unsplit):
      state = jax.jit(_init_fn(cfg, tx), out_shardings=shardings)()
  return state, shardings


def prng_kernel_pays(shardings) -> bool:
  """Whether the initialisation may draw its random numbers with the GPU's threefry kernel.

  XLA's GPU lowering of threefry unrolls its rounds into every random fusion: compiling the 1B
  ablation's initialisation took 89 s on the H200, and 8.8 s with
  `jax_threefry_gpu_kernel_lowering`, to the same values (docs/performance.md section 19). The
  kernel is a custom call, which the partitioner cannot split: on a split state every device
  would draw each whole tensor. So only where no leaf is split (one device, pure data
  parallelism), where every device draws every tensor anyway.
  """
  return all(s.is_fully_replicated for s in jax.tree.leaves(shardings))


# A split state is drawn whole on every device (then sliced) if the whole takes at most this share
# of a device's memory: the whole and its slices live together for a moment, beside the
# initialisation's temporaries.
REPLICATED_INIT_SHARE = 0.4


def replicated_init_pays(abstract, shardings, device_bytes: int | None) -> bool:
  """Whether to draw a split state whole on every device with the threefry kernel (init_state):
  on the GPU only (device_bytes, its memory, is None elsewhere: the kernel is the GPU's), for a
  state that is split and whose whole fits REPLICATED_INIT_SHARE of the device."""
  if not device_bytes or prng_kernel_pays(shardings):
    return False
  whole = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract))
  return whole <= REPLICATED_INIT_SHARE * device_bytes


def _device_bytes() -> int | None:
  """A GPU's memory (bytes_limit of the first local device); None on other platforms."""
  device = jax.local_devices()[0]
  if device.platform != 'gpu':
    return None
  return (device.memory_stats() or {}).get('bytes_limit')


@contextlib.contextmanager
def _prng_kernel(on: bool):
  """jax_threefry_gpu_kernel_lowering on (if `on`) for the enclosed jit, restored after."""
  saved = jax.config.jax_threefry_gpu_kernel_lowering
  jax.config.update('jax_threefry_gpu_kernel_lowering', on or saved)
  try:
    yield
  finally:
    jax.config.update('jax_threefry_gpu_kernel_lowering', saved)


def count_params(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def state_layout(abstract) -> dict[str, list]:
  """{path: [shape, dtype]} of every leaf: written into checkpoints and compared on restore."""
  flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
  return {jax.tree_util.keystr(path): [list(x.shape), str(x.dtype)] for path, x in flat}


def _dotted(path) -> str:
  """'blocks.3.attn.wq_a' from a tree path (the Variable's trailing `.value` dropped)."""
  parts = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', None)))) for k in path]
  if parts and parts[-1] == 'value':
    parts.pop()
  return '.'.join(parts)


def named_leaves(tree) -> dict[str, Any]:
  """{dotted path: leaf} of a state entry ('blocks.3.attn.wq_a': array)."""
  return {_dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
