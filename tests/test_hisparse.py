"""``hisparse``: LRU resolve against a NumPy oracle, data round trips, accounting, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ula_jax.config.schema import HiSparseConfig, MemoryConfig
from ula_jax.core.compat import shard_map
from ula_jax.memory import build_memory_system
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.hisparse import HiSparse
from ula_jax.memory.resident import Resident
from tests.memory_util import CHUNK, W, Workload, local_state, prefill_fn, put_dp, step_fn

GEO = KVGeometry(num_layers=3, group_size=2, entry_width=W, index_dim=4, top_k=4,
                 kv_dtype="float32")


def make_cfg(buffer=6, ratio=10.0, top_k=None, device_pool=None, host_pool=0, *,
             check=True) -> MemoryConfig:
  """check=False: the hisparse values skip the schema's checks and reach HiSparse as
  given, so its own checks are the ones under test."""
  hisparse = (HiSparseConfig if check else HiSparseConfig.model_construct)(
      top_k=top_k, device_buffer_size=buffer, host_to_device_ratio=ratio)
  return MemoryConfig(system="hisparse", device_pool=device_pool, host_pool=host_pool,
                      hisparse=hisparse)


def make_system(cfg=None, geo=GEO, dp=1, tp=1, max_batch=3, page_size=4, max_context=64):
  return build_memory_system(cfg or make_cfg(), geo, MeshInfo(dp, tp), max_batch=max_batch,
                             page_size=page_size, max_context=max_context)


# ----------------------------------------------------------------------------------
# The oracle: per row, look each selected address up, load misses into LRU victims
# ----------------------------------------------------------------------------------


class Oracle:
  """Plain-Python HiSparse buffers of one dp rank (one table per layer group)."""

  def __init__(self, system: HiSparse):
    self.R, self.Q, self.G = system.max_batch, system.quota, system.geo.num_groups
    S = self.R * self.Q
    self.slot_of = [dict() for _ in range(self.G)]
    self.slot_addr = [np.full(S, INVALID) for _ in range(self.G)]
    self.stamp = [np.full(S, -1) for _ in range(self.G)]
    self.clock = [0] * self.G

  def _victims(self, g, row, clock, n):
    cands = sorted((self.stamp[g][s], s) for s in range(row * self.Q, (row + 1) * self.Q)
                   if self.stamp[g][s] != clock)
    return [s for _, s in cands[:n]]

  def _place(self, g, slot, addr, clock):
    old = self.slot_addr[g][slot]
    if old >= 0:
      del self.slot_of[g][old]
    self.slot_addr[g][slot] = addr
    self.stamp[g][slot] = clock
    self.slot_of[g][addr] = slot

  def prefill(self, addrs, valid, row):
    keep = [a for a, v in zip(addrs, valid) if v and a >= 0][-self.Q:]
    for g in range(self.G):
      self.clock[g] += 1
      for a, s in zip(keep, self._victims(g, row, None, len(keep))):
        self._place(g, s, a, self.clock[g])

  def resolve(self, g, sel, valid, new, active):
    self.clock[g] += 1
    clock = self.clock[g]
    B, k = sel.shape
    slots = np.full((B, k), INVALID)
    new_slot = np.full(B, INVALID)
    hits = misses = 0
    for b in range(B):
      if not active[b]:
        continue
      has_new = new[b] >= 0
      seen, load = set(), []
      for i in range(k):
        a = sel[b, i]
        if not valid[b, i] or a < 0 or a in seen:
          continue
        seen.add(a)
        if has_new and a == new[b]:
          hits += 1
        elif a in self.slot_of[g]:
          self.stamp[g][self.slot_of[g][a]] = clock
          hits += 1
        else:
          load.append(a)
      misses += len(load)
      if has_new and new[b] in self.slot_of[g]:
        self.stamp[g][self.slot_of[g][new[b]]] = clock
      elif has_new:
        load.append(new[b])
      for a, s in zip(load, self._victims(g, b, clock, len(load))):
        self._place(g, s, a, clock)
      if has_new:
        new_slot[b] = self.slot_of[g][new[b]]
      for i in range(k):
        if valid[b, i] and sel[b, i] >= 0:
          slots[b, i] = self.slot_of[g][sel[b, i]]
    return slots, new_slot, hits, misses

  def release(self, addrs):
    for g in range(self.G):
      for a in addrs:
        s = self.slot_of[g].pop(a, None)
        if s is not None:
          self.slot_addr[g][s] = INVALID
          self.stamp[g][s] = -1


# ----------------------------------------------------------------------------------
# A workload of one dp rank: requests in rows, random KV, random selections
# ----------------------------------------------------------------------------------


def run_against_oracle(system, rng, steps=14):
  state = local_state(system)
  step = jax.jit(step_fn(system))
  prefill = jax.jit(prefill_fn(system))
  release = jax.jit(system.release)
  wl, oracle = Workload(system, rng), Oracle(system)
  R, k = system.max_batch, system.geo.top_k
  total = {"hits": 0, "misses": 0}

  def admit(row):
    nonlocal state
    for a, v, e in wl.admit(row, int(rng.integers(1, 2 * CHUNK + 3))):
      state = prefill(state, a, v, e, row)
      oracle.prefill(a, v, row)

  for row in range(R - 1):  # the last row starts empty and is admitted later
    admit(row)
  for t in range(steps):
    if t == steps // 2:  # a request leaves; its row is reused by a new one
      addrs = wl.finish(0)
      state = release(state, addrs, addrs >= 0, 0)
      oracle.release(addrs.tolist())
      admit(0)
      admit(R - 1)
    sel, sel_valid, new_addr, active = wl.decode_inputs(k)
    new_e = wl.entries(R)
    state, slots, new_slots, stats, reads = step(state, sel, sel_valid, new_addr, active, new_e)
    for g in range(wl.G):
      o_slots, o_new, o_hits, o_misses = oracle.resolve(g, sel[g], sel_valid[g], new_addr,
                                                        active)
      np.testing.assert_array_equal(np.asarray(slots[g]), o_slots, err_msg=f"step {t} group {g}")
      np.testing.assert_array_equal(np.asarray(new_slots[g]), o_new)
      assert int(stats[g]["hits"]) == o_hits
      assert int(stats[g]["misses"]) == o_misses
      total["hits"] += o_hits
      total["misses"] += o_misses
    wl.commit(new_addr, active, new_e)
    wl.check_reads(sel, sel_valid, active, np.asarray(reads))
  for g in range(wl.G):  # the device table agrees with the oracle's at the end
    np.testing.assert_array_equal(np.asarray(state.slot_addr[g]), oracle.slot_addr[g])
  return state, total


# ----------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------


def test_resolve_matches_lru_oracle(rng):
  """Random selections (duplicates, invalid entries, idle rows, a reused row) give the
  oracle's slots, and the rows read back at those slots are the rows written."""
  system = make_system(make_cfg(buffer=6))
  _, total = run_against_oracle(system, rng, steps=14)
  assert total["misses"] > 0 and total["hits"] > 0  # the buffer both hit and evicted


