"""Exact LRU over one layer group's device slots: a timestamp per slot.

``stamp[s]`` is the round in which slot ``s`` was last touched (``FREE`` when free);
``clock`` counts rounds. Victims: free slots first (lowest index first), then occupied
slots by oldest stamp (lowest index first among equals), never a slot touched in the
current round. Picking ranks all ``S`` slots (``lax.top_k``): exact, but it scans the
whole pool every round, which is what PB-LRU avoids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ula_jax.core.types import INVALID
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.policies.base import FREE, Policy

_PROTECTED = np.iinfo(np.int32).max  # sort key of slots touched this round


@struct.dataclass
class LruState:
  stamp: jax.Array  # [S] int32 round of the last touch, FREE when free
  clock: jax.Array  # [] int32 the current round


class Lru(Policy):
  name = "lru"

  def init(self) -> LruState:
    return LruState(stamp=jnp.full((self.num_slots,), FREE, jnp.int32), clock=jnp.int32(0))

  def begin_round(self, st: LruState) -> LruState:
    return st.replace(clock=st.clock + 1)

  def _set(self, stamp: jax.Array, slots: jax.Array, valid: jax.Array, value) -> jax.Array:
    ok = valid & (slots >= 0) & (slots < self.num_slots)
    return stamp.at[jnp.where(ok, slots, self.num_slots)].set(value, mode="drop")

  def touch(self, st: LruState, slots: jax.Array, valid: jax.Array) -> LruState:
    return st.replace(stamp=self._set(st.stamp, slots, valid, st.clock))

  def release(self, st: LruState, slots: jax.Array, valid: jax.Array) -> LruState:
    return st.replace(stamp=self._set(st.stamp, slots, valid, FREE))

  def pick(self, st: LruState, n_need: jax.Array, n: int):
    # Stamps are >= 0, so FREE (-1) sorts first; top_k keeps the lower index first
    # among equal keys, which gives "lowest slot first" within a round.
    key = jnp.where(st.stamp == st.clock, _PROTECTED, st.stamp)
    m = min(n, self.num_slots)
    neg, slots = jax.lax.top_k(-key, m)
    neg = jnp.pad(neg, (0, n - m), constant_values=-_PROTECTED)
    slots = jnp.pad(slots, (0, n - m))
    j = jnp.arange(n)
    ok = (j < n_need) & (neg != -_PROTECTED)
    return jnp.where(ok, slots, INVALID).astype(jnp.int32), ok, ok & (neg == -FREE)

  def first_free(self, st: LruState, n: int):
    free = st.stamp == FREE
    cs = jnp.cumsum(free.astype(jnp.int32))
    j = jnp.arange(n, dtype=jnp.int32)
    pos = bitmap.search_right(cs, j)
    ok = j < cs[-1]
    return jnp.where(ok, pos, INVALID), ok

  def describe(self, st: LruState) -> dict[str, np.ndarray]:
    return {"stamp": np.asarray(st.stamp), "clock": np.asarray(st.clock)}
