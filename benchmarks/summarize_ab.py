"""Markdown table of gpu_ab.sh's runs: one row per metrics.jsonl (ab_<side>_<round>).

    python benchmarks/summarize_ab.py OUT/ab_*.jsonl [--logs OUT]

Per run: the last line's `run_tokens_per_s` and `run_mfu` (every step since the compile step
over its training time, train/throughput.py), the median window's tokens/s beside it, the peak
device memory, the last loss, and with --logs the first step's time (compilation included)
from the run's log.
"""

import argparse
import json
import os
import re
import statistics


def summarize(path: str, logs: str | None) -> dict:
  name = os.path.basename(path).removesuffix('.jsonl')
  rows = [json.loads(line) for line in open(path)]
  timed = [r for r in rows if r.get('tokens_per_s') is not None]
  last = timed[-1] if timed else {}
  out = {'run': name, 'steps': last.get('step'),
         'run_tokens_per_s': last.get('run_tokens_per_s'), 'run_mfu': last.get('run_mfu'),
         'window_tokens_per_s': statistics.median(r['tokens_per_s'] for r in timed)
         if timed else None,
         'peak_memory_gb': max((r['peak_memory_gb'] for r in rows if 'peak_memory_gb' in r),
                               default=None),
         'loss': last.get('loss'), 'first_step_s': None}
  log = os.path.join(logs, name + '.log') if logs else None
  if log and os.path.exists(log):
    found = re.search(r'first step \(compilation included\) took ([0-9.]+) s', open(log).read())
    out['first_step_s'] = float(found.group(1)) if found else None
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('paths', nargs='+')
  p.add_argument('--logs', default=None, help='the folder of the runs\' logs')
  args = p.parse_args(argv)

  def f(x, spec):
    return '-' if x is None else format(x, spec)
  print('| run | steps | tokens/s (run) | MFU (run) | tokens/s (median window) | peak GB | '
        'first step s | loss |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for r in sorted((summarize(path, args.logs) for path in args.paths), key=lambda r: r['run']):
    print(f"| {r['run']} | {f(r['steps'], 'd')} | {f(r['run_tokens_per_s'], ',.0f')} | "
          f"{f(r['run_mfu'], '.1%')} | {f(r['window_tokens_per_s'], ',.0f')} | "
          f"{f(r['peak_memory_gb'], '.1f')} | {f(r['first_step_s'], '.1f')} | "
          f"{f(r['loss'], '.4f')} |")


if __name__ == '__main__':
  main()
