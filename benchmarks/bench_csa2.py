"""Time one CSA2 attention layer against cuDNN dense causal attention of the same FLOPs per pair.

Usage (GPU, V4.1-Flash attention shapes, released quantization formats):
    python benchmarks/bench_csa2.py --seq_lens 16384,65536 --out csa2.jsonl
    python benchmarks/bench_csa2.py --small          # CPU smoke run (configs/tiny.py shapes)

What is timed is the attention core, `Attention.attend`: for a Full layer the compressor, index
keys, indexer query, query-chunked scoring, two-stage top-k (and the candidate pool for the
candidate source), the gathered sparse branch, the window branch, sink merge, inverse RoPE, and
the indexer's distillation loss; for a Reuse layer the window and the sparse branch over its
source's selection (the source's tensors are inputs). The q/kv/output projections are left out
on both sides: they are the same work with or without sparsity.

Dense baseline: `jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)` with
128 heads x 256 (cuDNN stops at head dim 256; 64 heads x 512 has the same FLOPs per query-key
pair), q, k, v all [1, T, 128, 256].

Forward+backward: the gradient of <o, ct> (+ the indexer loss) with respect to the layer's
parameters and all its float inputs (for Reuse, including the source's compressed KV), i.e.
what a training step runs for this layer. Method: jit, one warm-up (compile) call,
block_until_ready, median over --reps runs on fresh inputs (benchmarks/timing.py).
Each result is printed and appended to --out as one JSON line as soon as it exists.

Each case runs in its own function scope (`run_case`) and everything it allocated is released
before the next (its arrays, its compiled programs: `release`), so the whole table runs in one
call: at 65,536 tokens the Reuse layer used to fail on an 8.55 GiB allocation after the dense
and Full cases had run in the same process. Each record carries the compiled program's own
memory (XLA's memory analysis: arguments, outputs and temporaries, GiB).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)
from timing import time_fn  # noqa: E402  (benchmarks/timing.py)
from deepseek41.config import layer_roles, resolve  # noqa: E402
from deepseek41.model.attention import Attention  # noqa: E402
from deepseek41.model.shared import Shared  # noqa: E402

# name -> (layer in configs/v41_flash.py, layer in configs/tiny.py)
LAYERS = {'full2': (2, 2), 'reuse2': (3, 3), 'full1_candidates': (20, 4), 'reindex': (24, 6),
          'reuse1': (21, 5)}


def load_config(name):
  spec = importlib.util.spec_from_file_location('cfg', os.path.join(ROOT, 'configs', name))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--seq_lens', default='16384,65536')
  p.add_argument('--layers', default='full2,reuse2', help=f'comma list of {sorted(LAYERS)}')
  p.add_argument('--dense', default=True, action=argparse.BooleanOptionalAction,
                 help='also time cuDNN dense causal attention')
  p.add_argument('--modes', default='fwd,fwd_bwd')
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--small', action='store_true', help='tiny shapes on the CPU (smoke run)')
  p.add_argument('--set', action='append', default=[],
                 help='config override model.KEY=VALUE (python literal), repeatable')
  p.add_argument('--out', help='append JSON lines here')
  return p.parse_args(argv)


def model_config(args):
  c = load_config('tiny.py' if args.small else 'v41_flash.py')
  c.model.attention_variant = 'csa2'
  if args.small:
    c.model.compute_dtype = 'float32'
  for item in args.set:
    key, value = item.split('=', 1)
    try:
      value = eval(value, {})  # noqa: S307 - a benchmark flag, like --config.x=...
    except (NameError, SyntaxError):
      pass
    c.model[key.removeprefix('model.')] = value
  c.data.seq_len = max(int(s) for s in args.seq_lens.split(','))
  c.mesh.data = c.mesh.fsdp = c.mesh.expert = c.mesh.tensor = c.mesh.context = 1  # one device
  return resolve(c, num_devices=1).model


def _batch(t):
  return {'segment_ids': jnp.ones((1, t), jnp.int32),
          'positions': jnp.arange(t, dtype=jnp.int32)[None]}


def _split_float(tree):
  """(float leaves, rebuild(float leaves) -> tree): differentiate a pytree with int leaves."""
  leaves, treedef = jax.tree.flatten(tree)
  where = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

  def rebuild(floats):
    out = list(leaves)
    for i, x in zip(where, floats):
      out[i] = x
    return jax.tree.unflatten(treedef, out)
  return [leaves[i] for i in where], rebuild


def csa2_case(cfg, name, t, dtype, small):
  """(fwd, fwd_bwd, make_args, role) for one layer of the role table at sequence length t."""
  return layer_case(cfg, LAYERS[name][1 if small else 0], t, dtype)


def layer_case(cfg, layer, t, dtype):
  """(fwd, fwd_bwd, make_args, role): layer `layer`'s attention core at sequence length t, in
  cfg's attention variant (the CSA2 sources it reads run untimed in make_args)."""
  roles = layer_roles(cfg)
  role = roles[layer]
  rngs = nnx.Rngs(params=0)
  attn = Attention(cfg, role, rngs)
  graphdef, state = nnx.split(attn)
  batch = _batch(t)
  # Sources this layer reads (KV source, index source, candidate pool) run once, untimed.
  source_layers = sorted({role.kv_source, role.index_source,
                          cfg.candidate_source_layer_id if role.uses_candidates else -1} -
                         {layer, -1}) if cfg.csa2 else []
  sources = [Attention(cfg, roles[s], nnx.Rngs(params=1 + s)) for s in source_layers]
  run_source = nnx.jit(lambda m, x, s: m(x, batch, s))
  project = nnx.jit(lambda m, x: m.project(x, batch['positions']))

  def inputs(rep):
    key = jax.random.fold_in(jax.random.key(0), rep)
    k_x, k_ct = jax.random.split(key)
    x = jax.random.normal(k_x, (1, t, cfg.d_model), jnp.float32).astype(dtype)
    shared = Shared()
    for src in sources:
      _, shared = run_source(src, x, shared)
    shared = shared.replace(indexer_totals=None)
    q_r, q, kv = project(attn, x)
    ct = jax.random.normal(k_ct, q.shape, jnp.float32).astype(dtype)
    return x, q_r, q, kv, shared, ct

  def core(state, x, q_r, q, kv, shared):
    o, out = nnx.merge(graphdef, state).attend(x, q_r, q, kv, batch, shared)
    totals = jnp.zeros(3, jnp.float32) if out.indexer_totals is None else out.indexer_totals
    return o, totals[0] / jnp.maximum(totals[1], 1.0)

  @jax.jit
  def fwd(state, x, q_r, q, kv, shared, ct):
    del ct
    return core(state, x, q_r, q, kv, shared)

  @jax.jit
  def fwd_bwd(state, x, q_r, q, kv, shared, ct):
    floats, rebuild = _split_float(shared)

    def loss(state, x, q_r, q, kv, floats):
      o, indexer_loss = core(state, x, q_r, q, kv, rebuild(floats))
      return jnp.sum(o.astype(jnp.float32) * ct.astype(jnp.float32)) + indexer_loss
    return jax.grad(loss, argnums=range(6))(state, x, q_r, q, kv, floats)

  cache = {}

  def make_args(rep):
    if rep not in cache:
      cache.clear()
      cache[rep] = (state,) + inputs(rep)
    return cache[rep]
  return fwd, fwd_bwd, make_args, role


