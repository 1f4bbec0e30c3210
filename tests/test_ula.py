"""ula (DP mode): sizes and validation, layout and memory kinds, a hand-checked step,
accounting, equality with ``resident``'s rows, and a sharded step on 8 devices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.config.schema import MemoryConfig
from ula_jax.core import compat
from ula_jax.memory import build_memory_system, system_class
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.oracle import RefUla
from ula_jax.memory.resident import Resident
from ula_jax.memory.ula.dp import Ula

GEO = KVGeometry(num_layers=3, group_size=2, entry_width=4, index_dim=2, top_k=3,
                 kv_dtype="float32")  # groups: layers (0, 1) and (2,)


CFG = dict(system="ula", device_pool=9, host_pool=7, policy="pb_lru", pb_lru_buckets=2)


def make_cfg(**kw) -> MemoryConfig:
  return MemoryConfig(**{**CFG, **kw})


def unchecked_cfg(**kw) -> MemoryConfig:
  """``make_cfg`` without the schema's checks: the values reach Ula as given, so its
  own checks are the ones under test."""
  return MemoryConfig.model_construct(**{**CFG, **kw})


def build(cfg=None, *, geo=GEO, mesh_info=MeshInfo(1, 1), max_batch=2, page_size=4,
          max_context=8) -> Ula:
  return Ula(cfg or make_cfg(), geo, mesh_info, max_batch=max_batch, page_size=page_size,
             max_context=max_context)


def one_device_mesh():
  return jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1])


def local(state):
  return jax.jit(lambda s: jax.tree.map(lambda x: x[0], s))(state)


def rows(rng, n, L=3, W=4):
  """[L, n, W] float32: one row per layer and entry (layer-major, as prefill takes them)."""
  return rng.standard_normal((L, n, W)).astype(np.float32)


def layer_view(pool_base, size):
  """``read_pool``'s ``(pool, base)`` / ``read_host_pool``'s ``(pool, base, stride)`` ->
  that layer's [size, W]."""
  pool, base, stride = (*pool_base, 1)[:3]
  return np.asarray(pool)[int(base) + stride * np.arange(size)]


def gather(pool_base, slots):
  """The rows attention reads: ``pool[base + slots]``."""
  pool, base = pool_base
  return np.asarray(pool)[int(base) + np.asarray(slots)]


@functools.lru_cache(maxsize=None)
def default_system(host_layout: str = "layer_major") -> Ula:
  """One shared instance per host layout, so tests share its compiled functions."""
  return build(make_cfg(host_layout=host_layout))


@functools.lru_cache(maxsize=None)
def jitted(system):
  return {
      "prefill": jax.jit(system.write_prefill),
      "resolve": jax.jit(system.resolve, static_argnums=1),
      "move": jax.jit(system.move_layer, static_argnums=1),
      "write": jax.jit(system.write_token, static_argnums=1),
      "release": jax.jit(system.release),
  }


# ----------------------------------------------------------------------------------
# sizes and validation
# ----------------------------------------------------------------------------------


def test_sizes_in_tokens():
  s = build(make_cfg(device_pool=16, host_pool=9))
  assert (s.device_slots, s.host_slots) == (16, 9)
  assert s.capacity_tokens == s.num_logical == 24  # 25 rounded down to pages of 4
  assert s.step_entries == 2 * (3 + 1)
  s.validate()


