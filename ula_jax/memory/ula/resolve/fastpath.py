"""The all-hit fast path of the resolve: a step where nothing has to move.

Most decode steps of a warm pool need no data movement: every selected entry is on the
device, and the batch's new tokens go to free device slots. The full resolve still
deduplicates ``M = B * k + B`` entries by sorting (or by bitmaps, in Pallas), searches the
policy's victim lists and the host's free slots, and compacts empty plans. Here such a
step costs ``O(B * k)`` gathers and scatters plus ``O(Sd / 32)``-word reductions (exact
LRU, which keeps no free bitmap, scans its ``Sd`` stamps as its own pick does), and
returns the same arrays, bit for bit, as ``Ula.resolve_meta``: table, owners, host free
bitmap, policy state, slots, plan and stats.

``all_hit`` decides, on device, whether a step is such a step; ``resolve_fast_or`` picks
the fast branch or the full resolve with ``jax.lax.cond`` (on a GPU, XLA reads the
predicate back to the host and ends a CUDA graph there; ``resolve_speculative`` takes the
fast branch with no conditional, for ``kernels.fast_path_mode='speculate'``). The condition,
over the wanted selections (``sel_valid`` and ``0 <= addr < N``) and the wanted new tokens
(``active`` and ``0 <= new_addr < N``):

1. every wanted selection is on the device (``0 <= table[a] < Sd``) or is the address of
   a wanted new token (the indexer may select the token being decoded);
2. the wanted selections on the device are distinct (checked per bitmap word: the sum of
   the words' bits has as many set bits as bits were added exactly when no bit repeats);
3. no wanted new token is stored (``table[a] < 0``) and no two share an address;
4. after the hits' touch, the policy has at least as many free device slots as there are
   wanted new tokens.

Why the full resolve then gives the same result: its unique entries are the hits (each on
the device, so none is placed) and the new tokens (not stored, so each is placed; a
selection of a new token merges into it). Nothing is on the host, so there are no misses
and no host slot changes hands (its host free bitmap is ``summarize`` of the unchanged
level 0, which is the bitmap itself: summary levels always match level 0). It places the
j-th new token by ascending address on the policy's j-th candidate, and both policies list
free slots first, lowest first (PB-LRU: the free bitmap heads its victim lists; exact LRU:
free slots have the lowest key and ``top_k`` keeps the lower index among equals), so with
enough free slots no victim is picked: the j-th new token takes the j-th free slot, which
is ``policy.first_free``. The policy sees the same calls (``begin_round``, the hits'
touch, the new slots' touch) with the same sets of slots.

The fast path relies on the invariant every transition keeps: distinct stored addresses
hold distinct slots. Other policies than PB-LRU and exact LRU always take the full resolve.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ula_jax.core.scatter import set_where
from ula_jax.core.types import INVALID
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.policies.base import FREE
from ula_jax.memory.ula.policies.lru import Lru
from ula_jax.memory.ula.policies.pb_lru import PbLru
from ula_jax.memory.ula.state import GroupMeta, UlaPlan

_I32 = jnp.int32


def supports(system: Any) -> bool:
  """Whether ``system``'s policy has a fast path (PB-LRU and exact LRU do)."""
  return isinstance(system.policy, (PbLru, Lru))


def _require(system: Any) -> None:
  if not supports(system):
    raise ValueError(f"memory.policy={system.policy_name!r}: the all-hit fast path "
                     "supports 'pb_lru' and 'lru'")


class _Staged(NamedTuple):
  """Per-element lookups shared by the condition and the fast branch."""

  addr_s: jax.Array  # [B*k] int32 selected addresses
  want_s: jax.Array  # [B*k] bool selection is a valid address
  loc_s: jax.Array  # [B*k] int32 its location (INVALID where not wanted)
  hit_s: jax.Array  # [B*k] bool wanted and on the device
  addr_n: jax.Array  # [B] int32 new tokens' addresses
  want_n: jax.Array  # [B] bool new token is active with a valid address
  loc_n: jax.Array  # [B] int32 its location (INVALID where not wanted)
  rank_n: jax.Array  # [B] int32 wanted new tokens with a smaller address
  words_h: jax.Array  # [W0] uint32 the hits' bits, summed (their or when distinct)


