"""Data: tokenizer, prepare CLI (text -> token shards), the embedded default corpus, image-text
sources (images.py, shapes.py, multimodal.py), and the Grain pipeline that turns them into
packed batches.

    python -m deepseek41.data.prepare --input DIR --output OUT --vocab_size 8192
    it = iter(make_dataset(cfg.data, split='train', batch_size=8, seed=0))

Names are imported lazily: `python -m deepseek41.data.prepare` must not find its own module
already imported by this package (runpy warns), and the tokenizer alone should not load Grain.
"""

import importlib

_EXPORTS = {
    'default_corpus_dir': 'default_corpus',
    'BATCH_KEYS': 'pipeline', 'IMAGE': 'pipeline', 'TEXT': 'pipeline',
    'make_dataset': 'pipeline', 'resolve_sources': 'pipeline', 'vocab_size_of': 'pipeline',
    'tokenizer_path_of': 'pipeline',
    'load_image': 'images', 'patchify': 'images', 'resize': 'images', 'target_size': 'images',
    'MultimodalSource': 'multimodal', 'resolve_image_sources': 'multimodal',
    'prepare_dataset': 'prepare',
    'DataError': 'shards', 'ShardWriter': 'shards', 'TokenShardSource': 'shards',
    'read_meta': 'shards',
    'Tokenizer': 'tokenizer', 'load_tokenizer': 'tokenizer', 'train_tokenizer': 'tokenizer',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)


def __dir__():
  return __all__
