"""A numpy reader and writer of sharded safetensors checkpoints (docs/hf_interop.md, "Files").

The format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} (plus `__metadata__`), then the raw little-endian bytes. A sharded checkpoint adds
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {name: file}}).

Why our own: the format is this small, `ml_dtypes` gives the float8/float4 element types the
released checkpoint uses, and reading one tensor as a memory map of its byte range is what makes
a conversion stream (host memory near the largest tensor, never the model). The `safetensors`
package would add a dependency for the same thing.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

INDEX_FILE = 'model.safetensors.index.json'
SINGLE_FILE = 'model.safetensors'

DTYPES = {
    'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32), 'F16': np.dtype(np.float16),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32),
    'I16': np.dtype(np.int16), 'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8),
    'BOOL': np.dtype(np.bool_), 'F8_E4M3': np.dtype(ml_dtypes.float8_e4m3fn),
    'F8_E5M2': np.dtype(ml_dtypes.float8_e5m2), 'F8_E8M0': np.dtype(ml_dtypes.float8_e8m0fnu),
}
NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 8  # header padded so every tensor starts 8-byte aligned


class SafetensorsError(ValueError):
  """A checkpoint file is malformed or lacks a tensor; the message names the file and tensor."""


class TensorRef:
  """One tensor of one file: shape, dtype, and a lazy read of exactly its bytes."""

  def __init__(self, path: str, name: str, dtype: np.dtype, shape: tuple[int, ...],
               start: int, end: int):
    self.path, self.name, self.dtype, self.shape = path, name, dtype, shape
    self.start, self.end = start, end

  @property
  def nbytes(self) -> int:
    return self.end - self.start

  def read(self) -> np.ndarray:
    """A private copy of the tensor; the file mapping is closed before returning, so only the
    copy stays resident."""
    count = int(np.prod(self.shape, dtype=np.int64))
    if count * self.dtype.itemsize != self.nbytes:
      raise SafetensorsError(f'{self.path}: tensor {self.name!r} has {self.nbytes} bytes, '
                             f'not {count} x {self.dtype.itemsize} for shape {self.shape}')
    if count == 0:
      return np.zeros(self.shape, self.dtype)
    page = mmap.ALLOCATIONGRANULARITY
    base = self.start - self.start % page
    with open(self.path, 'rb') as f, mmap.mmap(f.fileno(), self.end - base, offset=base,
                                                access=mmap.ACCESS_READ) as mm:
      view = np.frombuffer(mm, dtype=self.dtype, count=count, offset=self.start - base)
      out = view.reshape(self.shape).copy()
      del view
    return out


def read_header(path: str) -> tuple[dict, int]:
  """(header dict, data start offset) of one .safetensors file."""
  try:
    with open(path, 'rb') as f:
      head = f.read(8)
      if len(head) != 8:
        raise SafetensorsError(f'{path}: shorter than a safetensors header')
      (n,) = struct.unpack('<Q', head)
      size = os.fstat(f.fileno()).st_size
      if n > size - 8:
        raise SafetensorsError(f'{path}: header length {n} exceeds the file size {size}')
      header = json.loads(f.read(n))
  except (OSError, json.JSONDecodeError) as e:
    raise SafetensorsError(f'{path}: cannot read the safetensors header ({e})') from e
  return header, 8 + n


def file_tensors(path: str) -> dict[str, TensorRef]:
  header, data_start = read_header(path)
  size = os.path.getsize(path)
  out = {}
  for name, info in header.items():
    if name == '__metadata__':
      continue
    if info.get('dtype') not in DTYPES:
      raise SafetensorsError(f'{path}: tensor {name!r} has dtype {info.get("dtype")!r}, not one '
                             f'of {sorted(DTYPES)}')
    start, end = info['data_offsets']
    if not 0 <= start <= end <= size - data_start:
      raise SafetensorsError(f'{path}: tensor {name!r} data offsets {start, end} lie outside '
                             'the file')
    out[name] = TensorRef(path, name, DTYPES[info['dtype']], tuple(info['shape']),
                          data_start + start, data_start + end)
  return out


class CheckpointReader:
  """Every tensor of a checkpoint directory (sharded with an index, or one model.safetensors)."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    self.tensors: dict[str, TensorRef] = {}
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)['weight_map']
      except (OSError, ValueError, KeyError) as e:
        raise SafetensorsError(f'{index}: not a safetensors index ({e})') from e
      by_file: dict[str, list[str]] = {}
      for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
      for file, names in sorted(by_file.items()):
        path = os.path.join(directory, file)
        if not os.path.exists(path):
          raise SafetensorsError(f'{index} names {file} (for {names[0]!r}), which is missing')
        refs = file_tensors(path)
        for name in names:
          if name not in refs:
            raise SafetensorsError(f'{index} puts tensor {name!r} in {file}, which lacks it')
          self.tensors[name] = refs[name]
    elif os.path.exists(single):
      self.tensors = file_tensors(single)
    else:
      raise SafetensorsError(f'{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}')

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def ref(self, name: str) -> TensorRef:
    if name not in self.tensors:
      raise SafetensorsError(f'{self.directory}: the checkpoint has no tensor {name!r}')
    return self.tensors[name]

  def read(self, name: str) -> np.ndarray:
    return self.ref(name).read()


