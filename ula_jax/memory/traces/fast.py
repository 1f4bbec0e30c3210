"""NumPy models of the memory systems' metadata, for replaying large traces on a CPU.

Each model makes exactly the choices of its memory system's jax transitions (the same
slots, victims, counts), on the host and without pools:

* ``FastUla``: ``ula`` DP mode (``Ula.prefill_meta`` / ``resolve_meta`` /
  ``release_meta``) under ``pb_lru`` or ``lru``;
* ``FastHiSparse``: ``hisparse`` (``HiSparse.write_prefill`` / ``resolve`` /
  ``release``: a buffer of ``device_buffer_size + 1`` slots per row and group, LRU);
* ``FastResident``: ``resident`` (nothing to count; its capacity).

Why: the jax transitions are written for a GPU. On a CPU a GLM-5-sized step (64 rows x
20 groups x 2048 selections, pools of millions of slots) takes 1.3-12 s there (sorts and
bitmap searches sized for the worst case, a full ``top_k`` over the pool for exact LRU),
and 0.2-0.5 s here, where free slots are found from a lowest-free hint, victims by
counting stamps, and only the entries that move are sorted. ``tests/test_trace_workload.py``
replays random traces with tight pools through both and requires identical counts per
step and group, and identical capacity.

Every model has ``prefill(addrs, row)``, ``decode(sel_addr, sel_valid, new_addr,
active) -> counts [G, len(stat_keys)]``, ``release(addrs, row)`` and ``report() ->
CapacityReport`` (through the system's own ``report``).
"""

from __future__ import annotations

import numpy as np

from ula_jax.core.types import INVALID
from ula_jax.memory.base import CapacityReport

_BIG = np.iinfo(np.int32).max


class FreeSlots:
  """The first ``n`` free slots, ascending, of ``size`` slots whose free ones
  ``is_free(a, b)`` gives ([b - a] bool for slots ``[a, b)``), reading only the stretch
  that holds them: a hint ``lo`` says no slot below it is free (prefill takes slots in
  order, so most of a full pool lies below it)."""

  def __init__(self, size: int, is_free):
    self.size, self.is_free, self.lo = size, is_free, 0

  def first(self, n: int) -> np.ndarray:
    """[<= n] int64 the lowest free slots, ascending (fewer when fewer are free)."""
    found, got, a = [], 0, self.lo
    width = max(4 * n, 1 << 16)
    while got < n and a < self.size:
      b = min(self.size, a + width)
      idx = np.flatnonzero(self.is_free(a, b))[:n - got] + a
      found.append(idx)
      got += idx.shape[0]
      if got == 0:
        self.lo = b  # nothing free below b
      a, width = b, width * 2
    return np.concatenate(found) if found else np.zeros((0,), np.int64)

  def freed(self, slots: np.ndarray) -> None:
    """Slots that became free (the hint moves down to the lowest)."""
    if slots.size:
      self.lo = min(self.lo, int(slots.min()))


class HostSlots:
  """A group's host slots: a free mask (``Sh`` usable of ``Hr`` rows) with ``FreeSlots``."""

  def __init__(self, rows: int, usable: int):
    self.mask = np.arange(rows) < usable
    self.search = FreeSlots(rows, lambda a, b: self.mask[a:b])

  def first(self, n: int) -> np.ndarray:
    return self.search.first(n)

  def take(self, slots: np.ndarray) -> None:
    self.mask[slots] = False

  def give(self, slots: np.ndarray) -> None:
    self.mask[slots] = True
    self.search.freed(slots)


# ----------------------------------------------------------------------------------
# Policies of one group's device slots (ula)
# ----------------------------------------------------------------------------------


