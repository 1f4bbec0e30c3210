"""The Pallas sparse MLA attention kernel against the jnp reference.

``TestSparseAttentionPallasGpu`` runs the kernel through Triton (a GPU); its
interpret-mode twin reruns every case on CPU, where Pallas starts every output as NaN,
so a head or row the kernel fails to write shows up. Fresh random inputs per run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.core import kv_layout as kv_layout_lib
from ula_jax.core.compat import lower_for
from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.kernels.sparse_attention.pallas import (AttentionConfig, attention_cost,
                                                     bytes_read, launch_seconds,
                                                     merge_splits, merge_splits_pallas,
                                                     sparse_mla_attention_pallas)
from ula_jax.kernels.sparse_attention.reference import sparse_mla_attention_reference

# Keyed by the pool dtype. bf16: the kernel feeds bf16 queries and bf16 softmax weights
# to the tensor cores (float32 accumulation); the reference computes in float32.
TOL = {jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
       jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5)}


def make_inputs(rng, B, H, Dl, Dr, S, k, dtype, *, p_valid=0.7, empty_row=True):
  """Random queries and pool; slots in range where valid, garbage (-1 or past the end)
  where not; with ``empty_row`` the second row selects nothing. Drawn with numpy (one
  transfer per array instead of a compiled program per eager jax.random call)."""
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
  q_lat, q_rope, pool = normal(B, H, Dl), normal(B, H, Dr), normal(S, Dl + Dr)
  valid = rng.random((B, k)) < p_valid
  if empty_row and B > 1:
    valid[1] = False
  junk = rng.choice(np.asarray([-1, S, S + 7], np.int32), (B, k))
  slots = np.where(valid, rng.integers(0, S, (B, k)), junk).astype(np.int32)
  return q_lat, q_rope, pool, jnp.asarray(slots), jnp.asarray(valid)


def make_fp8_inputs(rng, B, H, Dl, Dr, S, k, **kw):
  """``make_inputs`` with the pool stored as fp8 rows (``model.kv_layout='fp8'``): entries
  of magnitudes spread over three octaves by row, so the rows' scales differ (wider
  spreads put the kernel's bf16 softmax weights times the largest entries past
  ``TOL``)."""
  q_lat, q_rope, pool, slots, valid = make_inputs(rng, B, H, Dl, Dr, S, k, jnp.float32, **kw)
  spread = jnp.asarray(np.exp2(rng.integers(-1, 2, (S, 1))).astype(np.float32))
  rows = kv_layout_lib.quantize(pool * spread, Dl)
  return q_lat.astype(jnp.bfloat16), q_rope.astype(jnp.bfloat16), rows, slots, valid


@functools.cache
def _reference(scale: float, kv_layout: str = "bf16"):
  extra = {} if kv_layout == "bf16" else {"kv_layout": kv_layout}
  return jax.jit(functools.partial(sparse_mla_attention_reference, scale=scale, **extra))


def reference(*args, scale, kv_layout="bf16"):
  """The jnp reference, jitted (op-by-op it would compile every operation)."""
  return _reference(float(scale), kv_layout)(*args)


def assert_close(got, want, dtype):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == np.float32
  assert np.isfinite(got).all(), "the kernel left NaN/inf (unwritten or poisoned) outputs"
  np.testing.assert_allclose(got, want, **TOL[jnp.dtype(dtype)])


class SparseAttentionPallasCases:
  """Every case runs the Pallas kernel with ``interpret=self.INTERPRET``."""

  INTERPRET = False

  def run(self, *args, scale, config=None, **kw):
    f = functools.partial(sparse_mla_attention_pallas, scale=scale, config=config,
                          interpret=self.INTERPRET, **kw)
    return jax.jit(f)(*args)

  @pytest.mark.parametrize("B, H, Dl, Dr, S, k, config", [
      # two fp8 blocks, k not a multiple of block_k, H not a multiple of block_h
      (3, 20, 256, 16, 100, 45, AttentionConfig(num_splits=1, block_k=16)),
      # several splits (blocks 2, 2, 1)
      (2, 8, 128, 32, 60, 70, AttentionConfig(num_splits=3, block_k=16)),
      # each step's slots loaded in the loop, four blocks
      (2, 16, 512, 16, 60, 40, AttentionConfig(num_splits=2, block_k=16, preload_slots=0)),
  ])
  def test_fp8_rows_match_reference(self, rng, B, H, Dl, Dr, S, k, config):
    """fp8 rows decoded in the kernel: the reference's outputs (dequantised in float32)
    up to the kernel's bf16 queries and softmax weights."""
    args = make_fp8_inputs(rng, B, H, Dl, Dr, S, k)
    scale = 1.0 / math.sqrt(Dl + Dr)
    got = self.run(*args, scale=scale, config=config, kv_layout="fp8")
    want = reference(*args, scale=scale, kv_layout="fp8")
    assert_close(got, want, jnp.bfloat16)
    assert not np.asarray(got[1]).any()  # the second row selects nothing

  def test_fp8_rows_behind_invalid_slots_never_leak(self, rng):
    """Unused fp8 rows hold 0xFF bytes: NaN fp8 values and a NaN scale."""
    B, H, Dl, Dr, S, k = 2, 16, 128, 16, 24, 40
    q_lat, q_rope, rows, slots, valid = make_fp8_inputs(rng, B, H, Dl, Dr, S, k,
                                                        empty_row=False)
    slots, valid, rows = np.asarray(slots), np.asarray(valid), np.asarray(rows)
    used = np.zeros(S, bool)
    used[slots[valid]] = True
    garbage = jnp.asarray(np.where(used[:, None], rows, 0xFF).astype(np.uint8))
    slots = jnp.asarray(np.where(valid, slots, np.argmax(~used)).astype(np.int32))
    valid = jnp.asarray(valid)
    got = self.run(q_lat, q_rope, garbage, slots, valid, scale=0.1, kv_layout="fp8",
                   config=AttentionConfig(num_splits=2, block_k=16))
    want = reference(q_lat, q_rope, jnp.asarray(rows), slots, valid, scale=0.1,
                     kv_layout="fp8")
    assert_close(got, want, jnp.bfloat16)

  @pytest.mark.parametrize(
      "B, H, Dl, Dr, S, k, config, dtype",
      [
          # k not a multiple of block_k, H not a multiple of block_h, one split
          (3, 20, 64, 16, 100, 45, AttentionConfig(num_splits=1, block_k=16), jnp.bfloat16),
          # several splits (blocks 2, 2, 1), fewer heads than a head block
          (2, 8, 32, 16, 60, 70, AttentionConfig(num_splits=3, block_k=16), jnp.bfloat16),
          # each step's slots loaded in the loop instead of the split's list up front
          (2, 8, 32, 16, 60, 70, AttentionConfig(num_splits=2, block_k=16, preload_slots=0),
           jnp.bfloat16),
          # float32 pool (full-precision dots), one selected entry, larger k blocks
          (2, 16, 32, 16, 20, 1, AttentionConfig(block_k=64), jnp.float32),
      ])
  def test_matches_reference(self, rng, B, H, Dl, Dr, S, k, config, dtype):
    args = make_inputs(rng, B, H, Dl, Dr, S, k, dtype)
    scale = 1.0 / math.sqrt(Dl + Dr)
    got = self.run(*args, scale=scale, config=config)
    assert_close(got, reference(*args, scale=scale), dtype)
    if B > 1:  # the second row selects nothing
      assert not np.asarray(got[1]).any()

  def test_rows_behind_invalid_slots_never_leak(self, rng):
    """Unused pool rows hold NaN (uninitialised memory); invalid slots point at them."""
    B, H, Dl, Dr, S, k = 2, 16, 32, 16, 24, 40
    q_lat, q_rope, pool, slots, valid = make_inputs(rng, B, H, Dl, Dr, S, k, jnp.bfloat16,
                                                    empty_row=False)
    slots, valid, pool = np.asarray(slots), np.asarray(valid), np.asarray(pool)
    used = np.zeros(S, bool)
    used[slots[valid]] = True
    unused = ~used[:, None]
    garbage = jnp.asarray(np.where(unused, np.nan, pool).astype(pool.dtype))
    slots = jnp.asarray(np.where(valid, slots, np.argmax(~used)).astype(np.int32))
    valid = jnp.asarray(valid)
    got = self.run(q_lat, q_rope, garbage, slots, valid, scale=0.1,
                   config=AttentionConfig(num_splits=2, block_k=16))
    clean = jnp.asarray(np.where(unused, 0, pool).astype(pool.dtype))
    want = reference(q_lat, q_rope, clean, slots, valid, scale=0.1)
    assert_close(got, want, jnp.bfloat16)

  def test_merge_kernel_matches_the_jnp_merge(self, rng):
    """Heads not a multiple of the merge block, a split that saw nothing for some heads
    and a head no split saw (zeros)."""
    B, NS, H, Dl = 2, 5, 20, 128
    o = jnp.asarray(rng.standard_normal((B, NS, H, Dl)), jnp.float32)
    lse = rng.standard_normal((B, NS, H)).astype(np.float32) * 3
    lse[0, 2, :7] = -np.inf
    lse[1, :, 4] = -np.inf
    lse = jnp.asarray(lse)
    got = jax.jit(functools.partial(merge_splits_pallas, interpret=self.INTERPRET))(o, lse)
    assert_close(got, merge_splits(o, lse), jnp.float32)
    assert not np.asarray(got[1, 4]).any()

  @pytest.mark.parametrize("B, k", [(0, 8), (2, 0)])
  def test_empty_batch_or_selection(self, rng, B, k):
    args = make_inputs(rng, B, 4, 32, 16, 10, k, jnp.bfloat16)
    got = self.run(*args, scale=0.5)
    assert got.shape == (B, 4, 32) and not np.asarray(got).any()


