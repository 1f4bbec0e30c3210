"""ula against its NumPy reference over random admit / prefill / decode / release sequences.

A harness drives the jax system (jitted, on one device's local state: the dp axis of
``init_state`` stripped) and ``reference.RefUla`` side by side and, after every step,
checks that they agree exactly (tables, owners, policy state, pools, slots, stats) and
that the invariants hold: each live address in exactly one slot, no slot with two
addresses, the bytes read back for every resolved entry are the bytes written, victims
never selected in their own step, host pools still in ``pinned_host``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.addressing import PageAllocator
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.policies import FREE, PbLru
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.oracle import RefUla
from ula_jax.memory.ula.dp import Ula


def make_system(*, policy: str, buckets: int = 2, device: int, host: int, max_batch: int,
                top_k: int, page_size: int, num_layers: int = 3, group_size: int = 2,
                width: int = 4) -> Ula:
  cfg = MemoryConfig(system="ula", device_pool=device, host_pool=host, policy=policy,
                     pb_lru_buckets=buckets)
  geo = KVGeometry(num_layers=num_layers, group_size=group_size, entry_width=width,
                   index_dim=2, top_k=top_k, kv_dtype="float32")
  system = Ula(cfg, geo, MeshInfo(1, 1), max_batch=max_batch, page_size=page_size,
               max_context=64)
  system.validate()
  return system


@functools.lru_cache(maxsize=None)
def local_state(system: Ula):
  """``init_state`` on a one-device mesh with the dp axis stripped (memory kinds kept).

  Cached per system: states are immutable and nothing here donates them, so every
  example can start from the same arrays.
  """
  mesh = jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1])
  return jax.jit(lambda s: jax.tree.map(lambda x: x[0], s))(system.init_state(mesh))


@functools.lru_cache(maxsize=None)
def jitted(system: Ula) -> dict:
  """One jitted function per transition (cached per system so examples share compiles)."""

  def decode_group(state, g, sel_addr, sel_valid, new_addr, active, entries):
    state, res = system.resolve(state, g, sel_addr, sel_valid, new_addr, active)
    for l in system.geo.group_layers(g):
      state = system.move_layer(state, l, res)
    for i, l in enumerate(system.geo.group_layers(g)):
      state = system.write_token(state, l, res, entries[i], active)
    return state, res

  return {
      "prefill": jax.jit(system.write_prefill),
      "decode_group": jax.jit(decode_group, static_argnums=1),
      "release": jax.jit(system.release),
  }


@dataclasses.dataclass
class Req:
  pages: np.ndarray
  prompt_len: int
  total_len: int
  row: int
  written: int = 0  # positions stored so far (prompt first, then decoded tokens)

  def addr(self, pos: int, page_size: int) -> int:
    return int(self.pages[pos // page_size]) * page_size + pos % page_size


class Harness:
  """The jax system and the reference, step by step, checked after every step."""

  def __init__(self, system: Ula, chunk: int = 4):
    self.sys, self.chunk = system, chunk
    self.ref = RefUla.like(system)
    self.state = local_state(system)
    self.f = jitted(system)
    self.written: dict[tuple[int, int], np.ndarray] = {}  # (layer, addr) -> row
    self.steps = 0

  # -- transitions ----------------------------------------------------------------

  def prefill(self, addrs: list[int], rng: np.random.Generator) -> None:
    C, L, W = self.chunk, self.sys.geo.num_layers, self.sys.geo.entry_width
    for i in range(0, len(addrs), C):
      part = addrs[i:i + C]
      a = np.full((C,), INVALID, np.int32)
      a[:len(part)] = part
      valid = np.arange(C) < len(part)
      entries = rng.standard_normal((L, C, W)).astype(np.float32)  # layer-major
      self.state = self.f["prefill"](self.state, jnp.asarray(a), jnp.asarray(valid),
                                     jnp.asarray(entries), jnp.int32(0))
      self.ref.write_prefill(a, valid, entries)
      for l in range(L):
        for j, addr in enumerate(part):
          self.written[(l, addr)] = entries[l][j]

  def decode(self, sel_addr: np.ndarray, sel_valid: np.ndarray, new_addr: np.ndarray,
             active: np.ndarray, rng: np.random.Generator) -> dict:
    """One decode step over every group; returns the summed stats."""
    geo, totals = self.sys.geo, {"hits": 0, "misses": 0, "evictions": 0}
    for g in range(geo.num_groups):
      layers = list(geo.group_layers(g))
      entries = tuple(rng.standard_normal((new_addr.shape[0], geo.entry_width))
                      .astype(np.float32) for _ in layers)
      before = np.asarray(self.state.meta.dev_owner[g])
      self.state, res = self.f["decode_group"](
          self.state, g, jnp.asarray(sel_addr[g]), jnp.asarray(sel_valid[g]),
          jnp.asarray(new_addr), jnp.asarray(active), tuple(map(jnp.asarray, entries)))
      step = self.ref.resolve(g, sel_addr[g], sel_valid[g], new_addr, active)
      for l in layers:
        self.ref.move_layer(l, step)
      for i, l in enumerate(layers):
        self.ref.write_token(l, step, entries[i], active)
        for b in np.flatnonzero(active):
          self.written[(l, int(new_addr[b]))] = entries[i][b]

      np.testing.assert_array_equal(np.asarray(res.slots), step.slots)
      np.testing.assert_array_equal(np.asarray(res.new_slot), step.new_slot)
      stats = {k: int(v) for k, v in res.stats.items()}
      assert stats == step.stats
      for k in totals:
        totals[k] += stats[k]

      # Victims are never entries of this step (selected or new).
      plan = res.plan
      n_ev = int(plan.n_evict)
      assert n_ev == stats["evictions"] and int(plan.n_fetch) == stats["misses"]
      victims = before[np.asarray(plan.evict_src)[:n_ev]]
      assert sorted(victims.tolist()) == sorted(step.victims)
      needed = set(sel_addr[g][sel_valid[g]].tolist()) | set(new_addr[active].tolist())
      assert not needed & set(victims.tolist())

      # Attention reads exactly what was written, for every resolved entry.
      slots = np.asarray(res.slots)
      for l in layers:
        pool, base = self.sys.read_pool(self.state, l)
        pool, base = np.asarray(pool), int(base)
        for b, i in zip(*np.nonzero(sel_valid[g])):
          np.testing.assert_array_equal(pool[base + slots[b, i]],
                                        self.written[(l, int(sel_addr[g][b, i]))])
    self.steps += 1
    return totals

  def release(self, addrs: np.ndarray, valid: np.ndarray) -> None:
    self.state = self.f["release"](self.state, jnp.asarray(addrs), jnp.asarray(valid),
                                   jnp.int32(0))
    self.ref.release(addrs, valid)
    for a in addrs[valid]:
      for l in range(self.sys.geo.num_layers):
        self.written.pop((l, int(a)), None)

  # -- checks ---------------------------------------------------------------------

  def check(self) -> None:
    sys_, state = self.sys, self.state
    Sd, Sh = sys_.device_slots, sys_.host_slots
    Hr, L = sys_.host_rows, sys_.geo.num_layers
    assert state.dev_pool.sharding.memory_kind == "device"
    assert state.host_pool.sharding.memory_kind == "pinned_host"
    assert state.dev_pool.shape[0] == L * Sd and state.host_pool.shape[0] == L * Hr
    dev_pool, host_pool = np.asarray(state.dev_pool), np.asarray(state.host_pool)
    for g, ref in enumerate(self.ref.groups):
      meta = jax.tree.map(lambda x: x[g], state.meta)
      table = np.asarray(meta.table)
      dev_owner, host_owner = np.asarray(meta.dev_owner), np.asarray(meta.host_owner)[:Sh]
      np.testing.assert_array_equal(table, ref.table_array())
      ref_dev, ref_host = ref.owners()
      np.testing.assert_array_equal(dev_owner, ref_dev)
      np.testing.assert_array_equal(host_owner, ref_host)
      view, ref_view = sys_.policy.describe(meta.policy), ref.policy.describe()
      for k, v in ref_view.items():
        np.testing.assert_array_equal(view[k], v, err_msg=k)

      # One slot per live address, one address per slot.
      live = np.flatnonzero(table != INVALID)
      locs = table[live]
      assert len(set(locs.tolist())) == len(locs)
      for a, loc in zip(live, locs):
        assert (dev_owner[loc] if loc < Sd else host_owner[loc - Sd]) == a
      assert (dev_owner != INVALID).sum() + (host_owner != INVALID).sum() == len(live)

      # Free sets agree with the owners.
      hfree = bitmap.np_unpack(meta.host_free[0], sys_.host_rows)
      np.testing.assert_array_equal(hfree[:Sh], host_owner == INVALID)
      assert not hfree[Sh:].any() and bitmap.is_consistent(meta.host_free)
      if isinstance(sys_.policy, PbLru):
        assert (view["in_buckets"] == 1).all() and bool(view["summaries_ok"])
        np.testing.assert_array_equal(view["bucket"] == FREE, dev_owner == INVALID)
      else:
        np.testing.assert_array_equal(view["stamp"] == FREE, dev_owner == INVALID)

      # Bytes: pools equal the reference's, and every live entry reads back as written.
      for l in sys_.geo.group_layers(g):
        dev = dev_pool[l * Sd:(l + 1) * Sd]
        host = host_pool[l * Hr:l * Hr + Sh]
        np.testing.assert_array_equal(dev, self.ref.dev_pools[l])
        np.testing.assert_array_equal(host, self.ref.host_pools[l])
        for a, loc in zip(live, locs):
          row = dev[loc] if loc < Sd else host[loc - Sd]
          np.testing.assert_array_equal(row, self.written[(l, int(a))])

  def all_free(self) -> bool:
    m = self.state.meta  # every group at once: leaves [G, ...]
    return bool((np.asarray(m.table) == INVALID).all()
                and (np.asarray(m.dev_owner) == INVALID).all()
                and (np.asarray(m.host_owner) == INVALID).all())


class Workload:
  """Requests on one dp rank: admission by pages, chunked prefill, decode, release."""

  def __init__(self, harness: Harness):
    self.h = harness
    sys_ = harness.sys
    self.B, self.k, self.page = sys_.max_batch, sys_.geo.top_k, sys_.page_size
    self.alloc = PageAllocator(sys_.num_logical // self.page)
    self.rows: list[Req | None] = [None] * self.B

  def can_admit(self, total_len: int) -> bool:
    return (any(r is None for r in self.rows)
            and -(-total_len // self.page) <= self.alloc.free_pages)

  def admit(self, prompt_len: int, total_len: int) -> None:
    row = self.rows.index(None)
    pages = self.alloc.allocate(-(-total_len // self.page))
    self.rows[row] = Req(pages, prompt_len, total_len, row)

  def prefilling(self) -> list[Req]:
    return [r for r in self.rows if r is not None and r.written < r.prompt_len]

  def decodable(self) -> list[Req]:
    return [r for r in self.rows
            if r is not None and r.prompt_len <= r.written < r.total_len]

  def live(self) -> list[Req]:
    return [r for r in self.rows if r is not None]

  def prefill_chunk(self, req: Req, n: int, rng) -> None:
    n = min(n, req.prompt_len - req.written)
    addrs = [req.addr(p, self.page) for p in range(req.written, req.written + n)]
    self.h.prefill(addrs, rng)
    req.written += n

  def decode(self, rng, picks: list[list[int]] | None = None, valid_p: float = 0.8) -> dict:
    """picks[b]: the positions row b selects (default: random, repeats allowed)."""
    G = self.h.sys.geo.num_groups
    sel = np.full((G, self.B, self.k), INVALID, np.int32)
    sel_valid = np.zeros((G, self.B, self.k), bool)
    new = np.full((self.B,), INVALID, np.int32)
    active = np.zeros((self.B,), bool)
    for r in self.decodable():
      b = r.row
      active[b] = True
      new[b] = r.addr(r.written, self.page)
      for g in range(G):
        pos = rng.integers(0, r.written + 1, size=self.k)  # the new token may be selected
        sel[g, b] = [r.addr(int(p), self.page) for p in pos]
        sel_valid[g, b] = rng.random(self.k) < valid_p
    stats = self.h.decode(sel, sel_valid, new, active, rng)
    for r in self.decodable():
      r.written += 1
    return stats

  def release(self, req: Req) -> None:
    # Padded to the whole address space, so every release has one shape (one compile).
    n = self.h.sys.num_logical
    addrs = np.full((n,), INVALID, np.int32)
    own = np.concatenate([p * self.page + np.arange(self.page) for p in req.pages])
    addrs[:own.shape[0]] = own
    valid = np.arange(n) < req.written
    self.h.release(addrs, valid)
    self.alloc.free(req.pages)
    self.rows[req.row] = None


# ----------------------------------------------------------------------------------
# Hypothesis state machine (small sizes)
# ----------------------------------------------------------------------------------

SMALL = dict(device=9, host=7, max_batch=2, top_k=3, page_size=4)  # M = 8, N = 16
SYSTEMS = {
    "pb_lru": make_system(policy="pb_lru", buckets=2, **SMALL),
    "lru": make_system(policy="lru", **SMALL),
}


class UlaMachine(RuleBasedStateMachine):
  system: Ula

  @initialize(seed=st.integers(0, 2**31 - 1))
  def setup(self, seed):
    self.rng = np.random.default_rng(seed)
    self.h = Harness(self.system)
    self.w = Workload(self.h)

  @rule(prompt_len=st.integers(1, 9), new_tokens=st.integers(1, 6))
  def admit(self, prompt_len, new_tokens):
    if self.w.can_admit(prompt_len + new_tokens):
      self.w.admit(prompt_len, prompt_len + new_tokens)

  @precondition(lambda self: bool(self.w.prefilling()))
  @rule(data=st.data(), n=st.integers(1, 6))
  def prefill(self, data, n):
    req = data.draw(st.sampled_from(self.w.prefilling()))
    self.w.prefill_chunk(req, n, self.rng)

  @precondition(lambda self: bool(self.w.decodable()))
  @rule(valid_p=st.sampled_from([0.5, 1.0]))
  def decode(self, valid_p):
    self.w.decode(self.rng, valid_p=valid_p)

  @precondition(lambda self: bool(self.w.live()))
  @rule(data=st.data())
  def release(self, data):
    self.w.release(data.draw(st.sampled_from(self.w.live())))

  @invariant()
  def agrees_with_reference(self):
    if hasattr(self, "h"):
      self.h.check()

  def teardown(self):
    if hasattr(self, "w"):
      for r in self.w.live():
        self.w.release(r)
      self.h.check()
      assert self.h.all_free()


_SETTINGS = settings(max_examples=12, stateful_step_count=20, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_state_machine(name):
  machine = type(f"UlaMachine_{name}", (UlaMachine,), {"system": SYSTEMS[name]})
  machine.TestCase.settings = _SETTINGS
  machine.TestCase().runTest()


# ----------------------------------------------------------------------------------
# A longer run with multi-word bitmaps
# ----------------------------------------------------------------------------------


def test_long_run_matches_reference(rng):
  # Bitmaps of three words with summaries; one group keeps the compile short.
  system = make_system(policy="pb_lru", buckets=3, device=70, host=45, max_batch=3,
                       top_k=8, page_size=8, num_layers=1, group_size=1)  # N = 112
  h = Harness(system, chunk=8)
  w = Workload(h)
  totals = {"hits": 0, "misses": 0, "evictions": 0}
  # Two long prompts overflow the 70 device slots, so the run starts with host entries.
  for _ in range(2):
    w.admit(38, 46)
  for req in w.live():
    while req.written < req.prompt_len:
      w.prefill_chunk(req, 8, rng)
  assert (np.asarray(h.state.meta.host_owner) >= 0).sum() == 76 - 70
  for _ in range(60):
    total = int(rng.integers(4, 40))
    if w.can_admit(total):
      w.admit(int(rng.integers(1, total)), total)
    for req in w.prefilling()[:1]:
      w.prefill_chunk(req, 8, rng)
    if w.decodable():
      for k, v in w.decode(rng).items():
        totals[k] += v
    done = [r for r in w.live() if r.written == r.total_len]
    for r in done[:1]:
      w.release(r)
    h.check()
  for r in w.live():
    w.release(r)
  h.check()
  assert h.all_free()
  # The run moved data both ways, so the comparison above covered fetch and write-back.
  assert totals["misses"] > 0 and totals["evictions"] > 0 and totals["hits"] > 0
