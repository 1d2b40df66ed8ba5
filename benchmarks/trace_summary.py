"""Where the device time of profiled training steps goes: a summary of a jax.profiler trace.

    python benchmarks/trace_summary.py WORKDIR/profile [--top 20] [--depth 3] [--merge-layers]
        [--device-substr GPU] [--hlo DUMP/module_*.jit_train_step.*after_optimizations.txt]
        [--bodies 25]

Reads the newest `perfetto_trace.json.gz` (else `*.trace.json.gz`) under the directory, as
`--config.log.profile_start_step=N` writes it, and prints
  (a) device busy time per executed program (a window: one step on one device) and in total,
  (b) kernel time by named-scope path (`layer3/attention/csa2`), forward and backward apart,
  (c) the kernels with the most total time.
Standard library only, so it runs wherever the trace is copied to.

On the GPU the scope path is read from the kernel's `args`: XLA annotates each kernel launch with
`name`, the op's JAX name stack (`.../transpose(jvp(layer3))/attention/csa2/...`), and xprof may
add `tf_op` or HLO text with `op_name` metadata (`long_name`). Kernels launched through XLA command
buffers (CUDA graphs) lose it: `XLA_FLAGS=--xla_gpu_enable_command_buffer=` restores it. On the
CPU the events carry only `hlo_op`, `hlo_module`, `run_id` and `device_ordinal`: every op lands
in `(no scope)`. Some GPU kernels carry no name stack either (a sixth of the full structure's
step, docs/performance.md section 19). `--hlo` reads the program's optimized HLO, as
`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"`
writes it (same flags otherwise, so the names match), and takes such a kernel's name stack from
the `op_name` metadata of its HLO instruction (the event's `hlo_op`, else its name with the
last `_N` read as `.N`). With `--hlo`, `--bodies N` also prints (d): the HLO of the N XLA
fusions with the most total time (the fusion's line, with its operand and result shapes, and the
start of its fused computation), which says what a glue fusion computes.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import re
import sys

_OP_NAME = re.compile(r'op_name="([^"]*)"')           # metadata inside HLO text (long_name)
_WRAPPED = re.compile(r'([A-Za-z_]\w*)\((.*)\)')      # jvp(layer3), transpose(jvp(...)), jit(f)
_LAYER = re.compile(r'layer\d+')
# Name-stack components that are control flow or transformation plumbing, not model structure.
_PLUMBING = {'while', 'body', 'cond', 'eval_jaxpr', 'scan', 'checkpoint', 'remat',
             'rematted_computation', 'shard_map', 'closed_call', 'core_call', 'pjit',
             'custom_jvp_call', 'custom_vjp_call', 'custom_vjp_call_jaxpr'}
_SCOPE_KEYS = ('tf_op', 'name', 'long_name')  # args that may hold the name stack
PHASES = ('fwd', 'bwd', 'remat', 'other')


# ---- loading --------------------------------------------------------------------------------

def find_trace(root: str) -> str:
  """The newest perfetto_trace.json.gz under root (else the newest *.trace.json.gz)."""
  found = {'perfetto': [], 'trace': []}
  for dirpath, _, files in os.walk(root):
    for f in files:
      if f == 'perfetto_trace.json.gz':
        found['perfetto'].append(os.path.join(dirpath, f))
      elif f.endswith('.trace.json.gz'):
        found['trace'].append(os.path.join(dirpath, f))
  paths = found['perfetto'] or found['trace']
  if not paths:
    raise SystemExit(f'no perfetto_trace.json.gz or *.trace.json.gz under {root}')
  return max(paths, key=os.path.getmtime)


def load_events(path: str) -> list[dict]:
  with gzip.open(path, 'rt') as f:
    trace = json.load(f)
  return trace['traceEvents'] if isinstance(trace, dict) else trace


def track_names(events: list[dict]) -> tuple[dict, dict]:
  """({pid: process name}, {(pid, tid): thread name}) from the `M` metadata events."""
  procs, threads = {}, {}
  for e in events:
    if e.get('ph') != 'M':
      continue
    name = (e.get('args') or {}).get('name', '')
    if e.get('name') == 'process_name':
      procs[e.get('pid')] = name
    elif e.get('name') == 'thread_name':
      threads[(e.get('pid'), e.get('tid'))] = name
  return procs, threads


def device_ops(events: list[dict], procs: dict, threads: dict, device_substr: str) -> list[dict]:
  """Complete events of executed ops on the tracks of processes named like `device_substr`.

  On the GPU only the hardware `Stream #N` lines are kept: xprof may add derived lines
  (`XLA Ops`, `XLA Modules`, name scopes) that repeat the same time. Without stream lines (the
  CPU), only events that name an HLO op are ops; the rest are runtime and Python markers.
  """
  pids = {pid for pid, name in procs.items() if device_substr in name}
  xs = [e for e in events if e.get('ph') == 'X' and e.get('pid') in pids and e.get('dur', 0) > 0]
  streams = {k for k, name in threads.items() if k[0] in pids and name.startswith('Stream')}
  if streams:
    xs = [e for e in xs if (e['pid'], e.get('tid')) in streams]
  else:
    xs = [e for e in xs if 'hlo_op' in (e.get('args') or {})] or xs
  return sorted(xs, key=lambda e: e['ts'])


# ---- scopes ---------------------------------------------------------------------------------

def name_stack(args: dict) -> str:
  """The op's JAX name stack from a kernel's args ('' when it carries none)."""
  for key in _SCOPE_KEYS:
    v = args.get(key)
    if not isinstance(v, str):
      continue
    m = _OP_NAME.search(v)
    if m:
      return m.group(1)
    if ' ' not in v and ('/' in v or '(' in v):
      return v
  for v in args.values():
    if isinstance(v, str) and (m := _OP_NAME.search(v)):
      return m.group(1)
  return ''


def _first_name(stack: str) -> str:
  """XLA joins the names of merged ops ('(a:b)', 'a;b'); keep the first."""
  head = re.split('[;:]', stack, maxsplit=1)[0]
  if head.count('(') > head.count(')'):  # the '(' that opened the joined list
    head = head[1:] if head.startswith('(') else head.replace('/(', '/', 1)
  return head


def _split(stack: str) -> list[str]:
  """Split on '/' outside parentheses."""
  parts, depth, cur = [], 0, []
  for ch in stack:
    depth += (ch == '(') - (ch == ')')
    if ch == '/' and depth == 0:
      parts.append(''.join(cur))
      cur = []
    else:
      cur.append(ch)
  parts.append(''.join(cur))
  return parts


def parse_scope(stack: str) -> tuple[list[str], str]:
  """(scope components, phase) of a name stack.

  Wrappers are stripped: `jit(...)` components are dropped (the step itself and library helpers
  such as jit(_where)), `jvp(x)`, `transpose(x)`, `vmap(x)` become x. Phase: `bwd` under
  transpose, `remat` for the forward recomputed in the backward pass, `fwd` under jvp, `other`
  outside the differentiated function (optimizer update, metrics).
  """
  parts, wrappers, remat = [], set(), False
  for comp in _split(_first_name(stack)):
    while (m := _WRAPPED.fullmatch(comp)):
      wrapper, comp = m.groups()
      wrappers.add(wrapper)
      if wrapper == 'jit':
        comp = ''
        break
    remat |= comp == 'rematted_computation'
    if not comp or comp in _PLUMBING or comp.startswith('branch_'):
      continue
    if parts and parts[-1] == comp:  # transpose(jvp(layer1))/jvp(layer1) under remat
      continue
    parts.append(comp)
  if remat:
    phase = 'remat'
  elif 'transpose' in wrappers:
    phase = 'bwd'
  elif 'jvp' in wrappers:
    phase = 'fwd'
  else:
    phase = 'other'
  return parts, phase


_HLO_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', re.M)


def hlo_text(path: str) -> str:
  """An HLO text dump (.gz or plain)."""
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rt') as f:
    return f.read()


def hlo_op_names(text: str) -> dict[str, str]:
  """{HLO instruction name: the op_name of its metadata} of an HLO text dump."""
  return dict(_HLO_INSTRUCTION.findall(text))


def best_hlo(paths: list[str], ops: list[dict]) -> tuple[str, str, dict[str, str], int]:
  """(path, text, op names, kernel events named) of the dump in `paths` whose instructions name
  the most of `ops`: another module's generic names (fusion.12) would name the wrong ops."""
  best = None
  for path in paths:
    text = hlo_text(path)
    names = hlo_op_names(text)
    found = sum(1 for e in ops if _hlo_stack(e, names))
    if best is None or found > best[3]:
      best = (path, text, names, found)
  return best


