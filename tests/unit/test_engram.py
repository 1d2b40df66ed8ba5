"""Engram in the model: gate and injection, dead tokens, addressing once per batch, sharding, LR."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.config import base_config, resolve
from deepseek41.model.engram import Engram, layer_addresses, row_ids
from deepseek41.model.transformer import Transformer
from deepseek41.sharding import logical_to_spec
from tests.helpers import first_update_ratios, packed_batch, resolved


def _np_engram(mod, x_tnd, ids_tj, dead_t, eps):
  """Section 3.12 for one row, in numpy."""
  table = np.asarray(mod.table[...], np.float64)
  kv = table[ids_tj].reshape(len(ids_tj), -1) @ np.asarray(mod.proj[...], np.float64)
  n, d = x_tnd.shape[1:]
  kv = kv.reshape(-1, n + 1, d)
  key, v = kv[:, :n], kv[:, n]
  rstd = lambda a: 1 / np.sqrt((a ** 2).mean(-1, keepdims=True) + eps)  # noqa: E731
  qk = np.asarray(mod.q_weight[...]) * np.asarray(mod.k_weight[...])
  dot = (x_tnd * rstd(x_tnd) * qk * key * rstd(key)).sum(-1) / np.sqrt(d)
  g = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
  g[dead_t] = 0.0
  return x_tnd + g[..., None] * v[:, None, :]


@pytest.mark.parametrize('residual', ['mhc_single_pass', 'plain'])
def test_gate_and_injection_match_the_formula(residual):
  cfg = resolved(**{'model.residual': residual, 'model.init_std': 0.2}).model
  addr = layer_addresses(cfg)[1]
  mod = Engram(cfg, addr.rows, nnx.Rngs(params=0))
  mod.q_weight[...] = jax.random.normal(jax.random.key(1), mod.q_weight.shape)
  batch = packed_batch(seed=3, image_rows=(1,))
  ids = row_ids(cfg, {1: addr}, batch)[1]
  dead = (batch['segment_ids'] == 0) | (batch['modality'] != 0)
  n = cfg.hc_mult if residual != 'plain' else 1
  x = jax.random.normal(jax.random.key(2), batch['tokens'].shape + ((n,) if n > 1 else ()) +
                        (cfg.d_model,))
  out, dropped = mod(x, ids, jnp.asarray(dead))
  out = np.asarray(out)
  assert int(dropped) == 0
  for r in range(2):
    x_tnd = np.asarray(x[r], np.float64).reshape(x.shape[1], n, -1)
    want = _np_engram(mod, x_tnd, np.asarray(ids[r]), dead[r], cfg.rms_norm_eps)
    np.testing.assert_allclose(out[r].reshape(want.shape), want, rtol=2e-5, atol=2e-5)
  # Dead tokens (padding, image) pass through untouched; live ones are changed.
  np.testing.assert_array_equal(out[dead], np.asarray(x)[dead])
  assert np.abs(out[~dead] - np.asarray(x)[~dead]).max() > 1e-3


def test_model_hashes_once_and_engram_changes_the_output():
  cfg = resolved(**{'model.init_std': 0.1, 'model.engram': True})
  model = Transformer(cfg.model, nnx.Rngs(params=0))
  batch = packed_batch(seed=4)
  calls = []
  import deepseek41.model.transformer as tr
  original = tr.row_ids

  def counting(*a):
    calls.append(1)
    return original(*a)
  tr.row_ids = counting
  try:
    with_engram = np.asarray(model(batch)[0])
  finally:
    tr.row_ids = original
  assert len(calls) == 1                      # one call for all Engram layers of the batch
  off = Transformer(resolved(**{'model.init_std': 0.1, 'model.engram': False}).model,
                    nnx.Rngs(params=0))
  assert not any(b.engram is not None for b in off.blocks)
  assert np.abs(with_engram - np.asarray(off(batch)[0])).max() > 1e-4


def test_released_table_sizes():
  c = base_config()
  m = c.model
  m.vocab_size, m.num_layers, m.engram_layer_ids = 129280, 15, (1, 14)
  m.compress_ratios, m.kv_source_layer_ids, m.index_source_layer_ids = (0,) * 15, (), ()
  m.candidate_source_layer_id, m.num_encoder_layers = -1, 0
  m.engram_max_ngram, m.engram_n_heads, m.engram_head_dim = 4, 8, 256
  m.engram_vocab_start, m.engram_compressed_vocab_size = 16_000_000, 99_092
  cfg = resolve(c, num_devices=1, backend='cpu').model
  rows = {layer: a.rows for layer, a in layer_addresses(cfg).items()}
  assert rows == {1: 384_006_168, 14: 384_016_682}


def test_table_rows_are_sharded_by_the_rules():
  cfg = resolved()
  spec = logical_to_spec(('engram_rows', 'engram_dim'), cfg.mesh.rules)
  assert spec[0] == ('fsdp', 'expert') and (len(spec) < 2 or spec[1] is None)


def test_tables_learn_at_the_multiplied_rate():
  scaled = first_update_ratios(
      {'model.engram': True}, {'train.engram_table_lr_multiplier': 5.0},
      {'train.engram_table_lr_multiplier': 1.0},
      lambda name: 5.0 if ('engram' in name and 'table' in name) else 1.0)
  assert scaled == 1
