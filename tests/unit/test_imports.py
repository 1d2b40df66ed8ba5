"""The package's import structure (docs/design.md "Layers"): every import goes down the layer
order or stays inside its own folder, no module imports itself through others (no cycles), and
imports sit at the top of their module unless an optional dependency needs otherwise.

Read from the source with `ast`, so a violation is named file:line without importing anything.
"""

from __future__ import annotations

import ast
import os
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = os.path.join(ROOT, 'deepseek41')

# Bottom to top. A unit (a folder of the package, or a module at its top level) may import its
# own modules and those of the units below it; units on one level are peers and import neither.
LAYERS = (
    ('deepseek41', 'deepseek41.quant'),
    ('deepseek41.batch', 'deepseek41.packing'),
    ('deepseek41.ops',),
    ('deepseek41.config',),
    ('deepseek41.sharding',),
    ('deepseek41.model',),
    ('deepseek41.data',),
    ('deepseek41.train',),
    ('deepseek41.generate', 'deepseek41.interop'),
    ('deepseek41.tools', 'deepseek41.eval'),
)
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}

# Imports that may sit inside a function: optional dependencies, each with its extra.
OPTIONAL = {
    'wandb': "the 'wandb' extra (log.wandb_project)",
    'matplotlib': "the 'plot' / 'test' extras (tools.compare --out, the eval command's heat map)",
    'libtpu': "the 'tpu' extra (tools.topology_plan compiles for TPU slices)",
    'torch': "the 'hf' extra (benchmarks/hf_parity.py)",
    'transformers': "the 'hf' extra",
}
# Modules whose own imports wait for a reason of start-up order.
DEFERRED = {
    'deepseek41.train.__main__': 'the stop-signal handler (train/stop.py) is installed before '
                                 'jax and the trainer are imported: a signal during those '
                                 'seconds must end the run, not vanish in a gc callback',
}


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len('.py')].replace(os.sep, '.')
  return rel[:-len('.__init__')] if rel.endswith('.__init__') else rel


def _sources():
  for dirpath, dirnames, filenames in os.walk(PACKAGE):
    dirnames[:] = sorted(d for d in dirnames if d != '__pycache__')
    for name in sorted(filenames):
      if name.endswith('.py'):
        path = os.path.join(dirpath, name)
        yield path, _module_name(path)


def _imports(path: str, module: str):
  """(line, imported module, inside a function) of every import in `path`; for `from a import
  b` the module is a.b where that is a module of the package, else a."""
  tree = ast.parse(open(path, encoding='utf-8').read(), path)
  is_package = path.endswith('__init__.py')

  def walk(node, in_function):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        for alias in child.names:
          yield child.lineno, alias.name, inner
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ''
        if child.level:
          parts = module.split('.')
          parts = parts if is_package else parts[:-1]
          parts = parts[:len(parts) - child.level + 1]
          base = '.'.join(parts + ([base] if base else []))
        for alias in child.names:
          yield child.lineno, _internal(f'{base}.{alias.name}') or base, inner
      yield from walk(child, inner)
  yield from walk(tree, False)


def _unit(module: str) -> str:
  parts = module.split('.')
  if len(parts) == 1:
    return module
  folder = '.'.join(parts[:2])
  return folder


MODULES = dict((m, p) for p, m in _sources())


def _internal(name: str) -> str | None:
  """The package module `name` refers to (a module, or the package of a name imported from it)."""
  while name and name not in MODULES:
    name = name.rpartition('.')[0]
  return name or None


def test_every_unit_has_a_layer():
  missing = sorted({_unit(m) for m in MODULES} - set(LEVEL))
  assert not missing, f'add these to LAYERS (and docs/design.md "Layers"): {missing}'


def test_imports_go_down_the_layers():
  bad = []
  for module, path in MODULES.items():
    for line, name, _ in _imports(path, module):
      target = _internal(name) if name.startswith('deepseek41') else None
      if target is None:
        continue
      here, there = _unit(module), _unit(target)
      if here != there and LEVEL[there] >= LEVEL[here]:
        bad.append(f'{os.path.relpath(path, ROOT)}:{line}: {here} imports {target} '
                   f'({"a peer" if LEVEL[there] == LEVEL[here] else "a higher layer"})')
  assert not bad, '\n'.join(bad)


def test_no_import_cycles():
  graph = {m: set() for m in MODULES}
  for module, path in MODULES.items():
    for _, name, _ in _imports(path, module):
      target = _internal(name) if name.startswith('deepseek41') else None
      if target and target != module and not module.startswith(target + '.'):
        graph[module].add(target)  # a package's __init__ runs before its modules: not a cycle
  cycles, index, low, stack, on_stack = [], {}, {}, [], set()

  def connect(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))
  for v in sorted(graph):
    if v not in index:
      connect(v)
  assert not cycles, f'import cycles: {cycles}'


def test_imports_sit_at_the_top_of_their_module():
  bad = []
  for module, path in MODULES.items():
    for line, name, inner in _imports(path, module):
      if inner and name.split('.')[0] not in OPTIONAL and module not in DEFERRED:
        bad.append(f'{os.path.relpath(path, ROOT)}:{line}: import of {name} inside a function')
  assert not bad, '\n'.join(sorted(set(bad), key=lambda b: (b.split(':')[0], int(b.split(':')[1]))))
