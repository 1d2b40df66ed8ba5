"""model.attention_variant: CSA2, dense and window-only as one key (docs/architecture.md 3.8.1).

The key replaces model.csa2, and configs saved with it resolve to the same model; the dense
variant attends to every earlier token of its document exactly (a window as long as the row,
computed another way), trains from the command-line path, decodes equal to its full forward,
and is counted honestly in FLOPs and cache bytes.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deepseek41.config import (ConfigError, config_from_saved, layer_roles, load_config_file,
                               resolve)
from deepseek41.config.command_line import check_command_line
from deepseek41.generate.cache import empty_cache
from deepseek41.generate.decode import forward_chunk
from deepseek41.model.attention import Attention
from deepseek41.model.ced import UNBOUNDED, ced_prefill_logits, tail_reach
from deepseek41.model.layer_cache import CacheSpec
from deepseek41.model.shared import Shared
from deepseek41.model.transformer import Transformer
from deepseek41.tools.info import kv_cache_bytes
from deepseek41.train.flops import attention_flops_per_layer, decode_attention_flops
from deepseek41.train.warm_start import model_differences
from tests.helpers import REPO_ROOT, packed_layout, resolved

# Its tests share what they build (module fixtures, cached references): one worker runs the
# whole file (tests/conftest.py).
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = REPO_ROOT
DENSE = {'model.attention_variant': 'dense'}


# ---- the key and old configs -----------------------------------------------------------------


@pytest.mark.parametrize('old, new', [(True, 'csa2'), (False, 'window')])
def test_configs_saved_with_model_csa2_resolve_to_the_same_model(old, new):
  """A checkpoint's config.json from before the key: read back (generation, warm start) as the
  same model, and the resume check finds no difference from a run configured with the key."""
  now = resolved(**{'model.attention_variant': new}).to_dict()
  saved = {**now, 'model': {k: v for k, v in now['model'].items() if k != 'attention_variant'}}
  saved['model']['csa2'] = old
  assert config_from_saved(saved).model.attention_variant == new
  assert model_differences(saved['model'], now['model']) == ([], [])
  other = resolved(**{'model.attention_variant': 'dense'}).to_dict()['model']
  another_model, _ = model_differences(saved['model'], other)
  assert another_model == [f"model.attention_variant: checkpoint {new!r} != now 'dense'"]


def test_a_config_file_setting_model_csa2_is_told_the_replacement():
  c = load_config_file(os.path.join(ROOT, 'configs', 'tiny.py'))
  c.model.csa2 = True
  with pytest.raises(ConfigError, match=r"model.csa2.*model.attention_variant='csa2'"):
    resolve(c, num_devices=1, backend='cpu')


def test_the_command_line_names_the_replacement_too(tmp_path):
  problem = check_command_line(['ds41-train', f'--config={ROOT}/configs/tiny.py',
                             '--config.model.csa2=False', f'--workdir={tmp_path}'])
  assert "model.attention_variant='csa2' for csa2=True, 'window' for csa2=False" in problem


def test_the_shipped_configs_run_csa2():
  for name in ('tiny.py', 'ablation_1b.py', 'v41_flash.py'):
    c = load_config_file(os.path.join(ROOT, 'configs', name))
    assert c.model.attention_variant == 'csa2'


def test_dense_under_context_parallelism_is_refused_naming_the_key():
  with pytest.raises(ConfigError, match=r'model.attention_variant.*mesh.context=2'):
    resolved(num_devices=2, **DENSE, **{'mesh.data': 1, 'mesh.context': 2})
  resolved(num_devices=2, **{'mesh.data': 1, 'mesh.context': 2,
                             'model.attention_variant': 'csa2'})


# ---- the dense layer -------------------------------------------------------------------------


def _params(model):
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_parameters_dense_and_window_share_csa2_lacks_nothing_else():
  """Dense and window-only build the same parameters; CSA2 adds exactly its compressors and
  indexers (the attention projections, sink and output are common)."""
  models = {v: Transformer(resolved(**{'model.attention_variant': v}).model, nnx.Rngs(params=0))
            for v in ('csa2', 'dense', 'window')}
  assert _params(models['dense']) == _params(models['window'])
  extra = sum(x.size for block in models['csa2'].blocks if block.attn.csa2 is not None
              for x in jax.tree.leaves(nnx.state(block.attn.csa2, nnx.Param)))
  assert extra > 0 and _params(models['csa2']) == _params(models['dense']) + extra


def _layer_batch(t):
  seg, pos = packed_layout([(13, 20), (9, 16, 5)], t)
  return {'segment_ids': jnp.asarray(seg), 'positions': jnp.asarray(pos)}


def test_a_dense_layer_is_a_window_as_long_as_the_row():
  """Same parameters: the dense layer's output is the window layer's with the window the whole
  row (the window's own reference path), across packed documents and padding."""
  t = 40
  dense = resolved(**DENSE).model
  wide = dataclasses.replace(resolved().model, sliding_window=t, attention_impl='reference')
  role = layer_roles(dense)[2]
  assert role.ratio > 0
  x = jax.random.normal(jax.random.key(0), (2, t, dense.d_model))
  batch = _layer_batch(t)
  layer = Attention(dense, role, nnx.Rngs(params=1))
  want, _ = Attention(wide, role, nnx.Rngs(params=1))(x, batch, Shared())
  got, _ = layer(x, batch, Shared())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def _token_batch(tokens, seg, pos):
  return {'tokens': jnp.asarray(tokens), 'segment_ids': jnp.asarray(seg),
          'positions': jnp.asarray(pos), 'modality': jnp.zeros(tokens.shape, jnp.int32)}


@pytest.fixture(scope='module')
def dense_model():
  # The dense keys are the layer's latent in its window format: FP8 here, as released.
  cfg = resolved(**DENSE, **{'model.init_std': 0.1, 'model.sliding_window': 4,
                             'model.head_dim': 32, 'model.swa_quant': 'fp8_ue8m0_32'})
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, moe_backend=cfg.model.eval_moe_backend))
  return cfg, Transformer(cfg.model, nnx.Rngs(params=0))


