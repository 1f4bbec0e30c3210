"""ula against its NumPy reference over random admit / prefill / decode / release sequences.

Two drivers. ``UlaMachine`` (a hypothesis state machine) steps one sequence at a time
through one jitted transition per call and checks everything after every step, memory
kinds included. ``test_many_short_sequences_match_reference`` runs hundreds of short
sequences per policy as lanes of one compiled program and compares every lane with the
reference after every step (see its section below); ``test_ula_tp_properties`` does the
same for TP mode.

The state machine's harness drives the jax system (jitted, on one device's local state:
the dp axis of ``init_state`` stripped) and ``RefUla`` side by side and, after every step,
checks that they agree exactly (tables, owners, policy state, pools, slots, stats) and
that the invariants hold: each live address in exactly one slot, no slot with two
addresses, the bytes read back for every resolved entry are the bytes written, victims
never selected in their own step, host pools still in ``pinned_host``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st, target
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.addressing import PageAllocator
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.policies import FREE, PbLru
from ula_jax.memory.ula.policies import bitmap
from ula_jax.memory.ula.oracle import RefUla
from ula_jax.memory.ula.dp import Ula
from ula_jax.memory.ula.state import UlaState


def make_system(*, policy: str, buckets: int = 2, device: int, host: int, max_batch: int,
                top_k: int, page_size: int, num_layers: int = 3, group_size: int = 2,
                width: int = 4, host_layout: str = "layer_major") -> Ula:
  cfg = MemoryConfig(system="ula", device_pool=device, host_pool=host, policy=policy,
                     pb_lru_buckets=buckets, host_layout=host_layout)
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
        host = host_pool[np.asarray(sys_.host_row(l, jnp.arange(Sh, dtype=jnp.int32)))]
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
    # Exact LRU with the other host layout: an entry's layers side by side.
    "lru": make_system(policy="lru", host_layout="entry_major", **SMALL),
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


def soak_factor() -> int:
  """How many times the ``ci`` amount of random examples to run: 20 under the ``long``
  hypothesis profile (``ULA_HYPOTHESIS_PROFILE=long``, tests/conftest.py), else 1."""
  return 20 if os.environ.get("ULA_HYPOTHESIS_PROFILE", "ci") == "long" else 1


_SETTINGS = settings(max_examples=12 * soak_factor(), stateful_step_count=20, deadline=None,
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


# ----------------------------------------------------------------------------------
# Many short sequences: independent lanes of one compiled program
# ----------------------------------------------------------------------------------
#
# The state machine above checks a few dozen sequences per run; a bug that needs a
# particular order of misses, evictions and releases needs far more. Here every example
# is ``LANES`` independent random sequences of up to ``MAX_OPS`` operations. The page
# bookkeeping of a sequence does not depend on what the device computes, so each lane's
# whole sequence is laid out as fixed-shape arrays first; one jitted program (a loop
# over lanes, ``scan`` over steps, a traced group index in a ``scan`` over groups, the
# way the model runs its layer stack) runs every lane and returns its state after every
# step. Shapes never change, so each system compiles once per session. The reference
# then replays each lane and the two must agree after every step.

LANES = 8  # independent sequences per example
MAX_OPS = 12  # operations per sequence at most (shorter ones end in no-ops)
NOOP, PREFILL, DECODE, RELEASE = 0, 1, 2, 3
# Decode-heavy sequences: misses and evictions happen in decode steps.
OP_KINDS = st.sampled_from([DECODE, DECODE, DECODE, PREFILL, PREFILL, RELEASE])
LANE_PROGRAM = st.tuples(st.integers(0, 2**32 - 1),
                         st.lists(OP_KINDS, min_size=5, max_size=MAX_OPS))
PROGRAM = st.lists(LANE_PROGRAM, min_size=LANES, max_size=LANES)


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The static shapes of a lane program."""

  B: int  # decode rows
  k: int  # top-k
  G: int  # layer groups
  L: int  # layers
  W: int  # entry width
  C: int  # prefill chunk
  N: int  # logical addresses
  page: int

  @classmethod
  def of(cls, system, chunk: int = 4) -> Shapes:
    geo = system.geo
    return cls(B=system.max_batch, k=geo.top_k, G=geo.num_groups, L=geo.num_layers,
               W=geo.entry_width, C=chunk, N=system.num_logical, page=system.page_size)


