"""PB-LRU: parallel bucketed LRU over one layer group's device slots.

Slots used in the same round (one ``resolve`` of the group = one decode step) share a
bucket instead of carrying their own timestamps. The group keeps a ring of ``R`` recent
buckets, a cold bucket and the free set, each a hierarchical bitmap (``bitmap.py``):
every slot is in exactly one of them.

* ``begin_round``: the current bucket moves one place round the ring. The bucket it
  lands on (the oldest) is merged into cold and emptied: it becomes the new current
  bucket. Only marks change, never data.
* ``touch``: the slots leave whatever bucket held them and join the current one.
* ``pick``: free slots first, then cold, then the recent buckets oldest to newest;
  never the current bucket. Within a bucket, lowest slot first.

With ``R = 1`` the ring is just the current bucket: everything not touched this round
is cold. Exact LRU order is kept only between rounds at most ``R - 1`` apart; older
slots are equally cold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ula_jax.core.types import INVALID
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.policies.base import FREE, Policy

COLD = -2  # ``describe``: a slot in the cold bucket


@struct.dataclass
class PbLruState:
  free: tuple  # bitmap levels, each [W_i] uint32
  cold: tuple  # bitmap levels, each [W_i] uint32
  ring: tuple  # bitmap levels, each [R, W_i] uint32
  cur: jax.Array  # [] int32 index of the current bucket in the ring


class PbLru(Policy):
  name = "pb_lru"

  def __init__(self, num_slots: int, buckets: int):
    super().__init__(num_slots)
    if buckets < 1:
      raise ValueError(f"pb_lru buckets={buckets}: must be >= 1")
    self.buckets = buckets

  def init(self) -> PbLruState:
    S, R = self.num_slots, self.buckets
    return PbLruState(free=bitmap.full(S), cold=bitmap.empty(S), ring=bitmap.empty(S, (R,)),
                      cur=jnp.int32(0))

  def begin_round(self, st: PbLruState) -> PbLruState:
    nxt = (st.cur + 1) % self.buckets
    # "Any set" of an or is the or of "any set": summaries merge level by level.
    cold = tuple(c | r[nxt] for c, r in zip(st.cold, st.ring))
    ring = tuple(r.at[nxt].set(0) for r in st.ring)
    return st.replace(cold=cold, ring=ring, cur=nxt.astype(jnp.int32))

  def touch(self, st: PbLruState, slots: jax.Array, valid: jax.Array) -> PbLruState:
    return self.touch_words(st, bitmap.words_of(self.num_slots, slots, valid, distinct=True))

  def touch_words(self, st: PbLruState, m: jax.Array) -> PbLruState:
    """``touch`` of the slots whose bits are set in ``m`` ([W0] uint32 level-0 words).

    Touches in turn equal one touch of the or of their words: each clears its bits in
    every bucket and sets them in the current one, so the current bucket ends as
    ``(cur | a) & ~b | b = cur | a | b`` and every other loses ``a | b``.
    """
    return self._touch_into(st, m, st.cur, st.cold[0], st.ring[0])

  def round_touch_words(self, st: PbLruState, m: jax.Array) -> PbLruState:
    """``begin_round`` and then ``touch_words(m)`` in one pass over every bitmap.

    The bucket the round lands on is merged into cold and emptied, then takes ``m``;
    cold, free and the other buckets lose ``m``'s bits (``R = 1`` included: the one
    bucket is also the one it lands on).
    """
    nxt = ((st.cur + 1) % self.buckets).astype(jnp.int32)
    ring0 = st.ring[0]
    emptied = jnp.where((jnp.arange(self.buckets) == nxt)[:, None], jnp.uint32(0), ring0)
    return self._touch_into(st, m, nxt, st.cold[0] | ring0[nxt], emptied)

  def _touch_into(self, st: PbLruState, m: jax.Array, cur: jax.Array, cold0: jax.Array,
                  ring0: jax.Array) -> PbLruState:
    """The state whose current bucket is ``cur`` and whose level-0 cold and ring words
    are ``cold0`` and ``ring0``, after ``m``'s slots moved into bucket ``cur`` (every
    level rebuilt from level 0)."""
    keep = ~m
    lands = (jnp.arange(self.buckets) == cur)[:, None]
    ring = jnp.where(lands, ring0 | m[None], ring0 & keep[None])
    return st.replace(free=bitmap.summarize(st.free[0] & keep),
                      cold=bitmap.summarize(cold0 & keep), ring=bitmap.summarize(ring),
                      cur=jnp.asarray(cur, jnp.int32))

  def release(self, st: PbLruState, slots: jax.Array, valid: jax.Array) -> PbLruState:
    m = bitmap.words_of(self.num_slots, slots, valid, distinct=False)
    keep = ~m
    return st.replace(free=bitmap.summarize(st.free[0] | m),
                      cold=bitmap.summarize(st.cold[0] & keep),
                      ring=bitmap.summarize(st.ring[0] & keep[None]))

  def pick(self, st: PbLruState, n_need: jax.Array, n: int):
    # Victim order: free, cold, then the recent buckets oldest to newest (the current
    # bucket, the newest of all, is left out). One batched search over the stacked lists.
    R = self.buckets
    recent = (st.cur + 1 + jnp.arange(R - 1)) % R
    lists = tuple(jnp.concatenate([f[None], c[None], r[recent]])
                  for f, c, r in zip(st.free, st.cold, st.ring))  # levels, each [R + 1, W_i]
    pos, cnt = jax.vmap(lambda bm: bitmap.select_first(bm, n))(lists)  # [L, n], [L]
    incl = jnp.cumsum(cnt)
    j = jnp.arange(n, dtype=jnp.int32)
    src = jnp.clip(bitmap.search_right(incl, j), 0, R)
    idx = jnp.clip(j - (incl[src] - cnt[src]), 0, n - 1)
    ok = (j < n_need) & (j < incl[-1])
    slots = jnp.where(ok, pos[src, idx], INVALID).astype(jnp.int32)
    return slots, ok, ok & (src == 0)

  def first_free(self, st: PbLruState, n: int):
    pos, c = bitmap.select_first(st.free, n)
    return pos, jnp.arange(n) < c

  def describe(self, st: PbLruState) -> dict[str, np.ndarray]:
    S = self.num_slots
    bucket = np.full((S,), FREE, np.int32)
    free = bitmap.np_unpack(st.free[0], S)
    cold = bitmap.np_unpack(st.cold[0], S)
    ring = bitmap.np_unpack(st.ring[0], S)  # [R, S]
    seen = free.astype(np.int32) + cold + ring.sum(axis=0)
    bucket[cold] = COLD
    for r in range(self.buckets):
      bucket[ring[r]] = r
    summaries_ok = all(bitmap.is_consistent(bm) for bm in (st.free, st.cold, st.ring))
    return {"bucket": bucket, "cur": np.asarray(st.cur, np.int32), "in_buckets": seen,
            "summaries_ok": np.asarray(summaries_ok)}
