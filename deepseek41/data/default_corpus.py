"""The embedded default corpus: this interpreter's standard-library `.py` sources.

Every Python install carries about 12 MB of real, varied text, so training runs out of the box
with no download. It is prepared once per (python version, vocab size, max_files) into the cache
and reused; concurrent first uses (several processes on one host or a shared filesystem) each
prepare into a private temporary directory and the first atomic rename wins.
"""

from __future__ import annotations

import os
import sys
import sysconfig

from deepseek41.data.prepare import InputFile, prepare_files
from deepseek41.data.shards import META_FILE, DataError

HELDOUT_FRACTION = 0.02
EXCLUDED_DIRS = frozenset({'site-packages', 'dist-packages', 'test', 'tests', 'idlelib',
                           '__pycache__'})
CORPUS_VERSION = 2  # bump when the file selection, split rule or tokenizer recipe changes


def stdlib_files(max_files: int = 0) -> list[InputFile]:
  """Sorted stdlib sources; `max_files > 0` keeps the first N (small, fast corpora for tests)."""
  root = sysconfig.get_paths()['stdlib']
  if not os.path.isdir(root):
    raise DataError(f'the standard library directory {root} does not exist, so the default '
                    'corpus is unavailable; set data.sources to a prepared dataset')
  found = []
  for dirpath, dirs, names in os.walk(root):
    dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith('.')]
    for name in names:
      if name.endswith('.py'):
        path = os.path.join(dirpath, name)
        # The relative path is the file's identity: it fixes the split on every machine.
        key = os.path.relpath(path, root).replace(os.sep, '/')
        found.append(InputFile(path=path, key=key, jsonl=False))
  found.sort(key=lambda f: f.key)
  if max_files > 0:
    found = found[:max_files]
  if not found:
    raise DataError(f'no .py files under {root}; set data.sources to a prepared dataset')
  return found


def default_corpus_dir(cache_dir: str, vocab_size: int, max_files: int = 0, *,
                       progress: bool = True) -> str:
  """Path of the prepared default corpus, preparing it on first use."""
  cache_dir = cache_dir or os.path.join(os.path.expanduser('~'), '.cache', 'deepseek41')
  py = f'py{sys.version_info.major}{sys.version_info.minor}'
  files = 'all' if max_files <= 0 else str(max_files)
  out = os.path.join(cache_dir, f'stdlib-v{CORPUS_VERSION}-{py}-vocab{vocab_size}-files{files}')
  if _is_complete(out):
    return out
  os.makedirs(cache_dir, exist_ok=True)
  try:
    prepare_files(stdlib_files(max_files), out, vocab_size=vocab_size,
                  heldout_fraction=HELDOUT_FRACTION, progress=progress,
                  record={'corpus': 'python stdlib', 'python': sys.version,
                          'max_files': max_files, 'requested_vocab_size': vocab_size})
  except (DataError, OSError):
    # Another process finished first: its rename won and ours failed. Anything else re-raises
    # (including a foreign directory at `out`, which is never deleted: others may be reading it).
    if not _is_complete(out):
      raise
  return out


def _is_complete(out: str) -> bool:
  return all(os.path.isfile(os.path.join(out, split, META_FILE)) for split in ('train', 'heldout'))
