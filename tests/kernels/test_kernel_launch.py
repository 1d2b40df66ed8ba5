"""ops/launch.py is the one place a kernel launches and the one rule of where it runs.

- The rule: in the Pallas interpreter on the CPU, a caller's `interpret=` over it; a kernel
  launched with no choice runs interpreted here.
- A scan of the package's source (AST, so comments and docstrings do not count): no module but
  launch.py calls `pallas_call` itself, and none computes an `interpret` value from the platform
  (the default backend, the mesh's devices) or compares the default backend with 'cpu' in ops/
  or model/.
- ops/contracts.py, read by the config's `auto` policy and checks, imports without jax.
"""

import ast
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deepseek41.ops import launch
from deepseek41.ops.gpu.mgpu_common import interpret_params
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = os.path.join(ROOT, 'deepseek41')
LAUNCH = os.path.join('deepseek41', 'ops', 'launch.py')
# Calls that ask which platform this is: an `interpret` value must not be computed from them.
PLATFORM_PROBES = {'default_backend', 'get_abstract_mesh', 'devices', 'local_devices'}


def test_the_rule_interprets_on_the_cpu_unless_told():
  assert jax.default_backend() == 'cpu'
  assert launch.platform() == 'cpu' and launch.interpreted()
  assert launch.interpreted(True) and not launch.interpreted(False)
  with jax.set_mesh(jax.make_mesh((1,), ('data',))):  # the mesh's platform: still the CPU
    assert launch.platform() == 'cpu' and launch.interpreted()


def test_a_kernel_launched_without_a_choice_runs_interpreted_here():
  def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  x = jnp.arange(16, dtype=jnp.float32)
  call = launch.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))
  np.testing.assert_array_equal(np.asarray(call(x)), np.asarray(x) + 1.0)
  jaxpr = jax.make_jaxpr(call)(x)
  eqn, = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == 'pallas_call']
  assert eqn.params['interpret']
  assert pl.pallas_call is not launch.pallas_call


_TRACED = []  # the scale of each trace of `_scale_kernel`'s body


def _scale_kernel(x_ref, o_ref, *, scale, **_):
  _TRACED.append(scale)
  o_ref[...] = x_ref[...] * scale


def _scaled_launch(scale: float, block: int, interpret=None, **keywords):
  """A launch built afresh, as the kernels' wrappers build theirs at every call: a new kernel
  partial and new index-map lambdas."""
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return launch.pallas_call(functools.partial(_scale_kernel, scale=scale, **keywords),
                            out_shape=jax.ShapeDtypeStruct((32,), jnp.float32), grid=(32 // block,),
                            in_specs=[spec], out_specs=pl.BlockSpec((block,), lambda i: (i,)),
                            interpret=interpret)


def test_an_equal_launch_reuses_the_kernel_trace():
  """Launches equal in every part share one `pl.pallas_call`, so the kernel body is traced once
  per operand type however many call sites build it; any difference (a closure value, a
  block, the interpret choice, the operand type) is its own launch, and a launch holding an
  array is built afresh each time."""
  traced = _TRACED
  traced.clear()
  x = jnp.arange(32, dtype=jnp.float32)
  for _ in range(3):
    np.testing.assert_array_equal(jax.jit(lambda x: _scaled_launch(2.0, 8)(x))(x),
                                  2 * np.arange(32))
  assert traced == [2.0]
  for scale, block in ((3.0, 8), (2.0, 16)):
    np.testing.assert_array_equal(_scaled_launch(scale, block)(x), scale * np.arange(32))
  assert traced == [2.0, 3.0, 2.0]
  _scaled_launch(2.0, 8, interpret=True)(x)     # the rule's choice here, spelled out
  _scaled_launch(2.0, 8)(x + 1)                 # another array of the same type
  assert traced == [2.0, 3.0, 2.0]
  _scaled_launch(2.0, 8)(jnp.arange(32, dtype=jnp.int32))  # another operand type
  assert len(traced) == 4
  offset = jnp.ones(())
  for _ in range(2):
    _scaled_launch(2.0, 8, offset=offset)(x)
  assert len(traced) == 6

  def countdown(n):  # a closure that holds itself: keyed no deeper than a limit, not shared
    return n if n <= 0 else countdown(n - 1)
  for _ in range(2):
    _scaled_launch(2.0, 8, helper=countdown)(x)
  assert len(traced) == 8


def _package_modules():
  for dirpath, dirnames, filenames in os.walk(PACKAGE):
    dirnames[:] = [d for d in dirnames if d != '__pycache__']
    for f in sorted(filenames):
      if f.endswith('.py'):
        path = os.path.join(dirpath, f)
        with open(path, encoding='utf-8') as fh:
          yield os.path.relpath(path, ROOT), ast.parse(fh.read(), path)


def _called_name(call: ast.Call) -> str | None:
  f = call.func
  return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _probes_platform(expr) -> bool:
  return any((isinstance(n, ast.Call) and _called_name(n) in PLATFORM_PROBES) or
             (isinstance(n, ast.Attribute) and n.attr == 'platform')
             for n in ast.walk(expr))


def _interpret_values(tree):
  """Every expression that becomes an `interpret` value: keyword arguments, assignments to a
  name or attribute called interpret, parameter defaults, and the body of a function whose
  name says interpret."""
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef) and 'interpret' in node.name:
      yield node
    if isinstance(node, ast.keyword) and node.arg == 'interpret':
      yield node.value
    elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      if any(getattr(t, 'id', getattr(t, 'attr', None)) == 'interpret' for t in targets):
        yield node.value
    elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
      args = node.args
      positional = args.posonlyargs + args.args
      for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
        if arg.arg == 'interpret':
          yield default
      for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        if arg.arg == 'interpret' and default is not None:
          yield default