def test_sizes_in_bytes():
  assert GEO.token_bytes == 3 * 4 * 4
  s = build(make_cfg(device_pool="1KiB", host_pool="0.5KiB"))
  assert (s.device_slots, s.host_slots) == (1024 // 48, 512 // 48)
  assert s.num_logical == (21 + 10) // 4 * 4


def test_defaults():
  cfg = MemoryConfig(system="ula")  # the schema's defaults: no device_pool, host_pool, ...
  s = build(cfg, max_batch=2, max_context=8)
  assert (s.device_slots, s.host_slots) == (16, 0)
  assert (s.policy_name, s.buckets) == ("pb_lru", 32)


def test_registry_builds_and_validates():
  assert system_class("ula") is Ula
  s = build_memory_system(make_cfg(), GEO, MeshInfo(1, 1), max_batch=2, page_size=4,
                          max_context=8)
  assert isinstance(s, Ula) and s.name == "ula"
  with pytest.raises(ValueError, match=r"memory\.device_pool=5 holds 5 tokens"):
    build_memory_system(make_cfg(device_pool=5), GEO, MeshInfo(1, 1), max_batch=2,
                        page_size=4, max_context=8)


@pytest.mark.parametrize("kw,match", [
    (dict(device_pool=7),
     r"memory\.device_pool=7 holds 7 tokens per device and layer group, fewer than one "
     r"decode step needs on the device: engine\.max_batch \* \(top_k \+ 1\) = 2 \* \(3 \+ 1\)"
     r" = 8; use memory\.device_pool >= 8 tokens \(384 bytes\)"),
    (dict(device_pool="300B"), r"memory\.device_pool='300B' holds 6 tokens"),
    (dict(device_pool=-1), r"memory\.device_pool=-1: must be >= 0 tokens"),
    (dict(device_pool="lots"), r"memory\.device_pool='lots': expected a token count"),
    (dict(host_pool=-3), r"memory\.host_pool=-3: must be >= 0 tokens"),
    (dict(host_pool="8 parsecs"), r"memory\.host_pool='8 parsecs': expected a token count"),
    (dict(policy="fifo"), r"memory\.policy='fifo': expected one of \['pb_lru', 'lru'\]"),
    (dict(pb_lru_buckets=0), r"memory\.pb_lru_buckets=0: expected an integer >= 1"),
    (dict(pb_lru_buckets=True), r"memory\.pb_lru_buckets=True: expected an integer >= 1"),
])
def test_validate_rejects(kw, match):
  with pytest.raises(ValueError, match=match):
    build(unchecked_cfg(**kw)).validate()


def test_validate_rejects_capacity_below_a_page():
  geo = KVGeometry(num_layers=1, group_size=1, entry_width=4, index_dim=2, top_k=1)
  s = build(make_cfg(device_pool=2, host_pool=1), geo=geo, max_batch=1, page_size=4)
  with pytest.raises(ValueError, match=r"memory\.device_pool \+ memory\.host_pool = 2 \+ 1 "
                     r"tokens per device, fewer than one page \(engine\.page_size=4\)"):
    s.validate()


# ----------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------


def test_init_state_layout_and_memory_kinds():
  s = build(mesh_info=MeshInfo(2, 1))
  mesh = jax.make_mesh((2, 1), ("dp", "tp"), devices=jax.devices()[:2])
  state = s.init_state(mesh)
  # 3 layers of 9 device / 7 host rows each, flat; 2 groups of metadata, stacked.
  p = state.dev_pool
  assert p.shape == (2, 3 * 9, 4) and p.sharding.memory_kind == "device"
  assert p.sharding.spec == P("dp")
  p = state.host_pool
  assert p.shape == (2, 3 * 7, 4) and p.sharding.memory_kind == "pinned_host"
  assert p.sharding.spec == P("dp")
  m = state.meta
  assert m.table.shape == (2, 2, 16) and (np.asarray(m.table) == INVALID).all()
  assert m.dev_owner.shape == (2, 2, 9) and m.host_owner.shape == (2, 2, 7)
  assert m.policy.ring[0].shape == (2, 2, 2, 1) and m.policy.cur.shape == (2, 2)
  assert state.index_keys.shape == (2, 2, 16, 2)
  for leaf in jax.tree.leaves(state.meta):
    assert leaf.shape[:2] == (2, 2)
    assert leaf.sharding.memory_kind == "device" and leaf.sharding.spec[0] == "dp"
  assert all(spec == P("dp") for spec in jax.tree.leaves(s.state_specs(state)))
  # Stripping the dp axis (one rank's view) keeps every leaf in its memory space.
  loc = local(build().init_state(one_device_mesh()))
  assert loc.host_pool.sharding.memory_kind == "pinned_host"
  assert loc.dev_pool.sharding.memory_kind == "device"


# ----------------------------------------------------------------------------------
# a hand-checked step
# ----------------------------------------------------------------------------------


def _scenario(host_layout: str = "layer_major"):
  """Prefill addresses 0..11 (device 0..8, host 0..2), then one decode step of group 0.

  Selection [[10, 11, 0], [1, 2, 12]], new tokens [12, 13]: hits 0, 1, 2; misses 10, 11
  (host 1, 2); new 12, 13. Four entries move in; the device is full, so the four oldest
  non-selected slots 3..6 (PB-LRU: the recent bucket written by prefill) go to host
  slots 1, 2 (vacated by the misses) and 3, 4.
  """
  s = default_system(host_layout)
  f = jitted(s)
  rng = np.random.default_rng(0)
  state = local(s.init_state(one_device_mesh()))
  data = rows(rng, 12)
  state = f["prefill"](state, jnp.arange(12, dtype=jnp.int32), jnp.ones(12, bool),
                       jnp.asarray(data), jnp.int32(0))
  sel = jnp.asarray([[10, 11, 0], [1, 2, 12]], jnp.int32)
  new, active = jnp.asarray([12, 13], jnp.int32), jnp.ones(2, bool)
  state, res = f["resolve"](state, 0, sel, jnp.ones((2, 3), bool), new, active)
  return s, f, state, res, data, rng


@pytest.mark.parametrize("host_layout", ["layer_major", "entry_major"])
def test_hand_checked_step(host_layout):
  s, f, state, res, data, rng = _scenario(host_layout)
  np.testing.assert_array_equal(np.asarray(res.slots), [[3, 4, 0], [1, 2, 5]])
  np.testing.assert_array_equal(np.asarray(res.new_slot), [5, 6])
  assert {k: int(v) for k, v in res.stats.items()} == {"hits": 3, "misses": 2,
                                                        "evictions": 4}
  p = res.plan
  assert (int(p.n_fetch), int(p.n_evict)) == (2, 4)
  np.testing.assert_array_equal(np.asarray(p.fetch_src)[:2], [1, 2])
  np.testing.assert_array_equal(np.asarray(p.fetch_dst)[:2], [3, 4])
  np.testing.assert_array_equal(np.asarray(p.evict_src)[:4], [3, 4, 5, 6])
  np.testing.assert_array_equal(np.asarray(p.evict_dst)[:4], [1, 2, 3, 4])
  assert (np.asarray(p.fetch_src)[2:] == INVALID).all()
  Sd = 9
  table = np.asarray(state.meta.table[0])
  np.testing.assert_array_equal(
      table[:14], [0, 1, 2, Sd + 1, Sd + 2, Sd + 3, Sd + 4, 7, 8, Sd + 0, 3, 4, 5, 6])
  # Group 1 has its own table: still as prefill left it.
  np.testing.assert_array_equal(np.asarray(state.meta.table[1])[:12],
                                list(range(9)) + [Sd, Sd + 1, Sd + 2])

  new_rows = rows(rng, 2)
  for l in (0, 1):
    state = f["move"](state, l, res)
  for l in (0, 1):
    state = f["write"](state, l, res, jnp.asarray(new_rows[l]), jnp.ones(2, bool))
  for l in (0, 1):
    dev = layer_view(s.read_pool(state, l), 9)
    host = layer_view(s.read_host_pool(state, l), 7)
    want = {a: data[l][a] for a in range(12)} | {12: new_rows[l][0], 13: new_rows[l][1]}
    for b, i in np.ndindex(2, 3):
      a = int(np.asarray([[10, 11, 0], [1, 2, 12]])[b, i])
      np.testing.assert_array_equal(dev[int(res.slots[b, i])], want[a])
    for h, a in zip([1, 2, 3, 4], [3, 4, 5, 6]):
      np.testing.assert_array_equal(host[h], want[a])
  assert state.host_pool.sharding.memory_kind == "pinned_host"
  # Layer 2 (group 1) did not move.
  np.testing.assert_array_equal(layer_view(s.read_pool(state, 2), 9), data[2][:9])
  np.testing.assert_array_equal(layer_view(s.read_host_pool(state, 2), 7)[:3], data[2][9:])


@pytest.mark.parametrize("impl, host_layout", [("xla", "layer_major"), ("pallas", "layer_major"),
                                               ("pallas", "entry_major")])
def test_move_group_moves_what_move_layer_moves_layer_by_layer(impl, host_layout):
  """move_group (one stage, fetch and evict launch for the group's layers, its first
  layer traced) leaves both pools bit for bit as move_layer for each layer does, in the
  hand-checked step where victims take the host slots the misses vacate."""
  # Its own instance: the kernels' implementation is set below.
  s = build(make_cfg(host_layout=host_layout))
  s.set_fetch_impl(impl)
  _, _, state, res, _, _ = _scenario(host_layout)
  # Off the one-device mesh (the engine runs moves inside shard_map, where arrays carry
  # no mesh axes; Pallas' interpret mode takes none), each leaf in its own memory.
  own = lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                    memory_kind=x.sharding.memory_kind)
  state, res = jax.tree.map(lambda x: jax.device_put(np.asarray(x), own(x)), (state, res))
  by_layer = state
  for l in (0, 1):
    by_layer = jax.jit(s.move_layer, static_argnums=1)(by_layer, l, res)
  group = jax.jit(s.move_group, static_argnums=2)(state, jnp.int32(0), 2, res)
  for name in ("dev_pool", "host_pool"):
    want, got = np.asarray(getattr(by_layer, name)), np.asarray(getattr(group, name))
    assert not np.array_equal(want, np.asarray(getattr(state, name)))  # rows moved
    np.testing.assert_array_equal(got, want)
  assert group.host_pool.sharding.memory_kind == "pinned_host"


