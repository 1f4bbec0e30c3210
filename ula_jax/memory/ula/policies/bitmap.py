"""Hierarchical bitmaps over device slots: one bit per slot plus summary levels.

A bitmap of ``S`` bits is a tuple of levels. ``levels[0]`` holds the bits themselves in
``uint32`` words (bit ``s`` is bit ``s % 32`` of word ``s // 32``); ``levels[i + 1]``
has one bit per word of ``levels[i]``, set when that word is not zero ("anything set
below?"). The top level is a single word. Bits past ``S`` in the last word are always 0.

Everything is data-parallel jnp (popcount, cumsum, searches); nothing loops over
slots. ``select_first`` walks the levels from the top so that it only ever looks at the
words that hold the answer: finding ``n`` set bits costs ``O(n)`` words per level,
however many empty words lie between them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.core.types import INVALID

WORD_BITS = 32

Bitmap = tuple  # tuple[jax.Array, ...]: levels, each [..., W_i] uint32


def num_words(num_bits: int) -> int:
  """Words of level 0 for ``num_bits`` bits (at least one, so empty bitmaps have a shape)."""
  return max(1, -(-num_bits // WORD_BITS))


def level_sizes(num_bits: int) -> tuple[int, ...]:
  """Words per level, bottom first; the last level has one word."""
  sizes = [num_words(num_bits)]
  while sizes[-1] > 1:
    sizes.append(num_words(sizes[-1]))
  return tuple(sizes)


def pack(mask: jax.Array) -> jax.Array:
  """[..., n] bool -> [..., ceil(n / 32)] uint32 words (bit i of word w = mask[32 w + i])."""
  n = mask.shape[-1]
  W = num_words(n)
  pad = W * WORD_BITS - n
  m = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)])
  m = m.reshape(*mask.shape[:-1], W, WORD_BITS).astype(jnp.uint32)
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  # Distinct powers of two: the sum is the bitwise or.
  return jnp.sum(m << shifts, axis=-1, dtype=jnp.uint32)


def unpack(words: jax.Array, num_bits: int) -> jax.Array:
  """[..., W] uint32 -> [..., num_bits] bool (inverse of ``pack``)."""
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
  bits = (words[..., :, None] >> shifts) & jnp.uint32(1)
  return bits.reshape(*words.shape[:-1], -1)[..., :num_bits].astype(jnp.bool_)


def summarize(words: jax.Array) -> Bitmap:
  """Builds every summary level above ``words`` ([..., W0] uint32)."""
  levels = [words]
  while levels[-1].shape[-1] > 1:
    levels.append(pack(levels[-1] != 0))
  return tuple(levels)


def np_unpack(words: np.ndarray, num_bits: int) -> np.ndarray:
  """Host-side ``unpack``: [..., W] uint32 words -> [..., num_bits] bool (numpy)."""
  words = np.asarray(words, np.uint32)
  bits = (words[..., :, None] >> np.arange(WORD_BITS, dtype=np.uint32)) & np.uint32(1)
  return bits.reshape(*words.shape[:-1], -1)[..., :num_bits].astype(bool)


def is_consistent(bm: Bitmap) -> bool:
  """Host-side check: every summary level matches the level below (tests, debugging)."""
  levels = [np.asarray(x) for x in bm]
  for below, above in zip(levels, levels[1:]):
    nonempty = below != 0
    want = np_unpack(above, nonempty.shape[-1])
    pad = np_unpack(above, above.shape[-1] * WORD_BITS)[..., nonempty.shape[-1]:]
    if not np.array_equal(want, nonempty) or pad.any():
      return False
  return levels[-1].shape[-1] == 1


def from_mask(mask: jax.Array) -> Bitmap:
  """[..., S] bool -> a bitmap with its summaries."""
  return summarize(pack(mask))


def to_mask(bm: Bitmap, num_bits: int) -> jax.Array:
  """A bitmap's bits as [..., num_bits] bool."""
  return unpack(bm[0], num_bits)


def empty(num_bits: int, batch: tuple[int, ...] = ()) -> Bitmap:
  """An all-clear bitmap (optionally with leading batch axes)."""
  return tuple(jnp.zeros((*batch, w), jnp.uint32) for w in level_sizes(num_bits))


def full(num_bits: int) -> Bitmap:
  """Every one of ``num_bits`` bits set."""
  return from_mask(jnp.ones((num_bits,), jnp.bool_))