def _compares_backend_with_cpu(node) -> bool:
  if not isinstance(node, ast.Compare):
    return False
  sides = [node.left, *node.comparators]
  return (any(isinstance(s, ast.Call) and _called_name(s) == 'default_backend' for s in sides) and
          any(isinstance(s, ast.Constant) and s.value == 'cpu' for s in sides))


def launch_rule_violations(modules) -> list[str]:
  """file:line of each way around the launch helper in (path, AST) pairs."""
  out = []
  for path, tree in modules:
    if path == LAUNCH:
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and node.attr == 'pallas_call' and not (
          isinstance(node.value, ast.Name) and node.value.id == 'launch'):
        out.append(f'{path}:{node.lineno}: calls pallas_call itself, not launch.pallas_call')
      if isinstance(node, ast.ImportFrom) and any(a.name == 'pallas_call' for a in node.names) \
          and node.module != 'deepseek41.ops.launch':
        out.append(f'{path}:{node.lineno}: imports pallas_call from {node.module}')
      in_ops_or_model = path.startswith((os.path.join('deepseek41', 'ops'),
                                         os.path.join('deepseek41', 'model')))
      if in_ops_or_model and _compares_backend_with_cpu(node):
        out.append(f'{path}:{node.lineno}: compares default_backend() with cpu '
                   '(launch.interpreted() is the rule)')
    for value in _interpret_values(tree):
      if _probes_platform(value):
        out.append(f'{path}:{value.lineno}: decides interpret from the platform '
                   '(launch.interpreted() is the rule)')
  return out


def test_every_kernel_launches_through_the_one_helper():
  modules = list(_package_modules())
  assert any(path == LAUNCH for path, _ in modules)
  violations = launch_rule_violations(modules)
  assert not violations, '\n'.join(violations)


def test_the_scan_finds_each_way_around_the_helper():
  """The scan is not vacuous: each pattern it forbids, written in a module, is reported."""
  snippets = {
      'direct': 'from jax.experimental import pallas as pl\nf = pl.pallas_call(k, out_shape=s)\n',
      'imported': 'from jax.experimental.pallas import pallas_call\n',
      'keyword': 'y = kernel(x, interpret=jax.default_backend() == "cpu")\n',
      'default': 'def kernel(x, *, interpret=jax.default_backend() != "gpu"):\n  pass\n',
      'assigned': 'interpret = jax.sharding.get_abstract_mesh().abstract_device.platform\n',
      'compared': 'tiles = SMALL if jax.default_backend() == "cpu" else BIG\n',
      'helper': 'def _interpret():\n  name = jax.default_backend()\n  return name == "cpu"\n',
  }
  path = os.path.join('deepseek41', 'ops', 'gpu', 'made_up.py')
  for name, src in snippets.items():
    assert launch_rule_violations([(path, ast.parse(src))]), name
  allowed = 'y = launch.pallas_call(k, out_shape=s, interpret=interpret)\n'
  assert not launch_rule_violations([(path, ast.parse(allowed))])


def test_contracts_import_without_jax():
  """The config validates without starting a backend: ops/contracts.py (and the ops package on
  the way to it) imports with jax made unimportable."""
  script = '\n'.join([
      'import sys',
      'class NoJax:',
      '  def find_spec(self, name, path=None, target=None):',
      '    if name.split(".")[0] in ("jax", "jaxlib"):',
      '      raise ImportError(f"{name} is blocked")',
      'sys.meta_path.insert(0, NoJax())',
      'from deepseek41.ops import contracts',
      'assert contracts.index_scores_supported(16, 128)',
      'assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")]',
      'print("ok")',
  ])
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  out = subprocess.run([sys.executable, '-c', script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-2000:]


def test_mosaic_gpu_kernels_follow_the_rule():
  """plgpu.kernel's interpret= (ops/gpu/mgpu_common.py) from the same rule: the interpreter here
  unless told otherwise, a test's own interpreter parameters kept."""
  assert isinstance(interpret_params(None), plgpu.InterpretGPUParams)
  assert interpret_params(False) is False
  mine = plgpu.InterpretGPUParams(detect_races=True)
  assert interpret_params(mine) is mine
