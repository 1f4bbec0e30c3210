"""Large arrays written to and read from files shard by shard, a bounded chunk at a time.

A checkpoint written through orbax copies each shard whole into host memory before it
writes it, and reads each shard whole before placing it: a 100 GiB ``pinned_host`` pool
(one shard on one GPU) then needs another 100 GiB of RAM, more than a host that holds
such a pool has. Here every shard of an array (one per distinct index; replicas are
written once) goes to its own raw file, ``shard-00000.bin``, ..., in row-major byte
order, and moves in chunks of at most ``CHUNK_BYTES``:

* host memory (``pinned_host`` and ``unpinned_host`` shards) is written from, and read
  back into, the shard's own bytes (its buffer pointer), by several threads, with no copy
  in between: a restore writes the live array's bytes **in place** (the caller's pool,
  already made, is filled, so the host never holds it twice). A CPU backend's device
  memory is saved the same way;
* device memory moves through host chunks: a chunk of rows is sliced on the device and
  copied to the host (the next chunk's copy starts before this one is written); a
  restore deletes the array, makes each device's shard anew and writes chunk after
  chunk into it, donated, in place.

``save`` returns a JSON-able description (shape, dtype, each file's shard index and
size) that ``restore`` checks the live array and the files against, raising
``ShardFileError`` naming the file and what differs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import os
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding

CHUNK_BYTES = 64 << 20
"""The most bytes one chunk of a shard holds in host memory while it moves."""
THREADS = 8
"""Threads writing or reading host-addressable shards (distinct chunks in parallel)."""
HOST_KINDS = ("pinned_host", "unpinned_host")
"""The memory kinds of host memory (restored in place)."""


class ShardFileError(ValueError):
  """Files that do not hold the array asked for (the message names the file)."""


def in_host_memory(x: jax.Array) -> bool:
  """Whether ``x`` lives in host memory (a memory kind of the host's)."""
  return x.sharding.memory_kind in HOST_KINDS


def _host_addressable(x: jax.Array) -> bool:
  """Whether this process reads ``x``'s shards' bytes directly (host memory, or any
  memory of a CPU backend)."""
  return in_host_memory(x) or all(d.platform == "cpu" for d in x.sharding.device_set)


def _index_doc(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
  return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _distinct_shards(x: jax.Array) -> list[tuple[list[list[int]], list[Any]]]:
  """Each distinct shard index of ``x`` (sorted) with its addressable shards."""
  by_index: dict[str, tuple[list[list[int]], list[Any]]] = {}
  for shard in x.addressable_shards:
    idx = _index_doc(shard.index, x.shape)
    by_index.setdefault(repr(idx), (idx, []))[1].append(shard)
  return [by_index[k] for k in sorted(by_index)]


def _bytes_view(data: jax.Array) -> np.ndarray:
  """The bytes of a single-device, host-addressable array, as a writable uint8 view."""
  n = data.size * data.dtype.itemsize
  if n == 0:
    return np.zeros(0, np.uint8)
  return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(data.unsafe_buffer_pointer()))


def _geometry(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, int, int]:
  """(axis, rows per chunk, bytes per row) of a shard of ``shape``: chunks are runs of the
  first axis longer than 1 (every axis before it has one element, so a run of it is
  contiguous), at most ``chunk_bytes`` each (one row at least)."""
  axis = next((a for a, n in enumerate(shape) if n > 1), max(len(shape) - 1, 0))
  row = math.prod(shape[axis + 1:]) * itemsize
  rows = shape[axis] if shape else 1
  return axis, max(1, min(rows, chunk_bytes // max(row, 1))), row


def _spans(total: int, step: int) -> Iterator[tuple[int, int]]:
  for lo in range(0, total, step):
    yield lo, min(total, lo + step)


def _each_chunk(fn, nbytes: int, chunk_bytes: int) -> None:
  """``fn((lo, hi))`` for each chunk of ``nbytes`` bytes, on ``THREADS`` threads."""
  with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
    list(pool.map(fn, _spans(nbytes, chunk_bytes)))


def _pwrite_all(fd: int, view: np.ndarray, offset: int) -> None:
  mv = memoryview(view)
  while mv:
    n = os.pwrite(fd, mv, offset)
    mv, offset = mv[n:], offset + n


def _pread_all(fd: int, view: np.ndarray, offset: int, path: Path) -> None:
  mv = memoryview(view)
  while mv:
    n = os.preadv(fd, [mv], offset)
    if n == 0:
      raise ShardFileError(f"{path}: ends at byte {offset}, before the shard's end")
    mv, offset = mv[n:], offset + n


@functools.lru_cache(maxsize=64)
def _slicer(shape: tuple[int, ...], dtype: str, axis: int, rows: int):
  del shape, dtype  # (the cache key: one compiled slice per shard shape)
  return jax.jit(lambda x, lo: lax.dynamic_slice_in_dim(x, lo, rows, axis))


@functools.lru_cache(maxsize=64)
def _updater(shape: tuple[int, ...], dtype: str, axis: int):
  del shape
  # The update moves bits as unsigned integers: XLA:CPU computes a bfloat16 update in
  # float32 and would change NaN payloads.
  bits = jax.numpy.dtype(f"uint{np.dtype(dtype).itemsize * 8}") \
      if np.dtype(dtype).itemsize in (1, 2, 4, 8) and np.dtype(dtype) != np.bool_ else None

  def update(x, c, lo):
    if bits is None:
      return lax.dynamic_update_slice_in_dim(x, c, lo, axis)
    cast = lambda v, t: lax.bitcast_convert_type(v, t)
    return cast(lax.dynamic_update_slice_in_dim(cast(x, bits), cast(c, bits), lo, axis),
                x.dtype)

  return jax.jit(update, donate_argnums=0)


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: str, sharding: SingleDeviceSharding):
  return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)


def save(x: jax.Array, folder: str | Path, chunk_bytes: int | None = None) -> dict:
  """Writes ``x`` into ``folder`` (created; one file per distinct shard of this
  process) and returns its description for ``restore``."""
  chunk_bytes = chunk_bytes or CHUNK_BYTES
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  jax.block_until_ready(x)
  files = []
  for k, (idx, shards) in enumerate(_distinct_shards(x)):
    path = folder / f"shard-{k:05d}.bin"
    data = shards[0].data
    nbytes = data.size * data.dtype.itemsize
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      if _host_addressable(x):
        view = _bytes_view(data)
        _each_chunk(lambda s: _pwrite_all(fd, view[s[0]:s[1]], s[0]), nbytes, chunk_bytes)
      else:
        _save_device_shard(data, fd, chunk_bytes)
      os.fsync(fd)
    finally:
      os.close(fd)
    files.append({"file": path.name, "index": idx, "nbytes": nbytes})
  return {"shape": list(x.shape), "dtype": str(x.dtype), "files": files}


def _save_device_shard(data: jax.Array, fd: int, chunk_bytes: int) -> None:
  """A device shard to ``fd`` through host chunks, the next chunk's copy under way while
  one is written."""
  shape = tuple(data.shape)
  if data.size == 0:
    return
  axis, rows, row = _geometry(shape, data.dtype.itemsize, chunk_bytes)
  n = shape[axis]
  slicer = _slicer(shape, str(data.dtype), axis, rows)
  # The last chunk starts at n - rows (overlapping the one before): one compiled slice.
  starts = [min(lo, n - rows) for lo, _ in _spans(n, rows)]

  def fetch(lo: int) -> jax.Array:
    chunk = slicer(data, lo)
    chunk.copy_to_host_async()
    return chunk

  ahead = fetch(starts[0])
  for i, lo in enumerate(starts):
    chunk, ahead = ahead, (fetch(starts[i + 1]) if i + 1 < len(starts) else None)
    _pwrite_all(fd, np.ascontiguousarray(np.asarray(chunk)).view(np.uint8).reshape(-1),
                lo * row)


def check(x: jax.Array, folder: str | Path, doc: dict) -> dict[str, tuple[Path, int]]:
  """The file and size of each distinct shard index of ``x`` (keyed by its repr),
  checked against ``doc`` (``save``'s description) and the files' sizes; raises
  ShardFileError naming what differs."""
  folder = Path(folder)
  if doc.get("shape") != list(x.shape) or doc.get("dtype") != str(x.dtype):
    raise ShardFileError(f"{folder}: holds an array of shape {doc.get('shape')} and dtype "
                         f"{doc.get('dtype')}, not {list(x.shape)} {x.dtype}")
  saved = {repr(f["index"]): (folder / f["file"], int(f["nbytes"])) for f in doc["files"]}
  for idx, shards in _distinct_shards(x):
    if repr(idx) not in saved:
      raise ShardFileError(f"{folder}: no file holds the shard at index {idx} (the array's "
                           "sharding differs from the saved one's)")
    path, nbytes = saved[repr(idx)]
    want = shards[0].data.size * x.dtype.itemsize
    try:
      size = path.stat().st_size
    except OSError as e:
      raise ShardFileError(f"{path}: unreadable ({e})") from None
    if nbytes != want or size != want:
      raise ShardFileError(f"{path}: {size} bytes (description: {nbytes}), the shard at "
                           f"index {idx} has {want}")
  return saved


def restore(x: jax.Array, folder: str | Path, doc: dict,
            chunk_bytes: int | None = None) -> jax.Array:
  """``x``'s array as ``save`` wrote it into ``folder`` (``doc``: what ``save``
  returned), in ``x``'s sharding and memory kind.

  An ``x`` in host memory is written in place and returned (its buffers must be its
  own: no other live array may share them). Otherwise ``x`` is deleted and each
  device's shard made anew, filled chunk by chunk.
  """
  chunk_bytes = chunk_bytes or CHUNK_BYTES
  folder = Path(folder)
  saved = check(x, folder, doc)
  groups = _distinct_shards(x)
  if in_host_memory(x):
    jax.block_until_ready(x)
    for idx, shards in groups:
      path, nbytes = saved[repr(idx)]
      first, *replicas = [_bytes_view(s.data) for s in shards]

      def read(span: tuple[int, int]) -> None:  # into the first copy, then its replicas
        lo, hi = span
        _pread_all(fd, first[lo:hi], lo, path)
        for v in replicas:
          v[lo:hi] = first[lo:hi]

      fd = os.open(path, os.O_RDONLY)
      try:
        _each_chunk(read, nbytes, chunk_bytes)
      finally:
        os.close(fd)
    return x
  sharding, shape, dtype = x.sharding, tuple(x.shape), x.dtype
  placed = [(idx, s.device, tuple(s.data.shape)) for idx, shards in groups for s in shards]
  x.delete()
  bufs = {}
  for idx, device, local in placed:
    path, _ = saved[repr(idx)]
    bufs[device] = _restore_device_shard(path, device, local, dtype, sharding.memory_kind,
                                         chunk_bytes)
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [bufs[d] for d in sharding.addressable_devices])


