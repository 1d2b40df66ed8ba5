"""Tables for benchmarks/gpu_scaleout.sh: each run's loss curve against its 1-GPU reference and
its tokens/s per GPU against the 1-GPU run of the same device call.

    python benchmarks/summarize_scaleout.py DIR [DIR...]   # the $OUT folders of the calls

Runs are the DIR/<name>.jsonl metrics files (names unique across the folders). Throughput is the
median over logged steps after the first log line (which waited for compilation).
"""

import json
import pathlib
import statistics
import sys

# run -> (devices, loss reference, throughput reference), the references from the same device call
# (the machines are noisy); `w_proc2_to_gpu1@` is that run's own steps on one GPU, after it
# restored the 2-process checkpoint.
RUNS = {
    'w_gpu1': (1, None, None),
    'w_data2': (2, 'w_gpu1', 'w_gpu1'),
    'w_expert2': (2, 'w_gpu1', 'w_gpu1'),
    'w_expert2_bf16': (2, 'w_gpu1', 'w_gpu1'),
    'w_expert2_bound': (2, 'w_gpu1', 'w_gpu1'),
    'w_expert2_padded': (2, 'w_gpu1', 'w_gpu1'),
    'w_fsdp2': (2, 'w_gpu1', 'w_gpu1'),
    'w_tensor2': (2, 'w_gpu1', 'w_gpu1'),
    'w_tensor2_nosp': (2, 'w_gpu1', 'w_gpu1'),
    'w_proc2': (2, 'w_gpu1', 'w_gpu1'),
    'w_proc2_to_gpu1@': (1, 'w_gpu1', 'w_gpu1'),
    'f_gpu1': (1, None, None),
    'f_data2': (2, 'f_gpu1', 'f_gpu1'),
}


def load(dirs):
  curves = {}
  for d in dirs:
    for path in sorted(pathlib.Path(d).glob('*.jsonl')):
      rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
      curves[path.stem] = [r for r in rows if r.get('tokens_per_s') is not None]
  # The restored run's file holds the 2-process steps before its own: keep its own.
  if 'w_proc2_to_gpu1' in curves and 'w_proc2' in curves:
    done = max(r['step'] for r in curves['w_proc2'])
    curves['w_proc2_to_gpu1@'] = [r for r in curves.pop('w_proc2_to_gpu1') if r['step'] > done]
  return curves


def tokens_per_gpu(rows, n):
  rates = [r['tokens_per_s'] for r in rows[1:]] or [r['tokens_per_s'] for r in rows]
  return statistics.median(rates) / n, min(rates) / n, max(rates) / n


def loss_gap(rows, ref):
  ref_loss = {r['step']: r['loss'] for r in ref}
  gaps = [abs(r['loss'] - ref_loss[r['step']]) for r in rows if r['step'] in ref_loss]
  return (max(gaps), len(gaps)) if gaps else (None, 0)


def table(curves):
  lines = ['| run | GPUs | steps | last loss | max abs loss gap (steps compared) | tokens/s per GPU '
           '(median, min-max) | vs 1 GPU | peak memory |',
           '|---|---:|---:|---:|---:|---:|---:|---:|']
  for name, (n, loss_ref, speed_ref) in RUNS.items():
    rows = curves.get(name)
    if not rows:
      continue
    gap, compared = loss_gap(rows, curves[loss_ref]) if loss_ref in curves else (None, 0)
    med, lo, hi = tokens_per_gpu(rows, n)
    ratio = ''
    if speed_ref in curves:
      ratio = f'{med / tokens_per_gpu(curves[speed_ref], RUNS[speed_ref][0])[0]:.1%}'
    mem = rows[-1].get('peak_memory_gb')
    lines.append(
        f'| {name} | {n} | {rows[0]["step"]}-{rows[-1]["step"]} | {rows[-1]["loss"]:.4f} | '
        + (f'{gap:.4f} ({compared})' if gap is not None else '-')
        + f' | {med:,.0f} ({lo:,.0f}-{hi:,.0f}) | {ratio or "-"} | '
        + (f'{mem:.1f} GB' if mem else '-') + ' |')
  return '\n'.join(lines)


if __name__ == '__main__':
  print(table(load(sys.argv[1:] or ['.'])))
