"""A plain Python/NumPy model of ula's address space and both policies (for tests).

Sets, dicts and loops, one entry at a time: slow and easy to check by eye. It makes the
same deterministic choices as the jax code (``ula.py``, ``policies/``), so the two can be
compared exactly after every step:

* a step's needed entries (selection and new tokens) are taken in ascending address
  order; the j-th entry to place gets the policy's j-th candidate slot;
* candidates: free device slots (ascending), then the policy's order of occupied slots;
* victims, in candidate order, take free host slots in ascending order, the slots the
  misses vacate counting as free;
* prefill: unstored addresses in chunk order take free device slots (ascending), then
  free host slots (ascending).
"""

from __future__ import annotations

import dataclasses

import numpy as np

INVALID = -1
FREE = -1  # policy views: a free slot
COLD = -2  # PB-LRU view: a slot in the cold bucket


# ----------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------


class RefPbLru:
  """PB-LRU with Python sets: free, cold and a ring of ``buckets`` recent buckets."""

  def __init__(self, num_slots: int, buckets: int):
    self.num_slots = num_slots
    self.buckets = buckets
    self.free = set(range(num_slots))
    self.cold: set[int] = set()
    self.ring: list[set[int]] = [set() for _ in range(buckets)]
    self.cur = 0

  def _remove(self, s: int) -> None:
    self.free.discard(s)
    self.cold.discard(s)
    for b in self.ring:
      b.discard(s)

  def begin_round(self) -> None:
    nxt = (self.cur + 1) % self.buckets
    self.cold |= self.ring[nxt]
    self.ring[nxt] = set()
    self.cur = nxt

  def touch(self, slots) -> None:
    for s in slots:
      self._remove(s)
      self.ring[self.cur].add(s)

  def release(self, slots) -> None:
    for s in slots:
      self._remove(s)
      self.free.add(s)

  def order(self) -> list[tuple[int, bool]]:
    """Every pickable slot in victim order, with "was free"."""
    out = [(s, True) for s in sorted(self.free)]
    out += [(s, False) for s in sorted(self.cold)]
    for i in range(1, self.buckets):
      out += [(s, False) for s in sorted(self.ring[(self.cur + i) % self.buckets])]
    return out

  def first_free(self, n: int) -> list[int]:
    return sorted(self.free)[:n]

  def describe(self) -> dict[str, np.ndarray]:
    bucket = np.full((self.num_slots,), FREE, np.int32)
    for s in self.cold:
      bucket[s] = COLD
    for r, b in enumerate(self.ring):
      for s in b:
        bucket[s] = r
    return {"bucket": bucket, "cur": np.asarray(self.cur, np.int32)}


class RefLru:
  """Exact LRU: the round of each slot's last touch (None = free)."""

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self.stamp: list[int | None] = [None] * num_slots
    self.clock = 0

  def begin_round(self) -> None:
    self.clock += 1

  def touch(self, slots) -> None:
    for s in slots:
      self.stamp[s] = self.clock

  def release(self, slots) -> None:
    for s in slots:
      self.stamp[s] = None

  def order(self) -> list[tuple[int, bool]]:
    free = [s for s in range(self.num_slots) if self.stamp[s] is None]
    used = [s for s in range(self.num_slots)
            if self.stamp[s] is not None and self.stamp[s] != self.clock]
    used.sort(key=lambda s: (self.stamp[s], s))
    return [(s, True) for s in free] + [(s, False) for s in used]

  def first_free(self, n: int) -> list[int]:
    return [s for s in range(self.num_slots) if self.stamp[s] is None][:n]

  def describe(self) -> dict[str, np.ndarray]:
    stamp = np.asarray([FREE if t is None else t for t in self.stamp], np.int32)
    return {"stamp": stamp, "clock": np.asarray(self.clock, np.int32)}


def make_ref_policy(name: str, num_slots: int, buckets: int):
  if name == "pb_lru":
    return RefPbLru(num_slots, buckets)
  if name == "lru":
    return RefLru(num_slots)
  raise ValueError(f"policy={name!r}: expected 'pb_lru' or 'lru'")


