"""Compile the training step (or the optimizer update alone, or one decode step of generation)
for an H100 or H200 on a machine without a GPU, and report what the GPU program is: its memory
analysis, and its kernels by scope with the bytes each moves (benchmarks/hlo_kernels.py). XLA's
GPU compiler runs here, deviceless, through jax's topology API; the Pallas kernels are lowered
and compiled for sm_90 as on the GPU.
No kernel runs, so nothing is timed: use it to see what a change does to the program (kernel
counts, layout copies, bytes, peak memory) before spending device time on it.

The target and its setup: deepseek41/tools/gpu_target.py. Once (about 4 GB of wheels matching
the installed jax, outside the venv):
    bash benchmarks/get_gpu_compiler.sh /tmp/gpu-compiler
Then:
    PYTHONPATH=/tmp/gpu-compiler .venv/bin/python benchmarks/compile_for_gpu.py \
        --config=configs/ablation_1b.py --config.data.seq_len=4096 --config.train.batch_size=8 \
        [--program=step|optimizer|decode] [--target=h100|h200] [--depth=3] [--hlo_out=FILE]
    --program=decode [--decode_batch=1] [--decode_context=4096] [--decode_chunk=1]
        [--decode_steps=1]: one plain decode step (or, --decode_chunk > 1, one chunk of a
        chunked prefill) as generation runs it (generate/generator.py `generation_config`'s
        paths, the cache sized to the context, greedy): its kernel count is what a token costs
        in launches. --decode_steps=N > 1: N greedy steps in one while loop, as the device loop
        (`Programs.decode_steps`) runs them, and the loop body's kernels are reported: XLA
        compiles a step inside the loop differently from a lone one (docs/performance.md 58).

What differs from the GPU's own compile: tools/gpu_target.py. XLA schedules for the target's
memory, so compile for the GPU the numbers are for (the 1B step at 8 x 4,096 without remat: 65.1
GB for an H100, 74.0 for an H200, 68.9 measured there; docs/performance.md sections 44 and 46).
The muon_hybrid update on the 1B model compiles to 2,010 kernels (the H100 profile: 2,117 a
step). `python -m deepseek41.tools.plan --topology=h200` gives the same peak as a plan.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
from absl import app, flags

jax.config.update('jax_platforms', 'cpu')  # the GPU is only a compile target here

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_kernels  # noqa: E402  (benchmarks/hlo_kernels.py)
from deepseek41.config import resolve  # noqa: E402
from deepseek41.tools import gpu_target  # noqa: E402
from deepseek41.tools.info import CONFIG_FLAG  # noqa: E402  (--config and its overrides)
from deepseek41.sharding import make_mesh  # noqa: E402
from deepseek41.tools.memory_plan import (  # noqa: E402
    compiled_optimizer_update, lowered_train_step, program_memory)

_PROGRAM = flags.DEFINE_enum('program', 'step', ['step', 'optimizer', 'decode'],
                             'The whole train step, the optimizer update alone, or one decode '
                             'step.')
_DECODE_BATCH = flags.DEFINE_integer('decode_batch', 1, '--program=decode: rows.')
_DECODE_CHUNK = flags.DEFINE_integer('decode_chunk', 1, '--program=decode: positions per row '
                                     'in the step (> 1: a chunked prefill\'s program, the '
                                     'logits of its last position only).')
_DECODE_STEPS = flags.DEFINE_integer('decode_steps', 1, '--program=decode: greedy steps in one '
                                     'while loop (> 1: the loop body\'s kernels reported).')
_DECODE_CONTEXT = flags.DEFINE_integer('decode_context', 4096,
                                       '--program=decode: the cache length.')
_TARGET = flags.DEFINE_enum('target', 'h100', sorted(gpu_target.TARGETS),
                            'The GPU to compile for.')
_DEPTH = flags.DEFINE_integer('depth', 3, 'Scope components in the kernel table.')
_TOP = flags.DEFINE_integer('top', 30, 'Rows of the kernel table.')
_HLO_OUT = flags.DEFINE_string('hlo_out', '', 'Write the optimized HLO text here.')
_XLA = flags.DEFINE_list('xla_option', [], '--program=decode: XLA debug options for its '
                         'compile, NAME=VALUE (e.g. xla_gpu_triton_gemm_any=true).')


def compile_step(cfg, devices):
  lowered, options = lowered_train_step(cfg, devices)
  return lowered.compile(options)


def compile_optimizer(cfg, devices):
  from flax import nnx
  from deepseek41.model.params import RouterBias
  from deepseek41.train.state import build_model
  _, params, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, RouterBias)
  return compiled_optimizer_update(cfg, make_mesh(cfg.mesh, devices), params)


def compile_decode(cfg, devices):
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from deepseek41.generate.cache import empty_cache
  from deepseek41.generate.decode import forward_chunk
  from deepseek41.generate.generator import DECODE_EXECUTION_KEYS, generation_config
  from deepseek41.generate.programs import compiler_options, weights_in_compute_dtype
  from deepseek41.model.layer_cache import CacheSpec
  from deepseek41.model.transformer import Transformer
  if _DECODE_STEPS.value > 1 and _DECODE_CHUNK.value > 1:
    raise SystemExit('--decode_steps > 1 takes one position a step (--decode_chunk=1)')
  # The decode keys as the flags set them (generation would start them from the defaults).
  cfg = generation_config(cfg.to_dict(), backend='gpu', execution={
      f'model.{k}': getattr(cfg.model, k) for k in DECODE_EXECUTION_KEYS})
  model = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(params=0)))
  graph, state = nnx.split((model, None))  # as Programs holds it: (model, drafter)
  state = weights_in_compute_dtype(graph, state, None)
  q = _DECODE_CHUNK.value
  spec = CacheSpec(batch=_DECODE_BATCH.value, max_len=_DECODE_CONTEXT.value, max_chunk=q)
  cache = jax.eval_shape(lambda: empty_cache(model, spec))
  tok_b = jax.ShapeDtypeStruct((_DECODE_BATCH.value, q), jnp.int32)

  def step(state, cache, tok_bq):  # Programs.plain (greedy, no DSpark) or prefill_full_chunk
    last = None if q == 1 else jnp.full((tok_bq.shape[0],), q - 1, jnp.int32)
    logits, _, cache = forward_chunk(nnx.merge(graph, state)[0], cache, tok_bq,
                                     jnp.ones(tok_bq.shape, bool), logits_row_b=last)
    return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache
  def loop(state, cache, tok_bq):  # Programs.decode_steps' loop, greedy, every row running
    def body(carry):
      i, cache, tok_b = carry
      next_b, cache = step(state, cache, tok_b[:, None])
      return i + 1, cache, next_b
    return jax.lax.while_loop(lambda c: c[0] < _DECODE_STEPS.value, body,
                              (jnp.int32(0), cache, tok_bq[:, 0]))
  mesh = Mesh(devices[:1], ('one',))
  one = NamedSharding(mesh, PartitionSpec())
  with jax.set_mesh(mesh):  # the kernels compile for the mesh's platform (ops/launch.py)
    return jax.jit(loop if _DECODE_STEPS.value > 1 else step, in_shardings=one,
                   out_shardings=one, donate_argnums=(1,)).lower(
        state, cache, tok_b).compile(
            {**(compiler_options(cfg.model) or {}), **xla_options(_XLA.value)} or None)


def xla_options(items) -> dict:
  """NAME=VALUE strings as typed compile options (true/false: bool, digits: int)."""
  def typed(v):
    return {'true': True, 'false': False}.get(v.lower(), int(v) if v.lstrip('-').isdigit() else v)
  bad = [o for o in items if '=' not in o]
  if bad:
    raise SystemExit(f'--xla_option: {bad[0]!r} is not NAME=VALUE')
  return {k: typed(v) for k, v in (o.split('=', 1) for o in items)}


def main(argv):
  del argv
  try:
    devices = gpu_target.topology_devices(_TARGET.value)
  except RuntimeError as e:  # no CUDA plugin on the path: it says how to get one
    raise SystemExit(str(e))
  cfg = resolve(CONFIG_FLAG.value, num_devices=1, backend='gpu')
  t0 = time.perf_counter()
  with gpu_target.triton_lowers_for(_TARGET.value):  # compiled, not interpreted, for sm_90
    compiled = {'step': compile_step, 'optimizer': compile_optimizer,
                'decode': compile_decode}[_PROGRAM.value](cfg, devices)
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  if _HLO_OUT.value:
    with open(_HLO_OUT.value, 'w') as f:
      f.write(text)
  mem = program_memory(compiled)
  in_loop = _PROGRAM.value == 'decode' and _DECODE_STEPS.value > 1
  rows = hlo_kernels.kernels(text, loop_body=in_loop)
  kinds = {}
  for k in rows:
    kinds[k.kind] = kinds.get(k.kind, 0) + 1
  summary = dict(program=_PROGRAM.value, target=_TARGET.value,
                 lower_and_compile_s=round(seconds, 1),
                 **{f'{part}_gb': mem[part] / 1e9
                    for part in ('argument', 'temp', 'output', 'alias', 'peak')},
                 counted='the loop body' if in_loop else 'the entry',
                 kernels=len(rows), gb_moved=sum(k.bytes for k in rows) / 1e9,
                 copies=kinds.get('%copy', 0),
                 transposing=sum(n for kind, n in kinds.items() if 'transpose' in kind))
  print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in summary.items()}))
  print(f'{"GB moved":>9} {"kernels":>8}  scope (depth {_DEPTH.value})')
  for scope, n, b in hlo_kernels.by_scope(rows, _DEPTH.value)[:_TOP.value]:
    print(f'{b / 1e9:9.2f} {n:8d}  {scope}')


if __name__ == '__main__':
  app.run(main)