def test_report_counts_each_entry_once():
  s, _, state, _, _, _ = _scenario()
  rep = s.report(jax.tree.map(lambda x: x[None], state))
  # Group 0: 9 on the device, host holds 9 and the 4 victims; group 1: as prefilled.
  assert rep.device_used.tolist() == [[18]] and rep.host_used.tolist() == [[5 + 3]]
  assert rep.distinct.tolist() == [14 + 12]
  assert rep.duplicates == 0 and rep.distinct_fraction == 1.0
  assert rep.device_capacity.tolist() == [[18]] and rep.host_capacity.tolist() == [[14]]
  assert rep.entry_bytes == 2 * 4 * 4
  assert rep.extra["policy"] == "pb_lru" and rep.extra["layout"] == "dp"


def test_report_counts_tp_copies():
  s = build(mesh_info=MeshInfo(1, 2))
  state = s.init_state(jax.make_mesh((1, 2), ("dp", "tp"), devices=jax.devices()[:2]))
  # Group 0 of dp rank 0 holds three entries.
  table = np.asarray(state.meta.table).copy()
  table[0, 0, :3] = [0, 1, 9]
  owner = np.asarray(state.meta.dev_owner).copy()
  owner[0, 0, :2] = [0, 1]
  host_owner = np.asarray(state.meta.host_owner).copy()
  host_owner[0, 0, 0] = 2
  meta = state.meta.replace(table=table, dev_owner=owner, host_owner=host_owner)
  rep = s.report(state.replace(meta=meta))
  assert rep.device_used.tolist() == [[2, 2]] and rep.host_used.tolist() == [[1, 1]]
  assert rep.distinct.tolist() == [3] and rep.duplicates == 3
  assert rep.extra["layout"] == "dp_replicated"


