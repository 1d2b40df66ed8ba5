"""Held-out evaluation: the mixture's loss and, with image sources, the caption losses."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from deepseek41.config import RunConfig
from deepseek41.data.pipeline import make_dataset
from deepseek41.train.feed import global_batch


def eval_config(cfg: RunConfig) -> RunConfig:
  """`cfg` with the routed experts computed by `model.eval_moe_backend`, which is dropless: the
  model the evaluation step is built from (same parameters and state layout, so the training
  state merges into it unchanged)."""
  return dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, moe_backend=cfg.model.eval_moe_backend))


class Evaluator:
  """`eval_batches` held-out batches per evaluation, the same batches every time."""

  def __init__(self, cfg, eval_step, mesh, sharding, engram_map, local_batch: int):
    self.cfg = cfg
    self.eval_step = eval_step
    self.mesh = mesh
    self.sharding = sharding
    self.engram_map = engram_map
    self.local_batch = local_batch
    self.drafts: list[dict] = []

  def __call__(self, state) -> dict[str, float]:
    """`eval_loss` over the whole mixture; with image sources also the caption loss (the text
    of the image samples) with the real images and with blank ones. {} on synthetic data."""
    if self.cfg.data.synthetic:
      return {}
    self.drafts = []  # the DSpark stage's per-anchor outputs, for acceptance and calibration
    out = {'eval_loss': self.held_out_losses(state)[0]}
    if self.drafts:
      from deepseek41.train.dspark_stage import held_out_metrics
      out.update(held_out_metrics(self.drafts))
    if self.cfg.data.image_sources:
      out['eval_caption_loss_image'], out['eval_caption_loss_blank'] = self.held_out_losses(
          state, ('image',), blanks=(False, True))
    return {k: v for k, v in out.items() if v is not None}

  def held_out_losses(self, state, kinds=('text', 'image'),
                      blanks=(False,)) -> list[float | None]:
    """Mean held-out CE per entry of `blanks` (False: the batch as read, True: black images),
    all over the same batches, which are read and decoded once."""
    cfg = self.cfg
    # An endless unshuffled stream: every process gets the same number of batches, and each
    # evaluation sees the same eval_batches batches. In-process: worker start-up would cost
    # more than the few evaluation batches.
    ds = make_dataset(dataclasses.replace(cfg.data, num_workers=0), split='heldout',
                      batch_size=self.local_batch, seed=cfg.train.seed,
                      process_index=jax.process_index(), process_count=jax.process_count(),
                      repeat=True, shuffle=False, kinds=kinds)
    sums_v2 = np.zeros((len(blanks), 2))  # (ce_sum, tokens) per variant
    it = iter(ds)
    try:
      for _, local in zip(range(cfg.train.eval_batches), it):
        for i, blank in enumerate(blanks):
          batch = global_batch(local, self.sharding, self.engram_map, vision=cfg.model.vision,
                               blank_images=blank)
          with jax.set_mesh(self.mesh):
            out = jax.device_get(self.eval_step(state, batch))
          sums_v2[i] += (float(out['ce_sum']), float(out['tokens']))
          if 'alpha_nk' in out and not blank:
            self.drafts.append(out)
    finally:
      if hasattr(it, 'close'):
        it.close()
    return [ce / n if n else None for ce, n in sums_v2]
