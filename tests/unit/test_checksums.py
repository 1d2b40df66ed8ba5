"""Checkpoint checksums in parallel pieces equal one sequential CRC-32 of each file."""

import os
import zlib

import numpy as np
import pytest

from deepseek41.train import checksums


@pytest.mark.parametrize('len_a,len_b', [(0, 0), (5, 0), (0, 9), (1, 1), (1000, 7),
                                         (3, (1 << 20) + 3), (4096, 65536)])
def test_combined_crc_is_the_crc_of_the_concatenation(len_a, len_b):
  rng = np.random.default_rng(len_a * 31 + len_b)
  a, b = rng.bytes(len_a), rng.bytes(len_b)
  assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)


def test_file_checksums_in_pieces_equal_one_pass(tmp_path, monkeypatch):
  monkeypatch.setattr(checksums, 'PIECE', 1000)  # several pieces a file, a partial last one
  monkeypatch.setattr(checksums, 'READ', 300)
  rng = np.random.default_rng(0)
  sizes = {'empty': 0, 'one': 1, 'short': 999, 'exact': 1000, 'over': 1001, 'd/e/long': 5555}
  for name, size in sizes.items():
    os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
    (tmp_path / name).write_bytes(rng.bytes(size))
  want = {name: [size, zlib.crc32((tmp_path / name).read_bytes())]
          for name, size in sorted(sizes.items())}
  assert checksums.file_checksums(str(tmp_path), threads=3) == want
  data = bytearray((tmp_path / 'd/e/long').read_bytes())
  data[4321] ^= 1  # a flipped bit in the fifth piece changes the whole file's CRC
  (tmp_path / 'd/e/long').write_bytes(bytes(data))
  assert checksums.file_checksums(str(tmp_path))['d/e/long'] != want['d/e/long']