def fusion_body(text: str, name: str, max_lines: int = 24) -> str:
  """The instruction `name` of an HLO dump and, for a fusion, its called computation's first
  `max_lines` lines; '' if the dump has no such instruction."""
  line = re.search(rf'^\s*(?:ROOT )?%{re.escape(name)} = .*$', text, re.M)
  if not line:
    return ''
  out = [re.sub(r', metadata=\{.*', '', line.group(0).strip())[:600]]
  called = re.search(r'calls=%([\w.\-]+)', line.group(0))
  if called:
    body = re.search(rf'^%{re.escape(called.group(1))} .*?^\}}', text, re.M | re.S)
    if body:
      lines = [re.sub(r', metadata=\{.*', '', ln.strip())[:300]
               for ln in body.group(0).splitlines()[1:-1]]
      out += ['    ' + ln for ln in lines[:max_lines]]
      if len(lines) > max_lines:
        out.append(f'    ... {len(lines) - max_lines} more lines')
  return '\n'.join(out)


def _hlo_stack(event: dict, hlo_names: dict[str, str]) -> str:
  args = event.get('args') or {}
  op = args.get('hlo_op') or re.sub(r'_(\d+)$', r'.\1', event.get('name', ''))
  return hlo_names.get(op, '')


def scope_key(event: dict, depth: int, merge_layers: bool,
              hlo_names: dict[str, str] | None = None) -> tuple[str, str]:
  """(phase, first `depth` scope components joined by '/') of one kernel.

  The HLO dump's op_name, where given, wins over the event's own stack: for fusions in the
  grad-accumulation scan the event's stack stops at the step (the optimizer update and the
  expert and attention glue all read "(top level)" in the 2026-12-02 profile)."""
  stack = _hlo_stack(event, hlo_names or {}) or name_stack(event.get('args') or {})
  if not stack:
    return 'other', '(no scope)'
  parts, phase = parse_scope(stack)
  if merge_layers:
    parts = ['layer*' if _LAYER.fullmatch(p) else p for p in parts]
  return phase, '/'.join(parts[:depth]) or '(top level)'


