"""Zero-filled ``pinned_host`` arrays on 2 MiB pages, pinned by several threads.

A ``pinned_host`` array that XLA allocates sits in a region its host allocator pins with
``cuMemHostAlloc``: 4 KiB pages, faulted in and pinned by one thread. On an H100 host
that ran at 2.5-2.9 GB/s (a 32 GiB region in 11.9-13.9 s), so a 100 GiB host pool cost a
run over a minute before its first step. The same bytes as anonymous memory advised to
transparent huge pages (``madvise(MADV_HUGEPAGE)``), zeroed by 16 threads and then
registered with the CUDA driver (``cuMemHostRegister``) were ready at 22.7 GB/s
(``benchmarks/probes/gpu_host_pin.cu``); here a 100 GiB pool took 6.4 s against XLA's
66.2 s (16 GiB: zeroed in 0.54 s, registered in 0.56 s; faulting the pages with
``MADV_POPULATE_WRITE`` instead took 1.58 s, so they are written;
``benchmarks/probes/gpu_pinned_region.py``, RESULTS.md "Pinning host pools").

``zeros(device, shape, dtype)`` makes such a region and hands it to jax through DLPack as
pinned host memory of ``device`` (``kDLCUDAHost``): jax views it in place, as an array of
memory kind ``pinned_host``; XLA reads and writes it as it does its own (donation keeps
the same bytes). Regions are not freed by jax: each one is kept in a table here, and
``release_unused`` (called before every new region) waits for the devices' queued work,
then unregisters and unmaps those no live jax array points into any more.

``available(device)`` says whether this path can serve ``device`` (a CUDA GPU, the driver
library loadable, jax's DLPack import of pinned host memory present); ``zeros`` raises
``PinnedRegionError`` where a step fails, and the caller falls back to XLA's allocator.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import functools
import os
import threading
from typing import Any

import jax
import numpy as np

from ula_jax.core import compat, host_memory

_HUGE = 2 << 20  # transparent huge page size on x86-64 and arm64 (4 KiB base pages)
_PROT_RW = 0x1 | 0x2
_MAP_PRIVATE_ANON = 0x02 | 0x20
_MADV_HUGEPAGE = 14
_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
_KDL_CUDA_HOST = 3
_MAP_FAILED = ctypes.c_void_p(-1).value

# DLPack's type codes for the dtypes pools use.
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}


class PinnedRegionError(RuntimeError):
  """A step of making a pinned region failed (the message says which)."""


class _DLDevice(ctypes.Structure):
  _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
  _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
              ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
              ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
  _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
              ("deleter", ctypes.c_void_p)]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                        ctypes.c_int, ctypes.c_long]
  libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  return libc


@functools.lru_cache(maxsize=1)
def _cuda() -> ctypes.CDLL:
  """The CUDA driver library (the one XLA itself uses), initialised."""
  try:
    lib = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    raise PinnedRegionError(f"the CUDA driver library is not loadable ({e})") from e
  lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
  lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
  lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
  lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
  lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
  lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
  lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
  lib.cuCtxSynchronize.argtypes = []
  _check(lib.cuInit(0), "cuInit")
  return lib


def _check(status: int, what: str) -> None:
  if status != 0:
    raise PinnedRegionError(f"{what} failed with CUDA driver error {status}")


class _Region:
  """One mapping: ``base`` (as mapped), ``addr`` (its first 2 MiB boundary), ``nbytes``
  registered from ``addr``."""

  def __init__(self, base: int, length: int, addr: int, nbytes: int):
    self.base, self.length, self.addr, self.nbytes = base, length, addr, nbytes
    self.registered = False

  def contains(self, pointer: int) -> bool:
    return self.addr <= pointer < self.addr + max(self.nbytes, 1)


_LOCK = threading.Lock()
_REGIONS: dict[int, _Region] = {}  # by addr


def available(device: Any) -> bool:
  """Whether ``zeros`` can make ``device``'s pinned host arrays: a CUDA GPU, Linux, the
  driver library loadable, and a jax whose DLPack import takes pinned host memory."""
  if getattr(device, "platform", None) != "gpu" or "cuda" not in str(
      getattr(device.client, "platform_version", "")).lower():
    return False
  if not compat.dlpack_takes_pinned_host() or not hasattr(os, "sched_getaffinity"):
    return False
  try:
    _cuda()
  except PinnedRegionError:
    return False
  return True


def _map(nbytes: int, threads: int) -> _Region:
  # Writing pages the host does not have ends in the kernel's OOM killer, not in an
  # error; XLA's allocator fails such a request with one, so it is refused here first.
  free = host_memory.free_ram()
  if free is not None and nbytes + _HUGE > free:
    raise PinnedRegionError(f"{nbytes} bytes asked for, {free} bytes of RAM available")
  libc = _libc()
  length = -(-nbytes // _HUGE) * _HUGE + _HUGE  # room to start on a 2 MiB boundary
  base = libc.mmap(None, length, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
  if base in (None, _MAP_FAILED):
    raise PinnedRegionError(f"mmap of {length} bytes failed (errno {ctypes.get_errno()})")
  addr = -(-base // _HUGE) * _HUGE
  region = _Region(base, length, addr, nbytes)
  span = length - (addr - base)
  libc.madvise(addr, span, _MADV_HUGEPAGE)  # advice only: 4 KiB pages where refused
  # Fault every page in by writing zeros, several threads at once (ctypes calls release
  # the GIL), so registering finds them present.
  chunk = max(-(-nbytes // threads // _HUGE) * _HUGE, _HUGE)

  def zero(start: int) -> None:
    ctypes.memset(addr + start, 0, min(chunk, nbytes - start))

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(zero, range(0, nbytes, chunk)))
  return region


class _Current:
  """The device's primary context (the one XLA runs in) current in this thread."""

  def __init__(self, local_id: int):
    self.local_id = local_id

  def __enter__(self) -> ctypes.CDLL:
    cu = _cuda()
    self.device, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(cu.cuDeviceGet(ctypes.byref(self.device), self.local_id), "cuDeviceGet")
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device),
           "cuDevicePrimaryCtxRetain")
    try:
      _check(cu.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    except PinnedRegionError:
      cu.cuDevicePrimaryCtxRelease_v2(self.device)
      raise
    return cu

  def __exit__(self, *exc: Any) -> None:
    cu = _cuda()
    popped = cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    cu.cuDevicePrimaryCtxRelease_v2(self.device)  # XLA holds the context too: stays alive
    _check(popped, "cuCtxPopCurrent")


def _register(region: _Region, device: Any) -> None:
  with _Current(int(device.local_hardware_id)) as cu:
    _check(cu.cuMemHostRegister_v2(
        region.addr, region.nbytes,
        _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP),
        f"cuMemHostRegister of {region.nbytes} bytes")
    region.registered = True


def _free(region: _Region) -> None:
  if region.registered:
    _cuda().cuMemHostUnregister(region.addr)
  _libc().munmap(region.base, region.length)


class _Export:
  """What ``jax.dlpack.from_dlpack`` takes: a DLPack capsule of ``region`` as pinned host
  memory of the device with local id ``device_id``."""

  def __init__(self, region: _Region, shape: tuple[int, ...], dtype: np.dtype,
               device_id: int, device_type: int = _KDL_CUDA_HOST):
    self.region, self.shape, self.dtype, self.device_id = region, shape, dtype, device_id
    self.device_type = device_type

  def __dlpack_device__(self) -> tuple[int, int]:
    return (self.device_type, self.device_id)

  def __dlpack__(self, stream: Any = None, **kw: Any) -> Any:
    del stream, kw
    libc = _libc()
    ndim = len(self.shape)
    size = ctypes.sizeof(_DLManagedTensor) + 8 * ndim
    # One malloc'd block (the tensor, then its shape), freed by the consumer with free().
    block = libc.malloc(size)
    if not block:
      raise PinnedRegionError("malloc of a DLPack tensor failed")
    mt = _DLManagedTensor.from_address(block)
    shape = (ctypes.c_int64 * ndim).from_address(block + ctypes.sizeof(_DLManagedTensor))
    shape[:] = list(self.shape)
    mt.dl_tensor.data = self.region.addr
    mt.dl_tensor.device = _DLDevice(self.device_type, self.device_id)
    mt.dl_tensor.ndim = ndim
    mt.dl_tensor.dtype = _DLDataType(_dl_code(self.dtype), self.dtype.itemsize * 8, 1)
    mt.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.strides = None  # row-major
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = ctypes.cast(libc.free, ctypes.c_void_p).value
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new_capsule(block, b"dltensor", None)


def _dl_code(dtype: np.dtype) -> int:
  if dtype == jax.numpy.bfloat16:
    return 4  # kDLBfloat
  if dtype.kind == "V" or "float8" in dtype.name:
    raise PinnedRegionError(f"dtype {dtype.name} has no DLPack code here")
  return _DL_CODES[dtype.kind]


def buffer_pointers(x: jax.Array, devices: set[Any] | None = None) -> list[int]:
  """The buffer addresses of ``x``'s addressable shards (on ``devices``, when given)."""
  out = []
  for shard in x.addressable_shards:
    if devices is None or shard.device in devices:
      try:
        out.append(shard.data.unsafe_buffer_pointer())
      except Exception:  # deleted meanwhile, or no pointer for this memory kind
        continue
  return out


def release_unused(devices: list[Any] | None = None) -> int:
  """Unregisters and unmaps every region no live jax array on ``devices`` (default: the
  local GPUs) points into, once those devices' queued work is done (an array dropped
  while a program still writes its bytes is no longer live, but its program still runs);
  returns how many bytes were given back."""
  with _LOCK:
    if not _REGIONS:
      return 0
    devices = [d for d in jax.local_devices() if d.platform == "gpu"] if devices is None \
        else devices
    live = [p for x in jax.live_arrays() for p in buffer_pointers(x, set(devices))]
    gone = [r for r in _REGIONS.values() if not any(r.contains(p) for p in live)]
    if gone:
      for d in devices:
        if d.platform == "gpu":
          with _Current(int(d.local_hardware_id)) as cu:
            _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    for r in gone:
      del _REGIONS[r.addr]
      _free(r)
    return sum(r.nbytes for r in gone)


def holds(x: jax.Array) -> bool:
  """Whether a shard of ``x`` lies in a region made here."""
  with _LOCK:
    regions = list(_REGIONS.values())
  return any(r.contains(p) for p in buffer_pointers(x) for r in regions)


def held_bytes() -> int:
  """Bytes of regions made here and not yet given back."""
  with _LOCK:
    return sum(r.nbytes for r in _REGIONS.values())


def zeros(device: Any, shape: tuple[int, ...], dtype: Any,
          threads: int | None = None) -> jax.Array:
  """A zero-filled array of ``shape`` and ``dtype`` in ``device``'s pinned host memory, on
  a region of 2 MiB pages pinned here (see the module's docstring)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  _dl_code(dtype)  # refuse dtypes DLPack cannot name before anything is mapped
  release_unused()
  threads = threads or max(1, min(16, len(os.sched_getaffinity(0))))
  region = _map(max(nbytes, 1), threads)
  try:
    _register(region, device)
    with _LOCK:
      _REGIONS[region.addr] = region
    x = jax.dlpack.from_dlpack(_Export(region, tuple(shape), dtype,
                                       int(device.local_hardware_id)))
  except Exception as e:
    with _LOCK:
      _REGIONS.pop(region.addr, None)
    _free(region)
    if isinstance(e, PinnedRegionError):
      raise
    raise PinnedRegionError(f"jax did not take the region as pinned host memory: {e}") from e
  kind = x.sharding.memory_kind
  ptr = x.addressable_shards[0].data.unsafe_buffer_pointer()
  if kind != "pinned_host" or ptr != region.addr or x.devices() != {device}:
    raise PinnedRegionError(
        f"jax viewed the region as memory kind {kind!r} at {ptr:#x} on {x.devices()}, not "
        f"pinned_host at {region.addr:#x} on {device}")
  return x


__all__ = ["PinnedRegionError", "available", "buffer_pointers", "held_bytes", "holds",
           "release_unused", "zeros"]