def test_release_frees_every_slot():
  s, f, state, res, _, _ = _scenario()
  addrs = jnp.arange(16, dtype=jnp.int32)
  state = f["release"](state, addrs, addrs < 14, jnp.int32(0))
  for g in range(GEO.num_groups):
    m = jax.tree.map(lambda x: x[g], state.meta)
    assert (np.asarray(m.table) == INVALID).all()
    assert (np.asarray(m.dev_owner) == INVALID).all()
    assert (np.asarray(m.host_owner) == INVALID).all()
    assert (s.policy.describe(m.policy)["bucket"] == -1).all()


def test_prefill_rewrites_in_place_and_unstored_selections_get_no_slot():
  s = default_system()
  f = jitted(s)
  rng = np.random.default_rng(4)
  state = local(s.init_state(one_device_mesh()))
  ones = jnp.ones(12, bool)
  state = f["prefill"](state, jnp.arange(12, dtype=jnp.int32), ones,
                       jnp.asarray(rows(rng, 12)), jnp.int32(0))
  before = np.asarray(state.meta.table)
  # Rewriting stored addresses (10 on the host, 3 on the device) takes no new slot.
  again = rows(rng, 12)
  addrs = jnp.asarray([10, 3] + [INVALID] * 10, jnp.int32)
  state = f["prefill"](state, addrs, jnp.arange(12) < 2, jnp.asarray(again), jnp.int32(0))
  np.testing.assert_array_equal(np.asarray(state.meta.table), before)
  for l in range(3):
    np.testing.assert_array_equal(layer_view(s.read_host_pool(state, l), 7)[1], again[l][0])
    np.testing.assert_array_equal(layer_view(s.read_pool(state, l), 9)[3], again[l][1])
  # Address 14 was never stored and is no new token: no slot, no placement, no count.
  sel = jnp.asarray([[14, 0, 1], [2, 14, 12]], jnp.int32)
  state, res = f["resolve"](state, 0, sel, jnp.ones((2, 3), bool),
                            jnp.asarray([12, INVALID], jnp.int32), jnp.asarray([True, False]))
  slots = np.asarray(res.slots)
  assert slots[0, 0] == slots[1, 1] == INVALID and (slots[[0, 0, 1], [1, 2, 0]] >= 0).all()
  assert np.asarray(res.new_slot)[1] == INVALID and slots[1, 2] == np.asarray(res.new_slot)[0]
  assert int(np.asarray(state.meta.table[0])[14]) == INVALID
  assert {k: int(v) for k, v in res.stats.items()} == {"hits": 3, "misses": 0,
                                                        "evictions": 1}


