"""Text files, directories and JSONL -> tokenizer.json + train / heldout token shards.

    python -m deepseek41.data.prepare --input corpus/ --input extra.jsonl --output /data/mine \
        --vocab_size 8192 [--heldout_fraction 0.01] [--jsonl_field text] [--shard_tokens N]

Output:  DIR/tokenizer.json, DIR/train/, DIR/heldout/ (see shards.py), DIR/prepare.json. The
vocab_size recorded there (and in the shards' meta.json) is the tokenizer's real size: a small
corpus can give fewer tokens than --vocab_size asks for, which prepare warns about.

A plain file is one document; a `.jsonl` file holds one document per line (a JSON object whose
`--jsonl_field` is the text); a directory contributes every non-hidden file below it, in sorted
order. A document goes to heldout when a hash of (its file's path relative to the input, its
index in the file) falls below `heldout_fraction`, so the held-out set does not change when other
files are added or the corpus moves. Everything is written to a temporary directory that is
renamed into place at the end: `DIR` either holds a complete dataset or does not exist.

Input is UTF-8 text. A binary file (NUL bytes, or mostly bytes that are not UTF-8, in its first
8 KiB) is skipped with a warning naming it, and it is an error when every input is binary. Other
bytes that are not UTF-8 become U+FFFD, with a warning naming the file and the count.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

import tqdm

from deepseek41.data.shards import DEFAULT_SHARD_TOKENS, DataError, ShardWriter
from deepseek41.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

SPLITS = ('train', 'heldout')
TOKENIZER_FILE = 'tokenizer.json'
PREPARE_FILE = 'prepare.json'
_ENCODE_CHUNK_CHARS = 4 << 20  # texts handed to the (multi-threaded) HF encoder at once
_BINARY_SNIFF_BYTES = 8192
# Share of not-UTF-8 bytes at the start above which a file without NUL bytes is binary too. Text
# in a Latin-1-like encoding stays far below (a few accented letters); random bytes are near 0.5.
_BINARY_UNDECODABLE_SHARE = 0.3
_SKIPPED_LISTED = 10  # skipped files named one by one in the warning; prepare.json lists all

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InputFile:
  path: str   # where to read it
  key: str    # stable name for the held-out hash: the path relative to the input given
  jsonl: bool


def collect_files(inputs: Sequence[str], extensions: Sequence[str] = ()) -> list[InputFile]:
  """Expands inputs into files. Directories: every non-hidden regular file, sorted."""
  if not inputs:
    raise DataError('no inputs given; pass at least one --input FILE_OR_DIR')
  exts = tuple(e if e.startswith('.') else '.' + e for e in extensions)
  files = []
  for given in inputs:
    if not os.path.exists(given):
      raise DataError(f'input path {given} does not exist')
    if os.path.isfile(given):
      files.append(_input_file(given, os.path.basename(given)))
      continue
    found = []
    for root, dirs, names in os.walk(given):
      dirs[:] = [d for d in dirs if not d.startswith('.') and d != '__pycache__']
      for name in names:
        path = os.path.join(root, name)
        if name.startswith('.') or not os.path.isfile(path):
          continue
        if exts and not name.endswith(exts):
          continue
        found.append(_input_file(path, os.path.relpath(path, given)))
    files.extend(sorted(found, key=lambda f: f.key))
  return files


def _input_file(path: str, key: str) -> InputFile:
  return InputFile(path=path, key=key.replace(os.sep, '/'), jsonl=path.endswith('.jsonl'))


def _read_bytes(path: str) -> bytes:
  try:
    with open(path, 'rb') as f:
      return f.read()
  except OSError as e:
    raise DataError(f'cannot read input file {path}: {e.strerror or e}') from e


def binary_reason(path: str) -> str | None:
  """Why the start of `path` looks binary (images, archives, UTF-16), or None for text."""
  try:
    with open(path, 'rb') as f:
      head = f.read(_BINARY_SNIFF_BYTES)
  except OSError as e:
    raise DataError(f'cannot read input file {path}: {e.strerror or e}') from e
  if b'\0' in head:
    return 'it contains NUL bytes'
  # final=False: a character cut by the sniff's end is not counted as undecodable.
  decoded = codecs.getincrementaldecoder('utf-8')('surrogateescape').decode(head, final=False)
  bad = _count_escaped(decoded)
  if head and bad / len(head) > _BINARY_UNDECODABLE_SHARE:
    return f'{bad} of its first {len(head)} bytes are not UTF-8'
  return None


def _count_escaped(text: str) -> int:
  """surrogateescape turns each undecodable byte into one of U+DC80..U+DCFF."""
  return sum(1 for c in text if '\udc80' <= c <= '\udcff')


def decode_text(raw: bytes) -> tuple[str, int]:
  """(text, number of bytes that are not UTF-8); those bytes become U+FFFD."""
  try:
    return raw.decode('utf-8'), 0
  except UnicodeDecodeError:
    return raw.decode('utf-8', errors='replace'), _count_escaped(
        raw.decode('utf-8', errors='surrogateescape'))


def drop_binary(files: Sequence[InputFile]) -> tuple[list[InputFile], list[str]]:
  """(the text files, the paths of binary ones), warning about the latter; an error if all are."""
  text, skipped = [], []
  for f in files:
    reason = binary_reason(f.path)
    if reason is None:
      text.append(f)
    else:
      skipped.append((f.path, reason))
  named = ', '.join(f'{path} ({reason})' for path, reason in skipped[:_SKIPPED_LISTED])
  if len(skipped) > _SKIPPED_LISTED:
    named += f' and {len(skipped) - _SKIPPED_LISTED} more'
  advice = 'prepare reads UTF-8 text; convert text in another encoding first (iconv -t utf-8)'
  if skipped and not text:
    raise DataError(f'every input file is binary, nothing to tokenize: {named}; {advice}')
  if skipped:
    log.warning('skipped %d binary files (prepare.json lists them): %s; %s', len(skipped), named,
                advice)
  return text, [path for path, _ in skipped]


def iter_documents(f: InputFile, jsonl_field: str,
                   on_undecodable: Callable[[int, int], None] | None = None) -> Iterator[str]:
  """The documents of one file. Bytes that are not UTF-8 become U+FFFD rather than failing;
  `on_undecodable(line_no, count)` hears of each line (line 0: a whole plain file) that had some.
  """
  if not f.jsonl:
    text, bad = decode_text(_read_bytes(f.path))
    if bad and on_undecodable:
      on_undecodable(0, bad)
    yield text
    return
  for line_no, line in _read_lines(f.path, on_undecodable):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f'{f.path}:{line_no}: not valid JSON ({e.msg}); every line of a .jsonl '
                      'file must be one JSON object') from e
    if not isinstance(record, dict) or jsonl_field not in record:
      raise DataError(f'{f.path}:{line_no}: no field {jsonl_field!r} in this line; set '
                      '--jsonl_field to the key that holds the text')
    value = record[jsonl_field]
    if not isinstance(value, str):
      raise DataError(f'{f.path}:{line_no}: field {jsonl_field!r} is a '
                      f'{type(value).__name__}, expected a string')
    yield value


def _read_lines(path: str, on_undecodable: Callable[[int, int], None] | None
                ) -> Iterator[tuple[int, str]]:
  """(1-based line number, line) streamed from disk, split on b'\\n' only.

  str.splitlines would also split on U+2028 and friends, which JSON strings may contain raw.
  """
  try:
    with open(path, 'rb') as f:
      for line_no, raw in enumerate(f, start=1):
        line, bad = decode_text(raw)
        if bad and on_undecodable:
          on_undecodable(line_no, bad)
        yield line_no, line
  except OSError as e:
    raise DataError(f'cannot read input file {path}: {e.strerror or e}') from e


def heldout_score(key: str, doc_index: int) -> float:
  """A uniform number in [0, 1) fixed by the document's identity, not by run or machine."""
  digest = hashlib.blake2b(f'{key}\0{doc_index}'.encode(), digest_size=8).digest()
  return int.from_bytes(digest, 'little') / 2.0**64