@pytest.mark.gpu
class TestSparseAttentionPallasGpu(SparseAttentionPallasCases):
  INTERPRET = False

  @pytest.mark.parametrize("H, config", [
      (8, AttentionConfig()),
      (64, AttentionConfig()),  # 64-head blocks, split along k
      (64, AttentionConfig(block_h=32, num_splits=1, block_k=32)),  # no split
      (64, AttentionConfig(block_h=16, block_k=32, num_warps=4, num_stages=3)),
  ])
  def test_model_geometry(self, rng, H, config):
    """GLM-5 geometry: latent 512 + rope 64, k = 2048, bf16."""
    B, Dl, Dr, S, k = 4, 512, 64, 8192, 2048
    args = make_inputs(rng, B, H, Dl, Dr, S, k, jnp.bfloat16)
    scale = 1.0 / math.sqrt(Dl + Dr)
    got = self.run(*args, scale=scale, config=config)
    assert_close(got, reference(*args, scale=scale), jnp.bfloat16)

  @pytest.mark.parametrize("B, config", [
      (4, AttentionConfig()),
      (1, AttentionConfig()),  # split along k
      (32, AttentionConfig(block_h=16, block_k=32, num_warps=4, num_stages=3)),
  ])
  def test_model_geometry_fp8(self, rng, B, config):
    """GLM-5 geometry with DeepSeek-V3.2's 656-byte fp8 rows, 64 heads, k = 2048."""
    H, Dl, Dr, S, k = 64, 512, 64, 8192, 2048
    args = make_fp8_inputs(rng, B, H, Dl, Dr, S, k)
    scale = 1.0 / math.sqrt(Dl + Dr)
    got = self.run(*args, scale=scale, config=config, kv_layout="fp8")
    assert_close(got, reference(*args, scale=scale, kv_layout="fp8"), jnp.bfloat16)