# ---- windows --------------------------------------------------------------------------------

def _device(e: dict):
  """The device an op ran on: its process (one per GPU), or device_ordinal on the CPU's threads."""
  return e['pid'], (e.get('args') or {}).get('device_ordinal')


def windows(ops: list[dict], events: list[dict], threads: dict) -> list[tuple[str, list[dict]]]:
  """[(program name, ops)], one window per program execution on one device, in time order.

  From xprof's `XLA Modules` lines where present (GPU), else from the ops' run_id / group_id
  (the CPU's thunks carry run_id), else one window per program and device for the whole trace.
  """
  pids = {e['pid'] for e in ops}
  modules = collections.defaultdict(list)
  for e in events:
    if (e.get('ph') == 'X' and e.get('pid') in pids
        and threads.get((e.get('pid'), e.get('tid'))) == 'XLA Modules'):
      modules[e['pid']].append(e)
  out = collections.defaultdict(list)
  if modules:
    for mods in modules.values():
      mods.sort(key=lambda m: m['ts'])
    starts = {pid: [m['ts'] for m in mods] for pid, mods in modules.items()}
    for e in ops:
      i = bisect.bisect_right(starts.get(e['pid'], []), e['ts']) - 1
      m = modules[e['pid']][i] if i >= 0 else None
      inside = m is not None and e['ts'] <= m['ts'] + m.get('dur', 0)
      key = (m['name'], e['pid'], m['ts']) if inside else ('(outside modules)', e['pid'], 0)
      out[key].append(e)
  else:
    for e in ops:
      args = e.get('args') or {}
      run = args.get('run_id', args.get('group_id'))
      out[(args.get('hlo_module', '?'), _device(e), run)].append(e)
  return sorted(((key[0], evs) for key, evs in out.items()), key=lambda w: w[1][0]['ts'])