def test_without_host_pool_nothing_moves():
  s = build(make_cfg(device_pool=12, host_pool=0))
  assert s.num_logical == 12 and s.host_rows == 1
  f = jitted(s)
  rng = np.random.default_rng(1)
  state = local(s.init_state(one_device_mesh()))
  data = rows(rng, 10)
  state = f["prefill"](state, jnp.arange(10, dtype=jnp.int32), jnp.ones(10, bool),
                       jnp.asarray(data), jnp.int32(0))
  sel = jnp.asarray([[9, 3, 10], [0, 11, 5]], jnp.int32)
  state, res = f["resolve"](state, 0, sel, jnp.ones((2, 3), bool),
                            jnp.asarray([10, 11], jnp.int32), jnp.ones(2, bool))
  assert {k: int(v) for k, v in res.stats.items()} == {"hits": 4, "misses": 0,
                                                        "evictions": 0}
  assert s.move_layer(state, 0, res) is state
  np.testing.assert_array_equal(np.asarray(res.slots), [[9, 3, 10], [0, 11, 5]])


# ----------------------------------------------------------------------------------
# the rows attention reads are resident's rows
# ----------------------------------------------------------------------------------


def test_reads_the_same_rows_as_resident():
  """Same prefill and decode steps into ``resident`` and a ula whose device holds only
  9 of 16 entries per group: for every selection, ``read_pool(l)[slots]`` agree."""
  rng = np.random.default_rng(2)
  ula = default_system()
  res_sys = Resident(MemoryConfig(system="resident", device_pool=16), GEO,
                     MeshInfo(1, 1), max_batch=2, page_size=4, max_context=8)
  systems = [ula, res_sys]
  states = [local(x.init_state(one_device_mesh())) for x in systems]
  fs = [jitted(x) for x in systems]
  # Two requests: addresses 0..7 and 8..15, prompts of 5, three decode steps each.
  prompt = np.asarray([0, 1, 2, 3, 4, 8, 9, 10, 11, 12], np.int32)
  data = rows(rng, 10)
  for i, (x, f) in enumerate(zip(systems, fs)):
    for c in (slice(0, 5), slice(5, 10)):
      states[i] = f["prefill"](states[i], jnp.asarray(prompt[c]), jnp.ones(5, bool),
                               jnp.asarray(data[:, c]), jnp.int32(0))
  for t in range(3):
    pos = 5 + t
    new = jnp.asarray([pos, 8 + pos], jnp.int32)
    active = jnp.ones(2, bool)
    entries = rows(rng, 2)
    for g in range(GEO.num_groups):
      picks = rng.integers(0, pos + 1, size=(2, 3)) + np.asarray([[0], [8]])
      sel, valid = jnp.asarray(picks, jnp.int32), jnp.asarray(rng.random((2, 3)) < 0.9)
      read = []
      for i, (x, f) in enumerate(zip(systems, fs)):
        states[i], res = f["resolve"](states[i], g, sel, valid, new, active)
        for l in GEO.group_layers(g):
          states[i] = f["move"](states[i], l, res)
        got = []
        for l in GEO.group_layers(g):
          states[i] = f["write"](states[i], l, res, jnp.asarray(entries[l]), active)
          got.append(gather(x.read_pool(states[i], l), res.slots))
        read.append(np.where(np.asarray(valid)[None, :, :, None], np.stack(got), 0))
      np.testing.assert_array_equal(read[0], read[1])
  assert int(np.asarray(states[0].meta.host_owner[0] >= 0).sum()) > 0