class TestSparseAttentionPallasInterpret(SparseAttentionPallasCases):
  INTERPRET = True


def test_dispatcher_runs_the_pallas_kernel(rng):
  # Default config: k = 70 is two blocks of 64, so the automatic split count is 2.
  args = make_inputs(rng, 2, 4, 32, 16, 12, 70, jnp.float32)
  got = sparse_mla_attention(*args, scale=0.3, impl="pallas", interpret=True)
  assert_close(got, reference(*args, scale=0.3), jnp.float32)


def test_dispatcher_forwards_interpret_to_pallas_only(monkeypatch):
  from ula_jax.kernels.sparse_attention import pallas as pallas_mod
  seen = []
  monkeypatch.setattr(pallas_mod, "sparse_mla_attention_pallas",
                      lambda *a, scale, interpret: seen.append(interpret) or a[0])
  args = (jnp.zeros((1, 2, 8)), jnp.zeros((1, 2, 4)), jnp.zeros((5, 12)),
          jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool))
  sparse_mla_attention(*args, scale=1.0, impl="pallas", interpret=False)
  sparse_mla_attention(*args, scale=1.0, impl="pallas")
  assert seen == [False, None]
  # The reference has no interpret mode: the argument is accepted and ignored.
  out = sparse_mla_attention(*args, scale=1.0, impl="xla", interpret=True)
  assert out.shape == (1, 2, 8)