def _stage(system: Any, meta: Any, sel_addr: jax.Array, sel_valid: jax.Array,
           new_addr: jax.Array, active: jax.Array) -> _Staged:
  N, Sd = system.num_logical, system.device_slots
  addr_s = sel_addr.reshape(-1).astype(_I32)
  want_s = sel_valid.reshape(-1).astype(jnp.bool_) & (addr_s >= 0) & (addr_s < N)
  loc_s = jnp.where(want_s, meta.table[jnp.clip(addr_s, 0, N - 1)], INVALID)
  hit_s = want_s & (loc_s >= 0) & (loc_s < Sd)
  addr_n = new_addr.astype(_I32)
  want_n = active.astype(jnp.bool_) & (addr_n >= 0) & (addr_n < N)
  loc_n = jnp.where(want_n, meta.table[jnp.clip(addr_n, 0, N - 1)], INVALID)
  key_n = jnp.where(want_n, addr_n, N)  # N sorts after every wanted address
  rank_n = jnp.sum(key_n[None, :] < key_n[:, None], axis=1, dtype=_I32)
  words_h = bitmap.words_of(Sd, loc_s, hit_s, distinct=True)
  return _Staged(addr_s, want_s, loc_s, hit_s, addr_n, want_n, loc_n, rank_n, words_h)


def _free_after_hits(system: Any, meta: Any, st: _Staged, words: jax.Array) -> jax.Array:
  """Free device slots once ``begin_round`` and the hits' touch ran ([] int32).

  words: [W0] uint32 the hits' bits (valid when the hits are distinct)
  """
  pst = meta.policy
  if isinstance(system.policy, PbLru):  # begin_round leaves the free bitmap alone
    return jnp.sum(jax.lax.population_count(pst.free[0] & ~words).astype(_I32))
  # Exact LRU: the touch stamps the hits with the new clock (>= 0), so hits that were
  # marked free stop being free.
  Sd = system.device_slots
  was_free = pst.stamp[jnp.clip(st.loc_s, 0, Sd - 1)] == FREE
  return (jnp.sum(pst.stamp == FREE, dtype=_I32)
          - jnp.sum(st.hit_s & was_free, dtype=_I32))


def _all_hit(system: Any, meta: Any, st: _Staged) -> jax.Array:
  B = st.addr_n.shape[0]
  N, Sd = system.num_logical, system.device_slots
  # 1. wanted selections: on the device, or a wanted new token (compared with all B).
  key_n = jnp.where(st.want_n, st.addr_n, N)  # N matches no wanted selection
  sel_new = st.want_s & jnp.any(st.addr_s[:, None] == key_n[None, :], axis=1)
  placed_ok = jnp.all(~st.want_s | st.hit_s | sel_new)
  # 2. distinct hits: the summed bits have as many set bits as there are hits. A sum of
  # n powers of two has n set bits exactly when they are distinct (a repeated one
  # carries, and carries, including those past a word's top bit, only clear bits).
  words = st.words_h
  distinct_hits = (jnp.sum(jax.lax.population_count(words).astype(_I32))
                   == jnp.sum(st.hit_s, dtype=_I32))
  # 3. new tokens: not stored, distinct.
  unstored = jnp.all(~st.want_n | (st.loc_n < 0))
  same = (st.addr_n[:, None] == st.addr_n[None, :]) & st.want_n[:, None] & st.want_n[None, :]
  distinct_new = ~jnp.any(same & ~jnp.eye(B, dtype=jnp.bool_))
  # 4. room: enough free slots for every new token.
  room = _free_after_hits(system, meta, st, words) >= jnp.sum(st.want_n, dtype=_I32)
  return placed_ok & distinct_hits & unstored & distinct_new & room


def _resolve_all_hit(system: Any, meta: Any, st: _Staged, shape: tuple[int, int]):
  B, k = shape
  M = B * k + B
  N, Sd = system.num_logical, system.device_slots
  policy = system.policy
  pst = meta.policy
  if isinstance(policy, PbLru):
    # The round and both touches at once: the new tokens' free slots are found in the
    # free bitmap less the hits (a new round leaves the free bitmap alone), then hits
    # and new slots join the new current bucket together, which leaves every bucket as
    # the round and the two touches in turn do (``PbLru.touch_words``,
    # ``PbLru.round_touch_words``).
    free, _ = bitmap.select_first(bitmap.summarize(pst.free[0] & ~st.words_h), B)
  else:
    pst = policy.touch(policy.begin_round(pst), st.loc_s, st.hit_s)
    free, _ = policy.first_free(pst, B)
  new_slot = jnp.where(st.want_n, free[jnp.clip(st.rank_n, 0, max(B - 1, 0))], INVALID)
  new_slot = new_slot.astype(_I32)
  table = set_where(meta.table, (st.addr_n,), new_slot, st.want_n, unique=True)
  dev_owner = set_where(meta.dev_owner, (new_slot,), st.addr_n, st.want_n, unique=True)
  if isinstance(policy, PbLru):
    pst = policy.round_touch_words(
        pst, st.words_h | bitmap.words_of(Sd, new_slot, st.want_n, distinct=True))
  else:
    pst = policy.touch(pst, new_slot, st.want_n)
  # The host side is untouched; its summary levels are consistent with level 0 (every
  # transition keeps them so), which is what the full resolve's ``summarize`` rebuilds.
  new_meta = GroupMeta(table=table, dev_owner=dev_owner, host_owner=meta.host_owner,
                       host_free=meta.host_free, policy=pst)
  # Hits keep their location; selections of a new token read its new slot.
  slots = jnp.where(st.want_s, table[jnp.clip(st.addr_s, 0, N - 1)], INVALID)
  none = jnp.full((M,), INVALID, _I32)
  zero = jnp.zeros((), _I32)
  plan = UlaPlan(fetch_src=none, fetch_dst=none, evict_src=none, evict_dst=none,
                 n_fetch=zero, n_evict=zero)
  stats = {"hits": jnp.sum(st.hit_s, dtype=_I32), "misses": zero, "evictions": zero}
  return new_meta, slots.astype(_I32).reshape(B, k), new_slot, plan, stats


