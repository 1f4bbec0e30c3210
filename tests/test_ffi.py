"""The ula_jax_ffi custom calls (custom_calls/, ``pip install ./custom_calls``).

``TestCopyRowsFfiCpu`` runs the CPU handlers; ``TestCopyRowsFfiGpu`` reruns every case
with the CUDA handlers on a GPU (built with ``ULA_JAX_FFI_CUDA=ON``). Destinations are
poisoned so rows the call must not touch are detectable; copies are bit-exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ula_jax_ffi  # noqa: F401  (registers the targets; pip install ./custom_calls)
from tests.test_fetch import (LAYOUTS, assert_same_bits, expected_copy, poison, random_pairs,
                              random_rows)
from ula_jax.core import compat
from ula_jax.kernels.fetch import evict_rows, fetch_rows
from ula_jax.kernels.fetch import ffi as fetch_ffi
from ula_jax.kernels.fetch.hlo import host_parameter_shapes, pool_materializations

class CopyRowsFfiCases:
  """Every case runs on the first device of ``PLATFORM`` with the pools in their
  memory kinds (host pool 'pinned_host', device pool 'device')."""

  PLATFORM = "gpu"

  def _put(self, x, kind: str) -> jax.Array:
    device = jax.devices(self.PLATFORM)[0]
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))

  @pytest.mark.parametrize("layout", sorted(LAYOUTS))
  @pytest.mark.parametrize("N", [0, 1, 300])
  def test_fetch_matches_numpy(self, layout, N, rng):
    dtype, W = LAYOUTS[layout]
    Sh, Sd = 401, 311
    host = random_rows(rng, (Sh, W), dtype)
    dev = poison((Sd, W), dtype)
    h_idx, d_idx = random_pairs(rng, N, Sh, Sd)
    run = jax.jit(functools.partial(fetch_rows, impl="ffi"), donate_argnums=2)
    out = run(self._put(host, "pinned_host"), self._put(h_idx, "device"),
              self._put(dev, "device"), self._put(d_idx, "device"))
    assert out.sharding.memory_kind == "device"
    assert_same_bits(out, expected_copy(host, h_idx, dev, d_idx))

  @pytest.mark.parametrize("layout", sorted(LAYOUTS))
  def test_evict_matches_numpy(self, layout, rng):
    dtype, W = LAYOUTS[layout]
    Sd, Sh, N = 97, 211, 61
    dev = random_rows(rng, (Sd, W), dtype)
    host = poison((Sh, W), dtype)
    d_idx, h_idx = random_pairs(rng, N, Sd, Sh)
    run = jax.jit(functools.partial(evict_rows, impl="ffi"), donate_argnums=2)
    out = run(self._put(dev, "device"), self._put(d_idx, "device"),
              self._put(host, "pinned_host"), self._put(h_idx, "device"))
    assert out.sharding.memory_kind == "pinned_host"
    assert_same_bits(out, expected_copy(dev, d_idx, host, h_idx))

  @pytest.mark.parametrize("dtype, W", [(np.float32, 7), (np.uint8, 13)])
  def test_rows_narrower_than_16_bytes_units(self, dtype, W, rng):
    """Rows of 28 and 13 bytes: the CUDA kernel falls back to 4- and 1-byte units."""
    Ss, Sd, N = 50, 40, 33
    src = random_rows(rng, (Ss, W), dtype)
    dst = poison((Sd, W), dtype)
    s_idx, d_idx = random_pairs(rng, N, Ss, Sd)
    run = jax.jit(functools.partial(fetch_rows, impl="ffi"), donate_argnums=2)
    out = run(self._put(src, "device"), self._put(s_idx, "device"), self._put(dst, "device"),
              self._put(d_idx, "device"))
    assert_same_bits(out, expected_copy(src, s_idx, dst, d_idx))

  def test_without_aliasing_untouched_rows_come_from_the_destination(self, rng):
    src = random_rows(rng, (20, 16), np.float32)
    dst = random_rows(rng, (10, 16), np.float32)
    s_idx, d_idx = np.array([3, 7], np.int32), np.array([9, 0], np.int32)
    call = jax.ffi.ffi_call("ula_jax_fetch_rows", jax.ShapeDtypeStruct(dst.shape, dst.dtype))
    out = jax.jit(call)(*(self._put(x, "device") for x in (src, s_idx, dst, d_idx)))
    assert_same_bits(out, expected_copy(src, s_idx, dst, d_idx))

  def test_handlers_report_bad_operands(self):
    put = functools.partial(self._put, kind="device")
    i3 = put(np.zeros(3, np.int32))

    def call(target, a, ai, b, bi):
      f = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(b.shape, b.dtype),
                           input_output_aliases={2: 0})
      # A handler's error surfaces when the call runs: on GPU that is after jit has
      # returned (asynchronous dispatch), so wait for the result.
      return jax.block_until_ready(jax.jit(f)(a, ai, b, bi))

    with pytest.raises(Exception, match=r"ula_jax_fetch_rows: host_pool \[4, 3\] and dev_pool "
                       r"\[4, 5\] must have the same row width W"):
      call("ula_jax_fetch_rows", put(np.zeros((4, 3))), i3, put(np.zeros((4, 5))), i3)
    with pytest.raises(Exception, match=r"ula_jax_evict_rows: dev_pool must be rank 2 \[S, W\], "
                       r"got \[4, 3, 2\]"):
      call("ula_jax_evict_rows", put(np.zeros((4, 3, 2))), i3, put(np.zeros((4, 3))), i3)
    with pytest.raises(Exception, match=r"ula_jax_fetch_rows: index lists must both be \[N\], "
                       r"got \[3\] and \[2\]"):
      call("ula_jax_fetch_rows", put(np.zeros((4, 3))), i3, put(np.zeros((4, 3))),
           put(np.zeros(2, np.int32)))
    with pytest.raises(Exception, match=r"ula_jax_evict_rows: dev_pool and host_pool must have "
                       r"one dtype"):
      call("ula_jax_evict_rows", put(np.zeros((4, 3), np.float32)), i3,
           put(np.zeros((4, 3), np.int32)), i3)


class TestCopyRowsFfiCpu(CopyRowsFfiCases):
  PLATFORM = "cpu"


@pytest.mark.gpu
class TestCopyRowsFfiGpu(CopyRowsFfiCases):
  PLATFORM = "gpu"

  def test_cuda_handlers_are_built(self):
    assert ula_jax_ffi.has_cuda(), ula_jax_ffi.CUDA_IMPORT_ERROR

  @pytest.mark.parametrize("direction", ["fetch", "evict"])
  def test_host_pool_is_read_in_place(self, direction):
    """Fails loudly if XLA stages the whole pinned-host pool around the custom call."""
    dtype, W = LAYOUTS["bf16x576"]
    Sh, Sd, N = 4099, 61, 9
    host = self._put(jnp.zeros((Sh, W), dtype), "pinned_host")
    dev = self._put(jnp.zeros((Sd, W), dtype), "device")
    idx = self._put(jnp.zeros((N,), jnp.int32), "device")
    f, args = ((fetch_rows, (host, idx, dev, idx)) if direction == "fetch"
               else (evict_rows, (dev, idx, host, idx)))
    hlo = jax.jit(functools.partial(f, impl="ffi"),
                  donate_argnums=2).lower(*args).compile().as_text()
    assert host_parameter_shapes(hlo), "the host pool did not reach the module in host memory"
    copies = pool_materializations(hlo, (Sh, W))
    assert not copies, ("XLA materialises the pinned host pool around the custom call:\n"
                        + "\n".join(copies))


def test_ffi_inside_shard_map_per_device_pools(rng):
  mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices("cpu")[:8])
  Sh, Sd, N, W = 9, 5, 4, 16
  host = random_rows(rng, (8 * Sh, W), np.float32)
  dev = poison((8 * Sd, W), np.float32)
  pairs = [random_pairs(rng, N, Sh, Sd) for _ in range(8)]
  h_idx = np.concatenate([p[0] for p in pairs])
  d_idx = np.concatenate([p[1] for p in pairs])
  put = lambda x, kind: jax.device_put(x, NamedSharding(mesh, P("dp"), memory_kind=kind))

  @jax.jit
  def run(host, h, dev, d):
    body = functools.partial(fetch_rows, impl="ffi")
    return compat.shard_map(body, mesh=mesh, in_specs=(P("dp"),) * 4, out_specs=P("dp"))(
        host, h, dev, d)

  out = run(put(host, "pinned_host"), put(h_idx, "device"), put(dev, "device"),
            put(d_idx, "device"))
  want = np.concatenate([
      expected_copy(host[i * Sh:(i + 1) * Sh], h_idx[i * N:(i + 1) * N],
                    dev[i * Sd:(i + 1) * Sd], d_idx[i * N:(i + 1) * N]) for i in range(8)])
  assert_same_bits(out, want)


def test_package_reports_its_platforms():
  assert ula_jax_ffi.platforms()[0] == "cpu"
  assert set(ula_jax_ffi.TARGETS) == {"ula_jax_fetch_rows", "ula_jax_evict_rows"}
  assert ula_jax_ffi.has_cuda() == ("cuda" in ula_jax_ffi.platforms())
  assert fetch_ffi.available("cpu")


def test_missing_package_or_cuda_build_says_how_to_build(monkeypatch):
  monkeypatch.setattr(ula_jax_ffi, "has_cuda", lambda: False)
  with pytest.raises(RuntimeError, match=r"ula_jax_ffi was not compiled with CUDA support .*"
                     r"ULA_JAX_FFI_CUDA=ON pip install --no-build-isolation --no-deps "
                     r"\./custom_calls"):
    fetch_ffi.require("gpu")
  assert not fetch_ffi.available("gpu")
  with pytest.raises(RuntimeError, match=r"no ula_jax_ffi handlers for backend 'tpu'"):
    fetch_ffi.require("tpu")
  monkeypatch.setattr(fetch_ffi, "ula_jax_ffi", None)
  with pytest.raises(RuntimeError, match=r"ula_jax_ffi is not installed .*: "
                     r"pip install \./custom_calls"):
    fetch_ffi.require("cpu")
  x = jnp.zeros((2, 4))
  i = jnp.zeros((1,), jnp.int32)
  with pytest.raises(RuntimeError, match=r"kernels.fetch='ffi': ula_jax_ffi is not installed"):
    fetch_rows(x, i, x, i, impl="ffi")
