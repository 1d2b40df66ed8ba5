"""Plain decoding's speed without a checkpoint: a config's model as initialised (decode speed does
not depend on what the weights learned), through generation's own programs and paths
(`generation_config`, `Programs`, `decode_loop`), each --execution set in one process:

    python benchmarks/bench_decode_init.py --config=configs/ablation_1b.py \
        --execution_sets='|model.moe_gather_small_calls=false|model.mhc_decode_block_d=256'

Sets are separated by '|' (an empty set: the defaults); the item `uncast` keeps every weight as
trained (`Programs(cast_weights=False)`: the baseline of generate/weight_reads.py). For each set
and batch size: the first run's seconds (compilation included) and the second run's decode
tokens/s. Saves the minutes a trained checkpoint costs on the device (gpu_generate.sh trains
one first).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = flags.DEFINE_string('config', 'configs/ablation_1b.py', 'A config file.')
_SETS = flags.DEFINE_string('execution_sets', '', "Execution overrides per run, '|'-separated.")
_BATCHES = flags.DEFINE_list('batch_sizes', ['1', '32'], 'Batch sizes.')
_PROMPT = flags.DEFINE_integer('prompt_tokens', 512, 'Prompt length.')
_NEW = flags.DEFINE_integer('new_tokens', 128, 'Tokens generated per row.')
_PER_DISPATCH = flags.DEFINE_integer('tokens_per_dispatch', 32, 'Decode steps per dispatch.')
_OUT = flags.DEFINE_string('out', '/tmp/bench_decode_init.json', 'Result JSON.')
_PROFILE = flags.DEFINE_string(
    'profile_dir', '', 'For the first set at each batch size, one more run traced from its second '
    'dispatch on into DIR/b<B> (benchmarks/trace_summary.py reads it).')


def main(argv):
  del argv
  from deepseek41.config import resolve
  from deepseek41.config.resolve import load_config_file
  from deepseek41.generate.generator import decode_loop, execution_overrides, generation_config
  from deepseek41.generate.programs import Programs
  from deepseek41.model.transformer import Transformer
  from deepseek41.sharding import make_mesh
  saved = resolve(load_config_file(_CONFIG.value), backend=jax.default_backend()).to_dict()
  result = {'device': str(jax.devices()[0].device_kind), 'config': _CONFIG.value}
  rng = np.random.default_rng(0)
  for spec in _SETS.value.split('|'):
    items = [s for s in spec.split(',') if s and s != 'uncast']
    cfg = generation_config(saved, execution=execution_overrides(items))
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
      model = Transformer(cfg.model, nnx.Rngs(params=0))
      progs = Programs(model, None, None, cast_weights='uncast' not in spec.split(','))
      for b in (int(x) for x in _BATCHES.value):
        prompts = [rng.integers(3, cfg.model.vocab_size, _PROMPT.value).astype(np.int32)
                   for _ in range(b)]
        kw = dict(eos_id=None, max_new_tokens=_NEW.value, temperature=0.0,
                  tokens_per_dispatch=_PER_DISPATCH.value)
        t0 = time.perf_counter()
        decode_loop(progs, cfg, prompts, **kw)
        first_s = time.perf_counter() - t0
        runs = decode_loop(progs, cfg, prompts, **kw)
        row = {'first_run_s': first_s,
               'tokens_per_s': sum(r.timed_tokens for r in runs) / runs[0].decode_s,
               'prefill_s': runs[0].prefill_s}
        result[f'{spec or "defaults"}|b{b}'] = row
        print(spec or 'defaults', b, row, flush=True)
        with open(_OUT.value, 'w') as f:
          json.dump(result, f, indent=1)
        if _PROFILE.value and spec == _SETS.value.split('|')[0]:
          profile_decoding(progs, cfg, prompts, kw, os.path.join(_PROFILE.value, f'b{b}'))
    del model, progs


def profile_decoding(progs, cfg, prompts, kw, trace_dir):
  """One more run, traced from the first streamed tokens on: steady dispatches, no prefill."""
  from deepseek41.generate.generator import decode_loop
  tracing = []

  def start_after_first_dispatch(row, new):
    if not tracing:
      jax.profiler.start_trace(trace_dir)
      tracing.append(True)
  decode_loop(progs, cfg, prompts, stream=start_after_first_dispatch, **kw)
  if tracing:
    jax.profiler.stop_trace()


if __name__ == '__main__':
  app.run(main)