@dataclasses.dataclass
class _Scan:
  """What the first pass learns: document counts and which document to hold out if none is."""
  num_docs: int = 0
  num_heldout: int = 0
  lowest: tuple[float, str, int] | None = None  # (score, file key, doc index)


def _file_splits(f: InputFile, jsonl_field: str, heldout_fraction: float,
                 forced: tuple[str, int] | None) -> Iterator[tuple[str, str]]:
  """Yields (split, text) for every non-empty document of one file."""
  for i, text in enumerate(iter_documents(f, jsonl_field)):
    if text:
      held = heldout_score(f.key, i) < heldout_fraction or (f.key, i) == forced
      yield 'heldout' if held else 'train', text


def _scan(files, jsonl_field, heldout_fraction, scan: _Scan, progress: bool, desc: str):
  """First pass: validates every file, counts documents, and yields the training texts."""
  for f in tqdm.tqdm(files, desc=desc, unit='file', disable=not progress):
    undecodable = _Undecodable()
    for i, text in enumerate(iter_documents(f, jsonl_field, undecodable)):
      if not text:
        continue
      score = heldout_score(f.key, i)
      scan.num_docs += 1
      if scan.lowest is None or score < scan.lowest[0]:
        scan.lowest = (score, f.key, i)
      if score < heldout_fraction:
        scan.num_heldout += 1
      else:
        yield text
    undecodable.warn(f.path)