def words_of(num_bits: int, pos: jax.Array, valid: jax.Array, *, distinct: bool) -> jax.Array:
  """Level-0 words with the bits at ``pos`` set.

  pos:   [n] int32 bit positions (ignored where not ``valid`` or out of range)
  valid: [n] bool
  distinct: the caller guarantees the valid positions are distinct, so a scatter-add of
    the bits is their or (``O(n)``); otherwise a mask of ``num_bits`` is packed (``O(S)``).
  returns [W0] uint32
  """
  ok = valid & (pos >= 0) & (pos < num_bits)
  W = num_words(num_bits)
  if not distinct:
    mask = jnp.zeros((num_bits,), jnp.bool_).at[jnp.where(ok, pos, num_bits)].set(
        True, mode="drop")
    return pack(mask)
  word = jnp.where(ok, pos // WORD_BITS, W)
  bit = jnp.left_shift(jnp.uint32(1), (jnp.where(ok, pos, 0) % WORD_BITS).astype(jnp.uint32))
  return jnp.zeros((W,), jnp.uint32).at[word].add(bit, mode="drop")


def count(bm: Bitmap) -> jax.Array:
  """Set bits ([] int32; batch axes reduced only over the words)."""
  return jnp.sum(jax.lax.population_count(bm[0]).astype(jnp.int32), axis=-1)


def _select_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
  """Position (0..31) of the ``rank``-th set bit of each ``word`` (binary search on
  popcounts of the low half: five steps, no loop over bits)."""
  pos = jnp.zeros(word.shape, jnp.int32)
  rank = rank.astype(jnp.int32)
  for width in (16, 8, 4, 2, 1):
    low = (word >> pos.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1)
    c = jax.lax.population_count(low).astype(jnp.int32)
    go = rank >= c
    rank = jnp.where(go, rank - c, rank)
    pos = jnp.where(go, pos + width, pos)
  return pos


# Searches of at most this many (query, element) pairs compare all pairs in one fused
# operation; larger ones run jnp.searchsorted's binary-search loop.
COMPARE_ALL_MAX = 1 << 20


def search_right(sorted_values: jax.Array, queries: jax.Array) -> jax.Array:
  """``jnp.searchsorted(sorted_values, queries, side='right')`` ([Q] int32), loop-free
  for small searches (``COMPARE_ALL_MAX``): on a GPU a search loop is a kernel launch
  per step."""
  method = ("compare_all" if sorted_values.shape[0] * queries.shape[0] <= COMPARE_ALL_MAX
            else "scan")
  return jnp.searchsorted(sorted_values, queries, side="right", method=method).astype(
      jnp.int32)


def _select_in_words(words: jax.Array, word_idx: jax.Array, n: int
                     ) -> tuple[jax.Array, jax.Array]:
  """The first ``n`` set bits of a list of candidate words, as positions.

  words:    [C] uint32 (0 where ``word_idx`` is INVALID)
  word_idx: [C] int32 the words' indices, ascending
  returns (pos [n] int32 ascending, INVALID past the last set bit; count [] int32)
  """
  pc = jax.lax.population_count(words).astype(jnp.int32)
  cs = jnp.cumsum(pc)
  j = jnp.arange(n, dtype=jnp.int32)
  c = jnp.clip(search_right(cs, j), 0, words.shape[0] - 1)
  rank = j - (cs[c] - pc[c])
  pos = word_idx[c] * WORD_BITS + _select_bit(words[c], rank)
  total = cs[-1]
  return jnp.where(j < total, pos, INVALID).astype(jnp.int32), jnp.minimum(total, n)


def select_first(bm: Bitmap, n: int) -> tuple[jax.Array, jax.Array]:
  """The ``n`` lowest set bits of a bitmap.

  Top-down: the top word names the non-empty words of the level below; only the first
  ``min(n, W)`` of those can hold the answer, so each level looks at ``O(n)`` words.

  returns (pos [n] int32 ascending, INVALID where fewer than n bits are set;
           count [] int32 = min(n, set bits))
  """
  if n == 0:
    return jnp.zeros((0,), jnp.int32), jnp.int32(0)
  top = len(bm) - 1
  cand = jnp.arange(bm[top].shape[-1], dtype=jnp.int32)
  for lvl in range(top, -1, -1):
    ok = cand >= 0
    words = jnp.where(ok, bm[lvl][jnp.where(ok, cand, 0)], jnp.uint32(0))
    if lvl == 0:
      return _select_in_words(words, cand, n)
    cand, _ = _select_in_words(words, cand, min(n, bm[lvl - 1].shape[-1]))
  raise AssertionError("unreachable")


def np_select_first(mask: np.ndarray, n: int) -> np.ndarray:
  """Reference for ``select_first`` on a plain bool mask: [n] int32, INVALID-padded."""
  pos = np.flatnonzero(np.asarray(mask))[:n]
  out = np.full((n,), INVALID, np.int32)
  out[:len(pos)] = pos
  return out
