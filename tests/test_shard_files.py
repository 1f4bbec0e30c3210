"""Arrays written to raw per-shard files in bounded chunks and read back (core.shard_files):
bit-exact round trips over memory kinds, dtypes and shardings (with chunks far smaller
than a row, and a last chunk that overlaps the one before), replicas written once, host
memory bounded by the chunk size while saving and restoring, host arrays restored in
place, and the errors raised (before anything is changed) for files that do not match."""

from __future__ import annotations

import os
import re
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ula_jax.core import shard_files
from tests.engine_util import mesh_for

KINDS = ("device", "pinned_host")
DTYPES = (jnp.bfloat16, np.uint8, np.int32, np.bool_, jnp.float8_e4m3fn)
SPECS = {  # name: (spec, shape) over the dp=2 x tp=4 mesh
    "dp": (P("dp"), (2, 37, 24)),
    "dp_tp": (P("dp", "tp"), (2, 4, 13, 8)),
    "replicated": (P(), (5, 7)),
    "tp_cols": (P(None, "tp"), (3, 8)),
    "dp_unit_rows": (P("dp"), (2, 1, 1, 9)),
}
SAVE_CHUNK, RESTORE_CHUNK = 40, 56  # bytes: many chunks, shorter than most rows


@pytest.fixture(scope="module")
def mesh():
  return mesh_for(2, 4)


def _pair(rng: np.random.Generator, shape: tuple[int, ...], dtype
          ) -> tuple[np.ndarray, np.ndarray]:
  """(values, poison) of ``shape`` and ``dtype`` that differ in every byte. The values'
  bytes are never zero (except bool's False), so a byte a restore leaves unwritten (the
  poison's, or a fresh buffer's zero) is caught."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    values = rng.integers(0, 2, shape).astype(np.bool_)
    return values, ~values
  n = int(np.prod(shape))
  words = rng.integers(1, 256, (n, dtype.itemsize), dtype=np.uint8)
  poison = words ^ rng.integers(1, 256, words.shape, dtype=np.uint8)
  return words.view(dtype).reshape(shape), poison.view(dtype).reshape(shape)


def _bytes(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def _assert_every_shard_holds(x: jax.Array, expected: np.ndarray) -> None:
  """Each addressable shard (every replica) holds ``expected``'s bytes at its index."""
  for shard in x.addressable_shards:
    np.testing.assert_array_equal(_bytes(shard.data), _bytes(expected[shard.index]),
                                  err_msg=f"shard on {shard.device} at {shard.index}")


def _pointers(x: jax.Array) -> list[int]:
  return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(mesh, kind, spec_name, seed, tmp_path):
  spec, shape = SPECS[spec_name]
  sharding = NamedSharding(mesh, spec, memory_kind=kind)
  rng = np.random.default_rng(seed)
  for dtype in DTYPES:
    dtype = np.dtype(dtype)
    # Random bytes include NaNs of every payload: they come back as they were on either
    # path (a device shard's update moves bits as integers).
    values, poison = _pair(rng, shape, dtype)
    x = jax.device_put(values, sharding)
    folder = tmp_path / dtype.name
    doc = shard_files.save(x, folder, chunk_bytes=SAVE_CHUNK)
    assert doc["shape"] == list(shape) and doc["dtype"] == str(dtype)
    _assert_every_shard_holds(x, values)  # saving leaves the array as it was

    target = jax.device_put(poison, sharding)
    before = _pointers(target)
    out = shard_files.restore(target, folder, doc, chunk_bytes=RESTORE_CHUNK)

    assert out.shape == shape and out.dtype == dtype, dtype
    assert out.sharding == sharding and out.sharding.memory_kind == kind
    assert all(s.data.sharding.memory_kind == kind for s in out.addressable_shards)
    _assert_every_shard_holds(out, values)
    np.testing.assert_array_equal(_bytes(out), _bytes(values), err_msg=str(dtype))
    if kind == "pinned_host":  # written in place: the caller's array, the same buffers
      assert out is target and not target.is_deleted()
      assert _pointers(out) == before
    else:  # the array passed in is given up; each shard is made anew
      assert out is not target and target.is_deleted()


