"""One layer's attention under each model.attention_variant at 4K-64K tokens: time and memory.

Usage (GPU, configs/ablation_1b.py's shapes and quantization):
    python benchmarks/bench_variants.py --seq_lens 4096,16384,32768,65536 --out variants.jsonl
    python benchmarks/bench_variants.py --small        # CPU smoke run (configs/tiny.py shapes)

Cases, per sequence length (docs/architecture.md 3.8.1 says what each variant computes):
  csa2/<layer>    a CSA2 layer's attention core, as benchmarks/bench_csa2.py times it: window +
                  sparse branch, and at a Full layer the compressor, indexer, top-k and the
                  indexer's loss (full2 = a ratio-2 KV and index source, reuse2 = a layer reusing
                  its selection, full1 = the ratio-1 candidate source, reindex = a Reindex layer)
  dense/<layer>   the same layer with attention_variant=dense: every earlier key of the row
                  (on the GPU the fused window kernel with the row as its window)
  window/<layer>  the same layer window-only
  cudnn           cuDNN causal attention at the model's FLOPs per query-key pair (2H x d/2
                  where d > 256: cuDNN's limit), the yardstick of what dense attention costs
Only the attention core is timed (`Attention.attend`); the projections are common to all.
Modes: fwd, and fwd_bwd (the gradient of <o, ct> + the indexer loss w.r.t. the layer's
parameters and float inputs). Each record: median ms over --reps fresh inputs after a warm-up,
the compile time, the compiled program's memory (XLA's analysis: arguments + outputs +
temporaries, GiB) and, for the variants, the layer's attention FLOPs as train/flops.py counts
them (TFLOP/s = those FLOPs x 3.5 for fwd_bwd, over the time: the MFU's own accounting). Each
case runs in its own scope and is released before the next (bench_csa2.py `run_case`), so one
call runs the whole table. Ends with a markdown table (time relative to the dense layer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_csa2  # noqa: E402  (benchmarks/bench_csa2.py)
from deepseek41.config import layer_roles, resolve  # noqa: E402
from deepseek41.train.flops import attention_flops_per_layer  # noqa: E402

# name -> (layer in configs/ablation_1b.py, layer in configs/tiny.py)
LAYERS = {'full2': (2, 2), 'reuse2': (3, 3), 'full1': (6, 4), 'reindex': (9, 6)}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default='ablation_1b.py', help='a file of configs/')
  p.add_argument('--seq_lens', default='4096,16384,32768,65536')
  p.add_argument('--variants', default='csa2,dense,window')
  p.add_argument('--layers', default='full2,reuse2',
                 help=f'CSA2 layers (comma list of {sorted(LAYERS)}); dense and window time '
                 'the first (every ratio > 0 layer computes the same there)')
  p.add_argument('--cudnn', default=True, action=argparse.BooleanOptionalAction,
                 help='also time cuDNN causal attention (XLA on the CPU)')
  p.add_argument('--modes', default='fwd,fwd_bwd')
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--small', action='store_true', help='configs/tiny.py shapes on the CPU')
  p.add_argument('--out', help='append JSON lines here')
  return p.parse_args(argv)


def model_config(args, variant: str):
  c = bench_csa2.load_config('tiny.py' if args.small else args.config)
  c.model.attention_variant = variant
  if args.small:
    c.model.compute_dtype = 'float32'
  c.data.seq_len = max(int(s) for s in args.seq_lens.split(','))
  c.train.batch_size = 1
  c.mesh.data = c.mesh.fsdp = c.mesh.expert = c.mesh.tensor = c.mesh.context = 1
  return resolve(c, num_devices=1).model


def table(rows) -> str:
  """Markdown: each case's ms, GiB and TFLOP/s, and its time over the dense layer's."""
  dense = {(r['seq_len'], r['mode']): r['ms'] for r in rows if r['case'].startswith('dense/')}
  out = ['| case | T | mode | ms | program GiB | TFLOP/s | / dense |',
         '| --- | ---: | --- | ---: | ---: | ---: | ---: |']
  for r in rows:
    d = dense.get((r['seq_len'], r['mode']))
    gib = '-' if r.get('program_gib') is None else f"{r['program_gib']:.2f}"
    tf = f"{r['tflops']:.1f}" if 'tflops' in r else '-'
    rel = f"{r['ms'] / d:.3f}" if d else '-'
    out.append(f"| {r['case']} | {r['seq_len']} | {r['mode']} | {r['ms']:.2f} | {gib} | {tf} | "
               f"{rel} |")
  return '\n'.join(out)


def main(argv=None):
  args = parse_args(argv)
  dtype = jnp.float32 if args.small else jnp.bfloat16
  modes = args.modes.split(',')
  names = args.layers.split(',')
  rows = []
  common = dict(command=' '.join(sys.argv), reps=args.reps)

  def emit(row):
    rows.append(row)
    bench_csa2.record(row, args)

  for t in (int(s) for s in args.seq_lens.split(',')):
    for variant in args.variants.split(','):
      cfg = model_config(args, variant)
      for name in (names if variant == 'csa2' else names[:1]):
        layer = LAYERS[name][1 if args.small else 0]
        role = layer_roles(cfg)[layer]
        flops = attention_flops_per_layer(cfg, t)[layer] * t
        bench_csa2.run_case(
            lambda: bench_csa2.layer_case(cfg, layer, t, dtype)[:3],
            modes, args.reps,
            dict(case=f'{variant}/{name}', variant=variant, layer=layer, role=role.mode,
                 ratio=role.ratio, seq_len=t, flops=flops, heads=cfg.num_heads,
                 head_dim=cfg.head_dim, window=cfg.sliding_window, topk=cfg.index_topk,
                 attention_impl=cfg.attention_impl, **common), emit)
        bench_csa2.release()
    if args.cudnn:
      heads, dim = bench_csa2.cudnn_shape(model_config(args, 'dense'))
      impl = 'xla' if args.small else 'cudnn'
      bench_csa2.run_case(lambda: bench_csa2.dense_case(t, heads, dim, dtype, impl), modes,
                          args.reps, dict(case=impl, heads=heads, head_dim=dim, seq_len=t,
                                          flops=4 * t * (t + 1) / 2 * heads * dim, **common),
                          emit)
      bench_csa2.release()
  print(table(rows))
  if args.out:
    with open(os.path.splitext(args.out)[0] + '_table.txt', 'w') as f:
      f.write(table(rows) + '\n')
  print(json.dumps({'device': str(jax.devices()[0].device_kind), 'cases': len(rows)}))


if __name__ == '__main__':
  main()
