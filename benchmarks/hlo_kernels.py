"""The kernels of a compiled XLA module, from its optimized HLO text: one row per kernel the entry
computation launches (fusions, copies, custom calls such as the Pallas kernels and cuBLAS
GEMMs), with its scope (the `op_name` the named scopes give it) and the bytes it moves.

Bytes are the operands' plus the result's, except that an operand a fusion reads only through
slices (after bitcasts, converts or reshapes: how a batched update hands each weight its part)
counts as those slices. An upper bound for the rest: a GEMM's operand counts once, however often
its tiles reread it; a fusion that reads part of an operand by other means counts all of it.
Only the entry computation is read (a loop XLA keeps is one row, `%while`, its body unlisted),
or with `loop_body=True` the body of the entry's largest while loop: what each of a decode
loop's steps launches. Used by benchmarks/compile_for_gpu.py on programs compiled for a GPU
without one.
"""

from __future__ import annotations

import collections
import math
import re
from typing import NamedTuple

ITEMSIZE = {'f64': 8, 's64': 8, 'u64': 8, 'f32': 4, 's32': 4, 'u32': 4, 'bf16': 2, 'f16': 2,
            's16': 2, 'u16': 2, 's8': 1, 'u8': 1, 'pred': 1, 'f8e4m3fn': 1, 'f8e5m2': 1,
            'f8e8m0fnu': 1, 's4': 1, 'u4': 1}
_ARRAY = re.compile(r'\b(' + '|'.join(ITEMSIZE) + r')\[([\d,]*)\]')
_INSTR = re.compile(r'\s*(?:ROOT )?(%[\w.-]+) = (.*?) ([\w-]+)\((.*)$')
_COMPUTATION = re.compile(r'\n(%[\w.-]+) \(.*?\) -> .*? \{\n(.*?)\n\}', re.S)
# Entry instructions that launch nothing.
NOT_KERNELS = frozenset({'parameter', 'constant', 'bitcast', 'get-tuple-element', 'tuple',
                         'after-all', 'opt-barrier', 'partition-id', 'replica-id'})
# Fused instructions an operand may pass through on its way to a slice, still read only there.
_VIEWS = frozenset({'bitcast', 'convert', 'reshape', 'copy'})


class Kernel(NamedTuple):
  name: str      # the instruction, e.g. %loop_add_fusion.80
  kind: str      # its name without the number: %loop_add_fusion, %copy, %custom-call
  scope: str     # op_name without the jit(...) prefix ('' if none)
  bytes: int     # read + written (module docstring)


def array_bytes(shape_text: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's elements summed)."""
  return sum(ITEMSIZE[dt] * math.prod(int(n) for n in dims.split(',') if n)
             for dt, dims in _ARRAY.findall(shape_text))


def _elements(shape_text: str) -> int:
  m = _ARRAY.search(shape_text)
  return math.prod(int(n) for n in m.group(2).split(',') if n) if m else 0


def _operands(rest: str) -> list[str]:
  depth, end = 0, len(rest)
  for i, ch in enumerate(rest):  # the operand list ends at its closing parenthesis
    depth += ch == '('
    if ch == ')':
      if depth == 0:
        end = i
        break
      depth -= 1
  return re.findall(r'%[\w.-]+', rest[:end])


def _elements_read(value: str, instrs: dict, users: dict, depth: int = 0) -> int | None:
  """Elements of `value` a fused computation reads, if only through slices; else None."""
  if depth > 8 or not users.get(value):
    return None
  total = 0
  for user in users[value]:
    shape, op = instrs[user]
    if op in ('slice', 'dynamic-slice'):
      total += _elements(shape)
    elif op in _VIEWS:
      part = _elements_read(user, instrs, users, depth + 1)
      if part is None:
        return None
      total += part
    else:
      return None
  return total


def _fused_reads(body: str, operand_shapes: list[str]) -> int:
  instrs, users, params = {}, collections.defaultdict(list), {}
  for line in body.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    instrs[name] = (shape, op)
    if op == 'parameter':
      params[int(re.match(r'(\d+)', rest).group(1))] = name
    for operand in _operands(rest):
      users[operand].append(name)
  total = 0
  for i, shape in enumerate(operand_shapes):
    full = array_bytes(shape)
    read = _elements_read(params[i], instrs, users) if i in params else None
    elements = _elements(shape)
    total += full if read is None or not elements else min(full, full * read // elements)
  return total


def kernels(hlo_text: str, loop_body: bool = False) -> list[Kernel]:
  """The entry computation's kernels in program order (`loop_body`: its largest while loop's
  body's instead)."""
  start = hlo_text.find('\nENTRY')
  if start < 0:
    raise ValueError('no ENTRY computation in this HLO text')
  bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(hlo_text[:start])}
  lines = hlo_text[start:].splitlines()[1:]
  if loop_body:
    loops = re.findall(r'\bwhile\(.*?body=(%[\w.-]+)', hlo_text[start:])
    if not loops:
      raise ValueError('no while loop in the entry computation')
    lines = max((bodies[b] for b in loops), key=len).splitlines()
  shapes, out = {}, []
  for line in lines:
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    shapes[name] = shape
    if op in NOT_KERNELS:
      continue
    operand_shapes = [shapes.get(o, '') for o in _operands(rest)]
    calls = re.search(r'calls=(%[\w.-]+)', rest)
    if calls and calls.group(1) in bodies:
      read = _fused_reads(bodies[calls.group(1)], operand_shapes)
    else:
      read = sum(array_bytes(s) for s in operand_shapes)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    scope = op_name.group(1).split('/', 1)[1] if op_name and '/' in op_name.group(1) else ''
    out.append(Kernel(name, re.sub(r'[.\d]+$', '', name), scope, read + array_bytes(shape)))
  return out


def by_scope(rows: list[Kernel], depth: int) -> list[tuple[str, int, int]]:
  """(scope cut to `depth` components, kernels, bytes), the most bytes first."""
  table = collections.defaultdict(lambda: [0, 0])
  for k in rows:
    key = '/'.join(k.scope.split('/')[:depth]) if k.scope else '(no scope)'
    table[key][0] += 1
    table[key][1] += k.bytes
  return sorted(((s, n, b) for s, (n, b) in table.items()), key=lambda r: -r[2])