# ----------------------------------------------------------------------------------
# sharded: 8 devices, ('dp', 'tp') = (4, 2)
# ----------------------------------------------------------------------------------


def test_sharded_step_on_eight_devices():
  # One group of two layers, bf16 rows (copies must keep every bit).
  geo = KVGeometry(num_layers=2, group_size=2, entry_width=4, index_dim=2, top_k=3,
                   kv_dtype="bfloat16")
  dp, tp, B, k, C = 4, 2, 2, 3, 11
  s = Ula(make_cfg(), geo, MeshInfo(dp, tp), max_batch=B, page_size=4, max_context=8)
  s.validate()
  mesh = jax.make_mesh((dp, tp), ("dp", "tp"))
  state = s.init_state(mesh)
  specs = s.state_specs(state)
  sq = lambda t: jax.tree.map(lambda x: x[0], t)
  ex = lambda t: jax.tree.map(lambda x: x[None], t)

  def step(state, addrs, valid, entries, sel, sel_valid, new, active, tok):
    st = s.write_prefill(sq(state), addrs[0], valid[0], sq(entries), jnp.int32(0))
    st, res = s.resolve(st, 0, sel[0], sel_valid[0], new[0], active[0])
    for l in range(2):
      st = s.move_layer(st, l, res)
    out = []
    for l in range(2):
      st = s.write_token(st, l, res, tok[0, l], active[0])
      pool, base = s.read_pool(st, l)
      out.append(pool[base + res.slots])
    return ex(st), jnp.stack(out)[None], res.slots[None], ex(res.stats)

  f = jax.jit(compat.shard_map(
      step, mesh=mesh, in_specs=(specs,) + (P("dp"),) * 8,
      out_specs=(specs, P("dp"), P("dp"), P("dp"))))

  rng = np.random.default_rng(3)
  # Each rank prefills 11 addresses of its own (9 fit on the device, 2 spill to the host)
  # and selects both spilled ones: every rank fetches 2 and, its device being full,
  # evicts 4 (2 fetched + 2 new tokens).
  addrs = np.stack([rng.permutation(12)[:C] for _ in range(dp)]).astype(np.int32)
  entries = rng.standard_normal((dp, 2, C, 4)).astype(jnp.bfloat16)  # [dp, L, C, W]
  new = np.asarray([[12, 13]] * dp, np.int32)
  sel = np.stack([[[a[9], a[10], a[0]], [a[1], a[2], 12]] for a in addrs]).astype(np.int32)
  tok = rng.standard_normal((dp, 2, B, 4)).astype(jnp.bfloat16)
  args = (addrs, np.ones((dp, C), bool), entries, sel, np.ones((dp, B, k), bool), new,
          np.ones((dp, B), bool), tok)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("dp")))
  state, out, slots, stats = f(state, *jax.tree.map(put, args))

  for p, kind in ((state.host_pool, "pinned_host"), (state.dev_pool, "device")):
    assert p.sharding.is_equivalent_to(NamedSharding(mesh, P("dp"), memory_kind=kind), 3)
  out, slots = np.asarray(out), np.asarray(slots)
  for d in range(dp):
    ref = RefUla.like(s)
    ref.write_prefill(addrs[d], np.ones(C, bool), entries[d])
    step_ref = ref.resolve(0, sel[d], np.ones((B, k), bool), new[d], np.ones(B, bool))
    np.testing.assert_array_equal(slots[d], step_ref.slots)
    assert {k_: int(np.asarray(v)[d]) for k_, v in stats.items()} == step_ref.stats
    for l in range(2):
      ref.move_layer(l, step_ref)
      ref.write_token(l, step_ref, tok[d, l], np.ones(B, bool))
      want = {int(a): entries[d, l, i] for i, a in enumerate(addrs[d])}
      want |= {12: tok[d, l, 0], 13: tok[d, l, 1]}
      for b, i in np.ndindex(B, k):
        np.testing.assert_array_equal(out[d, l, b, i], want[int(sel[d, b, i])])
    assert step_ref.stats == {"hits": 3, "misses": 2, "evictions": 4}
  rep = s.report(state)
  assert rep.distinct.tolist() == [C + 2] * dp
  assert (rep.device_used + rep.host_used == C + 2).all()  # per device, tp copies
