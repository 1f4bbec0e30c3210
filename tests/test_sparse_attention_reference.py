"""The sparse MLA attention reference: hand-computed values, dense equivalence, edges."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.kernels.sparse_attention.reference import sparse_mla_attention_reference

# Reads are upcast to float32, so both pool dtypes compare against a float64 dense
# computation over the same (rounded) values.
TOL = {"float32": 2e-5, "bfloat16": 2e-5}


def test_reference_hand_computed():
  # Dl = Dr = 2. Rows: r0 = c [1, 0]; r2 = k_rope [1, 0]; r1, r3 are never valid.
  pool = jnp.asarray([[1., 0., 0., 0.],
                      [0., 1., 0., 0.],
                      [0., 0., 1., 0.],
                      [2., 2., 0., 1.]])
  slots = jnp.asarray([[3, 0, 2, 1], [0, 1, 2, 3]], jnp.int32)
  valid = jnp.asarray([[False, True, True, False], [False] * 4])
  # head 0: scores 0.5 * [2 ln 3, 0] = [ln 3, 0] -> p = [3/4, 1/4] -> o = 3/4 r0.c
  # head 1: scores 0.5 * [0, 2] = [0, 1]        -> p = [1/(1+e), e/(1+e)] -> o = p0 r0.c
  q_lat = jnp.asarray([[[2 * math.log(3), 0.], [0., 5.]]] * 2)
  q_rope = jnp.asarray([[[0., 0.], [2., 0.]]] * 2)
  out = sparse_mla_attention(q_lat, q_rope, pool, slots, valid, scale=0.5)
  expected = np.asarray([[[0.75, 0.], [1 / (1 + math.e), 0.]],
                         [[0., 0.], [0., 0.]]])  # row 1 has nothing valid
  np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)
  assert out.dtype == jnp.float32


def _dense_masked(q_lat, q_rope, pool, slots, valid, scale):
  """Attention over every pool row, masked to the rows the selection names (float64)."""
  q_lat, q_rope = np.asarray(q_lat, np.float64), np.asarray(q_rope, np.float64)
  pool = np.asarray(pool.astype(jnp.float32), np.float64)
  Dl = q_lat.shape[-1]
  B, S = q_lat.shape[0], pool.shape[0]
  out = np.zeros(q_lat.shape)
  for b in range(B):
    mask = np.isin(np.arange(S), np.asarray(slots)[b][np.asarray(valid)[b]])
    if not mask.any():
      continue
    s = (q_lat[b] @ pool[:, :Dl].T + q_rope[b] @ pool[:, Dl:].T) * scale  # [H, S]
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[b] = p @ pool[:, :Dl]
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparse_equals_dense_masked(rng, dtype):
  B, H, Dl, Dr, S, k = 4, 3, 16, 8, 40, 12
  pool = jnp.asarray(rng.standard_normal((S, Dl + Dr)), dtype)
  q_lat = jnp.asarray(rng.standard_normal((B, H, Dl)), jnp.float32)
  q_rope = jnp.asarray(rng.standard_normal((B, H, Dr)), jnp.float32)
  slots = np.stack([rng.permutation(S)[:k] for _ in range(B)]).astype(np.int32)
  valid = rng.random((B, k)) < 0.7
  valid[0] = True  # every slot
  valid[1] = False  # none: zeros
  valid[2] = np.arange(k) == 5  # exactly one
  slots = np.where(valid, slots, -1)  # invalid slots carry INVALID, as memory systems give
  scale = (Dl + Dr) ** -0.5
  out = sparse_mla_attention(q_lat, q_rope, pool, jnp.asarray(slots), jnp.asarray(valid),
                             scale=scale)
  expected = _dense_masked(q_lat, q_rope, pool, slots, valid, scale)
  np.testing.assert_allclose(np.asarray(out), expected, rtol=TOL[dtype], atol=TOL[dtype])
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  # A single valid slot returns that row's latent for every head.
  np.testing.assert_allclose(
      np.asarray(out[2]),
      np.broadcast_to(np.asarray(pool[slots[2, 5], :Dl], np.float32), (H, Dl)), rtol=1e-6)


@pytest.mark.parametrize("B,k", [(0, 4), (2, 0)])
def test_empty_batch_or_selection(B, k):
  q_lat, q_rope = jnp.ones((B, 3, 8)), jnp.ones((B, 3, 4))
  pool = jnp.ones((10, 12))
  out = sparse_mla_attention(q_lat, q_rope, pool, jnp.zeros((B, k), jnp.int32),
                             jnp.ones((B, k), bool), scale=1.0)
  assert out.shape == (B, 3, 8) and out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_slot_order_does_not_matter(rng):
  B, H, Dl, Dr, S, k = 2, 2, 8, 4, 16, 6
  pool = jnp.asarray(rng.standard_normal((S, Dl + Dr)), jnp.float32)
  q_lat = jnp.asarray(rng.standard_normal((B, H, Dl)), jnp.float32)
  q_rope = jnp.asarray(rng.standard_normal((B, H, Dr)), jnp.float32)
  slots = np.stack([rng.permutation(S)[:k] for _ in range(B)]).astype(np.int32)
  valid = rng.random((B, k)) < 0.6
  perm = rng.permutation(k)
  a = sparse_mla_attention_reference(q_lat, q_rope, pool, jnp.asarray(slots),
                                     jnp.asarray(valid), scale=0.3)
  b = sparse_mla_attention_reference(q_lat, q_rope, pool, jnp.asarray(slots[:, perm]),
                                     jnp.asarray(valid[:, perm]), scale=0.3)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_jit_and_large_scores_stay_finite(rng):
  B, H, Dl, Dr, S, k = 2, 2, 8, 4, 16, 4
  pool = jnp.asarray(rng.standard_normal((S, Dl + Dr)) * 100, jnp.float32)
  q_lat = jnp.asarray(rng.standard_normal((B, H, Dl)) * 100, jnp.float32)
  q_rope = jnp.asarray(rng.standard_normal((B, H, Dr)), jnp.float32)
  slots = jnp.asarray(np.stack([rng.permutation(S)[:k] for _ in range(B)]), jnp.int32)
  valid = jnp.ones((B, k), bool)
  fn = jax.jit(lambda *a: sparse_mla_attention(*a, scale=1.0, impl="xla"))
  out = fn(q_lat, q_rope, pool, slots, valid)
  assert bool(jnp.isfinite(out).all())
  np.testing.assert_allclose(np.asarray(out),
                             _dense_masked(q_lat, q_rope, pool, slots, valid, 1.0),
                             rtol=1e-4, atol=1e-3)


def test_errors():
  q_lat, q_rope = jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 4))
  pool, slots, valid = jnp.zeros((10, 12)), jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), bool)
  with pytest.raises(ValueError,
                     match=r"kernels.attention='cuda': expected one of \['mosaic', 'pallas', 'xla'\]"):
    sparse_mla_attention(q_lat, q_rope, pool, slots, valid, scale=1.0, impl="cuda")
  with pytest.raises(ValueError,
                     match=r"pool.shape=\(10, 11\): expected \[S, Dl \+ Dr\] = \[S, 12\]"):
    sparse_mla_attention(q_lat, q_rope, jnp.zeros((10, 11)), slots, valid, scale=1.0)
  with pytest.raises(ValueError, match=r"q_lat.shape=\(2, 3, 8\), q_rope.shape=\(2, 4, 4\)"):
    sparse_mla_attention(q_lat, jnp.zeros((2, 4, 4)), pool, slots, valid, scale=1.0)
  with pytest.raises(ValueError, match=r"slots.shape=\(3, 5\), valid.shape=\(2, 5\): "
                                       r"expected both \[B, k\] with B=2"):
    sparse_mla_attention(q_lat, q_rope, pool, jnp.zeros((3, 5), jnp.int32), valid, scale=1.0)


def test_invalid_slots_never_read_garbage(rng):
  """Invalid slots read row 0 in place of INVALID; row 0 may be uninitialised (NaN),
  and a softmax weight of 0 times NaN is still NaN, so the gathered row must be zeroed."""
  B, H, Dl, Dr, S, k = 2, 2, 8, 4, 10, 6
  pool = rng.standard_normal((S, Dl + Dr)).astype(np.float32)
  q_lat = jnp.asarray(rng.standard_normal((B, H, Dl)), jnp.float32)
  q_rope = jnp.asarray(rng.standard_normal((B, H, Dr)), jnp.float32)
  slots = jnp.asarray([[3, -1, 5, 7, -1, 2], [-1] * 6], jnp.int32)
  assert slots.shape == (B, k)
  valid = slots >= 0
  garbage = pool.copy()
  garbage[0] = np.nan
  got = sparse_mla_attention_reference(q_lat, q_rope, jnp.asarray(garbage), slots, valid,
                                       scale=0.4)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_array_equal(np.asarray(got[1]), 0.0)  # nothing valid
  want = sparse_mla_attention_reference(q_lat, q_rope, jnp.asarray(pool), slots, valid,
                                        scale=0.4)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