def test_merge_splits_hand_computed():
  # One head, Dl = 1. Split 0 saw exp-sum e^1 with output 2; split 1 e^0 with output 5;
  # split 2 saw nothing. Merged: (e * 2 + 1 * 5) / (e + 1).
  o = jnp.asarray([[[[2.0]], [[5.0]], [[0.0]]]])
  lse = jnp.asarray([[[1.0], [0.0], [-jnp.inf]]])
  np.testing.assert_allclose(merge_splits(o, lse), [[[(math.e * 2 + 5) / (math.e + 1)]]],
                             rtol=1e-6)
  nothing = merge_splits(jnp.zeros((1, 2, 1, 1)), jnp.full((1, 2, 1), -jnp.inf))
  assert not np.asarray(nothing).any() and np.isfinite(np.asarray(nothing)).all()


def test_lowers_to_triton_for_the_model_geometry():
  """The GPU lowering (Pallas -> Triton IR) needs no GPU: power-of-2 block shapes and
  the gathers are checked here on CPU for both the single- and the split-k kernel."""
  B, H, Dl, Dr, S, k = 2, 64, 512, 64, 1000, 2048
  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((B, H, Dl), (B, H, Dr),
                                                             (S, Dl + Dr))]
  shapes += [jax.ShapeDtypeStruct((B, k), jnp.int32), jax.ShapeDtypeStruct((B, k), jnp.bool_)]
  for config in (AttentionConfig(num_splits=1), AttentionConfig(num_splits=4, block_h=64),
                 AttentionConfig(block_h=16, block_k=32, num_warps=4, num_stages=3)):
    f = functools.partial(sparse_mla_attention_pallas, scale=0.04, config=config,
                          interpret=False)
    text = lower_for(jax.jit(f).trace(*shapes)).as_text()
    assert "triton" in text


def test_fp8_rows_lower_to_triton_for_the_model_geometry():
  """The fp8 form's byte gathers, bitcasts and float8 casts lower to Triton IR (656-byte
  rows, 64 heads, k = 2048), with and without splits."""
  B, H, Dl, Dr, S, k = 2, 64, 512, 64, 1000, 2048
  shapes = [jax.ShapeDtypeStruct((B, H, Dl), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, H, Dr), jnp.bfloat16),
            jax.ShapeDtypeStruct((S, 656), jnp.uint8),
            jax.ShapeDtypeStruct((B, k), jnp.int32), jax.ShapeDtypeStruct((B, k), jnp.bool_)]
  for config in (AttentionConfig(num_splits=1), AttentionConfig(num_splits=4, block_h=64)):
    f = functools.partial(sparse_mla_attention_pallas, scale=0.04, config=config,
                          interpret=False, kv_layout="fp8")
    text = lower_for(jax.jit(f).trace(*shapes)).as_text()
    assert "ula_sparse_mla_attention_fp8" in text


