"""Compiled FLOPs of one decode step against the context length (docs/performance.md section 14).

    python benchmarks/decode_flops.py --config=configs/v41_flash.py --contexts=4096,65536,1048576

Lowers the generation step (generate/decode.py `forward_chunk`, one token at batch 1, the cache
sized to the context) on abstract shapes (nothing is allocated) and reads the XLA CPU compiler's
cost analysis. The routed experts run through `capacity_einsum` here, which at one token
computes one slot of every expert, so the absolute count over-states the MoE; the experts do not
depend on the context, so the growth between contexts is the attention's and the indexer's,
set beside the formula's (train/flops.py `decode_attention_flops`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = flags.DEFINE_string('config', 'configs/ablation_1b.py', 'Config file.')
_CONTEXTS = flags.DEFINE_list('contexts', ['4096', '65536', '1048576'], 'Context lengths.')


def main(argv):
  del argv
  from deepseek41.config import load_config_file, resolve
  from deepseek41.generate.cache import empty_cache
  from deepseek41.generate.decode import forward_chunk
  from deepseek41.model.layer_cache import CacheSpec
  from deepseek41.model.transformer import Transformer
  from deepseek41.train.flops import decode_attention_flops
  from deepseek41.model import csa2
  # XLA's cost analysis counts a loop's body once: score the stored index keys in one block
  # (the same FLOPs as generation's blocks; only the memory differs).
  csa2.STORED_KEYS_BLOCK = 1 << 40
  c = load_config_file(_CONFIG.value)
  c.model.attention_impl, c.model.index_impl, c.model.sparse_impl = 'chunked', 'reference', 'gathered'
  c.model.mhc_impl = 'reference'
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor, c.mesh.context = 1, 1, 1, 1, 1
  cfg = resolve(c, num_devices=1, backend='cpu')
  # Not validated as an evaluation backend (it drops past capacity), counted here only.
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_backend='capacity_einsum'))
  model = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(params=0)))
  graph, state = nnx.split(model)

  def step(state, cache, tok_b1):
    logits, _, cache = forward_chunk(nnx.merge(graph, state), cache, tok_b1,
                                     jnp.ones(tok_b1.shape, bool))
    return logits, cache
  out = {'config': _CONFIG.value}
  for context in (int(x) for x in _CONTEXTS.value):
    spec = CacheSpec(batch=1, max_len=context, max_chunk=1)
    cache = jax.eval_shape(lambda: empty_cache(model, spec))
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(state, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out[context] = {'compiled_flops': float(cost['flops']),
                    'formula_attention_flops': float(sum(decode_attention_flops(cfg.model, context))),
                    'compile_s': time.perf_counter() - t0}
    print(context, out[context], flush=True)
  first = int(_CONTEXTS.value[0])
  for context in (int(x) for x in _CONTEXTS.value[1:]):
    out[f'growth_{first}_to_{context}'] = {
        'compiled': out[context]['compiled_flops'] - out[first]['compiled_flops'],
        'formula': out[context]['formula_attention_flops'] - out[first]['formula_attention_flops']}
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
