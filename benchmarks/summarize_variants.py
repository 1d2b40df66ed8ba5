"""Markdown table of gpu_variants.sh's training runs: one row per metrics.jsonl (train_<variant>_<T>).

    python benchmarks/summarize_variants.py OUT/train_*.jsonl

Medians over the steps after the first --skip (compilation and warm-up): step time, tokens/s,
model TFLOP/s and MFU (train/flops.py counts each variant's own attention keys, so MFU
compares like with like), and the peak device memory.
"""

import argparse
import json
import os
import statistics


def summarize(path: str, skip: int) -> dict:
  name = os.path.basename(path).removeprefix('train_').removesuffix('.jsonl')
  variant, _, seq_len = name.rpartition('_')
  steps = [r for r in map(json.loads, open(path)) if 'step_time_s' in r and r['step'] > skip]
  row = {'variant': variant, 'seq_len': seq_len, 'steps': len(steps)}
  for key in ('step_time_s', 'tokens_per_s', 'model_tflops_per_s', 'mfu', 'peak_memory_gb',
              'loss'):
    values = [r[key] for r in steps if r.get(key) is not None]
    row[key] = statistics.median(values) if values else None
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('paths', nargs='+')
  p.add_argument('--skip', type=int, default=2, help='steps left out at the start')
  args = p.parse_args(argv)
  rows = sorted((summarize(path, args.skip) for path in args.paths),
                key=lambda r: (int(r['seq_len']) if r['seq_len'].isdigit() else 0, r['variant']))
  print('| variant | T | steps | step s | tokens/s | TFLOP/s | MFU | peak GB | loss |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')

  def f(x, spec):
    return '-' if x is None else format(x, spec)
  for r in rows:
    print(f"| {r['variant']} | {r['seq_len']} | {r['steps']} | {f(r['step_time_s'], '.3f')} | "
          f"{f(r['tokens_per_s'], ',.0f')} | {f(r['model_tflops_per_s'], '.1f')} | "
          f"{f(r['mfu'], '.1%')} | {f(r['peak_memory_gb'], '.1f')} | {f(r['loss'], '.3f')} |")


if __name__ == '__main__':
  main()