@pytest.mark.parametrize("kind", KINDS)
def test_replicas_are_written_once(mesh, kind, tmp_path):
  itemsize = np.dtype(np.int32).itemsize

  replicated = jax.device_put(np.arange(35, dtype=np.int32).reshape(5, 7),
                              NamedSharding(mesh, P(), memory_kind=kind))
  doc = shard_files.save(replicated, tmp_path / "rep", chunk_bytes=SAVE_CHUNK)
  assert sorted(os.listdir(tmp_path / "rep")) == ["shard-00000.bin"]
  assert doc["files"] == [{"file": "shard-00000.bin", "index": [[0, 5], [0, 7]],
                           "nbytes": 35 * itemsize}]
  assert ((tmp_path / "rep" / "shard-00000.bin").read_bytes()
          == np.arange(35, dtype=np.int32).tobytes())

  values = np.arange(2 * 37 * 24, dtype=np.int32).reshape(2, 37, 24)
  split = jax.device_put(values, NamedSharding(mesh, P("dp"), memory_kind=kind))
  doc = shard_files.save(split, tmp_path / "dp", chunk_bytes=SAVE_CHUNK)
  assert sorted(os.listdir(tmp_path / "dp")) == ["shard-00000.bin", "shard-00001.bin"]
  shard_bytes = 37 * 24 * itemsize
  assert doc["files"] == [
      {"file": "shard-00000.bin", "index": [[0, 1], [0, 37], [0, 24]], "nbytes": shard_bytes},
      {"file": "shard-00001.bin", "index": [[1, 2], [0, 37], [0, 24]], "nbytes": shard_bytes},
  ]
  for k, f in enumerate(doc["files"]):
    path = tmp_path / "dp" / f["file"]
    assert path.stat().st_size == f["nbytes"] == shard_bytes
    assert path.read_bytes() == _bytes(values[k]).tobytes()  # row-major, raw


def _peak_bytes(fn) -> int:
  """The most bytes Python (numpy included) held at once, above what it held at the
  start, while ``fn`` ran."""
  tracemalloc.start()
  try:
    start, _ = tracemalloc.get_traced_memory()
    fn()
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  return peak - start


@pytest.mark.parametrize("kind", KINDS)
def test_host_memory_stays_bounded_by_the_chunk(kind, seed, tmp_path):
  nbytes, chunk, bound = 32 << 20, 1 << 20, 4 << 20
  # tracemalloc sees numpy's buffers: a copy of the whole shard would be counted.
  assert _peak_bytes(lambda: np.empty(nbytes, np.uint8)) >= nbytes

  # One 32 MiB shard. On CPU a device shard is host memory too: save reads its bytes
  # directly, and restore moves it through one host chunk (a numpy buffer, traced).
  sharding = SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
  rng = np.random.default_rng(seed)
  values, poison = _pair(rng, (nbytes,), np.uint8)
  x = jax.device_put(values, sharding)
  target = jax.device_put(poison, sharding)
  jax.block_until_ready((x, target))
  del poison

  doc = {}
  save_peak = _peak_bytes(lambda: doc.update(shard_files.save(x, tmp_path, chunk_bytes=chunk)))
  assert save_peak < bound, save_peak
  assert (tmp_path / "shard-00000.bin").stat().st_size == nbytes

  out = []
  restore_peak = _peak_bytes(
      lambda: out.append(shard_files.restore(target, tmp_path, doc, chunk_bytes=chunk)))
  assert restore_peak < bound, restore_peak
  (y,) = out
  assert y.sharding.memory_kind == kind
  assert (y is target) == (kind == "pinned_host")
  np.testing.assert_array_equal(np.asarray(y), values)


@pytest.fixture
def saved(mesh, tmp_path):
  """An int32 (4, 8) array saved with P('dp') over the mesh: (its values, folder, doc)."""
  values = np.arange(32, dtype=np.int32).reshape(4, 8)
  x = jax.device_put(values, NamedSharding(mesh, P("dp")))
  doc = shard_files.save(x, tmp_path, chunk_bytes=SAVE_CHUNK)
  assert len(doc["files"]) == 2
  return values, tmp_path, doc


@pytest.mark.parametrize("kind", KINDS)
def test_another_shape_or_dtype_is_refused(mesh, saved, kind):
  _, folder, doc = saved
  sharding = NamedSharding(mesh, P("dp"), memory_kind=kind)
  for shape, dtype in (((4, 16), np.int32), ((2, 8), np.int32), ((4, 8), np.float32),
                       ((4, 8), np.uint32)):
    target = jax.device_put(np.zeros(shape, dtype), sharding)
    with pytest.raises(shard_files.ShardFileError,
                       match=re.escape(f"{folder}: holds an array of shape [4, 8] and dtype "
                                       f"int32, not {list(shape)} {np.dtype(dtype)}")):
      shard_files.restore(target, folder, doc)
    assert not target.is_deleted()