def test_resolve_matches_oracle_when_buffer_equals_top_k(rng):
  """device_buffer_size == top_k: the extra slot alone makes room for the token."""
  system = make_system(make_cfg(buffer=GEO.top_k), max_batch=2)
  run_against_oracle(system, rng, steps=10)


def test_context_that_fits_never_reads_from_host(rng):
  """Contexts up to the quota (device_buffer_size + 1 slots) are served on device."""
  system = make_system(make_cfg(buffer=12), max_batch=2)
  state = local_state(system)
  step, prefill = jax.jit(step_fn(system)), jax.jit(prefill_fn(system))
  wl = Workload(system, rng, max_new=6)
  for row in range(2):
    for a, v, e in wl.admit(row, system.quota - wl.max_new):
      state = prefill(state, a, v, e, row)
  for _ in range(wl.max_new):
    sel, sel_valid, new_addr, active = wl.decode_inputs(GEO.top_k, p_inactive=0.0)
    new_e = wl.entries(2)
    state, _, _, stats, reads = step(state, sel, sel_valid, new_addr, active, new_e)
    assert all(int(s["misses"]) == 0 and int(s["evictions"]) == 0 for s in stats)
    wl.commit(new_addr, active, new_e)
    wl.check_reads(sel, sel_valid, active, np.asarray(reads))


