"""Host pools on regions of 2 MiB pages pinned by the process (core.pinned_region,
memory.host_alloc): the mapping, the DLPack hand-over to jax (checked on CPU by handing a
region over as CPU memory: the same struct, another device type), when regions are given
back, and how the engine chooses and reports the allocator. The GPU test checks the
real thing: a pinned_host pool, written in place under donation, given back after."""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.config import ConfigError, load_config
from ula_jax.core import pinned_region
from ula_jax.engine import Engine, resolve_max_context
from ula_jax.memory.base import host_zeros, memory_kind_of
from tests.engine_util import BASE, DENSE, mesh_for

_KDL_CPU = 1


@pytest.fixture
def region():
  r = pinned_region._map(3 * (1 << 20) + 4096, threads=2)
  yield r
  pinned_region._free(r)


def test_a_region_starts_on_a_huge_page_boundary_and_reads_zero(region):
  assert region.addr % (2 << 20) == 0
  assert region.base <= region.addr and region.addr + region.nbytes <= region.base + region.length
  view = np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.addr))
  view[:] = 0xAB  # poison, then a fresh region must read zero again
  r2 = pinned_region._map(region.nbytes, threads=3)
  try:
    fresh = np.ctypeslib.as_array((ctypes.c_uint8 * r2.nbytes).from_address(r2.addr))
    assert not fresh.any()
  finally:
    pinned_region._free(r2)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.uint8, np.int32])
def test_jax_views_an_exported_region_in_place(region, dtype):
  dtype = np.dtype(dtype)
  shape = (1024, region.nbytes // 1024 // dtype.itemsize)
  words = np.ctypeslib.as_array(
      (ctypes.c_uint8 * (shape[0] * shape[1] * dtype.itemsize)).from_address(region.addr))
  rng = np.random.default_rng(0)
  words[:] = rng.integers(0, 256, words.size, dtype=np.uint8)
  if dtype.kind == "f":  # finite values only, so the comparison below is exact
    words.view(dtype)[:] = rng.standard_normal(words.size // dtype.itemsize).astype(dtype)
  x = jax.dlpack.from_dlpack(pinned_region._Export(region, shape, dtype, 0, _KDL_CPU))
  assert x.shape == shape and x.dtype == dtype
  assert x.unsafe_buffer_pointer() == region.addr  # a view, not a copy
  np.testing.assert_array_equal(np.asarray(x), words.view(dtype).reshape(shape))


def test_a_region_larger_than_the_free_ram_is_refused(monkeypatch):
  from ula_jax.core import host_memory

  monkeypatch.setattr(host_memory, "free_ram", lambda: 64 << 20)
  with pytest.raises(pinned_region.PinnedRegionError, match=r"67108864 bytes of RAM available"):
    pinned_region._map(64 << 20, threads=1)


def test_dtypes_dlpack_cannot_name_are_refused_before_anything_is_mapped():
  with pytest.raises(pinned_region.PinnedRegionError, match="float8_e4m3fn"):
    pinned_region.zeros(jax.devices()[0], (4, 4), jnp.float8_e4m3fn)


def test_a_region_is_given_back_once_no_array_points_into_it(monkeypatch):
  r = pinned_region._map(1 << 20, threads=1)
  monkeypatch.setitem(pinned_region._REGIONS, r.addr, r)
  x = jax.dlpack.from_dlpack(pinned_region._Export(r, (256, 1024), np.dtype(np.float32), 0,
                                                   _KDL_CPU))
  y = x[3:5]  # another array, elsewhere: does not hold the region
  cpus = jax.devices("cpu")
  assert pinned_region.release_unused(cpus) == 0 and pinned_region.held_bytes() >= r.nbytes
  del x
  assert pinned_region.release_unused(cpus) == r.nbytes
  assert r.addr not in pinned_region._REGIONS
  assert y.shape == (2, 1024)


def test_off_a_cuda_gpu_auto_takes_xla_and_huge_pages_is_refused():
  mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
  assert not pinned_region.available(jax.devices()[0])
  x = host_zeros(mesh, (2, 8, 16), jnp.bfloat16, "auto")
  assert memory_kind_of(x) == "pinned_host" and not np.asarray(x).any()
  with pytest.raises(ValueError, match=r"memory\.host_alloc='huge_pages': .*CUDA GPUs.*'cpu'"):
    host_zeros(mesh, (2, 8, 16), jnp.bfloat16, "huge_pages")
  with pytest.raises(ValueError, match=r"memory\.host_alloc='mmap': expected auto"):
    host_zeros(mesh, (2, 8, 16), jnp.bfloat16, "mmap")


def _fake_regions(monkeypatch, made):
  """pinned_region as on a GPU: every device available, each region a pinned_host array
  XLA makes (so the assembly of shards around it runs on CPU), recorded in ``made``."""
  def zeros(device, shape, dtype):
    made.append((device, shape))
    return jax.device_put(np.zeros(shape, dtype),
                          jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))

  monkeypatch.setattr(pinned_region, "available", lambda d: True)
  monkeypatch.setattr(pinned_region, "zeros", zeros)


def test_shards_of_a_region_pool_are_assembled_over_the_mesh(monkeypatch):
  made = []
  _fake_regions(monkeypatch, made)
  devs = jax.devices()[:4]
  mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=devs)
  x = host_zeros(mesh, (2, 2, 6, 8), jnp.float32, "auto", spec=P("dp", "tp"))
  assert memory_kind_of(x) == "pinned_host" and x.shape == (2, 2, 6, 8)
  assert sorted(made, key=lambda m: m[0].id) == [(d, (1, 1, 6, 8)) for d in devs]
  made.clear()
  y = host_zeros(mesh, (2, 6, 8), jnp.float32, "huge_pages")  # replicated over tp
  assert [shape for _, shape in made] == [(1, 6, 8)] * 4 and not np.asarray(y).any()