class _Undecodable:
  """Counts one file's bytes that are not UTF-8, for one warning per file."""

  def __init__(self):
    self.bytes, self.lines, self.first_line = 0, 0, 0

  def __call__(self, line_no: int, count: int) -> None:
    self.bytes += count
    self.lines += 1
    self.first_line = self.first_line or line_no

  def warn(self, path: str) -> None:
    if not self.bytes:
      return
    where = (f' on {self.lines} lines (first: line {self.first_line})' if self.first_line else '')
    log.warning('%s is not valid UTF-8: replaced %d byte%s%s by U+FFFD; if it is text in '
                'another encoding, convert it first (e.g. iconv -f latin1 -t utf-8)', path,
                self.bytes, 's' if self.bytes > 1 else '', where)


def _encode_and_write(tok: Tokenizer, files, jsonl_field, heldout_fraction, forced,
                      writers: dict[str, ShardWriter], progress: bool) -> None:
  """Second pass: tokenizes in chunks (HF encodes a chunk on all cores) and appends in order."""
  pending: list[tuple[str, str]] = []
  pending_chars = 0

  def flush():
    nonlocal pending, pending_chars
    for (split, _), ids_t in zip(pending, tok.encode_batch([t for _, t in pending])):
      writers[split].add(ids_t)
    pending, pending_chars = [], 0

  for f in tqdm.tqdm(files, desc='tokenizing', unit='file', disable=not progress):
    for split, text in _file_splits(f, jsonl_field, heldout_fraction, forced):
      pending.append((split, text))
      pending_chars += len(text)
      if pending_chars >= _ENCODE_CHUNK_CHARS:
        flush()
  flush()


def prepare_files(files: Sequence[InputFile], output: str, *, tokenizer_path: str | None = None,
                  vocab_size: int | None = None, heldout_fraction: float = 0.01,
                  jsonl_field: str = 'text', shard_tokens: int = DEFAULT_SHARD_TOKENS,
                  progress: bool = True, record: dict | None = None) -> str:
  """Prepares a dataset from explicit files (their keys fix the split); returns `output`."""
  if (tokenizer_path is None) == (vocab_size is None):
    raise DataError('pass exactly one of --tokenizer (an existing tokenizer.json) and '
                    '--vocab_size (train a new BPE tokenizer on the inputs)')
  if not 0.0 <= heldout_fraction < 1.0:
    raise DataError(f'heldout_fraction must be in [0, 1), got {heldout_fraction}')
  if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
    raise DataError(f'output {output} already exists; delete it or choose another --output')
  if not files:
    raise DataError('the inputs contain no files')
  files, binary = drop_binary(files)
  record = dict(record or {}, skipped_binary_files=binary)
  parent = os.path.dirname(os.path.abspath(output))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(output) + '.tmp-', dir=parent)
  try:
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the dataset may live in a shared cache
    _prepare_into(tmp, files, tokenizer_path, vocab_size, heldout_fraction, jsonl_field,
                  shard_tokens, progress, record)
    os.rename(tmp, output)  # atomic: readers never see a half-written dataset
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return output


