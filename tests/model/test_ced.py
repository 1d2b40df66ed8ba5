"""CED prefill: the tail's logits equal the full forward wherever no window is truncated."""

import numpy as np
import pytest
from flax import nnx

from deepseek41.model.ced import ced_prefill_logits, exact_tail_rows
from deepseek41.model.transformer import Transformer
from tests.helpers import packed_batch, resolved


@pytest.mark.parametrize('overrides', [
    {'model.residual': 'mhc_multi_pass'},                   # CSA2 off: window-only decoder
    {'model.attention_variant': 'csa2', 'model.index_n_heads': 2, 'model.index_head_dim': 8,
     'model.index_topk': 4, 'model.candidate_topk_blocks': 2, 'model.candidate_block_size': 2,
     'model.engram': True, 'model.engram_layer_ids': (1, 3),
     'model.residual': 'mhc_single_pass'},                  # + CSA2, Engram in the decoder
    {'model.attention_variant': 'csa2', 'model.index_n_heads': 2, 'model.index_head_dim': 8,
     'model.residual': 'plain'},
])
def test_prefill_tail_matches_full_forward(overrides):
  cfg = resolved(**{'model.init_std': 0.1, **overrides})
  model = Transformer(cfg.model, nnx.Rngs(params=0))
  batch = packed_batch(seed=7, docs_per_row=2, pad=0)
  full, _ = nnx.jit(lambda m, b: m(b))(model, batch)
  n_win = 32
  tail = np.asarray(nnx.jit(lambda m, b: ced_prefill_logits(m, b, n_win))(model, batch))
  exact = exact_tail_rows(cfg.model, n_win)
  assert 0 < exact < n_win
  np.testing.assert_allclose(tail[:, -exact:], np.asarray(full)[:, -exact:], rtol=2e-4,
                             atol=2e-4)
  # The first tail rows really are approximations (their windows are floored at the tail).
  assert np.abs(tail[:, 0] - np.asarray(full)[:, -n_win]).max() > 1e-4


def test_prefill_needs_a_split():
  cfg = resolved(**{'model.num_encoder_layers': 0})
  with pytest.raises(ValueError, match='num_encoder_layers'):
    ced_prefill_logits(Transformer(cfg.model, nnx.Rngs(params=0)), packed_batch(), 8)