def _restore_device_shard(path: Path, device: Any, shape: tuple[int, ...], dtype: Any,
                          memory_kind: str | None, chunk_bytes: int) -> jax.Array:
  buf = _zeros(shape, str(np.dtype(dtype)),
               SingleDeviceSharding(device, memory_kind=memory_kind))()
  if buf.size == 0:
    return buf
  axis, rows, row = _geometry(shape, np.dtype(dtype).itemsize, chunk_bytes)
  n = shape[axis]
  update = _updater(shape, str(np.dtype(dtype)), axis)
  chunk_shape = shape[:axis] + (rows,) + shape[axis + 1:]
  host = np.empty(rows * row, np.uint8)
  fd = os.open(path, os.O_RDONLY)
  try:
    for lo, _ in _spans(n, rows):
      lo = min(lo, n - rows)  # (the last chunk overlaps the one before: one compile)
      _pread_all(fd, host, lo * row, path)
      chunk = jax.device_put(host.view(dtype).reshape(chunk_shape), buf.sharding)
      buf = update(buf, chunk, lo)
      # The host chunk is read into again next; a CPU backend may alias it.
      jax.block_until_ready(buf)
  finally:
    os.close(fd)
  return buf


__all__ = ["CHUNK_BYTES", "HOST_KINDS", "THREADS", "ShardFileError", "check", "in_host_memory",
           "restore", "save"]
