"""Tiny V4.1 with native vision (CPU): configs/tiny.py plus a 2-layer DeepSeek-ViT.

    python -m deepseek41.train --config=configs/tiny_multimodal.py --workdir=/tmp/ds41-tiny-mm

Trains on a mixture of the embedded shapes captioning task (rendered 48x48 images of coloured
shapes; captions name the count, colour, shape and position, so they can only be predicted from
the image) and the default text corpus. Each image is 12 x 12 patches of 4 px, merged 3x3 into
4 x 4 = 16 LM tokens, so its span is 22 positions: start, 4 rows of 4 patches + newline, end.
Evaluation writes `eval_caption_loss_image` and `eval_caption_loss_blank` (the same held-out
captions with every image replaced by a black one) to metrics.jsonl.
Numbers: docs/performance.md section 7.
"""

import os

from deepseek41.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tiny.py'))
  m = c.model
  # A 2048-token BPE spells the captions in whole words: with tiny.py's 512 tokens they came out
  # letter by letter, the few tokens that depend on the image were drowned by the template, and
  # the model learned to ignore the image (docs/performance.md section 7.2).
  m.vocab_size = 2048
  c.data.default_corpus_vocab_size = 2048
  m.vision = True
  m.vision_layers = 2
  m.vision_dim = 64
  m.vision_heads = 4
  m.vision_mlp = 128
  m.vision_patch = 4
  m.vision_max_image_tokens = 16
  m.vision_min_pixels = 0

  c.data.sources = 'default:0.1'
  c.data.image_sources = 'shapes:0.9'
  c.data.shapes_image_size = 48
  c.data.max_images_per_row = 4
  # At the text model's lr the aligner's output grows into large near-constant vectors within a
  # few hundred steps and the LM stops reading the images (docs/performance.md section 7.2).
  c.train.vision_lr_multiplier = 0.1
  # Both rates above were found under AdamW (section 7.2); muon_hybrid is unmeasured here.
  c.train.optimizer = 'adamw'
  c.train.lr = 3e-3
  # Binding the image to the words comes after the caption template is learned: hold the
  # learning rate (WSD) for longer than tiny.py's 300-step cosine.
  c.train.steps = 600
  c.train.schedule = 'wsd'
  c.train.eval_every_steps = 100
  c.checkpoint.every_steps = 200
  return c