def test_dense_reaches_the_document_start_and_never_crosses_documents(dense_model):
  """Perturbing a token moves the logits of its own document from that token on, however far
  (beyond every stacked window), and nothing before it or in another document."""
  cfg, model = dense_model
  t = 40
  seg, pos = packed_layout([(30, 10)], t)
  tokens = np.random.default_rng(0).integers(3, 96, (1, t)).astype(np.int32)
  run = nnx.jit(lambda m, b: m(b)[0])
  base = np.asarray(run(model, _token_batch(tokens, seg, pos)))
  moved = tokens.copy()
  moved[0, 2] = (moved[0, 2] + 1) % 96
  diff = np.abs(np.asarray(run(model, _token_batch(moved, seg, pos))) - base).max(-1)[0]
  reach = cfg.model.num_layers * (cfg.model.sliding_window - 1)
  assert 29 > 2 + reach                    # the last row of document 1 is past every window
  assert (diff[:2] == 0).all() and (diff[30:] == 0).all()
  assert diff[29] > 1e-4


def test_dense_decoding_equals_the_full_forward(dense_model):
  """A prefill of two rows of different lengths, then one token at a time: every logit row
  equals the full forward's (the dense layers' cache holds every position)."""
  cfg, model = dense_model
  seq = np.random.default_rng(1).integers(3, 96, (2, 26)).astype(np.int32)
  full = np.asarray(nnx.jit(lambda m, b: m(b)[0])(model, _token_batch(
      seq, np.ones(seq.shape, np.int32), np.tile(np.arange(26, dtype=np.int32), (2, 1)))))
  chunk = nnx.jit(lambda m, c, tok, valid: forward_chunk(m, c, tok, valid)[::2])
  lengths = np.array([7, 18], np.int32)
  valid = np.arange(18)[None] < lengths[:, None]
  cache = empty_cache(model, CacheSpec(batch=2, max_len=32, max_chunk=1))
  logits, cache = chunk(model, cache, jnp.asarray(np.where(valid, seq[:, :18], 0)),
                        jnp.asarray(valid))
  for b in range(2):
    np.testing.assert_allclose(np.asarray(logits)[b, :lengths[b]], full[b, :lengths[b]],
                               rtol=2e-4, atol=2e-4)
  for _ in range(6):
    length = np.asarray(cache['length'])
    logits, cache = chunk(model, cache, jnp.asarray(seq[np.arange(2), length][:, None]),
                          jnp.ones((2, 1), bool))
    for b in range(2):
      np.testing.assert_allclose(np.asarray(logits)[b, 0], full[b, length[b]], rtol=2e-4,
                                 atol=2e-4)


def test_ced_prefill_of_a_dense_decoder_is_exact_over_the_whole_prompt(dense_model):
  cfg, model = dense_model
  assert tail_reach(cfg.model) == UNBOUNDED
  seq = np.random.default_rng(2).integers(3, 96, (2, 24)).astype(np.int32)
  batch = _token_batch(seq, np.ones(seq.shape, np.int32),
                       np.tile(np.arange(24, dtype=np.int32), (2, 1)))
  full = nnx.jit(lambda m, b: m(b)[0])(model, batch)
  ced = nnx.jit(lambda m, b: ced_prefill_logits(m, b, 24))(model, batch)
  np.testing.assert_allclose(np.asarray(ced), np.asarray(full), rtol=2e-4, atol=2e-4)


# ---- FLOPs and bytes ------------------------------------------------------------------------


def test_flops_count_each_variants_keys():
  t = 64
  per_key = {}
  for v in ('csa2', 'dense', 'window'):
    m = resolved(**{'model.attention_variant': v}).model
    per_key[v] = attention_flops_per_layer(m, t)
  m = resolved(**DENSE).model
  key = 4.0 * m.num_heads * m.head_dim
  w = m.sliding_window
  window_keys = sum(min(i + 1, w) for i in range(t)) / t
  for layer, role in enumerate(layer_roles(m)):
    assert per_key['window'][layer] == key * window_keys
    assert per_key['dense'][layer] == key * (window_keys if role.mode == 'SWA' else (t + 1) / 2)
    assert per_key['csa2'][layer] >= per_key['window'][layer]
  decode = decode_attention_flops(m, 1000)
  for layer, role in enumerate(layer_roles(m)):
    assert decode[layer] == key * (w if role.mode == 'SWA' else 1001)


def test_a_dense_layer_caches_its_latent_of_every_token():
  class Cfg:  # kv_cache_bytes reads the model section only
    def __init__(self, m):
      self.model = m
  m = resolved(**DENSE).model
  dense_layers = sum(r.mode != 'SWA' for r in layer_roles(m))
  got = kv_cache_bytes(Cfg(m))
  assert got['global_bytes_per_token'] == dense_layers * m.head_dim * 2.0
  assert got['swa_bytes_per_request'] == \
      (m.num_layers - dense_layers) * m.sliding_window * m.head_dim * 2.0


# ---- training from the command-line path ---------------------------------------------------