class PbLruSlots:
  """PB-LRU (``policies/pb_lru.py``) as one code per slot: ring bucket ``0..R-1``, cold,
  or free. Victims: free ascending, cold ascending, then the recent buckets oldest first
  (each ascending), never the current one."""

  def __init__(self, num_slots: int, buckets: int):
    self.R = buckets
    self.COLD, self.FREE = buckets, buckets + 1
    self.code = np.full((num_slots,), self.FREE, np.int8)
    self.cur = 0
    self.free = FreeSlots(num_slots, lambda a, b: self.code[a:b] == self.FREE)

  def begin_round(self) -> None:
    nxt = (self.cur + 1) % self.R
    self.code[self.code == nxt] = self.COLD
    self.cur = nxt

  def touch(self, slots: np.ndarray) -> None:
    self.code[slots] = self.cur

  def release(self, slots: np.ndarray) -> None:
    self.code[slots] = self.FREE
    self.free.freed(slots)

  def first_free(self, n: int) -> np.ndarray:
    return self.free.first(n)

  def pick(self, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots [<= n] int64 in victim order, was_free [<= n] bool)."""
    first = self.first_free(n)
    out, free = [first], [np.ones(first.shape, bool)]
    got = first.shape[0]
    for code in [self.COLD] + [(self.cur + i) % self.R for i in range(1, self.R)]:
      if got >= n:
        break
      idx = np.flatnonzero(self.code == code)[:n - got]
      out.append(idx)
      free.append(np.zeros(idx.shape, bool))
      got += idx.shape[0]
    return np.concatenate(out), np.concatenate(free)


class LruSlots:
  """Exact LRU (``policies/lru.py``): a round stamp per slot. Victims: free ascending,
  then by (stamp, slot), never a slot touched this round."""

  def __init__(self, num_slots: int):
    self.stamp = np.full((num_slots,), -1, np.int32)
    self.clock = 0
    self.free = FreeSlots(num_slots, lambda a, b: self.stamp[a:b] == -1)

  def begin_round(self) -> None:
    self.clock += 1

  def touch(self, slots: np.ndarray) -> None:
    self.stamp[slots] = self.clock

  def release(self, slots: np.ndarray) -> None:
    self.stamp[slots] = -1
    self.free.freed(slots)

  def first_free(self, n: int) -> np.ndarray:
    return self.free.first(n)

  def pick(self, n: int) -> tuple[np.ndarray, np.ndarray]:
    free = self.first_free(n)
    m = n - free.shape[0]
    if m <= 0:
      return free, np.ones(free.shape, bool)
    st = self.stamp
    used = (st >= 0) & (st != self.clock)
    hist = np.bincount(st[used], minlength=self.clock + 1)
    cum = np.cumsum(hist)
    v = int(np.searchsorted(cum, m))  # the oldest stamp needed, partly or wholly
    if v > self.clock:  # fewer occupied slots than asked for: all of them
      v = self.clock
    below = np.flatnonzero(used & (st < v))
    below = below[np.argsort(st[below], kind="stable")]  # (stamp, slot)
    at = np.flatnonzero(used & (st == v))[:m - below.shape[0]]
    occ = np.concatenate([below, at])
    return (np.concatenate([free, occ]),
            np.concatenate([np.ones(free.shape, bool), np.zeros(occ.shape, bool)]))


def make_slots(policy: str, num_slots: int, buckets: int):
  if policy == "pb_lru":
    return PbLruSlots(num_slots, buckets)
  if policy == "lru":
    return LruSlots(num_slots)
  raise ValueError(f"memory.policy={policy!r}: expected 'pb_lru' or 'lru'")


# ----------------------------------------------------------------------------------
# ula (DP mode)
# ----------------------------------------------------------------------------------


class FastUla:
  """``ula`` DP mode on one rank: per group a mapping table, owners, free host slots and
  the policy (``dp.py``: device slot ``s`` as ``s``, host slot ``h`` as ``Sd + h``)."""

  stat_keys = ("evictions", "hits", "misses")

  def __init__(self, system):
    self.system = system
    G = system.geo.num_groups
    self.G, self.N = G, system.num_logical
    self.Sd, self.Sh, self.Hr = system.device_slots, system.host_slots, system.host_rows
    self.table = np.full((G, self.N), INVALID, np.int32)
    self.dev_owner = np.full((G, self.Sd), INVALID, np.int32)
    self.host_owner = np.full((G, self.Hr), INVALID, np.int32)
    self.host_free = [HostSlots(self.Hr, self.Sh) for _ in range(G)]
    self.policy = [make_slots(system.policy_name, self.Sd, system.buckets) for _ in range(G)]
    self._mark = np.full((self.N,), -1, np.int32)  # scratch of the deduplication

  def prefill(self, addrs: np.ndarray, row: int) -> None:
    del row  # one pool shared by every request of the rank
    a = np.asarray(addrs, np.int64)
    ok = (a >= 0) & (a < self.N)
    for g in range(self.G):
      table, pol = self.table[g], self.policy[g]
      loc = np.where(ok, table[np.clip(a, 0, self.N - 1)], INVALID)
      fresh = ok & (loc < 0)
      rank = np.cumsum(fresh) - 1
      n_fresh = int(fresh.sum())
      dfree = pol.first_free(n_fresh)
      n_dev = dfree.shape[0]
      to_dev = fresh & (rank < n_dev)
      dslot = dfree[rank[to_dev]]
      hfree = self.host_free[g].first(n_fresh - n_dev)
      hrank = rank - n_dev
      to_hst = fresh & ~to_dev & (hrank >= 0) & (hrank < hfree.shape[0])
      hslot = hfree[hrank[to_hst]]
      table[a[to_dev]] = dslot
      table[a[to_hst]] = self.Sd + hslot
      self.dev_owner[g, dslot] = a[to_dev]
      self.host_owner[g, hslot] = a[to_hst]
      self.host_free[g].take(hslot)
      on_dev = ok & ~fresh & (loc >= 0) & (loc < self.Sd)
      pol.touch(np.concatenate([dslot, loc[on_dev]]))

  def decode(self, sel_addr, sel_valid, new_addr, active) -> np.ndarray:
    G, N, Sd = self.G, self.N, self.Sd
    new = np.asarray(new_addr, np.int64)
    new_ok = np.asarray(active, bool) & (new >= 0) & (new < N)
    new_set = new[new_ok]
    out = np.zeros((G, 3), np.int64)
    for g in range(G):
      a = np.asarray(sel_addr[g], np.int64).reshape(-1)
      a = np.concatenate([a[np.asarray(sel_valid[g]).reshape(-1) & (a >= 0) & (a < N)],
                          new_set])
      # The step's distinct addresses (any one occurrence stands for its duplicates).
      j = np.arange(a.shape[0], dtype=np.int32)
      self._mark[a] = j
      u = a[self._mark[a] == j]
      table, pol = self.table[g], self.policy[g]
      loc = table[u]
      on_dev = (loc >= 0) & (loc < Sd)
      on_host = loc >= Sd
      place = on_host | ((loc < 0) & np.isin(u, new_set))
      pol.begin_round()
      pol.touch(loc[on_dev])
      # The j-th entry to place (ascending address) takes the j-th candidate.
      order = np.argsort(u[place])
      pu, ploc = u[place][order], loc[place][order]
      cand, was_free = pol.pick(pu.shape[0])
      n = cand.shape[0]
      pu, ploc = pu[:n], ploc[:n]
      victim = ~was_free
      vslot = cand[victim]
      vaddr = self.dev_owner[g, vslot]
      # Write-back targets: free host slots ascending, the misses' own slots included.
      mh = (loc[on_host] - Sd).astype(np.int64)
      self.host_free[g].give(mh)
      vhost = self.host_free[g].first(vslot.shape[0])
      self.host_free[g].take(vhost)
      table[vaddr] = Sd + vhost
      table[pu] = cand
      self.dev_owner[g, cand] = pu
      self.host_owner[g, mh] = INVALID
      self.host_owner[g, vhost] = vaddr
      pol.touch(cand)
      out[g] = (vslot.shape[0], int(on_dev.sum()), int(on_host.sum()))
    return out

  def release(self, addrs: np.ndarray, row: int) -> None:
    del row
    a = np.asarray(addrs, np.int64)
    a = a[(a >= 0) & (a < self.N)]
    for g in range(self.G):
      loc = self.table[g, a]
      dev = loc[(loc >= 0) & (loc < self.Sd)]
      host = loc[loc >= self.Sd] - self.Sd
      self.table[g, a] = INVALID
      self.dev_owner[g, dev] = INVALID
      self.host_owner[g, host] = INVALID
      self.host_free[g].give(host.astype(np.int64))
      self.policy[g].release(dev)

  def report(self) -> CapacityReport:
    from ula_jax.memory.ula.state import GroupMeta, UlaState

    meta = GroupMeta(table=self.table[None], dev_owner=self.dev_owner[None],
                     host_owner=self.host_owner[None], host_free=None, policy=None)
    return self.system.report(UlaState(dev_pool=None, host_pool=None, meta=meta,
                                       index_keys=None))


# ----------------------------------------------------------------------------------
# hisparse
# ----------------------------------------------------------------------------------


class FastHiSparse:
  """``hisparse`` on one rank: per group ``slot_of`` [N], ``slot_addr`` / ``stamp`` [S]
  (S = rows x Q slots, row ``b`` owning ``[b Q, (b + 1) Q)``) and a clock; all groups
  updated at once (their buffers are independent)."""

  stat_keys = ("evictions", "hits", "misses")

  def __init__(self, system):
    self.system = system
    G = system.geo.num_groups
    self.G, self.N, self.R, self.Q = G, system.num_logical, system.max_batch, system.quota
    self.S = self.R * self.Q
    self.slot_of = np.full((G, self.N), INVALID, np.int32)
    self.slot_addr = np.full((G, self.S), INVALID, np.int32)
    self.stamp = np.full((G, self.S), -1, np.int64)
    self.clock = np.zeros((G,), np.int64)
    self.live = np.zeros((G, self.N), bool)
    self._mark = np.full((self.N,), -1, np.int32)

  def _assign(self, victim: np.ndarray, addr: np.ndarray, clock: np.ndarray) -> None:
    """Gives ``victim`` slots [G, M] (INVALID: none) to ``addr`` [G, M] (``_assign``)."""
    g, m = np.nonzero(victim >= 0)
    v, a = victim[g, m], addr[g, m]
    old = self.slot_addr[g, v]
    keep = old >= 0
    self.slot_of[g[keep], old[keep]] = INVALID
    ok = a >= 0
    self.slot_of[g[ok], a[ok]] = v[ok]
    self.slot_addr[g, v] = a
    self.stamp[g, v] = clock[g]

  def prefill(self, addrs: np.ndarray, row: int) -> None:
    """``write_prefill``: every entry on the host; the chunk's last ``Q`` in the row's
    buffer, into its free then least recently used slots."""
    a = np.asarray(addrs, np.int64)
    ok = (a >= 0) & (a < self.N)  # the host pool drops addresses past it
    self.live[:, a[ok]] = True
    okw = a >= 0
    n_ok = int(okw.sum())
    pos = np.cumsum(okw) - 1
    drop = max(n_ok - self.Q, 0)
    keep = okw & (pos >= drop)
    kidx = np.clip(pos - drop, 0, self.Q - 1)
    self.clock += 1
    stamp_r = self.stamp[:, row * self.Q:(row + 1) * self.Q]
    order = np.argsort(stamp_r, axis=1, kind="stable")  # free first, then oldest
    victim = np.where(keep[None, :], row * self.Q + order[:, kidx], INVALID)
    addr = np.broadcast_to(np.where(keep, a, INVALID), victim.shape)
    self._assign(victim, addr, self.clock)

  def decode(self, sel_addr, sel_valid, new_addr, active) -> np.ndarray:
    G, R, Q, N = self.G, self.R, self.Q, self.N
    sel = np.asarray(sel_addr, np.int64)  # [G, R, k]
    k = sel.shape[2]
    act = np.asarray(active, bool)
    new = np.asarray(new_addr, np.int64)
    has_new = act & (new >= 0)
    valid = np.asarray(sel_valid, bool) & (sel >= 0) & act[None, :, None]
    first = self._first(sel, valid)
    is_new = valid & has_new[None, :, None] & (sel == new[None, :, None])
    gi = np.arange(G)[:, None, None]
    cur = np.where(valid, self.slot_of[gi, np.clip(sel, 0, N - 1)], INVALID)
    new_cur = np.where(has_new[None], self.slot_of[:, np.clip(new, 0, N - 1)], INVALID)
    hit = valid & ~is_new & (cur >= 0)
    miss = valid & first & ~is_new & (cur < 0)
    clock = self.clock + 1
    g, b, i = np.nonzero(hit)
    self.stamp[g, cur[g, b, i]] = clock[g]
    g, b = np.nonzero(new_cur >= 0)
    self.stamp[g, new_cur[g, b]] = clock[g]

    # Victims per row: untouched slots by (stamp, slot), the first n_miss (+1) of them.
    n_miss = miss.sum(axis=2)  # [G, R]
    need_new = has_new[None] & (new_cur < 0)
    n_use = n_miss + need_new
    st = self.stamp.reshape(G, R, Q)
    key = np.where(st == clock[:, None, None], _BIG, st + 1) * Q + np.arange(Q)
    width = min(k + 1, Q)
    part = np.partition(key, width - 1, axis=2)[..., :width] if width < Q else key
    victims = np.sort(part, axis=2) % Q + (np.arange(R) * Q)[None, :, None]  # [G, R, k+1]
    rank = np.cumsum(miss, axis=2) - 1
    miss_slot = np.where(miss, np.take_along_axis(victims, np.maximum(rank, 0), axis=2),
                         INVALID)
    new_victim = np.take_along_axis(victims, np.minimum(n_miss, width - 1)[..., None],
                                    axis=2)[..., 0]
    new_slot = np.where(need_new, new_victim, new_cur)
    used = np.arange(width)[None, None, :] < n_use[..., None]
    evictions = (used & (self.slot_addr[np.arange(G)[:, None, None], victims] >= 0)).sum(
        axis=(1, 2))
    victim_all = np.concatenate([miss_slot.reshape(G, -1),
                                 np.where(need_new, new_slot, INVALID)], axis=1)
    addr_all = np.concatenate([np.where(miss, sel, INVALID).reshape(G, -1),
                               np.where(need_new, new[None], INVALID)], axis=1)
    self._assign(victim_all, addr_all, clock)
    self.live[:, new[has_new & (new < N)]] = True
    self.clock = clock
    hits = (valid & first & ~miss).sum(axis=(1, 2))
    return np.stack([evictions, hits, n_miss.sum(axis=1)], axis=1).astype(np.int64)

  def _first(self, sel: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[G, R, k] bool: the first occurrence of its address in its row (``resolve``'s
    stable-sort stage). Selections rarely repeat an address: rows that do are sorted."""
    G, R, k = sel.shape
    first = valid.copy()
    j = np.arange(R * k, dtype=np.int32).reshape(R, k)
    for g in range(G):
      v = valid[g]
      a = sel[g][v]
      self._mark[a] = j[v]
      dup = np.zeros((R, k), bool)
      dup[v] = self._mark[a] != j[v]
      for b in np.flatnonzero(dup.any(axis=1)):  # exact: the lowest index of each address
        key = np.where(v[b], sel[g, b], _BIG)
        order = np.argsort(key, kind="stable")
        skey = key[order]
        head = np.concatenate([[True], skey[1:] != skey[:-1]])
        f = np.zeros((k,), bool)
        f[order[head]] = True
        first[g, b] = f & v[b]
    return first

  def release(self, addrs: np.ndarray, row: int) -> None:
    del row  # a row's buffer only holds its own request's entries
    a = np.asarray(addrs, np.int64)
    a = a[(a >= 0) & (a < self.N)]
    slot = self.slot_of[:, a]  # [G, M]
    g, m = np.nonzero(slot >= 0)
    self.slot_addr[g, slot[g, m]] = INVALID
    self.stamp[g, slot[g, m]] = -1
    self.slot_of[:, a] = INVALID
    self.live[:, a] = False

  def report(self) -> CapacityReport:
    from ula_jax.memory.hisparse import HiSparseState

    return self.system.report(HiSparseState(
        host_pool=None, dev_pool=None, slot_of=None, slot_addr=self.slot_addr[None],
        stamp=None, clock=None, live=self.live[None], index_keys=None))


