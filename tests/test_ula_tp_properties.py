"""ula in TP mode against a NumPy model over many short random sequences.

The same lane programs as ``test_ula_properties`` (``Script``: admission, chunked
prefill, decode, release; ``LANES`` independent sequences per example, one jitted
program per system), run under ``shard_map`` on a ``(1, tp)`` mesh. The model below
replays each lane: the layout (``mod``, ``block``, ``request``: which rank owns each
address), every layer group's local buffer (``RefBuffer``: hits, misses, victims by the
reference policies) and every rank's owned entries (a ``RefUla`` per rank over its local
addresses when there is a host pool, a set of live local addresses when there is not).
After every step the ranks must agree on everything they share, and the system must
agree with the model: buffer tables, owners and policy state, the layout's page table,
each rank's tables and pools, slots, stats, and the rows attention read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ula_jax.config.schema import MemoryConfig
from ula_jax.core import compat
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.oracle import RefUla, make_ref_policy
from ula_jax.memory.ula.tp import DirectState, SharedState, TieredStore, UlaTP, UlaTPState
from ula_jax.memory.ula.state import UlaState
from tests.test_ula_properties import (DECODE, PREFILL, RELEASE, Tally, drive_lanes,
                                       lane_step, same)

TP = 2
GEO = KVGeometry(num_layers=4, group_size=2, entry_width=2, index_dim=2, top_k=2,
                 kv_dtype="float32", index_dtype="float32")  # two groups of one layer
B, PAGE = 2, 4
STEP = B * (GEO.top_k + 1)  # 6: the default local buffer, one decode step's entries


def make_system(layout: str, policy: str, device: int, host: int) -> UlaTP:
  cfg = MemoryConfig(system="ula", device_pool=device, host_pool=host, policy=policy,
                     pb_lru_buckets=2, layout=layout, local_buffer=None,
                     index_scoring="aligned")
  system = UlaTP(cfg, GEO, MeshInfo(1, TP), max_batch=B, page_size=PAGE, max_context=32)
  system.validate()
  return system


SYSTEMS = {
    # Owners with a host pool: 6 device-pool + 4 host slots per rank (N = 20).
    "mod": make_system("mod", "pb_lru", device=STEP + 6, host=4),
    # Owners on device only: 8 slots per rank (N = 16).
    "block": make_system("block", "lru", device=STEP + 8, host=0),
    # One owner rank per request, 2 local pages per rank, spilling when full (N = 16).
    "request": make_system("request", "lru", device=STEP + 6, host=4),
}
# Per layout under the ``ci`` profile: examples x LANES sequences (160), and how often the
# run must have missed and evicted in the buffers at least (a run reaches about 4x the
# misses and 2x the evictions).
EXAMPLES = 20
MIN_MOVES = 150


# ----------------------------------------------------------------------------------
# The program: lanes x steps under shard_map
# ----------------------------------------------------------------------------------


def empty_local_state(system: UlaTP) -> UlaTPState:
  """One rank's empty state, built inside the trace (default memory kinds)."""
  geo, W, Lb = system.geo, system.geo.entry_width, system.buffer_slots
  G, Lk = geo.num_groups, geo.num_layers
  meta = system.init_buffer_meta()
  shared = SharedState(buffers=jnp.zeros((Lk * Lb, W), geo.kv_dtype),
                       meta=jax.tree.map(lambda x: jnp.broadcast_to(x, (G, *x.shape)), meta),
                       layout=system.layout.init())
  if isinstance(system.store, TieredStore):
    u = system.store.ula
    ranked = UlaState(dev_pool=jnp.zeros((Lk * u.device_slots, W), geo.kv_dtype),
                      host_pool=jnp.zeros((Lk * u.host_rows, W), geo.kv_dtype),
                      meta=u.init_meta(),
                      index_keys=jnp.zeros((G, u.num_logical, geo.index_dim), geo.index_dtype))
  else:
    C = system.rank_capacity
    ranked = DirectState(pools=jnp.zeros((Lk * C, W), geo.kv_dtype),
                         live=jnp.zeros((G, C), jnp.bool_),
                         index_keys=jnp.zeros((G, C, geo.index_dim), geo.index_dtype))
  return UlaTPState(shared=shared, ranked=ranked)