# ----------------------------------------------------------------------------------
# One layer group's address space
# ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RefStep:
  """What one reference resolve decided."""

  slots: np.ndarray  # [B, k] int32 device slots (INVALID where not valid / not stored)
  new_slot: np.ndarray  # [B] int32
  stats: dict  # hits, misses, evictions
  fetches: list  # [(host slot, device slot)] misses moving in
  evictions: list  # [(device slot, host slot)] victims moving out
  victims: list  # victim addresses


class RefGroup:
  """Mapping table, owners and policy of one layer group."""

  def __init__(self, device_slots: int, host_slots: int, num_logical: int, policy):
    self.Sd, self.Sh, self.N = device_slots, host_slots, num_logical
    self.table: dict[int, tuple[str, int]] = {}
    self.dev_owner: list[int | None] = [None] * device_slots
    self.host_owner: list[int | None] = [None] * host_slots
    self.policy = policy

  def _ok(self, a: int) -> bool:
    return 0 <= a < self.N

  def prefill(self, addrs, valid) -> tuple[list, list]:
    """Returns per chunk row (device slot or INVALID, host slot or INVALID)."""
    dev_dst, host_dst = [INVALID] * len(addrs), [INVALID] * len(addrs)
    free_dev = self.policy.first_free(len(addrs))
    free_host = [h for h in range(self.Sh) if self.host_owner[h] is None]
    touched = []
    for i, (a, v) in enumerate(zip(addrs, valid)):
      a = int(a)
      if not v or not self._ok(a):
        continue
      if a in self.table:
        tier, s = self.table[a]
      elif free_dev:
        tier, s = "dev", free_dev.pop(0)
        self.table[a] = (tier, s)
        self.dev_owner[s] = a
      else:
        tier, s = "host", free_host.pop(0)
        self.table[a] = (tier, s)
        self.host_owner[s] = a
      if tier == "dev":
        dev_dst[i] = s
        touched.append(s)
      else:
        host_dst[i] = s
    self.policy.touch(touched)
    return dev_dst, host_dst

  def resolve(self, sel_addr, sel_valid, new_addr, active) -> RefStep:
    sel_addr, sel_valid = np.asarray(sel_addr), np.asarray(sel_valid)
    B, k = sel_addr.shape
    selected = {int(a) for a, v in zip(sel_addr.ravel(), sel_valid.ravel())
                if v and self._ok(int(a))}
    new = {int(a) for a, v in zip(new_addr, active) if v and self._ok(int(a))}
    needed = sorted(selected | new)

    self.policy.begin_round()
    hits = [a for a in needed if a in self.table and self.table[a][0] == "dev"]
    misses = [a for a in needed if a in self.table and self.table[a][0] == "host"]
    fresh = [a for a in needed if a not in self.table and a in new]
    self.policy.touch([self.table[a][1] for a in hits])
    to_place = sorted(misses + fresh)
    cands = self.policy.order()[:len(to_place)]
    assert len(cands) == len(to_place), "reference: not enough device slots"

    freed = {self.table[a][1] for a in misses}
    free_host = sorted({h for h in range(self.Sh) if self.host_owner[h] is None} | freed)
    fetches, evictions, victims = [], [], []
    moves = []
    for a, (s, was_free) in zip(to_place, cands):
      if not was_free:
        v = self.dev_owner[s]
        h = free_host.pop(0)
        evictions.append((s, h))
        victims.append(v)
      if a in self.table:  # a miss
        fetches.append((self.table[a][1], s))
      moves.append((a, s))
    # Table update: misses leave the host, victims arrive there, placed entries on device.
    for a in misses:
      self.host_owner[self.table[a][1]] = None
    for (s, h), v in zip(evictions, victims):
      self.table[v] = ("host", h)
      self.host_owner[h] = v
    for a, s in moves:
      self.table[a] = ("dev", s)
      self.dev_owner[s] = a
    self.policy.touch([s for _, s in moves])

    def slot(a: int) -> int:
      loc = self.table.get(a)
      return loc[1] if loc is not None and loc[0] == "dev" else INVALID

    slots = np.full((B, k), INVALID, np.int32)
    for b in range(B):
      for i in range(k):
        if sel_valid[b, i] and self._ok(int(sel_addr[b, i])):
          slots[b, i] = slot(int(sel_addr[b, i]))
    new_slot = np.asarray([slot(int(a)) if v and self._ok(int(a)) else INVALID
                           for a, v in zip(new_addr, active)], np.int32)
    stats = {"hits": len(hits), "misses": len(misses), "evictions": len(evictions)}
    return RefStep(slots, new_slot, stats, fetches, evictions, victims)

  def release(self, addrs, valid) -> None:
    for a, v in zip(addrs, valid):
      a = int(a)
      if not v or a not in self.table:
        continue
      tier, s = self.table.pop(a)
      if tier == "dev":
        self.dev_owner[s] = None
        self.policy.release([s])
      else:
        self.host_owner[s] = None

  def table_array(self) -> np.ndarray:
    """[N] int32 in ula's encoding: device slot s, host slot h as Sd + h, INVALID."""
    out = np.full((self.N,), INVALID, np.int32)
    for a, (tier, s) in self.table.items():
      out[a] = s if tier == "dev" else self.Sd + s
    return out

  def owners(self) -> tuple[np.ndarray, np.ndarray]:
    enc = lambda xs: np.asarray([INVALID if x is None else x for x in xs], np.int32)
    return enc(self.dev_owner), enc(self.host_owner)


