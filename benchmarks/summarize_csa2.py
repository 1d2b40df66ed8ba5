"""Markdown table of bench_csa2.py JSON lines: each layer's time and its speed-up over cuDNN."""

import json
import sys


def main(path):
  rows = [json.loads(line) for line in open(path)]
  dense = {(r['seq_len'], r['mode']): r['ms'] for r in rows if r['case'].startswith('dense')}
  print('| case | T | mode | ms | dense cuDNN ms | speed-up |')
  print('| --- | ---: | --- | ---: | ---: | ---: |')
  for r in rows:
    d = dense.get((r['seq_len'], r['mode']))
    speedup = f"{d / r['ms']:.2f}x" if d and not r['case'].startswith('dense') else '-'
    print(f"| {r['case']} | {r['seq_len']} | {r['mode']} | {r['ms']:.1f} | "
          f"{d:.1f} | {speedup} |" if d else
          f"| {r['case']} | {r['seq_len']} | {r['mode']} | {r['ms']:.1f} | - | - |")


if __name__ == '__main__':
  main(sys.argv[1])