@functools.lru_cache(maxsize=None)
def tp_lane_program(system: UlaTP):
  """The jitted lanes-by-steps program (one compile per system): every rank runs every
  lane; outputs come back with leading ``[1, tp]`` axes, then ``[lanes, T, ...]``."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:TP]).reshape(1, TP), ("dp", "tp"))

  def step(state, x):
    state, out = lane_step(system, state, x)
    return state, (state, out)

  def body(xs):
    ys = jax.lax.map(lambda x: jax.lax.scan(step, empty_local_state(system), x)[1], xs)
    return jax.tree.map(lambda a: a[None, None], ys)

  return jax.jit(compat.shard_map(body, mesh=mesh, in_specs=(P(),),
                                  out_specs=P("dp", "tp")))


# ----------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------


class RefLayout:
  """``layouts.py`` one address at a time: (rank, local address) of each address."""

  def __init__(self, system: UlaTP):
    lay = system.layout
    self.name, self.P, self.C = system.layout_name, system.tp, system.rank_capacity
    self.N, self.page, self.B = system.num_logical, system.page_size, system.max_batch
    self.LP = self.C // self.page
    self.page_rank: dict[int, tuple[int, int]] = {}  # page -> (rank, local page)
    self.free = [[True] * self.LP for _ in range(self.P)]
    self.row_owner: list[int | None] = [None] * self.B
    assert lay.num_logical == self.N

  def locate(self, a: int) -> tuple[int, int]:
    if not 0 <= a < self.N:
      return INVALID, INVALID
    if self.name == "mod":
      return a % self.P, a // self.P
    if self.name == "block":
      return a // self.C, a % self.C
    if a // self.page not in self.page_rank:
      return INVALID, INVALID
    rank, lpage = self.page_rank[a // self.page]
    return rank, lpage * self.page + a % self.page

  def place(self, addrs, valid, rows) -> None:
    """A fresh page takes its row owner's lowest free local page (a row without an owner
    takes the rank with the most free pages), else spills, lowest rank first."""
    if self.name != "request":
      return
    counts = [sum(f) for f in self.free]
    roomiest = int(np.argmax(counts))
    heads, seen = [], set()
    owners = list(self.row_owner)
    for a, v, r in zip(addrs.tolist(), valid.tolist(), rows.tolist()):
      if not v or not 0 <= a < self.N:
        continue
      page = a // self.page
      if page in self.page_rank:
        continue
      row_ok = 0 <= r < self.B
      owner = self.row_owner[r] if row_ok else None
      if row_ok and owner is None:
        owners[r] = roomiest
      if page not in seen:
        seen.add(page)
        heads.append((page, roomiest if owner is None else owner))
    self.row_owner = owners
    freelist = [[i for i in range(self.LP) if self.free[r][i]] for r in range(self.P)]
    used = [0] * self.P
    spills = []
    for page, pref in heads:
      if used[pref] < len(freelist[pref]):
        self.page_rank[page] = (pref, freelist[pref][used[pref]])
        used[pref] += 1
      else:
        spills.append(page)
    rest = [(r, i) for r in range(self.P) for i in freelist[r][used[r]:]]
    for page, (r, i) in zip(spills, rest):
      self.page_rank[page] = (r, i)
    for r, i in self.page_rank.values():
      self.free[r][i] = False

  def release(self, addrs, valid, row: int) -> None:
    if self.name != "request":
      return
    for a in addrs[valid].tolist():
      loc = self.page_rank.pop(a // self.page, None) if 0 <= a < self.N else None
      if loc is not None:
        self.free[loc[0]][loc[1]] = True
    if 0 <= row < self.B:
      self.row_owner[row] = None

  def arrays(self) -> dict[str, np.ndarray]:
    """``RequestLayoutState`` in the model's terms."""
    NP = self.P * self.LP
    rank, local = np.full((NP,), INVALID, np.int32), np.full((NP,), INVALID, np.int32)
    for page, (r, i) in self.page_rank.items():
      rank[page], local[page] = r, i
    owner = [INVALID if o is None else o for o in self.row_owner]
    return {"page_rank": rank, "page_local": local, "free": np.asarray(self.free),
            "row_owner": np.asarray(owner, np.int32)}