# ----------------------------------------------------------------------------------
# The whole system on one dp rank, data included
# ----------------------------------------------------------------------------------


class RefUla:
  """Every group's address space plus per-layer pools (numpy), one dp rank."""

  def __init__(self, *, device_slots: int, host_slots: int, num_logical: int, policy: str,
               buckets: int, num_layers: int, group_size: int, entry_width: int,
               dtype=np.float32):
    self.Sd, self.Sh = device_slots, host_slots
    self.num_layers, self.group_size = num_layers, group_size
    num_groups = -(-num_layers // group_size)
    self.groups = [RefGroup(device_slots, host_slots, num_logical,
                            make_ref_policy(policy, device_slots, buckets))
                   for _ in range(num_groups)]
    self.dev_pools = [np.zeros((device_slots, entry_width), dtype) for _ in range(num_layers)]
    self.host_pools = [np.zeros((host_slots, entry_width), dtype) for _ in range(num_layers)]

  @classmethod
  def like(cls, system) -> RefUla:
    """A reference sized like a ``ula.Ula`` system."""
    geo = system.geo
    return cls(device_slots=system.device_slots, host_slots=system.host_slots,
               num_logical=system.num_logical, policy=system.policy_name,
               buckets=system.buckets, num_layers=geo.num_layers, group_size=geo.group_size,
               entry_width=geo.entry_width, dtype=np.dtype(geo.kv_dtype))

  def group_layers(self, g: int) -> range:
    return range(g * self.group_size, min((g + 1) * self.group_size, self.num_layers))

  def write_prefill(self, addrs, valid, entries) -> None:
    for g, grp in enumerate(self.groups):
      dev_dst, host_dst = grp.prefill(addrs, valid)
      for l in self.group_layers(g):
        for i in range(len(addrs)):
          if dev_dst[i] != INVALID:
            self.dev_pools[l][dev_dst[i]] = entries[l][i]
          if host_dst[i] != INVALID:
            self.host_pools[l][host_dst[i]] = entries[l][i]

  def resolve(self, g: int, sel_addr, sel_valid, new_addr, active) -> RefStep:
    return self.groups[g].resolve(sel_addr, sel_valid, new_addr, active)

  def move_layer(self, layer: int, step: RefStep) -> None:
    dev, host = self.dev_pools[layer], self.host_pools[layer]
    fetched = [host[h].copy() for h, _ in step.fetches]
    evicted = [dev[s].copy() for s, _ in step.evictions]
    for (_, s), row in zip(step.fetches, fetched):
      dev[s] = row
    for (_, h), row in zip(step.evictions, evicted):
      host[h] = row

  def write_token(self, layer: int, step: RefStep, entry, active) -> None:
    for b, (s, v) in enumerate(zip(step.new_slot, active)):
      if v and s != INVALID:
        self.dev_pools[layer][s] = entry[b]

  def release(self, addrs, valid) -> None:
    for grp in self.groups:
      grp.release(addrs, valid)
