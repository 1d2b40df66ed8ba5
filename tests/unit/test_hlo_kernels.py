"""benchmarks/hlo_kernels.py: the kernels of a compiled module and the bytes they move, on a
program compiled here for the CPU (the GPU's HLO has the same syntax)."""

import importlib
import os

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import REPO_ROOT


@pytest.fixture
def hlo_kernels(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, 'benchmarks'))
  return importlib.import_module('hlo_kernels')  # a script beside the benchmarks


def compiled_text(fn, *shapes):
  return jax.jit(fn).lower(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).compile() \
      .as_text()


def test_array_bytes(hlo_kernels):
  assert hlo_kernels.array_bytes('f32[64,1024]{1,0}') == 64 * 1024 * 4
  assert hlo_kernels.array_bytes('(bf16[8,2]{1,0}, s32[], pred[3])') == 8 * 2 * 2 + 4 + 3


def test_a_fusion_reading_a_slice_counts_the_slice(hlo_kernels):
  """x[:, :128] * 2 reads an eighth of x: the kernel moves 1/8 of x in and that much out."""
  x_bytes = 256 * 1024 * 4
  rows = hlo_kernels.kernels(compiled_text(lambda x: x[:, :128] * 2.0, (256, 1024)))
  assert len(rows) == 1
  assert rows[0].bytes == x_bytes // 8 * 2
  assert rows[0].scope.startswith('mul') or rows[0].scope.startswith('slice')


def test_whole_reads_and_scopes(hlo_kernels):
  def f(x, y):
    with jax.named_scope('first'):  # the barrier keeps XLA from fusing the two scopes
      a_n = jax.lax.optimization_barrier(jnp.sum(x * y, axis=0))
    with jax.named_scope('second'):
      return jnp.exp(y) + a_n
  rows = hlo_kernels.kernels(compiled_text(f, (512, 512), (512, 512)))
  table = {scope: (n, moved) for scope, n, moved in hlo_kernels.by_scope(rows, 1)}
  one, row = 512 * 512 * 4, 512 * 4
  assert table == {'first': (1, 2 * one + row),      # reads x and y whole, writes a row
                   'second': (1, one + row + one)}   # reads y and the row, writes the result


def test_no_entry_is_an_error(hlo_kernels):
  with pytest.raises(ValueError, match='ENTRY'):
    hlo_kernels.kernels('HloModule m\n')


def test_loop_body_kernels(hlo_kernels):
  """loop_body=True lists the largest while loop's body (a decode loop's step), where the entry
  holds that loop as one row; a module without a loop is refused."""
  def loop(x):
    def body(c):
      i, x = c
      with jax.named_scope('step'):
        x = jax.lax.optimization_barrier(jnp.sin(x) * 2.0)
        return i + 1, jnp.cumsum(x, axis=0) + 1.0
    return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]
  text = compiled_text(loop, (64, 64))
  entry = hlo_kernels.kernels(text)
  body = hlo_kernels.kernels(text, loop_body=True)
  assert '%while' in [k.kind for k in entry]
  assert '%while' not in [k.kind for k in body]
  assert any(k.scope.startswith('while/body/step/mul') for k in body)
  assert not any('step' in k.scope for k in entry)
  with pytest.raises(ValueError, match='no while loop'):
    hlo_kernels.kernels(compiled_text(lambda x: x * 2.0, (8, 8)), loop_body=True)
