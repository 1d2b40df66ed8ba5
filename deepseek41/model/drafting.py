"""The backbone and its DSpark drafter as one model (docs/architecture.md section 3.14).

The drafter reads the backbone's features, embedding, head and target distributions through a
stop-gradient, so nothing of its own output reaches the backbone: which of the two trains is the
DSpark objective's choice (train/objectives/dspark.py), not the model's.
"""

from __future__ import annotations

import jax
from flax import nnx

from deepseek41.config import DSparkConfig, ModelConfig
from deepseek41.model.dspark import DSpark, sample_anchors, target_rows
from deepseek41.model.transformer import Transformer
from deepseek41.ops.cross_entropy import head_logits

# The two submodules, and the top-level keys of their parameter paths.
BACKBONE, DRAFTER = 'backbone', 'dspark'


class DraftingModel(nnx.Module):
  """The backbone and its drafter, side by side (parameter paths `backbone/...`, `dspark/...`)."""

  def __init__(self, cfg: ModelConfig, ds: DSparkConfig, rngs: nnx.Rngs, *, remat: str = 'none',
               sequence_parallel: bool = False, remat_layers: int = 0):
    self.backbone = Transformer(cfg, rngs, remat=remat, sequence_parallel=sequence_parallel,
                                remat_layers=remat_layers)
    self.dspark = DSpark(cfg, ds, rngs)

  def drafts_and_targets(self, batch, key):
    """The backbone's forward (its output, aux), DSpark's drafts at anchors drawn with `key` and
    the targets' logits [N, K, V], with nothing of the drafter's flowing back into the backbone.
    The output is the logits [B,T,V], or with `model.head_chunk` the head's input h [B,T,D]
    (the loss applies the head a chunk at a time: train/step.py `head_loss_sums`); then only
    the targets' rows go through the head here."""
    ds = self.dspark.ds
    backbone = self.backbone
    fused = bool(backbone.cfg.head_chunk)
    out, aux, captured = backbone.forward(batch, capture_layers=self.dspark.targets,
                                          head=not fused)
    sg = jax.lax.stop_gradient
    anchors = sample_anchors(key, batch['segment_ids'], ds.anchors_per_sequence)
    m_btd = self.dspark.context(sg(captured))
    drafts = self.dspark(m_btd, batch, anchors, sg(backbone.embed[...]), sg(backbone.head[...]))
    rows = target_rows(sg(out), anchors, ds.block_size)
    targets_nkv = head_logits(rows, sg(backbone.head_weight())) if fused else rows
    return out, aux, drafts, targets_nkv