def busy_us(ops: list[dict]) -> float:
  """Time at least one op runs, per device, summed over devices."""
  total = 0.0
  by_device = collections.defaultdict(list)
  for e in ops:
    by_device[_device(e)].append((e['ts'], e['ts'] + e['dur']))
  for spans in by_device.values():
    spans.sort()
    end = -float('inf')
    for s, t in spans:
      if t > end:
        total += t - max(s, end)
        end = t
  return total


# ---- report ---------------------------------------------------------------------------------

def _ms(us: float) -> str:
  return f'{us / 1000:10.3f}'


def host_steps(events: list[dict]) -> int:
  """Training steps the trace holds, from the trainer's `train` step annotations on the host."""
  return len({(e.get('args') or {}).get('step_num') for e in events
              if e.get('ph') == 'X' and e.get('name') == 'train'})


def report_windows(ops: list[dict], wins: list, steps: int = 0, max_rows: int = 32) -> None:
  """(a): busy time per program, then per execution of the busiest program (the train step).

  steps: the host's count of traced steps; when the device lines cannot tell the executions
  apart (one window for several steps), the per-step figure comes from it.
  """
  by_program = collections.defaultdict(list)
  for name, evs in wins:
    by_program[name].append(evs)
  busy = {name: [busy_us(evs) for evs in runs] for name, runs in by_program.items()}
  print('(a) device busy time per program execution on one device (window)')
  print(f'{"busy ms":>10} {"runs":>6} {"ms/run":>10}  program')
  for name, b in sorted(busy.items(), key=lambda kv: -sum(kv[1])):
    print(f'{_ms(sum(b))} {len(b):6d} {_ms(sum(b) / len(b))}  {name}')
  top = max(busy, key=lambda n: sum(busy[n]))
  t0 = min(e['ts'] for e in ops)
  print(f'windows of {top}:')
  print(f'{"start ms":>10} {"span ms":>10} {"busy ms":>10} {"ops":>7}')
  runs = by_program[top]
  for evs in runs[:max_rows]:
    start = min(e['ts'] for e in evs)
    span = max(e['ts'] + e['dur'] for e in evs) - start
    print(f'{_ms(start - t0)} {_ms(span)} {_ms(busy_us(evs))} {len(evs):7d}')
  if len(runs) > max_rows:
    print(f'... {len(runs) - max_rows} more')
  if steps > len(runs):
    print(f'the trace holds {steps} train steps (host step annotations) but {len(runs)} '
          f'window(s) of {top}: {sum(busy[top]) / steps / 1000:.3f} ms busy per step on average')
  span = max(e['ts'] + e['dur'] for e in ops) - t0
  devices = len({_device(e) for e in ops})
  print(f'total: device busy {busy_us(ops) / 1000:.3f} ms summed over {devices} device(s) in a '
        f'{span / 1000:.3f} ms trace; {len(wins)} windows; kernel time summed '
        f'{sum(e["dur"] for e in ops) / 1000:.3f} ms')


