"""Hierarchical bitmaps, PB-LRU and exact LRU against hand-checked cases and the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.core.types import INVALID
from ula_jax.memory.ula.policies import COLD, FREE, Lru, PbLru, bitmap, make_policy
from ula_jax.memory.ula.oracle import RefLru, RefPbLru

# ----------------------------------------------------------------------------------
# bitmap
# ----------------------------------------------------------------------------------

_select_first = jax.jit(bitmap.select_first, static_argnums=1)
_from_mask = jax.jit(bitmap.from_mask)
_words_of = jax.jit(bitmap.words_of, static_argnums=0, static_argnames="distinct")


@pytest.mark.parametrize("num_bits,sizes", [
    (0, (1,)), (1, (1,)), (32, (1,)), (33, (2, 1)), (32 * 32, (32, 1)),
    (32 * 32 + 1, (33, 2, 1)), (40000, (1250, 40, 2, 1))])
def test_level_sizes(num_bits, sizes):
  assert bitmap.level_sizes(num_bits) == sizes


@pytest.mark.parametrize("num_bits", [0, 1, 31, 32, 33, 100, 1025])
def test_pack_unpack_roundtrip(num_bits, rng):
  mask = rng.random(num_bits) < 0.3
  words = bitmap.pack(jnp.asarray(mask))
  assert words.shape == (bitmap.num_words(num_bits),) and words.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(bitmap.unpack(words, num_bits)), mask)


def test_pack_and_summaries_hand_checked():
  mask = np.zeros(2000, bool)
  mask[[0, 40, 1999]] = True
  bm = bitmap.from_mask(jnp.asarray(mask))
  words = np.asarray(bm[0])
  assert words[0] == 1 and words[1] == 1 << 8 and words[62] == 1 << 15
  assert np.count_nonzero(words) == 3
  # Level 1: one bit per word below (words 0, 1 and 62); level 2: words 0 and 1 of level 1.
  np.testing.assert_array_equal(np.asarray(bm[1]), [0b11, 1 << 30])
  np.testing.assert_array_equal(np.asarray(bm[2]), [0b11])
  assert len(bm) == 3 and bitmap.is_consistent(bm)
  assert not bitmap.is_consistent((bm[0], bm[1], jnp.zeros_like(bm[2])))


@pytest.mark.parametrize("num_bits", [1, 33, 40000])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_select_first_matches_numpy(num_bits, density, rng):
  mask = rng.random(num_bits) < density
  bm = _from_mask(jnp.asarray(mask))
  for n in (1, 7, 64):
    pos, cnt = _select_first(bm, n)
    np.testing.assert_array_equal(np.asarray(pos), bitmap.np_select_first(mask, n))
    assert int(cnt) == min(n, int(mask.sum()))
  assert int(bitmap.count(bm)) == int(mask.sum())


def test_select_first_hand_checked():
  mask = np.zeros(70, bool)
  mask[[3, 35, 36, 69]] = True
  pos, cnt = _select_first(_from_mask(jnp.asarray(mask)), 6)
  np.testing.assert_array_equal(np.asarray(pos), [3, 35, 36, 69, INVALID, INVALID])
  assert int(cnt) == 4


@pytest.mark.parametrize("num_bits", [5, 64, 1000])
def test_words_of_matches_pack(num_bits, rng):
  pos = rng.choice(num_bits, size=min(num_bits, 20), replace=False).astype(np.int32)
  valid = rng.random(pos.shape[0]) < 0.7
  mask = np.zeros(num_bits, bool)
  mask[pos[valid]] = True
  want = np.asarray(bitmap.pack(jnp.asarray(mask)))
  got = _words_of(num_bits, jnp.asarray(pos), jnp.asarray(valid), distinct=True)
  np.testing.assert_array_equal(np.asarray(got), want)
  # Repeats and out-of-range positions are fine on the non-distinct path.
  rep = np.concatenate([pos, pos, [-1, num_bits + 3]]).astype(np.int32)
  rep_valid = np.concatenate([valid, valid, [True, True]])
  got = _words_of(num_bits, jnp.asarray(rep), jnp.asarray(rep_valid), distinct=False)
  np.testing.assert_array_equal(np.asarray(got), want)


# ----------------------------------------------------------------------------------
# policies: hand-checked
# ----------------------------------------------------------------------------------


def _slots(xs, n):
  return jnp.asarray(list(xs) + [INVALID] * (n - len(xs)), jnp.int32)


@functools.lru_cache(maxsize=None)
def _jitted(policy):
  return {
      "begin_round": jax.jit(policy.begin_round),
      "touch": jax.jit(policy.touch),
      "release": jax.jit(policy.release),
      "pick": jax.jit(policy.pick, static_argnums=2),
      "first_free": jax.jit(policy.first_free, static_argnums=1),
      "round_touch": jax.jit(getattr(policy, "round_touch_words", lambda st, m: st)),
  }


def _round(policy, st, xs, n=8):
  """A new round in which slots ``xs`` are touched."""
  f = _jitted(policy)
  s = _slots(xs, n)
  return f["touch"](f["begin_round"](st), s, s >= 0)


def _pick(policy, st, need, n):
  return _jitted(policy)["pick"](st, jnp.int32(need), n)


def test_pb_lru_hand_checked():
  p = PbLru(8, buckets=2)
  st = _round(p, p.init(), [0, 1, 2])  # cur = 1: {0, 1, 2}
  st = _round(p, st, [3])  # cur = 0: {3}; bucket 1 is the older recent one
  slots, ok, was_free = _pick(p, st, 8, 8)
  np.testing.assert_array_equal(np.asarray(slots), [4, 5, 6, 7, 0, 1, 2, INVALID])
  np.testing.assert_array_equal(np.asarray(ok), [1] * 7 + [0])
  np.testing.assert_array_equal(np.asarray(was_free), [1] * 4 + [0] * 4)
  # Next round: bucket 1 is reused, so {0, 1, 2} goes cold; 0 is touched again.
  st = _round(p, st, [0])
  view = p.describe(st)
  np.testing.assert_array_equal(view["bucket"], [1, COLD, COLD, 0, FREE, FREE, FREE, FREE])
  assert int(view["cur"]) == 1 and (view["in_buckets"] == 1).all()
  slots, _, _ = _pick(p, st, 3, 8)
  np.testing.assert_array_equal(np.asarray(slots), [4, 5, 6] + [INVALID] * 5)
  slots, _, _ = _pick(p, st, 8, 8)
  np.testing.assert_array_equal(np.asarray(slots), [4, 5, 6, 7, 1, 2, 3, INVALID])
  # Released slots are free again, and first in line.
  st = _jitted(p)["release"](st, _slots([2, 2], 2), jnp.asarray([True, True]))
  np.testing.assert_array_equal(np.asarray(_jitted(p)["first_free"](st, 3)[0]), [2, 4, 5])


def test_pb_lru_single_bucket_is_current_plus_cold():
  p = PbLru(4, buckets=1)
  st = _round(p, p.init(), [0, 1, 2, 3])
  st = _round(p, st, [2])
  np.testing.assert_array_equal(p.describe(st)["bucket"], [COLD, COLD, 0, COLD])
  slots, _, was_free = _pick(p, st, 4, 4)
  np.testing.assert_array_equal(np.asarray(slots), [0, 1, 3, INVALID])
  assert not np.asarray(was_free).any()


def test_lru_hand_checked():
  p = Lru(4)
  st = _round(p, p.init(), [2, 0])  # round 1
  st = _round(p, st, [1])  # round 2
  slots, ok, was_free = _pick(p, st, 4, 4)
  np.testing.assert_array_equal(np.asarray(slots), [3, 0, 2, INVALID])
  np.testing.assert_array_equal(np.asarray(ok), [1, 1, 1, 0])
  np.testing.assert_array_equal(np.asarray(was_free), [1, 0, 0, 0])
  st = _round(p, st, [0])  # round 3: now 2 is the oldest
  slots, _, _ = _pick(p, st, 2, 4)
  np.testing.assert_array_equal(np.asarray(slots), [3, 2, INVALID, INVALID])
  np.testing.assert_array_equal(p.describe(st)["stamp"], [3, 2, 1, FREE])


def test_policy_errors():
  with pytest.raises(ValueError,
                     match=r"memory\.policy='fifo': expected one of \['pb_lru', 'lru'\]"):
    make_policy("fifo", 8, buckets=2)
  with pytest.raises(ValueError, match=r"pb_lru buckets=0: must be >= 1"):
    PbLru(8, buckets=0)


# ----------------------------------------------------------------------------------
# policies: random sequences against the reference
# ----------------------------------------------------------------------------------


def _check_same_view(policy, st, ref):
  got, want = policy.describe(st), ref.describe()
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  if isinstance(policy, PbLru):
    assert (got["in_buckets"] == 1).all() and bool(got["summaries_ok"])


@pytest.mark.parametrize("name,buckets", [("pb_lru", 1), ("pb_lru", 3), ("lru", 1)])
def test_policy_matches_reference(name, buckets, rng):
  S, n = 70, 12  # three words, so searches cross word boundaries
  policy = make_policy(name, S, buckets=buckets)
  ref = RefPbLru(S, buckets) if name == "pb_lru" else RefLru(S)
  f = _jitted(policy)
  st = policy.init()
  for _ in range(60):
    ops, p = ["round", "touch", "release", "pick", "free", "round_touch"], [.2, .35, .15, .2, .1, 0]
    if isinstance(policy, PbLru):  # a round and a touch in one pass (the all-hit path)
      p = [.15, .3, .15, .2, .1, .1]
    op = rng.choice(ops, p=p)
    if op == "round_touch":
      xs = rng.choice(S, size=rng.integers(0, n + 1), replace=False)
      words = bitmap.words_of(S, _slots(xs, n), _slots(xs, n) >= 0, distinct=True)
      st = f["round_touch"](st, words)
      ref.begin_round()
      ref.touch([int(x) for x in xs])
    elif op == "round":
      st = f["begin_round"](st)
      ref.begin_round()
    elif op == "touch":
      xs = rng.choice(S, size=rng.integers(0, n + 1), replace=False)
      st = f["touch"](st, _slots(xs, n), _slots(xs, n) >= 0)
      ref.touch([int(x) for x in xs])
    elif op == "release":
      xs = rng.integers(0, S, size=rng.integers(0, n + 1))  # repeats allowed
      st = f["release"](st, _slots(xs, n), _slots(xs, n) >= 0)
      ref.release([int(x) for x in xs])
    elif op == "pick":
      need = int(rng.integers(0, n + 1))
      slots, ok, was_free = f["pick"](st, jnp.int32(need), n)
      order = ref.order()[:need]
      want = [s for s, _ in order] + [INVALID] * (n - len(order))
      np.testing.assert_array_equal(np.asarray(slots), want)
      np.testing.assert_array_equal(np.asarray(ok), np.arange(n) < len(order))
      np.testing.assert_array_equal(np.asarray(was_free)[:len(order)], [w for _, w in order])
    else:
      pos, ok = f["first_free"](st, n)
      want = ref.first_free(n)
      np.testing.assert_array_equal(np.asarray(pos)[np.asarray(ok)], want)
      assert int(np.asarray(ok).sum()) == len(want)
    _check_same_view(policy, st, ref)


@pytest.mark.parametrize("limit", [0, bitmap.COMPARE_ALL_MAX])
def test_search_right_matches_searchsorted_either_way(rng, monkeypatch, limit):
  # limit 0: every search takes the loop; the default: these take the fused comparison.
  monkeypatch.setattr(bitmap, "COMPARE_ALL_MAX", limit)
  for size, queries in ((1, 3), (7, 40), (300, 65)):
    values = np.sort(rng.integers(0, 50, size)).astype(np.int32)
    q = rng.integers(-2, 53, queries).astype(np.int32)
    got = np.asarray(bitmap.search_right(jnp.asarray(values), jnp.asarray(q)))
    np.testing.assert_array_equal(got, np.searchsorted(values, q, side="right"))
    assert got.dtype == np.int32
