"""Exact top-k by radix select: ``select_topk``'s set without a sort.

``jax.lax.top_k`` of 2048 out of 64K positions for thousands of rows is a sort on a GPU.
``select_topk_radix`` finds each row's k-th largest score by radix select over the
float32 bit pattern instead, then keeps what lies above it:

1. Each score becomes a uint32 key in the float's total order (``ordered_key``: the
   order ``lax.top_k`` uses; -0.0 below +0.0), non-candidates the key of -inf.
2. ``kth_largest_key``: ``32 / radix_bits`` passes over the keys, each deciding the next
   ``radix_bits`` bits of the k-th largest key by counting, per row, the keys at or above
   ``2 ** radix_bits - 1`` thresholds at once (one read of the keys per pass, no sort;
   ``pallas.prefix_kth_largest_pallas`` runs the passes as kernels that read the
   scores up to each row's limit only).
3. Every key above it is picked, and of the keys equal to it the lowest positions, as
   many as make k (``lax.top_k`` breaks ties towards the lower position); of those the
   candidates are kept.
4. Compaction: each pick's rank among the row's picks (``inclusive_count``: a matmul with
   a triangular matrix of ones per tile of 128 positions, then a cumulative sum of the
   tile totals) is its slot in the output, written by one scatter with unique indices.

The result is ``select_topk``'s set of valid positions exactly, in ascending position
order (``select_topk`` orders them best first): the valid picks first, then INVALID.
``topk_mask`` stops before step 4 and returns the picks as a [N, T] mask, for callers
that attend through a mask (the training forward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.core.types import INVALID

F32 = jnp.float32
RADIX_BITS = 4  # bits decided per pass: 8 passes over the keys, 15 counts each
_TILE = 128  # positions per triangular matmul of ``inclusive_count``
_SIGN = np.uint32(0x80000000)


def ordered_key(x: jax.Array) -> jax.Array:
  """float32 -> uint32 keys in the float's total order (-NaN < -inf < ... < -0.0 < +0.0
  < ... < +inf < +NaN), the order ``lax.top_k`` compares in."""
  bits = jax.lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
  return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def kth_largest_key(key_nt: jax.Array, k: int, *, radix_bits: int = RADIX_BITS
                    ) -> jax.Array:
  """Each row's k-th largest key (the largest t with at least k keys >= t).

  key_nt: [N, T] uint32 with T >= k >= 1; radix_bits: bits decided per pass (divides 32)
  returns [N] uint32
  """
  if 32 % radix_bits:
    raise ValueError(f"radix_bits={radix_bits}: must divide 32")
  N = key_nt.shape[0]
  digits = jnp.arange(1, 1 << radix_bits, dtype=jnp.uint32)  # [D]

  def one_pass(p, prefix):
    # Invariant: at least k keys are >= prefix (its bits below ``shift`` are 0). The next
    # digit is the number of thresholds prefix | d << shift (d >= 1) that keep k keys at
    # or above them (the counts fall as d grows).
    shift = (32 - radix_bits * (p + 1)).astype(jnp.uint32)
    thr_nd = prefix[:, None] | (digits << shift)[None, :]
    counts_nd = jnp.sum(key_nt[:, :, None] >= thr_nd[:, None, :], axis=1, dtype=jnp.int32)
    digit = jnp.sum(counts_nd >= k, axis=1, dtype=jnp.int32).astype(jnp.uint32)
    return prefix | (digit << shift)

  return jax.lax.fori_loop(0, 32 // radix_bits, one_pass, jnp.zeros((N,), jnp.uint32))


def inclusive_count(mask_nt: jax.Array) -> jax.Array:
  """How many of ``mask_nt[n, :t + 1]`` are set: [N, T] bool -> [N, T] int32.

  Within tiles of 128 positions a matmul with an upper-triangular matrix of ones (0/1
  bfloat16 operands, float32 accumulation: exact, and on tensor cores), across tiles a
  cumulative sum of the tile totals ([N, T / 128])."""
  N, T = mask_nt.shape
  tile = min(_TILE, T)
  A = -(-T // tile)
  m = jnp.pad(mask_nt, ((0, 0), (0, A * tile - T))).reshape(N, A, tile)
  upper = jnp.triu(jnp.ones((tile, tile), jnp.bfloat16))  # upper[i, j] = i <= j
  within = jnp.einsum("nat,tu->nau", m.astype(jnp.bfloat16), upper,
                      preferred_element_type=F32).astype(jnp.int32)
  totals = within[:, :, -1]
  before = jnp.cumsum(totals, axis=1) - totals  # [N, A] picks in earlier tiles
  return (within + before[:, :, None]).reshape(N, A * tile)[:, :T]


def compact(picked_nt: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The set positions of each row in ascending order: [N, T] bool (at most k per row)
  -> positions [N, k] int32 (INVALID after the last), valid [N, k] bool."""
  N, T = picked_nt.shape
  if T == 0:
    return jnp.full((N, k), INVALID, jnp.int32), jnp.zeros((N, k), bool)
  rank = inclusive_count(picked_nt)  # the pick's 1-based slot
  rows = jnp.arange(N, dtype=jnp.int32)[:, None]
  dest = jnp.where(picked_nt & (rank <= k), rows * k + rank - 1, N * k)  # N * k: dropped
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
  # Unique indices: on a GPU with deterministic ops a scatter that may collide becomes a
  # loop over its updates.
  out = jnp.full((N * k,), INVALID, jnp.int32).at[dest.reshape(-1)].set(
      t.reshape(-1), mode="drop", unique_indices=True)
  count = jnp.minimum(rank[:, -1], k)
  valid = jnp.arange(k, dtype=jnp.int32)[None, :] < count[:, None]
  return out.reshape(N, k), valid