@pytest.mark.parametrize("kind", KINDS)
def test_another_sharding_is_refused(mesh, saved, kind):
  _, folder, doc = saved
  target = jax.device_put(np.zeros((4, 8), np.int32),
                          NamedSharding(mesh, P("tp"), memory_kind=kind))
  with pytest.raises(shard_files.ShardFileError,
                     match=r"no file holds the shard at index \[\[0, 1\], \[0, 8\]\]"):
    shard_files.restore(target, folder, doc)
  assert not target.is_deleted()


def _truncate(path, nbytes: int) -> None:
  os.truncate(path, nbytes)


def _remove(path, nbytes: int) -> None:
  del nbytes
  os.remove(path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("breakage, message", [
    (_truncate, r"shard-00001\.bin: 20 bytes \(description: 64\), the shard at index "
                r"\[\[2, 4\], \[0, 8\]\] has 64"),
    (_remove, r"shard-00001\.bin: unreadable"),
])
def test_a_broken_file_is_refused_before_anything_changes(mesh, saved, kind, breakage,
                                                          message):
  values, folder, doc = saved
  breakage(folder / "shard-00001.bin", 20)
  poison = values + 1000
  target = jax.device_put(poison, NamedSharding(mesh, P("dp"), memory_kind=kind))
  before = _pointers(target)

  with pytest.raises(shard_files.ShardFileError, match=message):
    shard_files.check(target, folder, doc)
  with pytest.raises(shard_files.ShardFileError, match=message):
    shard_files.restore(target, folder, doc, chunk_bytes=RESTORE_CHUNK)
  # Checked before the first byte moves: the target is alive and unchanged (the shard
  # whose file is intact was not written either).
  assert not target.is_deleted()
  assert _pointers(target) == before
  _assert_every_shard_holds(target, poison)


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_cut_short_while_reading_is_refused(mesh, saved, kind, monkeypatch):
  """A file that passes the check and then shrinks: the read that runs out names the
  file and where it ends."""
  _, folder, doc = saved
  real_check = shard_files.check

  def check_then_truncate(x, folder_, doc_):
    result = real_check(x, folder_, doc_)
    os.truncate(folder / "shard-00001.bin", 36)
    return result

  monkeypatch.setattr(shard_files, "check", check_then_truncate)
  target = jax.device_put(np.zeros((4, 8), np.int32),
                          NamedSharding(mesh, P("dp"), memory_kind=kind))
  with pytest.raises(shard_files.ShardFileError,
                     match=r"shard-00001\.bin: ends at byte \d+, before the shard's end"):
    shard_files.restore(target, folder, doc, chunk_bytes=16)


def test_check_returns_each_file_and_size(mesh, saved):
  _, folder, doc = saved
  target = jax.device_put(np.zeros((4, 8), np.int32), NamedSharding(mesh, P("dp")))
  files = shard_files.check(target, folder, doc)
  assert sorted((p.name, n) for p, n in files.values()) == [
      ("shard-00000.bin", 64), ("shard-00001.bin", 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("host_alloc", ["huge_pages", "xla"])
def test_gpu_pools_round_trip_and_the_host_pool_is_filled_in_place(host_alloc, seed, tmp_path):
  """On a GPU: a pinned_host pool (on a region of this process, or XLA's) is written
  from and read back into its own bytes, and a device pool made anew, bit for bit."""
  from ula_jax.memory.base import device_zeros, host_zeros

  dev = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("dp",), devices=[dev])
  rng = np.random.default_rng(seed)
  shape = (1, 3001, 576)
  values = rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(jnp.bfloat16)
  for make in (lambda: host_zeros(mesh, shape, jnp.bfloat16, host_alloc),
               lambda: device_zeros(mesh, shape, jnp.bfloat16, "device")):
    x = jax.device_put(values, make().sharding)
    doc = shard_files.save(x, tmp_path / x.sharding.memory_kind, chunk_bytes=1 << 20)
    target = make()
    before = _pointers(target)
    out = shard_files.restore(target, tmp_path / x.sharding.memory_kind, doc,
                              chunk_bytes=3 << 19)
    assert out.sharding == x.sharding
    np.testing.assert_array_equal(_bytes(out), _bytes(values))
    if x.sharding.memory_kind == "pinned_host":
      assert out is target and _pointers(out) == before
    else:
      assert target.is_deleted()
