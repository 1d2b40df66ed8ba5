"""The model's parameters as a list of typed records, read from the model itself.

One walk (`param_leaves`) over the (abstract, `nnx.eval_shape`) parameters feeds both
tools/info.py (parameters by component, active parameters per token) and train/flops.py (matmul
parameters per token and per image, for MFU). No second, hand-written formula: a change to a
module's weights changes every count.

Groups are variable types where they train differently (`EngramTable`, `VisionParam`, see
params.py); the finer component names of the report come from the module tree.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

import jax
from flax import nnx

from deepseek41.config import ModelConfig, layer_roles
from deepseek41.model.dspark import DSpark
from deepseek41.model.params import EngramTable, RouterBias, VisionParam, is_elementwise
from deepseek41.model.transformer import Transformer

ROUTED = ('w_gate', 'w_up', 'w_down')
VISION_ALIGNER = ('w_align1', 'b_align1', 'w_align2', 'b_align2', 'delimiters')
LOOKUPS = ('embedding', 'engram.tables')  # rows are gathered per token, never multiplied


@dataclasses.dataclass(frozen=True)
class Leaf:
  keys: tuple[str, ...]   # the path in the model, e.g. ('blocks', '3', 'moe', 'w_gate')
  component: str          # tools.info's name for it, e.g. 'experts.routed'
  size: int
  matmul: bool            # a weight a token is multiplied with (not a lookup or a scale)

  @property
  def layer(self) -> int | None:
    return int(self.keys[1]) if self.keys[0] == 'blocks' else None


def path_keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))) for k in path)


def component(keys: tuple[str, ...], var: nnx.Variable) -> str:
  """The component a parameter belongs to: its type for the groups, its place for the rest."""
  if isinstance(var, VisionParam):
    return 'vision.aligner' if keys[1] in VISION_ALIGNER else 'vision.encoder'
  if isinstance(var, EngramTable):
    return 'engram.tables'
  if keys[0] != 'blocks':
    return {'embed': 'embedding', 'head': 'head', 'final_norm': 'norms',
            'hc_head': 'mhc'}.get(keys[0], keys[0])
  part = keys[2]
  if part == 'moe':
    if keys[3] in ROUTED:
      return 'experts.routed'
    return 'router' if keys[3] == 'w_router' else 'experts.shared'
  if part == 'attn':
    if len(keys) > 4 and keys[3] == 'csa2':
      return {'compressor': 'compressors', 'index_keys': 'indexers',
              'index_query': 'indexers'}[keys[4]]
    return 'attention'
  if part == 'engram':
    return 'engram.projections'
  if part in ('attn_site', 'ffn_site'):
    return 'mhc'
  return 'norms'


def param_leaves(params) -> list[Leaf]:
  """Every parameter of an nnx.State of `nnx.Param`s, in flattening order."""
  out = []
  flat = jax.tree_util.tree_flatten_with_path(params,
                                             is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  for path, var in flat:
    keys = path_keys(path)
    comp = component(keys, var)
    value = var.get_value()
    lookup = comp in LOOKUPS or keys[-1] == 'delimiters'  # delimiters: vectors placed, not mixed
    out.append(Leaf(keys, comp, int(value.size),
                    value.ndim >= 2 and not lookup and not is_elementwise(var)))
  return out


@functools.lru_cache(maxsize=8)
def abstract_params(m: ModelConfig):
  """(params, router biases) of the model `m` builds, as shapes only."""
  model = nnx.eval_shape(lambda: Transformer(m, nnx.Rngs(params=0)))
  _, params, biases = nnx.split(model, nnx.Param, RouterBias)
  return params, biases


@functools.lru_cache(maxsize=8)
def model_leaves(m: ModelConfig) -> tuple[Leaf, ...]:
  """`param_leaves` of the model `m` builds, walked once per config."""
  return tuple(param_leaves(abstract_params(m)[0]))


def matmul_params_per_token(m: ModelConfig, leaves: Sequence[Leaf]) -> int:
  """Weights one token is multiplied with in training, every layer run on every token.

  Routed experts count K/E of their size; a layer's index keys are computed once per
  compressed entry, so 1/ratio of theirs. The vision path runs per image (`vision_matmul_params`).
  """
  roles = layer_roles(m)
  total = 0
  for leaf in leaves:
    if not leaf.matmul or leaf.component.startswith('vision'):
      continue
    if leaf.component == 'experts.routed':
      total += leaf.size * m.num_experts_per_tok // m.n_routed_experts
    elif leaf.component == 'indexers' and leaf.keys[4] == 'index_keys':
      total += leaf.size // roles[leaf.layer].ratio
    else:
      total += leaf.size
  return total


def vision_matmul_params(leaves: Sequence[Leaf]) -> tuple[int, int]:
  """(encoder weights multiplied per patch, aligner weights multiplied per merged token)."""
  encoder = sum(l.size for l in leaves if l.matmul and l.component == 'vision.encoder')
  aligner = sum(l.size for l in leaves if l.matmul and l.component == 'vision.aligner')
  return encoder, aligner


# ---- DSpark (model/dspark.py): counted apart from the backbone ----------------------------------


@functools.lru_cache(maxsize=8)
def _dspark_abstract(m, ds):
  """(leaves, router-bias count) of the DSpark module the config builds, as shapes only."""
  module = nnx.eval_shape(lambda: DSpark(m, ds, nnx.Rngs(params=0)))
  _, params, biases = nnx.split(module, nnx.Param, RouterBias)
  return tuple(param_leaves(params)), sum(x.size for x in jax.tree.leaves(biases))


def dspark_parameters(cfg) -> dict:
  """The drafter's parameters by part (total = every part + the blocks' router biases).

  `active_per_draft_token`: the DSpark weights one draft row multiplies (the blocks with routed
  experts at K/E of their size, the final norm, the Markov output table, the confidence head,
  the router biases); the Markov input table is a lookup, and the main projection + its norm run
  once per backbone token (`per_context_token`), not per drafted token. The backbone's LM head,
  which every draft row also multiplies, is the backbone's and is not counted here.
  """
  ds = cfg.dspark
  leaves, router_bias = _dspark_abstract(cfg.model, ds)
  parts: dict[str, int] = collections.Counter()
  block_parts: dict[str, int] = collections.Counter()
  active = float(router_bias)
  frac = ds.num_experts_per_tok / ds.n_routed_experts
  for leaf in leaves:
    if leaf.keys[0] == 'blocks':
      parts['blocks'] += leaf.size
      block_parts[leaf.component] += leaf.size
      active += leaf.size * (frac if leaf.component == 'experts.routed' else 1.0)
    else:
      name = {'markov_in': 'markov', 'markov_out': 'markov'}.get(leaf.keys[0], leaf.keys[0])
      parts[name] += leaf.size
      if leaf.keys[0] in ('markov_out', 'confidence', 'final_norm'):
        active += leaf.size
  out = {'total': sum(parts.values()) + router_bias, **dict(sorted(parts.items())),
         'router_bias': router_bias, 'num_blocks': ds.num_blocks,
         'per_block': parts['blocks'] // max(ds.num_blocks, 1),
         'blocks_by_component': dict(sorted(block_parts.items())),
         'active_per_draft_token': active,
         'per_context_token': parts['main_proj'] + parts['main_norm']}
  return out