def report(ops: list[dict], wins: list, *, depth: int, top: int, merge_layers: bool,
           steps: int = 0, hlo_names: dict[str, str] | None = None, hlo: str = '',
           bodies: int = 0) -> None:
  report_windows(ops, wins, steps)
  kernel_us = sum(e['dur'] for e in ops)

  groups = collections.defaultdict(lambda: [0.0, 0])
  phases = collections.Counter()
  for e in ops:
    phase, scope = scope_key(e, depth, merge_layers, hlo_names)
    groups[(phase, scope)][0] += e['dur']
    groups[(phase, scope)][1] += 1
    phases[phase] += e['dur']
  print(f'\n(b) kernel time by named scope (first {depth} components). Phase: fwd forward, '
        'bwd backward (transpose), remat forward recomputed in the backward pass, other outside '
        'the gradient (optimizer, metrics)')
  print('    ' + ', '.join(f'{p} {phases[p] / 1000:.3f} ms ({100 * phases[p] / kernel_us:.1f}%)'
                           for p in PHASES if phases[p]))
  print(f'{"ms":>10} {"%":>6} {"ops":>7} {"phase":>6}  scope')
  for (phase, scope), (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
    print(f'{_ms(us)} {100 * us / kernel_us:6.2f} {n:7d} {phase:>6}  {scope}')

  kernels = collections.defaultdict(lambda: [0.0, 0, ''])
  for e in ops:
    k = kernels[e.get('name', '?')]
    k[0] += e['dur']
    k[1] += 1
    k[2] = k[2] or '/'.join(scope_key(e, 99, False, hlo_names))
  print(f'\n(c) top {top} kernels by total time')
  print(f'{"ms":>10} {"%":>6} {"calls":>7}  kernel  [phase/scope of its first call]')
  for name, (us, n, where) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f'{_ms(us)} {100 * us / kernel_us:6.2f} {n:7d}  {name[:100]}  [{where}]')
  if not (bodies and hlo):
    return
  print(f'\n(d) the {bodies} XLA fusions with the most total time, from the HLO')
  shown = 0
  for name, (us, n, where) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
    body = fusion_body(hlo, re.sub(r'_(\d+)$', r'.\1', name)) or fusion_body(hlo, name)
    if not body or 'custom_call_target="__gpu$xla.gpu.triton"' in body:
      continue  # not in this program's HLO, or a Pallas kernel (its own name says what it is)
    print(f'\n{_ms(us)} ms, {n} calls: {name}  [{where}]\n{body}')
    shown += 1
    if shown == bodies:
      break


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('trace_dir', help='a profile directory (WORKDIR/profile), searched recursively')
  ap.add_argument('--top', type=int, default=20, help='kernels listed in (c)')
  ap.add_argument('--depth', type=int, default=3, help='scope components grouped in (b)')
  ap.add_argument('--device-substr', default='GPU',
                  help="keep processes whose name contains this ('/device:GPU:0'); '' keeps all "
                       '(the CPU, whose ops run on host threads)')
  ap.add_argument('--merge-layers', action='store_true', help='sum layerN scopes as layer*')
  ap.add_argument('--hlo', nargs='*', default=[],
                  help="the program's optimized HLO text (XLA's dump): the name stacks of "
                       'kernels whose trace events carry none; given several (a dump holds a '
                       'module per compilation), the one whose instructions name the most '
                       'kernels')
  ap.add_argument('--bodies', type=int, default=0,
                  help='with --hlo: print the HLO of this many of the costliest XLA fusions')
  args = ap.parse_args(argv)

  path = find_trace(args.trace_dir)
  events = load_events(path)
  procs, threads = track_names(events)
  print(f'trace: {path}')
  ops = device_ops(events, procs, threads, args.device_substr)
  if not ops:
    print(f'no op events on processes matching {args.device_substr!r}; processes: '
          f'{sorted(set(procs.values()))} (try --device-substr "")')
    return 1
  hlo, hlo_names = '', None
  if args.hlo:
    path, hlo, hlo_names, found = best_hlo(args.hlo, ops)
    own = sum(1 for e in ops if name_stack(e.get('args') or {}))
    print(f'hlo: {path} ({len(hlo_names)} instructions with op_name metadata; they name '
          f'{found} of {len(ops)} kernel events, {own} carry their own name stack)')
  report(ops, windows(ops, events, threads), depth=args.depth, top=args.top,
         merge_layers=args.merge_layers, steps=host_steps(events), hlo_names=hlo_names,
         hlo=hlo if args.bodies else '', bodies=args.bodies)
  return 0


if __name__ == '__main__':
  sys.exit(main())