# ----------------------------------------------------------------------------------
# resident
# ----------------------------------------------------------------------------------


class FastResident:
  """``resident``: slot = address, nothing moves; only the entries held (capacity)."""

  stat_keys: tuple[str, ...] = ()

  def __init__(self, system):
    self.system = system
    self.G, self.N = system.geo.num_groups, system.num_logical
    self.live = np.zeros((self.G, self.N), bool)

  def prefill(self, addrs: np.ndarray, row: int) -> None:
    a = np.asarray(addrs, np.int64)
    self.live[:, a[(a >= 0) & (a < self.N)]] = True

  def decode(self, sel_addr, sel_valid, new_addr, active) -> np.ndarray:
    new = np.asarray(new_addr, np.int64)
    self.live[:, new[np.asarray(active, bool) & (new >= 0) & (new < self.N)]] = True
    return np.zeros((self.G, 0), np.int64)

  def release(self, addrs: np.ndarray, row: int) -> None:
    a = np.asarray(addrs, np.int64)
    self.live[:, a[(a >= 0) & (a < self.N)]] = False

  def report(self) -> CapacityReport:
    from ula_jax.memory.resident import ResidentState

    return self.system.report(ResidentState(pools=None, live=self.live[None],
                                            index_keys=None))


def fast_model(system):
  """The NumPy model of ``system`` (a built ``MemorySystem``), or None where there is
  none (ula TP mode, far_tier: replayed through their jax transitions)."""
  from ula_jax.memory.hisparse import HiSparse
  from ula_jax.memory.resident import Resident
  from ula_jax.memory.ula.dp import Ula

  if type(system) is Ula:
    return FastUla(system)
  if type(system) is HiSparse:
    return FastHiSparse(system)
  if type(system) is Resident:
    return FastResident(system)
  return None