class Script:
  """One lane's operations as fixed-shape arrays ``[T, ...]``, built on the host.

  Admission by pages, chunked prefill, decode and release as the engine does them; the
  drawn kind of an operation that cannot run (a decode with nothing to decode) falls
  back to one that can, so short sequences still decode often.
  """

  def __init__(self, sh: Shapes, T: int, seed: int):
    self.sh, self.rng = sh, np.random.default_rng(seed)
    B, k, G, L, W, C, N = sh.B, sh.k, sh.G, sh.L, sh.W, sh.C, sh.N
    self.x = dict(
        op=np.zeros((T,), np.int32),
        p_addr=np.full((T, C), INVALID, np.int32), p_valid=np.zeros((T, C), bool),
        p_entries=np.zeros((T, L, C, W), np.float32), p_row=np.zeros((T,), np.int32),
        sel=np.full((T, G, B, k), INVALID, np.int32), sel_valid=np.zeros((T, G, B, k), bool),
        new=np.full((T, B), INVALID, np.int32), active=np.zeros((T, B), bool),
        d_entries=np.zeros((T, L, B, W), np.float32),
        r_addr=np.full((T, N), INVALID, np.int32), r_valid=np.zeros((T, N), bool),
        r_row=np.zeros((T,), np.int32))
    self.alloc = PageAllocator(N // sh.page)
    self.rows: list[Req | None] = [None] * B
    self.t = 0

  def live(self) -> list[Req]:
    return [r for r in self.rows if r is not None]

  def prefilling(self) -> list[Req]:
    return [r for r in self.live() if r.written < r.prompt_len]

  def decodable(self) -> list[Req]:
    return [r for r in self.live() if r.prompt_len <= r.written < r.total_len]

  def _room(self) -> int:
    """Tokens a new request may take (0: no free row)."""
    return self.alloc.free_pages * self.sh.page if None in self.rows else 0

  def add(self, kind: int) -> None:
    """Appends one operation of ``kind`` (or the fallback that can run)."""
    rng = self.rng
    if kind == RELEASE and self.live():
      done = [r for r in self.live() if r.written == r.total_len]
      self._release(done[0] if done and rng.random() < 0.7 else
                    self.live()[rng.integers(len(self.live()))])
    elif kind == DECODE and self.decodable():
      self._decode()
    elif self.prefilling() or self._room() >= 2:
      if self._room() >= 2 and (not self.prefilling() or rng.random() < 0.3):
        total = int(rng.integers(2, min(13, self._room()) + 1))
        row = self.rows.index(None)
        prompt = int(rng.integers(1, min(total - 1, 2 * self.sh.C) + 1))
        self.rows[row] = Req(self.alloc.allocate(-(-total // self.sh.page)), prompt, total, row)
        self._prefill(self.rows[row])
      else:
        self._prefill(self.prefilling()[rng.integers(len(self.prefilling()))])
    elif self.decodable():
      self._decode()
    elif self.live():
      self._release(self.live()[0])
    self.t += 1

  def _prefill(self, req: Req) -> None:
    x, t, sh = self.x, self.t, self.sh
    # Mostly whole chunks: short sequences spend their operations decoding.
    n = sh.C if self.rng.random() < 0.7 else int(self.rng.integers(1, sh.C + 1))
    n = min(n, req.prompt_len - req.written)
    x["op"][t] = PREFILL
    x["p_addr"][t, :n] = [req.addr(p, sh.page) for p in range(req.written, req.written + n)]
    x["p_valid"][t, :n] = True
    x["p_entries"][t] = self.rng.standard_normal(x["p_entries"].shape[1:])
    x["p_row"][t] = req.row
    req.written += n

  def _decode(self) -> None:
    x, t, sh, rng = self.x, self.t, self.sh, self.rng
    x["op"][t] = DECODE
    valid_p = 0.6 if rng.random() < 0.3 else 1.0
    for r in self.decodable():
      x["active"][t, r.row] = True
      x["new"][t, r.row] = r.addr(r.written, sh.page)
      for g in range(sh.G):
        pos = rng.integers(0, r.written + 1, size=sh.k)  # the new token may be selected
        x["sel"][t, g, r.row] = [r.addr(int(p), sh.page) for p in pos]
        x["sel_valid"][t, g, r.row] = rng.random(sh.k) < valid_p
      r.written += 1
    x["d_entries"][t] = rng.standard_normal(x["d_entries"].shape[1:])

  def _release(self, req: Req) -> None:
    x, t, page = self.x, self.t, self.sh.page
    own = np.concatenate([p * page + np.arange(page) for p in req.pages])
    x["op"][t] = RELEASE
    x["r_addr"][t, :own.shape[0]] = own
    x["r_valid"][t] = np.arange(self.sh.N) < req.written
    x["r_row"][t] = req.row
    self.alloc.free(req.pages)
    self.rows[req.row] = None

  def finish(self) -> None:
    """Releases what is still live, in the no-op steps left at the end (if any)."""
    while self.t < self.x["op"].shape[0] and self.live():
      self._release(self.live()[0])
      self.t += 1


def build_scripts(system, program, T: int = MAX_OPS + 2) -> tuple[list[Script], dict]:
  """One ``Script`` per lane of ``program`` ([(seed, kinds)]) and their arrays stacked
  ``[lanes, T, ...]``; two steps more than operations leave room to release the
  requests still live at the end (``Script.finish``)."""
  sh = Shapes.of(system)
  scripts = []
  for seed, kinds in program:
    sc = Script(sh, T, seed)
    for kind in kinds:
      sc.add(kind)
    sc.finish()
    scripts.append(sc)
  xs = {name: np.stack([sc.x[name] for sc in scripts]) for name in scripts[0].x}
  return scripts, xs


def tree_where(c: jax.Array, a, b):
  """``a`` where ``c`` else ``b``, leaf by leaf."""
  return jax.tree.map(lambda u, v: jnp.where(c, u, v), a, b)


def decode_groups(system, state, sel, sel_valid, new, active, entries):
  """One decode step over every group: a ``scan`` with a traced group index (base.py's
  order: resolve, every layer's move, every layer's new token, then attention's read).

  returns (state, per group [G, ...]: slots, new_slot, the stats, the plan and the rows
  read [gs, B, k, W])
  """
  gs = system.geo.group_size
  assert system.geo.num_layers % gs == 0, "a traced group needs equal groups"

  def group(state, g):
    state, res = system.resolve(state, g, sel[g], sel_valid[g], new, active)
    for i in range(gs):
      state = system.move_layer(state, g * gs + i, res)
    reads = []
    for i in range(gs):
      state = system.write_token(state, g * gs + i, res, entries[g * gs + i], active)
      pool, base = system.read_pool(state, g * gs + i)
      reads.append(pool[base + jnp.clip(res.slots, 0, None)])
    return state, (res.slots, res.new_slot, res.stats, res.plan, jnp.stack(reads))

  return jax.lax.scan(group, state, jnp.arange(system.geo.num_groups, dtype=jnp.int32))


def lane_step(system, state, x):
  """One operation of one lane: every transition is computed and ``x['op']`` picks the
  state that follows (a no-op keeps the state: ``resolve`` alone would start a round)."""
  op = x["op"]
  pre = system.write_prefill(state, x["p_addr"], x["p_valid"], x["p_entries"], x["p_row"])
  dec, out = decode_groups(system, state, x["sel"], x["sel_valid"], x["new"], x["active"],
                           x["d_entries"])
  rel = system.release(state, x["r_addr"], x["r_valid"], x["r_row"])
  nxt = tree_where(op == PREFILL, pre,
                   tree_where(op == DECODE, dec, tree_where(op == RELEASE, rel, state)))
  return nxt, out


def empty_local_state(system: Ula) -> UlaState:
  """A DP ``ula``'s empty local state, built inside a trace (default memory kind: the
  lanes' states are intermediate values of one program)."""
  geo, L, W = system.geo, system.geo.num_layers, system.geo.entry_width
  return UlaState(
      dev_pool=jnp.zeros((L * system.device_slots, W), geo.kv_dtype),
      host_pool=jnp.zeros((L * system.host_rows, W), geo.kv_dtype),
      meta=system.init_meta(),
      index_keys=jnp.zeros((geo.num_groups, system.num_logical, geo.index_dim),
                           geo.index_dtype))


@functools.lru_cache(maxsize=None)
def lane_program(system: Ula):
  """The jitted lanes-by-steps program of a DP system (one compile per system)."""

  def step(state, x):
    state, out = lane_step(system, state, x)
    return state, (state, out)  # every step's state comes back for the comparison

  def run(xs):  # leaves [lanes, T, ...]
    # Lanes one after another (``lax.map``): ``vmap`` would turn the resolve's
    # conditionals into selects of both branches and take longer to compile.
    return jax.lax.map(lambda x: jax.lax.scan(step, empty_local_state(system), x)[1], xs)

  return jax.jit(run)


class Tally:
  """Counts over every example of one parametrisation (the test checks them at the end)."""

  def __init__(self):
    self.sequences = self.decode_steps = self.misses = self.evictions = 0
    self.missing_steps = self.evicting_steps = 0

  def decode(self, misses: np.ndarray, evictions: np.ndarray) -> None:
    """One decode step's misses and evictions, per group ([G])."""
    self.decode_steps += 1
    self.misses += int(misses.sum())
    self.evictions += int(evictions.sum())
    self.missing_steps += int(misses.sum() > 0)
    self.evicting_steps += int(evictions.sum() > 0)

  def __str__(self) -> str:
    return (f"{self.sequences} sequences, {self.decode_steps} decode steps "
            f"({self.missing_steps} missing, {self.evicting_steps} evicting), "
            f"{self.misses} misses, {self.evictions} evictions")


def same(got, want, what: str) -> None:
  """Exact equality (bits of float rows included); the message names the place."""
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape or not np.array_equal(got, want):
    np.testing.assert_array_equal(got, want, err_msg=what)


def padded(pairs: list, M: int) -> np.ndarray:
  """[(src, dst)] -> [2, M] int32, INVALID after the pairs (a plan's compacted lists)."""
  out = np.full((2, M), INVALID, np.int32)
  for i, (a, b) in enumerate(pairs):
    out[:, i] = (a, b)
  return out


def check_dp_lanes(system: Ula, scripts: list[Script], xs: dict, ys, tally: Tally) -> None:
  """Replays every lane on ``RefUla`` and compares it with the program's outputs after
  every step: tables, owners, policy state, both pools, slots, plans, stats, and the rows
  attention read (the bytes written, for every resolved entry)."""
  states, outs = jax.tree.map(np.asarray, ys)
  slots, new_slot, stats, plan, reads = outs
  geo, Sh = system.geo, system.host_slots
  M = system.max_batch * (geo.top_k + 1)
  for lane, sc in enumerate(scripts):
    x = {n: v[lane] for n, v in xs.items()}
    ref, truth = RefUla.like(system), {}
    tally.sequences += 1
    for t in range(x["op"].shape[0]):
      at = f"lane {lane} step {t}"
      op = int(x["op"][t])
      if op == PREFILL:
        ref.write_prefill(x["p_addr"][t], x["p_valid"][t], x["p_entries"][t])
        for j in np.flatnonzero(x["p_valid"][t]):
          for l in range(geo.num_layers):
            truth[(l, int(x["p_addr"][t, j]))] = x["p_entries"][t, l, j]
      elif op == DECODE:
        new, active = x["new"][t], x["active"][t]
        for b in np.flatnonzero(active):
          for l in range(geo.num_layers):
            truth[(l, int(new[b]))] = x["d_entries"][t, l, b]
        for g in range(geo.num_groups):
          sel, sel_valid = x["sel"][t, g], x["sel_valid"][t, g]
          step = ref.resolve(g, sel, sel_valid, new, active)
          for l in geo.group_layers(g):
            ref.move_layer(l, step)
            ref.write_token(l, step, x["d_entries"][t, l], active)
          same(slots[lane, t, g], step.slots, f"{at} group {g}: slots")
          same(new_slot[lane, t, g], step.new_slot, f"{at} group {g}: new_slot")
          for key, v in step.stats.items():
            same(stats[key][lane, t, g], v, f"{at} group {g}: {key}")
          same([plan.fetch_src[lane, t, g], plan.fetch_dst[lane, t, g]],
               padded(step.fetches, M), f"{at} group {g}: fetch list")
          same([plan.evict_src[lane, t, g], plan.evict_dst[lane, t, g]],
               padded(step.evictions, M), f"{at} group {g}: write-back list")
          needed = set(sel[sel_valid].tolist()) | set(new[active].tolist())
          assert not needed & set(step.victims), f"{at}: a victim is needed in its own step"
          for i, l in enumerate(geo.group_layers(g)):
            for b, j in zip(*np.nonzero(sel_valid)):
              same(reads[lane, t, g, i, b, j], truth[(l, int(sel[b, j]))],
                   f"{at} layer {l}: row read for address {sel[b, j]}")
        tally.decode(stats["misses"][lane, t], stats["evictions"][lane, t])
      elif op == RELEASE:
        ref.release(x["r_addr"][t], x["r_valid"][t])
        for a in x["r_addr"][t][x["r_valid"][t]]:
          for l in range(geo.num_layers):
            truth.pop((l, int(a)), None)
      # The whole state after the step.
      meta = states.meta
      for g, grp in enumerate(ref.groups):
        same(meta.table[lane, t, g], grp.table_array(), f"{at} group {g}: table")
        dev_owner, host_owner = grp.owners()
        same(meta.dev_owner[lane, t, g], dev_owner, f"{at} group {g}: device owners")
        same(meta.host_owner[lane, t, g, :Sh], host_owner, f"{at} group {g}: host owners")
        view = system.policy.describe(jax.tree.map(lambda a: a[lane, t, g], meta.policy))
        for key, v in grp.policy.describe().items():
          same(view[key], v, f"{at} group {g}: policy {key}")
      same(states.dev_pool[lane, t], np.concatenate(ref.dev_pools), f"{at}: device pool")
      if Sh:
        # The reference keeps a host pool per layer: [L][Sh, W] -> the system's layout.
        axis = 1 if system.host_layout == "entry_major" else 0
        want = np.stack(ref.host_pools, axis=axis).reshape(-1, ref.host_pools[0].shape[-1])
        same(states.host_pool[lane, t], want, f"{at}: host pool")
    # Every sequence ends with all of its requests released: nothing stays stored.
    assert not sc.live()
    assert (states.meta.table[lane, -1] == INVALID).all()
    assert (states.meta.dev_owner[lane, -1] == INVALID).all()
    assert (states.meta.host_owner[lane, -1] == INVALID).all()


LANE_GEO = dict(num_layers=4, group_size=2, width=2)  # two groups of two layers
LANE_SYSTEMS = {
    # Device pools of one decode step and a little more: most steps miss and evict.
    "pb_lru": make_system(policy="pb_lru", buckets=2, device=6, host=6, max_batch=2,
                          top_k=2, page_size=4, **LANE_GEO),  # N = 12
    "lru": make_system(policy="lru", device=6, host=6, max_batch=2, top_k=2, page_size=2,
                       host_layout="entry_major", **LANE_GEO),  # N = 12
}
# Per parametrisation under the ``ci`` profile: examples x LANES sequences (320), and how
# often the run must have missed and evicted at least (a run reaches about 2x the misses
# and 10x the evictions, in a few hundred decode steps that move data).
LANE_EXAMPLES = 40
MIN_MOVES = 150


def lane_settings(examples: int) -> settings:
  return settings(max_examples=examples * soak_factor(), deadline=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example])


def drive_lanes(name: str, system, run, check, examples: int) -> None:
  """Hypothesis draws ``examples`` programs of ``LANES`` sequences each; ``run`` executes
  them in one compiled call and ``check(system, scripts, xs, out, tally)`` replays them
  through the model. Asserts the sequences ran and moved data (misses and evictions)."""
  tally = Tally()

  @lane_settings(examples)
  @given(PROGRAM)
  def lanes(program):
    scripts, xs = build_scripts(system, program)
    before = tally.misses + tally.evictions
    check(system, scripts, xs, run(xs), tally)
    # Steer generation toward programs that move more data.
    target(float(tally.misses + tally.evictions - before), label="misses + evictions")

  lanes()
  print(f"\n[{name}] {tally}")
  assert tally.sequences >= examples * LANES * soak_factor()
  assert tally.misses >= MIN_MOVES and tally.evictions >= MIN_MOVES, str(tally)
  assert tally.missing_steps >= MIN_MOVES // 3 and tally.evicting_steps >= MIN_MOVES // 3


@pytest.mark.parametrize("name", sorted(LANE_SYSTEMS))
def test_many_short_sequences_match_reference(name):
  system = LANE_SYSTEMS[name]
  drive_lanes(name, system, lane_program(system), check_dp_lanes, LANE_EXAMPLES)
