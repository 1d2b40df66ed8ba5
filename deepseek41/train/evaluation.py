"""Held-out evaluation: the mixture's loss, the objective's own held-out metrics (e.g. DSpark's
acceptance and calibration) and, with image sources, the caption losses."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from deepseek41.config import RunConfig
from deepseek41.data.pipeline import make_dataset
from deepseek41.train.feed import global_batch
from deepseek41.train.objectives import objective_for


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
    self.objective = objective_for(cfg)

  def __call__(self, state) -> dict[str, float]:
    """`eval_loss` over the whole mixture and the objective's metrics over the same batches;
    with image sources also the caption loss (the text of the image samples) with the real
    images and with blank ones. {} on synthetic data."""
    if self.cfg.data.synthetic:
      return {}
    outputs: list[dict] = []  # the eval step's outputs, for the objective's metrics
    out = {'eval_loss': self.held_out_losses(state, outputs=outputs)[0]}
    out.update(self.objective.held_out_metrics(outputs))
    if self.cfg.data.image_sources:
      out['eval_caption_loss_image'], out['eval_caption_loss_blank'] = self.held_out_losses(
          state, ('image',), blanks=(False, True))
    return {k: v for k, v in out.items() if v is not None}

  def held_out_losses(self, state, kinds=('text', 'image'), blanks=(False,),
                      outputs: list[dict] | None = None) -> list[float | None]:
    """Mean held-out CE per entry of `blanks` (False: the batch as read, True: black images),
    all over the same batches, which are read and decoded once; the eval step's outputs on the
    batches as read are appended to `outputs`."""
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
          if outputs is not None and not blank:
            outputs.append(out)
    finally:
      if hasattr(it, 'close'):
        it.close()
    return [ce / n if n else None for ce, n in sums_v2]