class RefBuffer:
  """One layer group's local buffer: which address each slot holds, and the policy."""

  def __init__(self, slots: int, num_logical: int, policy: str, buckets: int):
    self.N = num_logical
    self.table: dict[int, int] = {}
    self.owner: list[int | None] = [None] * slots
    self.policy = make_ref_policy(policy, slots, buckets)

  def resolve(self, sel, sel_valid, new, active):
    """Needed entries in ascending address order: hits stay, the rest take the policy's
    candidates (victims are dropped: their owners still hold them).
    returns (slots [B, k], new_slot [B], fetched addresses ascending, stats)"""
    ok = lambda a: 0 <= a < self.N
    selected = {int(a) for a, v in zip(sel.ravel(), sel_valid.ravel()) if v and ok(int(a))}
    fresh = {int(a) for a, v in zip(new, active) if v and ok(int(a))}
    needed = sorted(selected | fresh)
    self.policy.begin_round()
    hits = [a for a in needed if a in self.table]
    self.policy.touch([self.table[a] for a in hits])
    to_place = [a for a in needed if a not in self.table]
    cands = self.policy.order()[:len(to_place)]
    assert len(cands) == len(to_place), "model: buffer too small"
    evictions = 0
    for a, (s, was_free) in zip(to_place, cands):
      if not was_free:
        del self.table[self.owner[s]]
        evictions += 1
      self.table[a], self.owner[s] = s, a
    self.policy.touch([s for s, _ in cands])
    slot = lambda a: self.table.get(a, INVALID)
    slots = np.where(sel_valid, np.vectorize(slot, otypes=[np.int32])(sel), INVALID)
    new_slot = np.asarray([slot(int(a)) if v else INVALID for a, v in zip(new, active)],
                          np.int32)
    fetched = [a for a in to_place if a not in fresh]
    stats = {"hits": len(hits), "misses": len(fetched), "evictions": evictions}
    return slots, new_slot, fetched, stats

  def unbuffer(self, addrs, valid) -> None:
    for a in addrs[valid].tolist():
      s = self.table.pop(a, None)
      if s is not None:
        self.owner[s] = None
        self.policy.release([s])

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    table = np.full((self.N,), INVALID, np.int32)
    for a, s in self.table.items():
      table[a] = s
    return table, np.asarray([INVALID if a is None else a for a in self.owner], np.int32)


