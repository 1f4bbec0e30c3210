"""Row fetch/evict between a pinned-host pool and a device pool (ula_jax.kernels.fetch).

The xla reference is checked on hand-computed values; the Pallas kernel against a numpy
copy on fresh random inputs, with destinations poisoned so untouched rows are detectable.
``TestCopyRowsPallasGpu`` runs the kernel through Triton (a GPU); its interpret-mode twin
reruns every case on CPU. Copies are bit-exact, so every comparison is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core import compat
from ula_jax.kernels.fetch import STAGE_IMPLS, evict_rows, fetch_rows, stage_rows
from ula_jax.kernels.fetch.hlo import host_parameter_shapes, pool_materializations
from ula_jax.kernels.fetch.pallas import (CopyRowsConfig, copy_rows_pallas, evict_rows_pallas,
                                          fetch_rows_pallas, stage_rows_pallas, unit_elements)
from ula_jax.kernels.fetch.reference import evict_rows_reference, fetch_rows_reference

# The two KV row layouts: bf16 x 576 (1152 B) and the FP8 layout as raw bytes (656 B).
LAYOUTS = {"bf16x576": (jnp.bfloat16, 576), "fp8x656": (jnp.uint8, 656)}


def host_sharding(kind: str = "pinned_host") -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def poison(shape, dtype) -> np.ndarray:
  """A destination whose every element is a sentinel (NaN for floats)."""
  if jnp.issubdtype(dtype, jnp.floating):
    return np.full(shape, np.nan, dtype)
  return np.full(shape, 0xA5, dtype)


def random_rows(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  if jnp.issubdtype(dtype, jnp.floating):
    return rng.standard_normal(shape).astype(dtype)
  return rng.integers(0, 256, shape).astype(dtype)


def random_pairs(rng: np.random.Generator, n: int, src_rows: int, dst_rows: int,
                 skip: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
  """n index pairs: distinct destinations, and a fraction ``skip`` of pairs with an
  index outside its pool (negative or past the end) on either side."""
  dst = rng.permutation(max(dst_rows, n))[:n].astype(np.int32)  # may exceed dst_rows
  src = rng.integers(0, max(src_rows, 1), n).astype(np.int32)
  bad = rng.random(n) < skip
  side = rng.random(n) < 0.5
  src[bad & side] = rng.choice([-1, -7, src_rows, src_rows + 3], (bad & side).sum())
  dst[bad & ~side] = rng.choice([-1, -9, dst_rows], (bad & ~side).sum())
  return src, dst


def expected_copy(src: np.ndarray, src_idx: np.ndarray, dst: np.ndarray,
                  dst_idx: np.ndarray) -> np.ndarray:
  out = dst.copy()
  for s, d in zip(src_idx, dst_idx):
    if 0 <= s < src.shape[0] and 0 <= d < dst.shape[0]:
      out[d] = src[s]
  return out


def assert_same_bits(got, want) -> None:
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ----------------------------------------------------------------------------------
# The xla reference and the public entry points
# ----------------------------------------------------------------------------------


def test_reference_hand_checked():
  host = np.arange(12, dtype=np.float32).reshape(6, 2)  # row r = [2r, 2r + 1]
  dev = np.full((4, 2), -1.0, np.float32)
  out = fetch_rows_reference(jnp.asarray(host), jnp.asarray([5, 0, -1, 2, 9], jnp.int32),
                             jnp.asarray(dev), jnp.asarray([1, 3, 0, -2, 2], jnp.int32))
  np.testing.assert_array_equal(out, [[-1, -1], [10, 11], [-1, -1], [0, 1]])
  back = evict_rows_reference(out, jnp.asarray([1, 3, 0, 4], jnp.int32), jnp.asarray(host),
                              jnp.asarray([0, 4, -3, 1], jnp.int32))
  np.testing.assert_array_equal(back, [[10, 11], [2, 3], [4, 5], [6, 7], [0, 1], [10, 11]])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fetch_and_evict_with_pinned_host_pool_in_jit(impl, rng):
  dtype, W = LAYOUTS["bf16x576"]
  Sh, Sd, N = 53, 17, 12
  host = random_rows(rng, (Sh, W), dtype)
  dev = poison((Sd, W), dtype)
  h_idx, d_idx = random_pairs(rng, N, Sh, Sd)
  host_j = jax.device_put(host, host_sharding())
  dev_j = jax.device_put(dev, host_sharding("device"))
  fetch = jax.jit(functools.partial(fetch_rows, impl=impl), donate_argnums=2)
  out = fetch(host_j, jnp.asarray(h_idx), dev_j, jnp.asarray(d_idx))
  assert out.sharding.memory_kind == "device"
  want = expected_copy(host, h_idx, dev, d_idx)
  assert_same_bits(out, want)

  # Evict back into distinct host rows; the host pool stays in pinned host memory.
  e_dev, e_host = random_pairs(rng, N, Sd, Sh)
  evict = jax.jit(functools.partial(evict_rows, impl=impl), donate_argnums=2)
  host_out = evict(out, jnp.asarray(e_dev), host_j, jnp.asarray(e_host))
  assert host_out.sharding.memory_kind == "pinned_host"
  assert_same_bits(host_out, expected_copy(want, e_dev, host, e_host))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fetch_inside_shard_map_per_device_pools(impl, rng):
  """Each of 8 (CPU) devices fetches from its own host pool shard into its own pool."""
  mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices("cpu")[:8])
  dtype, W = jnp.float32, 24
  Sh, Sd, N = 9, 5, 4
  host = random_rows(rng, (8 * Sh, W), dtype)
  dev = poison((8 * Sd, W), dtype)
  pairs = [random_pairs(rng, N, Sh, Sd) for _ in range(8)]
  h_idx = np.concatenate([p[0] for p in pairs])
  d_idx = np.concatenate([p[1] for p in pairs])
  put = lambda x, kind: jax.device_put(x, NamedSharding(mesh, P("dp"), memory_kind=kind))

  @jax.jit
  def run(host, h, dev, d):
    # CPU devices: Pallas runs interpreted even where the default backend is a GPU.
    kwargs = {"interpret": True} if impl == "pallas" else {}
    body = functools.partial(fetch_rows, impl=impl, **kwargs)
    return compat.shard_map(body, mesh=mesh, in_specs=(P("dp"),) * 4, out_specs=P("dp"))(
        host, h, dev, d)

  out = run(put(host, "pinned_host"), put(h_idx, "device"), put(dev, "device"),
            put(d_idx, "device"))
  want = np.concatenate([
      expected_copy(host[i * Sh:(i + 1) * Sh], h_idx[i * N:(i + 1) * N],
                    dev[i * Sd:(i + 1) * Sd], d_idx[i * N:(i + 1) * N]) for i in range(8)])
  assert_same_bits(out, want)


def test_public_entry_points_validate_arguments():
  host = jnp.zeros((6, 4), jnp.float32)
  dev = jnp.zeros((3, 4), jnp.float32)
  i2 = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match=r"kernels.fetch='cuda': expected one of "
                     r"\['ffi', 'pallas', 'xla'\]"):
    fetch_rows(host, i2, dev, i2, impl="cuda")
  with pytest.raises(ValueError, match=r"host_pool.shape=\(6, 4, 1\): expected a pool \[S, W\]"):
    fetch_rows(host[..., None], i2, dev, i2)
  with pytest.raises(ValueError, match=r"host_pool.shape=\(6, 4\) and dev_pool.shape=\(3, 5\): "
                     r"expected the same row width W"):
    fetch_rows(host, i2, jnp.zeros((3, 5), jnp.float32), i2)
  with pytest.raises(ValueError, match=r"dev_pool.dtype=float32 and host_pool.dtype=bfloat16: "
                     r"expected one dtype"):
    evict_rows(dev, i2, host.astype(jnp.bfloat16), i2)
  with pytest.raises(ValueError, match=r"dev_idx: got float32\[2\], expected int32 \[N\]"):
    fetch_rows(host, i2, dev, i2.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"host_idx.shape=\(2,\) and dev_idx.shape=\(3,\): "
                     r"expected the same length N"):
    fetch_rows(host, i2, dev, jnp.zeros((3,), jnp.int32))
  # kernels.interpret is one field for every kernel: implementations other than Pallas
  # accept and ignore it.
  out = evict_rows(dev + 1, i2, host, i2, impl="xla", interpret=False)
  np.testing.assert_array_equal(out, host.at[0].set(1))


@pytest.mark.parametrize("impl", sorted(STAGE_IMPLS))
def test_stage_rows_entry_point(impl, rng):
  """Every implementation stages the in-range rows; bad operands name the argument."""
  pool = random_rows(rng, (50, 24), np.float32)
  idx = np.array([3, -1, 49, 50, 0, 7, -4], np.int32)
  out = np.asarray(stage_rows(jnp.asarray(pool), jnp.asarray(idx), impl=impl))
  ok = (idx >= 0) & (idx < 50)
  assert out.shape == (7, 24)
  assert_same_bits(out[ok], pool[idx[ok]])
  with pytest.raises(ValueError, match="idx"):
    stage_rows(jnp.asarray(pool), jnp.asarray(idx, jnp.int64 if jax.config.x64_enabled
                                              else jnp.float32), impl=impl)
  with pytest.raises(ValueError, match="pool.shape"):
    stage_rows(jnp.asarray(pool[0]), jnp.asarray(idx), impl=impl)
  with pytest.raises(ValueError, match="kernels.fetch='cuda'"):
    stage_rows(jnp.asarray(pool), jnp.asarray(idx), impl="cuda")
  counted = np.asarray(stage_rows(jnp.asarray(pool), jnp.asarray(idx), impl=impl,
                                  count=jnp.int32(3)))
  assert_same_bits(counted[[0, 2]], pool[idx[[0, 2]]])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fetch_and_evict_entry_points_honour_count(impl, rng):
  """count through the public entry points: the pairs past it are skipped by every
  implementation (the reference by their indices, Pallas by its programs)."""
  host = random_rows(rng, (40, 24), np.float32)
  dev = poison((30, 24), np.float32)
  h_idx, d_idx = random_pairs(rng, 20, 40, 30, skip=0.0)
  out = fetch_rows(jnp.asarray(host), jnp.asarray(h_idx), jnp.asarray(dev),
                   jnp.asarray(d_idx), impl=impl, count=jnp.int32(7))
  assert_same_bits(out, expected_copy(host, h_idx[:7], dev, d_idx[:7]))
  out = evict_rows(jnp.asarray(dev.copy() * 0 + 1), jnp.asarray(d_idx), jnp.asarray(host),
                   jnp.asarray(h_idx), impl=impl, count=jnp.int32(0))
  assert_same_bits(out, host)


def test_pallas_config_validates():
  with pytest.raises(ValueError, match=r"block_units=96: expected a power of 2"):
    CopyRowsConfig(block_units=96)
  with pytest.raises(ValueError, match=r"num_warps=3: expected a power of 2"):
    CopyRowsConfig(num_warps=3)
  with pytest.raises(ValueError, match=r"max_programs=0: expected at least 1"):
    CopyRowsConfig(max_programs=0)


def test_pallas_copy_refuses_more_units_than_int32_can_index():
  big = jax.ShapeDtypeStruct((2**25,), jnp.int32)
  pool = jax.ShapeDtypeStruct((16, 576), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"src_idx.shape\[0\]=33554432 rows of 72 units: more "
                     r"than 2\*\*31 units per call"):
    jax.eval_shape(copy_rows_pallas, pool, big, pool, big)


def test_pallas_copy_refuses_byte_pools_of_2_to_4_gib_on_a_gpu():
  """656-byte FP8 rows: a 3 GiB pool (traced, not made) is refused where the kernel
  compiles for a GPU (32-bit element offsets below 4 GiB); 1 and 5 GiB pools are not."""
  idx = jax.ShapeDtypeStruct((8,), jnp.int32)
  rows = lambda gib: jax.ShapeDtypeStruct((gib * 2**30 // 656, 656), jnp.uint8)
  small = rows(1)
  copy = lambda src, dst: jax.eval_shape(functools.partial(copy_rows_pallas, interpret=False),
                                         src, idx, dst, idx)
  with pytest.raises(ValueError, match=r"src: a pool of \d+ one-byte elements \(3.00 GiB\)"
                     r".*kernels.fetch='xla'"):
    copy(rows(3), small)
  with pytest.raises(ValueError, match=r"dst: a pool of"):
    copy(small, rows(3))
  assert copy(rows(5), small).shape == small.shape
  # Interpret mode (CPU) indexes any size.
  assert jax.eval_shape(copy_rows_pallas, rows(3), idx, small, idx).shape == small.shape


def test_unit_elements_spans_16_bytes_when_the_row_allows():
  assert unit_elements(576, jnp.bfloat16) == 8  # 72 units of 16 B per 1152-B row
  assert unit_elements(656, jnp.uint8) == 16  # 41 units of 16 B per 656-B row
  assert unit_elements(164, jnp.uint32) == 4
  assert unit_elements(6, jnp.float32) == 2 and unit_elements(7, jnp.float32) == 1


# ----------------------------------------------------------------------------------
# The HLO check used on GPU, on hand-written module text
# ----------------------------------------------------------------------------------

_HLO = """HloModule jit_fetch, entry_computation_layout={(bf16[4099,576]{1,0:S(5)}, s32[9]{0}, bf16[61,576]{1,0}, s32[9]{0})->bf16[61,576]{1,0}}