def _header_bytes(entries: list[tuple[str, np.dtype, tuple[int, ...], int]],
                  metadata: dict | None) -> bytes:
  header, offset = {}, 0
  if metadata:
    header['__metadata__'] = {str(k): str(v) for k, v in metadata.items()}
  for name, dtype, shape, nbytes in entries:
    header[name] = {'dtype': NAMES[dtype], 'shape': list(shape),
                    'data_offsets': [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header, separators=(',', ':')).encode()
  return raw + b' ' * (-(8 + len(raw)) % _ALIGN)


def _check_dtype(name: str, arr: np.ndarray) -> None:
  if arr.dtype not in NAMES:
    raise SafetensorsError(f'tensor {name!r}: dtype {arr.dtype} has no safetensors name')


def write_file(path: str, entries: list[tuple[str, np.ndarray]], metadata: dict | None = None):
  for name, arr in entries:
    _check_dtype(name, arr)
  raw = _header_bytes([(n, a.dtype, a.shape, a.nbytes) for n, a in entries], metadata)
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(raw)))
    f.write(raw)
    for _, arr in entries:
      f.write(np.ascontiguousarray(arr).tobytes())


class ShardedWriter:
  """Writes tensors as they come into shards of at most `shard_bytes` (a tensor larger than
  that gets a shard of its own), then the index.

  Streams: each tensor's bytes go to the shard's data file at once (the header, which lists
  them all, is written in front when the shard closes), so no more than the tensor being added
  is ever held in memory.
  """

  def __init__(self, directory: str, shard_bytes: int = 2 << 30, metadata: dict | None = None):
    self.directory, self.shard_bytes = directory, shard_bytes
    self.metadata = {'format': 'pt', **(metadata or {})}
    self.entries: list[tuple[str, np.dtype, tuple[int, ...], int]] = []
    self.data = None
    self.pending_bytes = 0
    self.files: list[list[str]] = []
    self.total = 0

  def _part(self, k: int, suffix: str) -> str:
    return os.path.join(self.directory, f'.shard-{k:05d}.{suffix}')

  def add(self, name: str, arr: np.ndarray) -> None:
    _check_dtype(name, arr)
    if self.entries and self.pending_bytes + arr.nbytes > self.shard_bytes:
      self._flush()
    if self.data is None:
      self.data = open(self._part(len(self.files), 'data'), 'wb')
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.size:  # the array's own buffer, no bytes copy
      self.data.write(memoryview(flat.view(np.uint8)))
    self.entries.append((name, arr.dtype, tuple(arr.shape), arr.nbytes))
    self.pending_bytes += arr.nbytes
    self.total += arr.nbytes

  def _flush(self) -> None:
    k = len(self.files)
    if self.data is None:
      self.data = open(self._part(k, 'data'), 'wb')
    self.data.close()
    raw = _header_bytes(self.entries, self.metadata)
    with open(self._part(k, 'safetensors'), 'wb') as out, open(self._part(k, 'data'), 'rb') as src:
      out.write(struct.pack('<Q', len(raw)))
      out.write(raw)
      while chunk := src.read(1 << 20):
        out.write(chunk)
    os.remove(self._part(k, 'data'))
    self.files.append([e[0] for e in self.entries])
    self.entries, self.data, self.pending_bytes = [], None, 0

  def close(self) -> dict[str, str]:
    """Name the shards `model-0000k-of-0000n.safetensors`, write the index; the weight map."""
    if self.entries or not self.files:
      self._flush()
    n = len(self.files)
    weight_map = {}
    for k, names in enumerate(self.files):
      final = f'model-{k + 1:05d}-of-{n:05d}.safetensors'
      os.replace(self._part(k, 'safetensors'), os.path.join(self.directory, final))
      weight_map.update({name: final for name in names})
    with open(os.path.join(self.directory, INDEX_FILE), 'w') as f:
      json.dump({'metadata': {'total_size': self.total}, 'weight_map': dict(sorted(
          weight_map.items()))}, f, indent=2)
    return weight_map


def write_checkpoint(directory: str, tensors: Iterable[tuple[str, np.ndarray]],
                     shard_bytes: int = 2 << 30) -> dict[str, str]:
  writer = ShardedWriter(directory, shard_bytes)
  for name, arr in tensors:
    writer.add(name, arr)
  return writer.close()


def iter_checkpoint(directory: str) -> Iterator[tuple[str, np.ndarray]]:
  reader = CheckpointReader(directory)
  for name in sorted(reader.tensors):
    yield name, reader.read(name)
