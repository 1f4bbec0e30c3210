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

from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.kernels.sparse_attention.pallas import (AttentionConfig, merge_splits,
                                                     sparse_mla_attention_pallas)
from ula_jax.kernels.sparse_attention.reference import sparse_mla_attention_reference

ON_GPU = jax.default_backend() == "gpu"

# Keyed by the pool dtype. bf16: the kernel feeds bf16 queries and bf16 softmax weights
# to the tensor cores (float32 accumulation); the reference computes in float32.
TOL = {jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
       jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5)}


def make_inputs(key, B, H, Dl, Dr, S, k, dtype, *, p_valid=0.7, empty_row=True):
  """Random queries and pool; slots in range where valid, garbage (-1 or past the end)
  where not; with ``empty_row`` the second row selects nothing."""
  ks = jax.random.split(key, 6)
  q_lat = jax.random.normal(ks[0], (B, H, Dl), jnp.float32).astype(dtype)
  q_rope = jax.random.normal(ks[1], (B, H, Dr), jnp.float32).astype(dtype)
  pool = jax.random.normal(ks[2], (S, Dl + Dr), jnp.float32).astype(dtype)
  slots = jax.random.randint(ks[3], (B, k), 0, S, jnp.int32)
  valid = jax.random.bernoulli(ks[4], p_valid, (B, k))
  if empty_row and B > 1:
    valid = valid.at[1].set(False)
  junk = jax.random.choice(ks[5], jnp.asarray([-1, S, S + 7], jnp.int32), (B, k))
  slots = jnp.where(valid, slots, junk)
  return q_lat, q_rope, pool, slots, valid


def assert_close(got, want, dtype):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == np.float32
  assert np.isfinite(got).all(), "the kernel left NaN/inf (unwritten or poisoned) outputs"
  np.testing.assert_allclose(got, want, **TOL[jnp.dtype(dtype)])


class SparseAttentionPallasCases:
  """Every case runs the Pallas kernel with ``interpret=self.INTERPRET``."""

  INTERPRET = False

  def run(self, *args, scale, config=None):
    f = functools.partial(sparse_mla_attention_pallas, scale=scale, config=config,
                          interpret=self.INTERPRET)
    return jax.jit(f)(*args)

  @pytest.mark.parametrize(
      "B, H, Dl, Dr, S, k, config, dtype",
      [
          # k not a multiple of block_k, H not a multiple of block_h, one split
          (3, 20, 64, 16, 100, 45, AttentionConfig(num_splits=1), jnp.bfloat16),
          # several splits (partial last one), fewer heads than a head block
          (2, 8, 32, 16, 60, 70, AttentionConfig(num_splits=3), jnp.bfloat16),
          # float32 pool (full-precision dots), one selected entry, larger k blocks
          (2, 16, 32, 16, 20, 1, AttentionConfig(block_k=64), jnp.float32),
      ])
  def test_matches_reference(self, key, B, H, Dl, Dr, S, k, config, dtype):
    args = make_inputs(key, B, H, Dl, Dr, S, k, dtype)
    scale = 1.0 / math.sqrt(Dl + Dr)
    got = self.run(*args, scale=scale, config=config)
    assert_close(got, sparse_mla_attention_reference(*args, scale=scale), dtype)
    if B > 1:  # the second row selects nothing
      assert not np.asarray(got[1]).any()

  def test_rows_behind_invalid_slots_never_leak(self, key):
    """Unused pool rows hold NaN (uninitialised memory); invalid slots point at them."""
    B, H, Dl, Dr, S, k = 2, 16, 32, 16, 24, 40
    q_lat, q_rope, pool, slots, valid = make_inputs(key, B, H, Dl, Dr, S, k, jnp.bfloat16,
                                                    empty_row=False)
    used = np.zeros(S, bool)
    used[np.asarray(slots)[np.asarray(valid)]] = True
    unused = jnp.asarray(~used)[:, None]
    garbage = jnp.where(unused, jnp.nan, pool).astype(pool.dtype)
    slots = jnp.where(valid, slots, jnp.argmax(~used).astype(jnp.int32))
    got = self.run(q_lat, q_rope, garbage, slots, valid, scale=0.1,
                   config=AttentionConfig(num_splits=2))
    clean = jnp.where(unused, 0, pool).astype(pool.dtype)
    want = sparse_mla_attention_reference(q_lat, q_rope, clean, slots, valid, scale=0.1)
    assert_close(got, want, jnp.bfloat16)

  @pytest.mark.parametrize("B, k", [(0, 8), (2, 0)])
  def test_empty_batch_or_selection(self, key, B, k):
    args = make_inputs(key, B, 4, 32, 16, 10, k, jnp.bfloat16)
    got = self.run(*args, scale=0.5)
    assert got.shape == (B, 4, 32) and not np.asarray(got).any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the interpret-mode twin runs on CPU)")
class TestSparseAttentionPallasGpu(SparseAttentionPallasCases):
  INTERPRET = False

  @pytest.mark.parametrize("H", [8, 64])
  def test_model_geometry(self, key, H):
    """GLM-5 geometry: latent 512 + rope 64, k = 2048, bf16."""
    B, Dl, Dr, S, k = 4, 512, 64, 8192, 2048
    args = make_inputs(key, B, H, Dl, Dr, S, k, jnp.bfloat16)
    scale = 1.0 / math.sqrt(Dl + Dr)
    got = self.run(*args, scale=scale)
    assert_close(got, sparse_mla_attention_reference(*args, scale=scale), jnp.bfloat16)


class TestSparseAttentionPallasInterpret(SparseAttentionPallasCases):
  INTERPRET = True


def test_dispatcher_runs_the_pallas_kernel(key):
  # Default config: k = 40 is two blocks of 32, so the automatic split count is 2.
  args = make_inputs(key, 2, 4, 32, 16, 12, 40, jnp.float32)
  got = sparse_mla_attention(*args, scale=0.3, impl="pallas")
  assert_close(got, sparse_mla_attention_reference(*args, scale=0.3), jnp.float32)


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
  for config in (AttentionConfig(num_splits=1), AttentionConfig(num_splits=4, block_h=64)):
    f = functools.partial(sparse_mla_attention_pallas, scale=0.04, config=config,
                          interpret=False)
    text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


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
  with pytest.raises(ValueError, match=r"block_k=24: expected a power of 2 >= 16"):
    AttentionConfig(block_k=24)
  with pytest.raises(ValueError, match=r"block_h=8: expected a power of 2 >= 16"):
    AttentionConfig(block_h=8)
  with pytest.raises(ValueError, match=r"num_splits=0: expected >= 1 \(or None\)"):
    AttentionConfig(num_splits=0)
  with pytest.raises(ValueError, match=r"num_warps=6: expected a power of 2"):
    AttentionConfig(num_warps=6)


def test_automatic_splits_fill_the_gpu_and_never_exceed_the_blocks():
  cfg = AttentionConfig()
  assert cfg.splits(B=1, H=64, k=2048) == 64  # 2 head blocks x 64 splits: one per block of k
  assert cfg.splits(B=64, H=64, k=2048) == 3
  assert cfg.splits(B=512, H=64, k=2048) == 1
  assert cfg.splits(B=1, H=8, k=40) == 2  # only two blocks of 32 to split