def test_arguments_and_config_are_validated():
  q = jnp.zeros((1, 2, 24))
  with pytest.raises(ValueError, match=r"q_lat.shape\[-1\]=24, q_rope.shape\[-1\]=8: the Pallas "
                     r"kernel needs powers of 2"):
    sparse_mla_attention_pallas(q, jnp.zeros((1, 2, 8)), jnp.zeros((4, 32)),
                                jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool), scale=1.0)
  with pytest.raises(ValueError, match=r"pool.shape=\(4, 40\): expected \[S, Dl \+ Dr\] = "
                     r"\[S, 48\]"):
    sparse_mla_attention_pallas(jnp.zeros((1, 2, 32)), jnp.zeros((1, 2, 16)), jnp.zeros((4, 40)),
                                jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool), scale=1.0)
  with pytest.raises(ValueError, match=r"pool: got uint8\[4, 48\], expected uint8 \[S, Dl \+ "
                     r"4 Dl/128 \+ 2 Dr\] = \[S, 164\] \(model.kv_layout='fp8'\)"):
    sparse_mla_attention_pallas(jnp.zeros((1, 2, 128)), jnp.zeros((1, 2, 16)),
                                jnp.zeros((4, 48), jnp.uint8), jnp.zeros((1, 3), jnp.int32),
                                jnp.ones((1, 3), bool), scale=1.0, kv_layout="fp8")
  with pytest.raises(ValueError, match=r"kv_layout"):
    sparse_mla_attention_pallas(jnp.zeros((1, 2, 128)), jnp.zeros((1, 2, 16)),
                                jnp.zeros((4, 144)), jnp.zeros((1, 3), jnp.int32),
                                jnp.ones((1, 3), bool), scale=1.0, kv_layout="int4")
  with pytest.raises(ValueError, match=r"block_k=24: expected a power of 2 >= 16"):
    AttentionConfig(block_k=24)
  with pytest.raises(ValueError, match=r"block_h=8: expected a power of 2 >= 16"):
    AttentionConfig(block_h=8)
  with pytest.raises(ValueError, match=r"num_splits=0: expected >= 1 \(or None\)"):
    AttentionConfig(num_splits=0)
  with pytest.raises(ValueError, match=r"num_warps=6: expected a power of 2"):
    AttentionConfig(num_warps=6)
  with pytest.raises(ValueError, match=r"num_stages=0: expected >= 1"):
    AttentionConfig(num_stages=0)
  with pytest.raises(ValueError, match=r"num_sms=0: expected > 0"):
    AttentionConfig(num_sms=0)
  with pytest.raises(ValueError, match=r"sm_tflops=-1.0: expected > 0"):
    AttentionConfig(sm_tflops=-1.0)
  with pytest.raises(ValueError, match=r"smem_kb=0: expected > 0"):
    AttentionConfig(smem_kb=0)
  with pytest.raises(ValueError, match=r"min_programs=0: expected > 0"):
    AttentionConfig(min_programs=0)


def test_launch_model_hand_computed():
  cfg = AttentionConfig()  # 132 SMs, 4000 GB/s HBM, 10000 GB/s L2, 3 TFLOP/s per SM
  row = 576 * 2
  # Batch 8, 16-head blocks, 4 splits: 128 programs of 512 rows (one wave).
  hbm = 8 * 2048 * row + 2 * 8 * 4 * 64 * 513 * 4  # rows once + partials written and read
  l2 = 4 * 8 * 2048 * row + 2 * 8 * 4 * 64 * 513 * 4  # four head blocks gather the rows
  work = 2 * 16 * 512 * (2 * 512 + 64)
  want = max(hbm / 4e12, l2 / 10e12, work / 3e12) + 3e-6
  assert launch_seconds(cfg, 8, 64, 2048, 512, 64, 2, 16, 4) == pytest.approx(want)
  # Batch 64 without splits: 64-head blocks leave 64 programs, each doing a quarter of
  # a request's work per SM twice over what 128 programs of 32 heads do.
  one = launch_seconds(cfg, 64, 64, 2048, 512, 64, 2, 64, 1)
  assert one == pytest.approx(2 * 64 * 2048 * 1088 / 3e12)
  assert launch_seconds(cfg, 64, 64, 2048, 512, 64, 2, 32, 1) == pytest.approx(one / 2)