class RefTP:
  """One lane's model: layout, buffers, owners' stores, and the rows written."""

  def __init__(self, system: UlaTP):
    self.sys, geo = system, system.geo
    self.layout = RefLayout(system)
    self.buffers = [RefBuffer(system.buffer_slots, system.num_logical, system.policy_name,
                              system.buckets) for _ in range(geo.num_groups)]
    self.tiered = isinstance(system.store, TieredStore)
    if self.tiered:
      self.stores = [RefUla.like(system.store.ula) for _ in range(system.tp)]
    else:  # [rank][group]: live local addresses
      self.live = [[set() for _ in range(geo.num_groups)] for _ in range(system.tp)]
    self.truth: dict[tuple[int, int], np.ndarray] = {}  # (layer, address) -> row

  def mine(self, addrs, valid, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(local addresses, INVALID where not owned by ``rank``; owned)."""
    loc = [self.layout.locate(int(a)) if v else (INVALID, INVALID)
           for a, v in zip(addrs.ravel(), valid.ravel())]
    r = np.asarray([x[0] for x in loc], np.int32).reshape(addrs.shape)
    local = np.asarray([x[1] for x in loc], np.int32).reshape(addrs.shape)
    own = (r == rank) & (r >= 0)
    return np.where(own, local, INVALID).astype(np.int32), own

  def prefill(self, addrs, valid, entries, row: int) -> None:
    self.layout.place(addrs, valid, np.full(addrs.shape, row, np.int32))
    for rank in range(self.sys.tp):
      local, own = self.mine(addrs, valid, rank)
      if self.tiered:
        self.stores[rank].write_prefill(local, own, entries)
      else:
        for live in self.live[rank]:
          live.update(local[own].tolist())
    for buf in self.buffers:
      buf.unbuffer(addrs, valid)
    for j in np.flatnonzero(valid):
      for l in range(self.sys.geo.num_layers):
        self.truth[(l, int(addrs[j]))] = entries[l, j]

  def decode_group(self, g: int, sel, sel_valid, new, active, entries):
    """returns (slots, new_slot, stats with the owners' host moves)"""
    geo, (Bn, k) = self.sys.geo, sel.shape
    slots, new_slot, fetched, stats = self.buffers[g].resolve(sel, sel_valid, new, active)
    f_addr = np.full((Bn * k,), INVALID, np.int32)
    f_addr[:len(fetched)] = fetched
    host = {"misses": 0, "evictions": 0}
    for rank in range(self.sys.tp):
      n_local, n_own = self.mine(new, active & (new >= 0), rank)
      if self.tiered:
        f_local, f_own = self.mine(f_addr, f_addr >= 0, rank)
        ref = self.stores[rank]
        step = ref.resolve(g, f_local.reshape(Bn, k), f_own.reshape(Bn, k), n_local, n_own)
        for l in geo.group_layers(g):
          ref.move_layer(l, step)
          ref.write_token(l, step, entries[l], n_own)
        for key in host:
          host[key] += step.stats[key]
      else:
        self.live[rank][g].update(n_local[n_own].tolist())
    if self.tiered:
      stats["host_fetches"], stats["host_evictions"] = host["misses"], host["evictions"]
    stats["xdev_rows"] = stats["misses"] * (self.sys.tp - 1) * len(geo.group_layers(g))
    return slots, new_slot, stats

  def release(self, addrs, valid, row: int) -> None:
    for rank in range(self.sys.tp):
      local, own = self.mine(addrs, valid, rank)
      if self.tiered:
        self.stores[rank].release(local, own)
      else:
        for live in self.live[rank]:
          live.difference_update(local[own].tolist())
    for buf in self.buffers:
      buf.unbuffer(addrs, valid)
    self.layout.release(addrs, valid, row)
    for a in addrs[valid].tolist():
      for l in range(self.sys.geo.num_layers):
        self.truth.pop((l, a), None)


# ----------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------


def check_tp_lanes(system: UlaTP, scripts, xs: dict, ys, tally: Tally) -> None:
  states, outs = jax.tree.map(lambda a: np.asarray(a)[0], ys)  # [tp, lanes, T, ...]
  slots, new_slot, stats, _, reads = outs
  geo, Lb, tiered = system.geo, system.buffer_slots, isinstance(system.store, TieredStore)
  C = system.rank_capacity
  # What every rank holds the same, and every rank's result, must agree over the ranks.
  for what, tree in (("shared state", states.shared), ("slots", slots),
                     ("new slots", new_slot), ("stats", stats), ("rows read", reads)):
    for leaf in jax.tree.leaves(tree):
      for r in range(1, system.tp):
        same(leaf[r], leaf[0], f"{what}: rank {r} differs from rank 0")
  sh = jax.tree.map(lambda a: a[0], states.shared)
  for lane, sc in enumerate(scripts):
    x = {n: v[lane] for n, v in xs.items()}
    ref = RefTP(system)
    tally.sequences += 1
    for t in range(x["op"].shape[0]):
      at = f"lane {lane} step {t}"
      op = int(x["op"][t])
      if op == PREFILL:
        ref.prefill(x["p_addr"][t], x["p_valid"][t], x["p_entries"][t], int(x["p_row"][t]))
      elif op == DECODE:
        new, active = x["new"][t], x["active"][t]
        ref.layout.place(new, active & (new >= 0), np.arange(new.shape[0], dtype=np.int32))
        for b in np.flatnonzero(active):
          for l in range(geo.num_layers):
            ref.truth[(l, int(new[b]))] = x["d_entries"][t, l, b]
        misses, evictions = np.zeros(geo.num_groups), np.zeros(geo.num_groups)
        for g in range(geo.num_groups):
          sel, sel_valid = x["sel"][t, g], x["sel_valid"][t, g]
          want_slots, want_new, want_stats = ref.decode_group(g, sel, sel_valid, new, active,
                                                             x["d_entries"][t])
          same(slots[0, lane, t, g], want_slots, f"{at} group {g}: slots")
          same(new_slot[0, lane, t, g], want_new, f"{at} group {g}: new_slot")
          for key, v in want_stats.items():
            same(stats[key][0, lane, t, g], v, f"{at} group {g}: {key}")
          misses[g], evictions[g] = want_stats["misses"], want_stats["evictions"]
          for i, l in enumerate(geo.group_layers(g)):
            for r in range(system.tp):
              for b, j in zip(*np.nonzero(sel_valid)):
                same(reads[r, lane, t, g, i, b, j], ref.truth[(l, int(sel[b, j]))],
                     f"{at} rank {r} layer {l}: row read for address {sel[b, j]}")
        tally.decode(misses, evictions)
      elif op == RELEASE:
        ref.release(x["r_addr"][t], x["r_valid"][t], int(x["r_row"][t]))
      # Shared: every group's buffer metadata and rows, the layout's page table.
      for g, buf in enumerate(ref.buffers):
        table, owner = buf.arrays()
        same(sh.meta.table[lane, t, g], table, f"{at} group {g}: buffer table")
        same(sh.meta.owner[lane, t, g], owner, f"{at} group {g}: buffer owners")
        view = system.policy.describe(jax.tree.map(lambda a: a[lane, t, g], sh.meta.policy))
        for key, v in buf.policy.describe().items():
          same(view[key], v, f"{at} group {g}: buffer policy {key}")
        for l in geo.group_layers(g):
          for s, a in enumerate(owner.tolist()):
            if a != INVALID:
              same(sh.buffers[lane, t, l * Lb + s], ref.truth[(l, a)],
                   f"{at} layer {l}: buffer slot {s} (address {a})")
      if system.layout_name == "request":
        for key, v in ref.layout.arrays().items():
          same(getattr(sh.layout, key)[lane, t], v, f"{at}: layout {key}")
      # Per rank: the owned entries.
      for r in range(system.tp):
        rk = jax.tree.map(lambda a: a[r, lane, t], states.ranked)
        if tiered:
          u, store = system.store.ula, ref.stores[r]
          for g, grp in enumerate(store.groups):
            same(rk.meta.table[g], grp.table_array(), f"{at} rank {r} group {g}: table")
            dev_owner, host_owner = grp.owners()
            same(rk.meta.dev_owner[g], dev_owner, f"{at} rank {r} group {g}: device owners")
            same(rk.meta.host_owner[g, :u.host_slots], host_owner,
                 f"{at} rank {r} group {g}: host owners")
            view = u.policy.describe(jax.tree.map(lambda a: a[g], rk.meta.policy))
            for key, v in grp.policy.describe().items():
              same(view[key], v, f"{at} rank {r} group {g}: policy {key}")
          same(rk.dev_pool, np.concatenate(store.dev_pools), f"{at} rank {r}: device pool")
          pools = store.host_pools  # [Hr, W] a layer, in the rank's host layout
          want = (np.stack(pools, axis=1).reshape(-1, pools[0].shape[-1])
                  if u.host_layout == "entry_major" else np.concatenate(pools))
          same(rk.host_pool, want, f"{at} rank {r}: host pool")
        else:
          live = np.zeros((geo.num_groups, C), bool)
          for g, addrs in enumerate(ref.live[r]):
            live[g, sorted(addrs)] = True
          same(rk.live, live, f"{at} rank {r}: live local addresses")
      if not tiered:  # every owned entry sits at its local address
        for (l, a), row in ref.truth.items():
          r, local = ref.layout.locate(a)
          same(states.ranked.pools[r, lane, t, l * C + local], row,
               f"{at} rank {r} layer {l}: pool row of address {a}")
    # Every sequence ends with its requests released: nothing stored, nothing buffered.
    assert not sc.live() and not ref.truth
    rep_used = (sh.meta.owner[lane, -1] != INVALID).sum()
    assert rep_used == 0 and (sh.meta.table[lane, -1] == INVALID).all()
    if tiered:
      assert (states.ranked.meta.table[:, lane, -1] == INVALID).all()
      assert (states.ranked.meta.dev_owner[:, lane, -1] == INVALID).all()
      assert (states.ranked.meta.host_owner[:, lane, -1] == INVALID).all()
    else:
      assert not states.ranked.live[:, lane, -1].any()


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_many_short_tp_sequences_match_model(name):
  system = SYSTEMS[name]
  drive_lanes(name, system, tp_lane_program(system), check_tp_lanes, EXAMPLES)