def _prepare_into(out_dir, files, tokenizer_path, vocab_size, heldout_fraction, jsonl_field,
                  shard_tokens, progress, record) -> None:
  scan = _Scan()
  train_texts = _scan(files, jsonl_field, heldout_fraction, scan, progress,
                      desc='reading' if tokenizer_path else 'training tokenizer')
  if tokenizer_path:
    tok = load_tokenizer(tokenizer_path)
    for _ in train_texts:  # still read everything: bad files fail before any tokenizing
      pass
  else:
    tok = train_tokenizer(train_texts, vocab_size)
  if scan.num_docs == 0:
    raise DataError(f'the inputs ({len(files)} files) contain no non-empty documents')
  forced = None
  if heldout_fraction > 0 and scan.num_heldout == 0 and scan.num_docs >= 2:
    forced = scan.lowest[1:]  # a small corpus still gets a non-empty heldout split
  tok.save(os.path.join(out_dir, TOKENIZER_FILE))
  sha = tok.sha256()
  writers = {s: ShardWriter(os.path.join(out_dir, s), tok.vocab_size, shard_tokens=shard_tokens,
                            tokenizer='../' + TOKENIZER_FILE, tokenizer_sha256=sha)
             for s in SPLITS}
  _encode_and_write(tok, files, jsonl_field, heldout_fraction, forced, writers, progress)
  metas = {s: w.close() for s, w in writers.items()}
  if metas['train']['num_docs'] == 0:
    raise DataError(f'every document went to heldout (heldout_fraction={heldout_fraction}); '
                    'lower --heldout_fraction')
  # vocab_size is the real size, which can be below requested_vocab_size (train_tokenizer).
  summary = dict(record, vocab_size=tok.vocab_size, tokenizer_sha256=sha,
                 num_files=len(files), heldout_fraction=heldout_fraction,
                 splits={s: {'num_docs': m['num_docs'], 'num_tokens': m['num_tokens']}
                         for s, m in metas.items()})
  with open(os.path.join(out_dir, PREPARE_FILE), 'w') as f:
    json.dump(summary, f, indent=2)


def prepare_dataset(inputs: Sequence[str], output: str, tokenizer_path: str | None = None,
                    vocab_size: int | None = None, heldout_fraction: float = 0.01, *,
                    jsonl_field: str = 'text', shard_tokens: int = DEFAULT_SHARD_TOKENS,
                    extensions: Sequence[str] = (), progress: bool = True,
                    argv: Sequence[str] | None = None) -> str:
  """Prepares `inputs` (files / directories / .jsonl) into `output`; returns `output`."""
  files = collect_files(inputs, extensions)
  record = {'inputs': list(inputs), 'output': output, 'tokenizer': tokenizer_path,
            'requested_vocab_size': vocab_size, 'jsonl_field': jsonl_field,
            'shard_tokens': shard_tokens, 'extensions': list(extensions),
            'argv': list(argv) if argv is not None else None}
  return prepare_files(files, output, tokenizer_path=tokenizer_path, vocab_size=vocab_size,
                       heldout_fraction=heldout_fraction, jsonl_field=jsonl_field,
                       shard_tokens=shard_tokens, progress=progress, record=record)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m deepseek41.data.prepare',
                              description=__doc__.split('\n\n')[0])
  p.add_argument('--input', action='append', required=True, metavar='PATH',
                 help='a text file, a .jsonl file or a directory; repeat for several')
  p.add_argument('--output', required=True, metavar='DIR', help='dataset directory to create')
  p.add_argument('--tokenizer', metavar='tokenizer.json', help='use this tokenizer')
  p.add_argument('--vocab_size', type=int, help='train a byte-level BPE of this size instead')
  p.add_argument('--heldout_fraction', type=float, default=0.01)
  p.add_argument('--jsonl_field', default='text', help='key of the text in each JSONL line')
  p.add_argument('--shard_tokens', type=int, default=DEFAULT_SHARD_TOKENS,
                 help='tokens per shard file')
  p.add_argument('--extensions', default='',
                 help='comma-separated suffixes kept in directories (default: every file)')
  p.add_argument('--no_progress', action='store_true', help='no progress bars')
  return p


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parser().parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format='%(levelname)s: %(message)s')
  try:
    out = prepare_dataset(
        args.input, args.output, args.tokenizer, args.vocab_size, args.heldout_fraction,
        jsonl_field=args.jsonl_field, shard_tokens=args.shard_tokens,
        extensions=[e for e in args.extensions.split(',') if e], progress=not args.no_progress,
        argv=argv)
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  with open(os.path.join(out, PREPARE_FILE)) as f:
    splits = json.load(f)['splits']
  print(f'wrote {out}: ' + ', '.join(f'{s} {v["num_docs"]} docs / {v["num_tokens"]} tokens'
                                     for s, v in splits.items()))
  return 0


if __name__ == '__main__':
  sys.exit(main())