%fused_convert (param_0: bf16[4099,576]) -> f32[4099,576] {
  %param_0 = bf16[4099,576]{1,0} parameter(0)
  ROOT %convert.1 = f32[4099,576]{1,0} convert(%param_0)
}

%fused_gather (param_0.1: bf16[4099,576], param_1: s32[9,1]) -> f32[9,576] {
  %param_0.1 = bf16[4099,576]{1,0} parameter(0)
  %convert.2 = f32[4099,576]{1,0} convert(%param_0.1)
  %param_1 = s32[9,1]{1,0} parameter(1)
  ROOT %gather.1 = f32[9,576]{1,0} gather(%convert.2, %param_1), offset_dims={1}
}

%fused_scatter (param_0.2: bf16[4099,576], param_1.1: s32[9,1], param_2: bf16[9,576]) -> bf16[4099,576] {
  %param_0.2 = bf16[4099,576]{1,0} parameter(0)
  %param_1.1 = s32[9,1]{1,0} parameter(1)
  %param_2 = bf16[9,576]{1,0} parameter(2)
  ROOT %scatter.1 = bf16[4099,576]{1,0} scatter(%param_0.2, %param_1.1, %param_2), update_window_dims={1}
}

ENTRY %main (p0: bf16[4099,576], p1: s32[9], p2: bf16[61,576], p3: s32[9]) -> bf16[61,576] {
  %p0 = bf16[4099,576]{1,0:S(5)} parameter(0)
  %copy-start = (bf16[4099,576]{1,0:S(5)}, bf16[4099,576]{1,0}, u32[]) copy-start(%p0)
  %copy-done = bf16[4099,576]{1,0} copy-done(%copy-start)
  %gte = bf16[4099,576]{1,0} get-tuple-element(%copy-start), index=1
  %fusion.3 = f32[4099,576]{1,0} fusion(%p0), kind=kLoop, calls=%fused_convert
  %fusion.4 = f32[9,576]{1,0} fusion(%p0, %i), kind=kLoop, calls=%fused_gather
  %input_scatter_fusion = bf16[4099,576]{1,0} fusion(%copy-done, %i, %r), kind=kInput, calls=%fused_scatter
  %fusion.2 = bf16[4099,576]{1,0:S(5)} fusion(%p1, %p3, %p0, %p2), kind=kCustom, calls=%k, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  ROOT %custom-call.1 = bf16[61,576]{1,0} custom-call(%p0, %p1, %p2, %p3), custom_call_target="ula_jax_fetch_rows"
}
"""


def test_pool_materializations_flags_copies_not_kernels_or_parameters():
  found = pool_materializations(_HLO, (4099, 576))
  # Not the parameter, the tuple element, the fused gather's operand, the in-place
  # scatter (its copy is flagged) or the kernel.
  assert [line.split(" = ")[0] for line in found] == ["%copy-start", "%copy-done", "%fusion.3"]
  assert len(pool_materializations(_HLO, (4099, 576), allow_kernel=False)) == 4
  assert pool_materializations(_HLO, (61, 576)) == []  # only the kernel's own result
  assert host_parameter_shapes(_HLO) == ["bf16[4099,576]{1,0:S(5)}"]


# ----------------------------------------------------------------------------------
# The Pallas kernel: GPU (Triton) and its interpret-mode twin
# ----------------------------------------------------------------------------------


class CopyRowsPallasCases:
  """Every case runs the Pallas row copy with ``interpret=self.INTERPRET``."""

  INTERPRET = False

  def _put(self, x: np.ndarray, kind: str) -> jax.Array:
    # Interpret mode stages a pinned-host pool through device memory; Triton reads it
    # in place.
    return jax.device_put(x, host_sharding(kind))

  @pytest.mark.parametrize("layout", sorted(LAYOUTS))
  @pytest.mark.parametrize("N", [0, 1, 37, 300])
  def test_fetch_matches_numpy(self, layout, N, rng):
    dtype, W = LAYOUTS[layout]
    Sh, Sd = 401, 311
    host = random_rows(rng, (Sh, W), dtype)
    dev = poison((Sd, W), dtype)
    h_idx, d_idx = random_pairs(rng, N, Sh, Sd)
    run = jax.jit(functools.partial(fetch_rows_pallas, interpret=self.INTERPRET),
                  donate_argnums=2)
    out = run(self._put(host, "pinned_host"), jnp.asarray(h_idx), self._put(dev, "device"),
              jnp.asarray(d_idx))
    assert_same_bits(out, expected_copy(host, h_idx, dev, d_idx))

  @pytest.mark.parametrize("layout", sorted(LAYOUTS))
  def test_evict_matches_numpy(self, layout, rng):
    dtype, W = LAYOUTS[layout]
    Sd, Sh, N = 97, 211, 61
    dev = random_rows(rng, (Sd, W), dtype)
    host = poison((Sh, W), dtype)
    d_idx, h_idx = random_pairs(rng, N, Sd, Sh)
    run = jax.jit(functools.partial(evict_rows_pallas, interpret=self.INTERPRET),
                  donate_argnums=2)
    out = run(self._put(dev, "device"), jnp.asarray(d_idx), self._put(host, "pinned_host"),
              jnp.asarray(h_idx))
    assert_same_bits(out, expected_copy(dev, d_idx, host, h_idx))

  @pytest.mark.parametrize("layout", sorted(LAYOUTS))
  @pytest.mark.parametrize("block_units", [16, 1024])
  def test_stage_reads_the_in_range_rows(self, layout, block_units, rng):
    """stage_rows: row i of the result is pool[idx[i]] for every in-range index (the
    rest is unspecified), with many programs and a partial last one."""
    dtype, W = LAYOUTS[layout]
    S, N = 173, 301
    pool = random_rows(rng, (S, W), dtype)
    idx, _ = random_pairs(rng, N, S, N, skip=0.6)
    run = jax.jit(functools.partial(stage_rows_pallas,
                                    config=CopyRowsConfig(block_units=block_units),
                                    interpret=self.INTERPRET))
    out = np.asarray(run(self._put(pool, "device"), jnp.asarray(idx)))
    ok = (idx >= 0) & (idx < S)
    assert out.shape == (N, W) and out.dtype == pool.dtype and 0 < ok.sum() < N
    assert_same_bits(out[ok], pool[idx[ok]])

  @pytest.mark.parametrize("count", [0, 1, 29, 60])
  @pytest.mark.parametrize("max_programs", [3, 2048])
  def test_count_skips_the_pairs_past_it(self, count, max_programs, rng):
    """count: pairs at or past it are skipped (fetch and evict), staged rows past it
    are not read; with blocks of 16 units many blocks lie wholly past it, and with 3
    programs each loops over every third block below it."""
    dtype, W = LAYOUTS["fp8x656"]
    Ss, Sd, N = 90, 70, 60
    src = random_rows(rng, (Ss, W), dtype)
    s_idx, d_idx = random_pairs(rng, N, Ss, Sd, skip=0.1)
    cfg = CopyRowsConfig(block_units=16, max_programs=max_programs)
    for fn in (fetch_rows_pallas, evict_rows_pallas):
      dst = poison((Sd, W), dtype)
      run = jax.jit(functools.partial(fn, config=cfg, interpret=self.INTERPRET))
      out = run(jnp.asarray(src), jnp.asarray(s_idx), jnp.asarray(dst), jnp.asarray(d_idx),
                count=jnp.int32(count))
      assert_same_bits(out, expected_copy(src, s_idx[:count], dst, d_idx[:count]))
    run = jax.jit(functools.partial(stage_rows_pallas, config=cfg, interpret=self.INTERPRET))
    out = np.asarray(run(jnp.asarray(src), jnp.asarray(s_idx), count=jnp.int32(count)))
    ok = (s_idx >= 0) & (s_idx < Ss) & (np.arange(N) < count)
    assert_same_bits(out[ok], src[s_idx[ok]])

  @pytest.mark.parametrize("max_programs", [2, 2048])
  def test_many_blocks_and_narrow_rows(self, max_programs, rng):
    """Tiny blocks (many of them, a partial last one; one program each, or two programs
    looping over them) and a row of 7 float32 values (units of one element)."""
    Ss, Sd, W, N = 40, 30, 7, 25
    src = random_rows(rng, (Ss, W), np.float32)
    dst = poison((Sd, W), np.float32)
    s_idx, d_idx = random_pairs(rng, N, Ss, Sd)
    cfg = CopyRowsConfig(block_units=16, max_programs=max_programs)
    run = jax.jit(functools.partial(copy_rows_pallas, config=cfg,
                                    interpret=self.INTERPRET))
    out = run(jnp.asarray(src), jnp.asarray(s_idx), jnp.asarray(dst), jnp.asarray(d_idx))
    assert_same_bits(out, expected_copy(src, s_idx, dst, d_idx))


@pytest.mark.gpu
class TestCopyRowsPallasGpu(CopyRowsPallasCases):
  INTERPRET = False

  @pytest.mark.parametrize("direction", ["fetch", "evict"])
  def test_host_pool_is_read_in_place(self, direction):
    """Fails loudly if XLA stages the whole pinned-host pool around the kernel: the
    undocumented raw-pointer behaviour this kernel relies on is gone; use impl='xla'."""
    dtype, W = LAYOUTS["bf16x576"]
    Sh, Sd, N = 4099, 61, 9
    host = jax.device_put(jnp.zeros((Sh, W), dtype), host_sharding())
    dev = jnp.zeros((Sd, W), dtype)
    idx = jnp.zeros((N,), jnp.int32)
    if direction == "fetch":
      f, args = fetch_rows_pallas, (host, idx, dev, idx)
    else:
      f, args = evict_rows_pallas, (dev, idx, host, idx)
    hlo = jax.jit(functools.partial(f, interpret=False),
                  donate_argnums=2).lower(*args).compile().as_text()
    assert host_parameter_shapes(hlo), "the host pool did not reach the module in host memory"
    copies = pool_materializations(hlo, (Sh, W))
    assert not copies, ("the Pallas kernel does not read the pinned host pool in place; "
                        "XLA materialises it:\n" + "\n".join(copies))


class TestCopyRowsPallasInterpret(CopyRowsPallasCases):
  INTERPRET = True