def test_automatic_launch_follows_the_model():
  cfg = AttentionConfig()
  launch = lambda B, H=64, k=2048: cfg.launch(B, H, k, 512, 64, 2)
  # Small batches take small head blocks (more programs) and split k to occupy the SMs;
  # from 16 programs up the largest head block that fits shared memory, with the
  # model's splits (the fastest launches measured on an H200).
  assert launch(1) == (16, 16)
  assert launch(4) == (16, 8)
  assert launch(8) == (32, 8)  # 8 requests x 2 head blocks
  assert launch(32) == (64, 4)
  assert launch(64) == (64, 2)
  assert launch(128) == (64, 1)
  # 64-head blocks plan (2 x 64 + 64) rows of 1152 B = 216 KB of shared memory with
  # block_k = 64, within the 220 KB budget; a smaller budget leaves 32-head blocks.
  assert cfg.smem_bytes(64, 512, 64, 2) == 192 * 1152
  assert AttentionConfig(smem_kb=200).launch(64, 64, 2048, 512, 64, 2)[0] == 32
  assert AttentionConfig(min_programs=128).launch(64, 64, 2048, 512, 64, 2)[0] == 32
  assert launch(1, H=8, k=40) == (16, 1)  # never below 16 heads; one block of k
  # Fixed values are kept; splits never outnumber the blocks of k, and empty ones are
  # dropped: 5 blocks of 16 in 4 splits would be (2, 2, 1, 0), so 3 splits.
  assert AttentionConfig(block_h=64, num_splits=1).launch(1, 64, 2048, 512, 64, 2) == (64, 1)
  assert AttentionConfig(block_k=16, num_splits=4).launch(1, 8, 80, 32, 16, 2) == (16, 3)
  assert AttentionConfig(num_splits=9).launch(1, 8, 40, 32, 16, 2) == (16, 1)
  assert cfg.warps(16) == 4 and cfg.warps(64) == 8
  assert AttentionConfig(num_warps=2).warps(64) == 2


def test_attention_cost_counts_bytes_and_flops():
  # Batch 32, GLM-5 geometry, bf16: 32-head programs in 2 splits.
  c = attention_cost(32, 64, 2048, 512, 64, jnp.bfloat16, jnp.bfloat16,
                     AttentionConfig(block_h=32, num_splits=2))
  assert c.must_read == 32 * 2048 * 1152 + 32 * 64 * 576 * 2
  assert c.must_read == bytes_read(32, 64, 2048, 512, 64, jnp.bfloat16, jnp.bfloat16)
  assert (c.block_h, c.splits, c.programs, c.num_warps) == (32, 2, 128, 8)
  assert c.partial_bytes == 2 * 32 * 2 * 64 * 513 * 4  # outputs and lse, written and read
  assert c.row_reads == 2 * 32 * 2048 * 1152  # two head blocks gather every row
  assert c.flops == 2 * 32 * 64 * 2048 * (512 + 512 + 64)
  assert c.model_us == pytest.approx(
      1e6 * launch_seconds(AttentionConfig(), 32, 64, 2048, 512, 64, 2, 32, 2))
  one = attention_cost(256, 64, 2048, 512, 64, jnp.bfloat16, jnp.bfloat16,
                       AttentionConfig(block_h=64))
  assert one.splits == 1 and one.partial_bytes == 0
  assert one.row_reads == 256 * 2048 * 1152  # one head block: every row gathered once