def all_hit(system: Any, meta: Any, sel_addr: jax.Array, sel_valid: jax.Array,
            new_addr: jax.Array, active: jax.Array) -> jax.Array:
  """Whether the step needs no data movement (the module doc's four conditions).

  system: a ``ula.Ula`` with a PB-LRU or exact LRU policy; meta: its ``GroupMeta``
  sel_addr: [B, k] int32; sel_valid: [B, k] bool; new_addr: [B] int32; active: [B] bool
  returns [] bool; where True, ``resolve_all_hit`` equals ``system.resolve_meta``
  """
  _require(system)
  return _all_hit(system, meta, _stage(system, meta, sel_addr, sel_valid, new_addr, active))


def resolve_all_hit(system: Any, meta: Any, sel_addr: jax.Array, sel_valid: jax.Array,
                    new_addr: jax.Array, active: jax.Array):
  """The resolve of a step for which ``all_hit`` holds (meaningless otherwise).

  Same arguments as ``all_hit``.
  returns (meta, slots [B, k] int32, new_slot [B] int32, plan, stats), identical to
  ``system.resolve_meta`` on the same inputs: an empty plan, no misses or evictions
  """
  _require(system)
  st = _stage(system, meta, sel_addr, sel_valid, new_addr, active)
  return _resolve_all_hit(system, meta, st, tuple(sel_addr.shape))


def resolve_fast_or(full: Callable[..., Any], system: Any, meta: Any, sel_addr: jax.Array,
                    sel_valid: jax.Array, new_addr: jax.Array, active: jax.Array):
  """``resolve_all_hit`` where ``all_hit`` holds, else ``full``, chosen on device.

  full: ``(meta, sel_addr, sel_valid, new_addr, active) -> result``, a full resolve with
  ``resolve_meta``'s signature and result (e.g. a ``kernels.resolve`` implementation)
  Other arguments and the result as in ``resolve_all_hit``. A policy without a fast path
  calls ``full`` directly.
  """
  if not supports(system):
    return full(meta, sel_addr, sel_valid, new_addr, active)
  st = _stage(system, meta, sel_addr, sel_valid, new_addr, active)
  return jax.lax.cond(
      _all_hit(system, meta, st),
      lambda: _resolve_all_hit(system, meta, st, tuple(sel_addr.shape)),
      lambda: full(meta, sel_addr, sel_valid, new_addr, active))


def resolve_speculative(system: Any, meta: Any, sel_addr: jax.Array, sel_valid: jax.Array,
                        new_addr: jax.Array, active: jax.Array):
  """The all-hit path taken without a conditional (``kernels.fast_path_mode='speculate'``).

  Same arguments and results as ``resolve_all_hit``, and ``stats['spec_fail']``: 1
  where ``all_hit`` does not hold. The caller then discards the step: it restores the
  group's metadata (``Ula.rollback``) and runs it again with the full resolve. Until
  then the results must be harmless: a wanted selection that is not on the device reads
  slot 0 (garbage that is never used) instead of an address past the device pool, and
  the new tokens' rows go to slots that are free before the step.
  """
  _require(system)
  st = _stage(system, meta, sel_addr, sel_valid, new_addr, active)
  ok = _all_hit(system, meta, st)
  meta, slots, new_slot, plan, stats = _resolve_all_hit(system, meta, st,
                                                         tuple(sel_addr.shape))
  want = st.want_s.reshape(slots.shape)
  slots = jnp.where(want & ((slots < 0) | (slots >= system.device_slots)), 0, slots)
  return meta, slots, new_slot, plan, dict(stats, spec_fail=(~ok).astype(_I32))


__all__ = ["all_hit", "resolve_all_hit", "resolve_fast_or", "resolve_speculative",
           "supports"]
