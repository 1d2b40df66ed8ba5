"""Packed cache bytes (packing.py) unpack to exactly the fake-quantized values, and their size is
the bytes per token `tools.info` reports (890 for the released config, docs/architecture.md 3.9)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepseek41 import packing
from deepseek41.config import layer_roles, load_config_file, resolve
from deepseek41.quant import QDQS
from deepseek41.tools.info import CACHE_BYTES_PER_VALUE, kv_cache_bytes
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def _samples(shape, seed=0):
  """Normal values over many magnitudes, plus blocks of zeros, ties, huge and tiny values."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape) * np.exp2(rng.integers(-40, 20, size=shape[:-1] + (1,)))
  x[0, :32] = 0.0
  x[1, :32] = np.array([6.0, -6.0, 0.25, 0.75, 1.25, -2.5, 5.0, 1e30] * 4)
  x[2, :32] = 1e-39
  return x.astype(np.float32)


@pytest.mark.parametrize('name', sorted(packing.FORMATS))
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_unpack_is_the_fake_quantization_bit_for_bit(name, dtype):
  x = jnp.asarray(_samples((6, 128)), dtype)
  packed = jax.jit(lambda x: packing.pack(name, x))(x)
  assert packed.codes.dtype == packed.scales.dtype == jnp.uint8
  got = jax.jit(lambda p: packing.unpack(name, p, dtype))(packed)
  want = QDQS[name](x)
  np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                np.asarray(want, np.float32).view(np.uint32))


@pytest.mark.parametrize('name', sorted(packing.FORMATS))
def test_packed_bytes_are_the_reported_bytes_per_value(name):
  x = jnp.ones((3, 256), jnp.float32)
  packed = packing.pack(name, x)
  stored = packed.codes.size + packed.scales.size
  assert stored == x.size * packing.bytes_per_value(name) == x.size * CACHE_BYTES_PER_VALUE[name]


def test_released_global_cache_is_890_bytes_per_token():
  """Each KV-source layer's compressed entries (main KV and indexer keys) of a 64-token prompt,
  packed at the released widths: 890 bytes per token over the layers, tools.info's number."""
  cfg = resolve(load_config_file(os.path.join(ROOT, 'configs', 'v41_flash.py')),
                num_devices=8, backend='cpu')  # its mesh splits the experts 8 ways
  m, tokens = cfg.model, 64
  total = 0
  for role in layer_roles(m):
    if role.mode == 'SWA' or role.kv_source != role.layer:
      continue  # Reuse / Reindex layers read their source's cache
    entries = tokens // role.ratio
    kv = packing.pack(m.kv_quant, jnp.ones((entries, m.head_dim), jnp.float32))
    keys = packing.pack(m.index_quant, jnp.ones((entries, m.index_head_dim), jnp.float32))
    total += sum(a.size for a in (*kv, *keys))
  assert total / tokens == kv_cache_bytes(cfg)['global_bytes_per_token'] == 890


def test_an_unknown_format_is_named():
  with pytest.raises(ValueError, match="'fp6'"):
    packing.pack('fp6', jnp.ones((1, 32)))
