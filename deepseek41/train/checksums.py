"""CRC-32 checksums of a checkpoint's files, computed over pieces of each file in parallel.

A restart verifies every file of its checkpoint before restoring it (train/checkpoint.py): a 1B
model's fp32 state is about 15 GB, which one thread feeds zlib's CRC-32 at 1-2.4 GB/s (a quarter
of a restart's verification and restore on the development CPU; docs/performance.md section 62).
zlib.crc32 releases the GIL on large buffers, so threads scale with the cores; each piece of a
file gets its own CRC, and the pieces' CRCs combine into the whole file's (the same value as one
sequential pass, so manifests written before this remain valid).

Combining: CRC-32 is linear over GF(2), so crc(A + B) = shift_{len B}(crc A) xor crc B, where
shift_n is the 32 x 32 bit matrix that feeds n zero bytes through the register. The matrix for
n bytes comes from repeated squaring of the one-bit matrix; it is built once per piece length.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import zlib

PIECE = 1 << 26   # bytes a task checksums (64 MiB)
READ = 1 << 24    # bytes a task reads at once
_POLY = 0xEDB88320  # CRC-32 (reflected), zlib's


def _times(matrix: tuple[int, ...], vector: int) -> int:
  """matrix [32 columns as ints] times a 32-bit vector over GF(2)."""
  out, i = 0, 0
  while vector:
    if vector & 1:
      out ^= matrix[i]
    vector >>= 1
    i += 1
  return out


def _squared(matrix: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(_times(matrix, column) for column in matrix)


@functools.lru_cache(maxsize=8)
def _shift(nbytes: int) -> tuple[int, ...]:
  """The matrix that advances a CRC register over `nbytes` (> 0) zero bytes."""
  one_bit = (_POLY,) + tuple(1 << k for k in range(31))
  power = _squared(_squared(_squared(one_bit)))  # 8 zero bits: one zero byte
  result = None
  while nbytes:
    if nbytes & 1:
      result = power if result is None else tuple(_times(power, c) for c in result)
    nbytes >>= 1
    if nbytes:
      power = _squared(power)
  return result


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
  """The CRC-32 of A followed by B, from crc(A), crc(B) and B's length."""
  if not len_b:
    return crc_a
  if not crc_a:  # the shift is linear: zero stays zero (a file's first piece, every small file)
    return crc_b
  return _times(_shift(len_b), crc_a) ^ crc_b


def _piece_crc32(path: str, offset: int, length: int) -> int:
  crc = 0
  with open(path, 'rb') as f:
    f.seek(offset)
    while length > 0:
      data = f.read(min(READ, length))
      if not data:  # the file shrank while read: its CRC will not match, as it should not
        break
      crc = zlib.crc32(data, crc)
      length -= len(data)
  return crc


def file_checksums(directory: str, threads: int | None = None) -> dict[str, list[int]]:
  """{path relative to directory: [size, crc32]} of every file under it, sorted by path."""
  files = []
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      files.append((os.path.relpath(path, directory), path, os.path.getsize(path)))
  pieces = [(path, offset, min(PIECE, size - offset))
            for _, path, size in files for offset in range(0, size, PIECE)]
  threads = threads or min(16, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix='crc32') as pool:
    crcs = dict(zip(pieces, pool.map(lambda p: _piece_crc32(*p), pieces)))
  out = {}
  for rel, path, size in sorted(files):
    crc = 0
    for offset in range(0, size, PIECE):
      length = min(PIECE, size - offset)
      crc = crc32_combine(crc, crcs[(path, offset, length)], length)
    out[rel] = [size, crc]
  return out