def test_accounting_hand_case_against_resident():
  """One 7-token request in row 0, quota 5 slots (buffer 4 + 1), 2 layer groups.

  hisparse: host 7 x 2 = 14 entries (all distinct); device holds the last 5 positions
  per group = 10 copies; physical 24, duplicates 10; quotas 2 rows x 5 x 2 = 20 slots,
  10 unused. resident: 14 slots used, 14 distinct, no duplicates. After one decode
  step selecting positions 0 (a miss) and 6 (a hit) while decoding position 7: host
  8 x 2 = 16; row 0's 5 slots were full, so the miss and the token evict the two
  oldest untouched entries (positions 2 and 3): still 5 per group, 10 duplicates."""
  geo = KVGeometry(num_layers=4, group_size=2, entry_width=W, index_dim=4, top_k=2,
                   kv_dtype="float32")
  his = make_system(make_cfg(buffer=4, ratio=4.0), geo=geo, max_batch=2, page_size=4)
  res_sys = Resident(MemoryConfig(system="resident", device_pool=64), geo, MeshInfo(1, 1),
                     max_batch=2, page_size=4, max_context=32)
  addrs = np.arange(8, dtype=np.int32)
  valid = addrs < 7
  entries = np.stack([np.ones((8, W), np.float32) * l for l in range(4)])
  h = jax.jit(prefill_fn(his))(local_state(his), addrs, valid, entries, 0)
  r = jax.jit(res_sys.write_prefill)(local_state(res_sys), addrs, valid, entries, 0)
  add_dp = lambda s: jax.tree.map(lambda x: np.asarray(x)[None], s)
  hr, rr = his.report(add_dp(h)), res_sys.report(add_dp(r))
  assert (hr.distinct_total, hr.physical_used, hr.duplicates) == (14, 24, 10)
  assert (int(hr.device_used.sum()), int(hr.host_used.sum())) == (10, 14)
  assert int(hr.device_capacity.sum()) == 20
  assert hr.extra["quota_unused_slots"] == [10]
  assert hr.extra["quota_rows_in_use"] == [1]
  assert (rr.distinct_total, rr.physical_used, rr.duplicates) == (14, 14, 0)
  assert hr.distinct_total == rr.distinct_total

  sel = np.array([[[0, 6], [0, 0]]] * 2, np.int32)
  sel_valid = np.array([[[True, True], [False, False]]] * 2)
  new_addr, active = np.array([7, INVALID], np.int32), np.array([True, False])
  new_e = np.stack([np.full((2, W), 10.0 + l, np.float32) for l in range(4)])
  h, _, _, stats, _ = jax.jit(step_fn(his))(h, sel, sel_valid, new_addr, active, new_e)
  assert [(int(s["hits"]), int(s["misses"]), int(s["evictions"])) for s in stats] == [(1, 1, 2)] * 2
  hr = his.report(add_dp(h))
  assert (hr.distinct_total, int(hr.device_used.sum()), hr.duplicates) == (16, 10, 10)
  # the evicted entries are the two oldest untouched slots: positions 2 and 3
  on_device = sorted(int(a) for a in np.asarray(h.slot_addr[0]) if a >= 0)
  assert on_device == [0, 4, 5, 6, 7]


def test_accounting_counts_tp_replicas(rng):
  """With tp = 2 every buffer and host pool is held by both tp ranks."""
  system = make_system(make_cfg(buffer=4), dp=1, tp=2, max_batch=2)
  mesh = jax.make_mesh((1, 2), ("dp", "tp"))
  state = system.init_state(mesh)
  specs = system.state_specs(state)
  addrs = np.arange(8, dtype=np.int32)[None]
  entries = rng.normal(size=(1, 3, 8, W)).astype(np.float32)  # [dp, L, C, W]

  def body(s, a, e):
    s = jax.tree.map(lambda x: x[0], s)
    s = system.write_prefill(s, a[0], a[0] >= 0, e[0], 1)
    return jax.tree.map(lambda x: x[None], s)

  f = jax.jit(shard_map(body, mesh=mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=specs))
  rep = system.report(f(state, *put_dp(mesh, (addrs, entries))))
  assert rep.device_used.tolist() == [[10, 10]] and rep.host_used.tolist() == [[16, 16]]
  assert rep.distinct.tolist() == [16]
  assert rep.duplicates == 2 * (10 + 16) - 16