def dense_case(t, heads, head_dim, dtype, implementation):
  def make_args(rep):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(1), rep), 4)
    return [jax.random.normal(k, (1, t, heads, head_dim), jnp.float32).astype(dtype)
            for k in keys]

  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

  @jax.jit
  def fwd(q, k, v, ct):
    del ct
    return attend(q, k, v)

  @jax.jit
  def fwd_bwd(q, k, v, ct):
    return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) *
                                            ct.astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  return fwd, fwd_bwd, make_args


def program_gib(fn, args) -> float | None:
  """What XLA's memory analysis gives the compiled program: arguments + outputs + temporaries
  (GiB); None where the backend reports none."""
  try:
    stats = fn.lower(*args).compile().memory_analysis()
  except Exception:  # noqa: BLE001 - a backend without the analysis
    return None
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes +
          stats.temp_size_in_bytes) / 2**30


def release():
  """Free what the finished case left: its arrays (cycles through nnx modules need the
  collector) and every compiled program with the buffers it holds."""
  gc.collect()
  jax.clear_caches()
  gc.collect()


def run_case(case, modes, reps, row, emit):
  """Time (and size) one case's modes, each result to emit(row); `case` builds (fwd, fwd_bwd,
  make_args) here, so that nothing of it outlives this call."""
  fwd, fwd_bwd, make_args = case()
  for mode, fn in (('fwd', fwd), ('fwd_bwd', fwd_bwd)):
    if mode in modes:
      ms, compile_s = time_fn(fn, make_args, reps)
      gib = program_gib(fn, make_args(0))
      emit(dict(row, mode=mode, ms=ms, compile_s=compile_s, program_gib=gib,
                **({'tflops': row['flops'] * (3.5 if mode == 'fwd_bwd' else 1.0) / ms / 1e9}
                   if 'flops' in row else {})))


def record(row, args):
  row.update(date=datetime.datetime.now().isoformat(timespec='seconds'),
             device=str(jax.devices()[0].device_kind), jax=jax.__version__)
  print(json.dumps(row), flush=True)
  if args.out:
    with open(args.out, 'a') as fh:
      fh.write(json.dumps(row) + '\n')


def main(argv=None):
  args = parse_args(argv)
  cfg = model_config(args)
  dtype = jnp.float32 if args.small else jnp.bfloat16
  modes = args.modes.split(',')
  common = dict(command=' '.join(sys.argv), sets=args.set, reps=args.reps)

  def emit(row):
    record(row, args)
  for t in (int(s) for s in args.seq_lens.split(',')):
    if args.dense:
      heads, dim = cudnn_shape(cfg)
      impl = 'xla' if args.small else 'cudnn'
      # flops: causal forward, q.k and p.v per pair; the flash backward recomputes q.k (3.5x)
      run_case(lambda: dense_case(t, heads, dim, dtype, impl), modes, args.reps,
               dict(case=f'dense_{impl}', heads=heads, head_dim=dim, seq_len=t,
                    flops=4 * t * (t + 1) / 2 * heads * dim, **common), emit)
      release()
    for name in args.layers.split(','):
      role = layer_roles(cfg)[LAYERS[name][1 if args.small else 0]]
      run_case(lambda: csa2_case(cfg, name, t, dtype, args.small)[:3], modes, args.reps,
               dict(case=name, layer=role.layer, role=role.mode, ratio=role.ratio, seq_len=t,
                    heads=cfg.num_heads, head_dim=cfg.head_dim, index_heads=cfg.index_n_heads,
                    topk=cfg.index_topk, window=cfg.sliding_window,
                    quant=[cfg.kv_quant, cfg.index_quant, cfg.swa_quant], **common), emit)
      release()


def cudnn_shape(cfg) -> tuple[int, int]:
  """(heads, head_dim) of cuDNN attention with the model's FLOPs per query-key pair: cuDNN stops
  at head dim 256, so 2H x d/2 where d is wider."""
  return (2 * cfg.num_heads, cfg.head_dim // 2) if cfg.head_dim > 256 else \
      (cfg.num_heads, cfg.head_dim)


if __name__ == '__main__':
  main()