def test_a_failed_region_falls_back_under_auto_only(monkeypatch, caplog):
  def fail(device, shape, dtype):
    raise pinned_region.PinnedRegionError("cuMemHostRegister of 64 bytes failed")

  monkeypatch.setattr(pinned_region, "available", lambda d: True)
  monkeypatch.setattr(pinned_region, "zeros", fail)
  mesh = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
  x = host_zeros(mesh, (1, 4, 4), jnp.float32, "auto")
  assert memory_kind_of(x) == "pinned_host"
  assert "cuMemHostRegister of 64 bytes failed" in caplog.text
  with pytest.raises(ValueError, match=r"memory\.host_alloc='huge_pages': a pinned region .*"
                     r"cuMemHostRegister of 64 bytes failed"):
    host_zeros(mesh, (1, 4, 4), jnp.float32, "huge_pages")


ULA = DENSE + ["memory.system=ula", "memory.device_pool=64", "memory.host_pool=256",
               "mesh.dp=1", "engine.max_batch=1"]


def test_counting_pools_abstractly_makes_no_region(monkeypatch):
  from ula_jax.memory import build_memory_system, pool_bytes_per_device
  from ula_jax.core.types import MeshInfo

  made = []
  _fake_regions(monkeypatch, made)
  cfg = load_config(BASE, ["model.preset=tiny"] + ULA)
  system = build_memory_system(cfg.memory, cfg.model.kv_geometry(), MeshInfo(1, 1),
                               max_batch=1, page_size=cfg.engine.page_size,
                               max_context=resolve_max_context(cfg))
  counted = pool_bytes_per_device(system, mesh_for(1))
  assert made == []  # traced abstractly: nothing pinned
  geo = cfg.model.kv_geometry()
  assert counted["pinned_host"] == (geo.num_layers * system.host_rows * geo.entry_width
                                    * np.dtype(geo.kv_dtype).itemsize)


def test_the_engine_reports_regions_when_it_pins_on_them(monkeypatch):
  made = []
  _fake_regions(monkeypatch, made)
  monkeypatch.setattr(pinned_region, "holds", lambda x: True)
  engine = _engine(ULA)
  assert engine.host_alloc == "huge_pages" and len(made) == 1


def _engine(overrides):
  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false"] + overrides)
  return Engine(cfg, mesh_for(1), max_context=resolve_max_context(cfg))


def test_the_engine_reports_the_allocator_and_refuses_huge_pages_off_a_gpu():
  assert _engine(ULA).host_alloc == "xla"
  assert _engine(DENSE + ["mesh.dp=1", "engine.max_batch=1"]).host_alloc is None
  with pytest.raises(ConfigError, match=r"memory\.host_alloc='huge_pages'"):
    _engine(ULA + ["memory.host_alloc=huge_pages"])


def test_resident_does_not_read_host_alloc():
  with pytest.raises(ConfigError, match=r"memory\.host_alloc"):
    load_config(BASE, ["memory.system=resident", "memory.host_alloc=xla"])


@pytest.mark.gpu
def test_a_gpu_host_pool_on_a_region_is_written_in_place_and_given_back():
  from ula_jax.kernels.fetch import evict_rows, fetch_rows

  dev = jax.devices()[0]
  assert pinned_region.available(dev)
  mesh = jax.make_mesh((1,), ("dp",), devices=[dev])
  rows, width, n = 1 << 16, 576, 4096
  pinned_region.release_unused()  # (regions of earlier tests' dropped arrays)
  held = pinned_region.held_bytes()
  pool = host_zeros(mesh, (1, rows, width), jnp.bfloat16, "huge_pages")
  assert memory_kind_of(pool) == "pinned_host"
  assert pinned_region.held_bytes() - held == rows * width * 2
  ptr = pool.addressable_shards[0].data.unsafe_buffer_pointer()
  on_dev = NamedSharding(mesh, P(), memory_kind="device")
  on_host = NamedSharding(mesh, P(), memory_kind="pinned_host")
  x = pool[0]
  assert not np.asarray(jax.device_put(x, on_dev)).any()
  rng = np.random.default_rng(1)
  src = jax.device_put(rng.standard_normal((n, width), np.float32).astype(jnp.bfloat16), on_dev)
  host_idx = jax.device_put(rng.choice(rows, n, replace=False).astype(np.int32), on_dev)
  dev_idx = jax.device_put(np.arange(n, dtype=np.int32), on_dev)
  region = pinned_region.zeros(dev, (rows, width), jnp.bfloat16)
  region_ptr = region.unsafe_buffer_pointer()
  evict = jax.jit(functools.partial(evict_rows, impl="pallas"), donate_argnums=(2,),
                  out_shardings=on_host)
  out = evict(src, dev_idx, region, host_idx)
  assert region.is_deleted()
  assert out.unsafe_buffer_pointer() == region_ptr  # written in place, no copy
  back = jax.jit(functools.partial(fetch_rows, impl="pallas"), donate_argnums=(2,))(
      out, host_idx, jnp.zeros((n, width), jnp.bfloat16, device=on_dev), dev_idx)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(src))
  del out, back, x, pool
  assert pinned_region.release_unused() >= 2 * rows * width * 2
  assert pinned_region.held_bytes() == held
  assert ptr