def test_sizes_follow_hisparse_config():
  cfg = make_cfg(buffer=6, ratio=2.5)
  system = make_system(cfg, max_batch=3, page_size=4)
  assert system.quota == 7 and system.device_slots == 21
  assert system.capacity_tokens == (int(2.5 * 21) // 4) * 4
  assert system.top_k == GEO.top_k
  budget = make_system(make_cfg(buffer=6, ratio=2.0, device_pool=40), max_batch=3)
  assert budget.capacity_tokens == 80
  host = make_system(make_cfg(buffer=6, host_pool=f"{GEO.token_bytes * 50}B"), max_batch=3)
  assert host.capacity_tokens == 48


@pytest.mark.parametrize("cfg, match", [
    (make_cfg(top_k=8), r"memory.hisparse.top_k=8: must equal the model's index_topk=4"),
    (make_cfg(buffer=3), r"memory.hisparse.device_buffer_size=3: must be >= top_k=4"),
    (make_cfg(ratio=0.0, check=False), r"memory.hisparse.host_to_device_ratio=0.0: must be > 0"),
    (make_cfg(device_pool=10), r"memory.device_pool holds 10 tokens per device, fewer than "
                               r"max_batch x \(device_buffer_size \+ 1\) = 3 x 7 = 21"),
    (make_cfg(host_pool=3), r"host pool holds 0 tokens per device, fewer than one page"),
])
def test_config_errors(cfg, match):
  with pytest.raises(ValueError, match=match):
    make_system(cfg)


def test_call_errors():
  system = make_system()
  state = local_state(system)
  k = GEO.top_k

  def resolve(g, B, k):
    return jax.eval_shape(lambda s: system.resolve(
        s, g, jnp.zeros((B, k), jnp.int32), jnp.ones((B, k), bool), jnp.zeros(B, jnp.int32),
        jnp.ones(B, bool)), state)

  with pytest.raises(ValueError, match=r"sel_addr has 2 rows; expected max_batch=3"):
    resolve(0, 2, k)
  with pytest.raises(ValueError, match=r"selection width k=7 exceeds "
                                       r"memory.hisparse.device_buffer_size=6"):
    resolve(0, 3, 7)
  # The layer check needs the planning group's value: resolve for real (not abstractly).
  _, res = system.resolve(state, 1, jnp.zeros((3, k), jnp.int32), jnp.ones((3, k), bool),
                          jnp.zeros(3, jnp.int32), jnp.ones(3, bool))
  with pytest.raises(ValueError, match=r"layer=0 is not in layer group 1 \(layers \[2\]\)"):
    system.move_layer(state, 0, res)
  with pytest.raises(ValueError, match=r"layer=1 is not in layer group 1"):
    system.write_token(state, 1, res, jnp.zeros((3, W)), jnp.ones(3, bool))


def test_copies_go_through_the_configured_fetch_kernel():
  system = make_system()
  system.fetch_impl = "nope"  # the engine sets it from kernels.fetch
  state = local_state(system)
  k = GEO.top_k
  _, res = jax.eval_shape(lambda s: system.resolve(
      s, 0, jnp.zeros((3, k), jnp.int32), jnp.ones((3, k), bool), jnp.zeros(3, jnp.int32),
      jnp.ones(3, bool)), state)
  with pytest.raises(ValueError, match=r"kernels.fetch='nope': expected one of"):
    jax.eval_shape(lambda s, r: system.move_layer(s, 0, r), state, res)


def test_under_shard_map_on_8_devices(rng):
  """Prefill and decode inside shard_map over a (dp=4, tp=2) mesh: every dp rank's
  reads equal what it wrote, and the pools keep their memory kinds."""
  dp, tp, R = 4, 2, 2
  system = make_system(make_cfg(buffer=6), dp=dp, tp=tp, max_batch=R)
  mesh = jax.make_mesh((dp, tp), ("dp", "tp"))
  state = system.init_state(mesh)
  specs = system.state_specs(state)
  strip = lambda t: jax.tree.map(lambda x: x[0], t)
  add = lambda t: jax.tree.map(lambda x: x[None], t)
  prefill, step = prefill_fn(system), step_fn(system)

  def sm(fn, n_in, n_out_extra):
    body = lambda s, *args: add(fn(strip(s), *strip(args)))
    out_specs = specs if n_out_extra == 0 else (specs,) + (P("dp"),) * n_out_extra
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=(specs,) + (P("dp"),) * n_in,
                          out_specs=out_specs))
    return lambda s, *args: f(s, *put_dp(mesh, args))

  prefill_sm = sm(prefill, 4, 0)
  step_sm = sm(step, 5, 4)
  loads = [Workload(system, np.random.default_rng(rng.integers(2**31))) for _ in range(dp)]
  for row in range(R):
    chunks = [wl.admit(row, 11) for wl in loads]
    for c in range(len(chunks[0])):
      args = [np.stack([chunks[d][c][i] for d in range(dp)]) for i in range(2)]
      ents = np.stack([chunks[d][c][2] for d in range(dp)])  # [dp, L, C, W]
      state = prefill_sm(state, args[0], args[1], ents, np.full((dp,), row, np.int32))
  for _ in range(4):
    inputs = [wl.decode_inputs(GEO.top_k) for wl in loads]
    new_e = [wl.entries(R) for wl in loads]
    stacked = [np.stack([inp[i] for inp in inputs]) for i in range(4)]
    ents = np.stack(new_e)  # [dp, L, R, W]
    state, slots, _, stats, reads = step_sm(state, *stacked, ents)
    for d, wl in enumerate(loads):
      sel, sel_valid, new_addr, active = inputs[d]
      wl.commit(new_addr, active, new_e[d])
      wl.check_reads(sel, sel_valid, active, np.asarray(reads)[d])
  assert state.host_pool.sharding.memory_kind == "pinned_host"
  assert state.dev_pool.sharding.memory_kind == "device"