def topk_mask(scores_nt: jax.Array, cand_nt: jax.Array, k: int, *,
              radix_bits: int = RADIX_BITS, kth: jax.Array | None = None) -> jax.Array:
  """``select_topk``'s set of valid picks as a mask, by radix select (steps 1-3 of the
  module docstring; no compaction).

  scores_nt: [N, T] float32; cand_nt: [N, T] bool (positions that may be picked)
  kth: [N] uint32, each row's k-th largest key where it was found elsewhere
       (``pallas.prefix_kth_largest_pallas``); None: ``kth_largest_key`` here
  returns [N, T] bool with min(k, candidates) positions set per row
  """
  if k < 1:
    raise ValueError(f"k={k}: must be >= 1")
  T = scores_nt.shape[1]
  if T <= k:  # every position is among the top k: the candidates are the picks
    return cand_nt
  key = ordered_key(jnp.where(cand_nt, scores_nt, -jnp.inf))
  tau = (kth_largest_key(key, k, radix_bits=radix_bits) if kth is None else kth)[:, None]
  above, tied = key > tau, key == tau
  need = k - jnp.sum(above, axis=1, keepdims=True, dtype=jnp.int32)  # >= 1 ties to take
  # Only rows with more ties than they take, some of them candidates, need the ties'
  # ranks (real scores rarely tie at the threshold; non-candidates tie at -inf).
  cut = ((jnp.sum(tied, axis=1, keepdims=True, dtype=jnp.int32) > need)
         & jnp.any(tied & cand_nt, axis=1, keepdims=True))

  def lowest_ties():
    return cand_nt & (above | (tied & (inclusive_count(tied) <= need)))

  return jax.lax.cond(jnp.any(cut), lowest_ties, lambda: cand_nt & (key >= tau))


def select_topk_radix(scores_nt: jax.Array, cand_nt: jax.Array, k: int, *,
                      radix_bits: int = RADIX_BITS, kth: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """``select_topk`` by radix select (module docstring): the same valid positions.

  scores_nt: [N, T] float32; cand_nt: [N, T] bool (positions that may be picked)
  kth: as ``topk_mask``'s
  returns positions [N, k] int32 in ascending order, valid ones first (INVALID after),
          valid [N, k] bool
  """
  return compact(topk_mask(scores_nt, cand_nt, k, radix_bits=radix_bits, kth=kth), k)


__all__ = ["RADIX_BITS", "compact", "inclusive_count", "kth_largest_key", "ordered_key",
           "select_topk_radix", "topk_mask"]
