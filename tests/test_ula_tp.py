"""ula in TP mode: sizes and validation, layouts, state layout and memory kinds, the
exact row broadcast, and random decode steps that must read what was written, the same
on every tp rank, for every layout, with and without a host pool.

``TPDriver`` runs the system's transitions under ``shard_map`` the way the engine and
``decode_step`` call them; the other TP test files use it too.
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
from ula_jax.memory import build_memory_system
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.layouts import BlockLayout, ModLayout, RequestLayout, make_layout
from ula_jax.memory.ula.dp import Ula
from ula_jax.memory.ula.tp import (FETCH_ALIGN, DirectState, UlaTP, capacity_classes,
                                   deliver_misses, merge_topk, own_misses)

GEO = KVGeometry(num_layers=3, group_size=2, entry_width=4, index_dim=2, top_k=3,
                 kv_dtype="float32", index_dtype="float32")  # groups: (0, 1) and (2,)
B, PAGE = 2, 4  # decode rows per dp rank, page size
STEP = B * (GEO.top_k + 1)  # 8: one decode step's entries


CFG = dict(system="ula", device_pool=STEP + 8, host_pool=0, policy="pb_lru", pb_lru_buckets=2,
           layout="mod", local_buffer=None, index_scoring="aligned")


def make_cfg(**kw) -> MemoryConfig:
  return MemoryConfig(**{**CFG, **kw})


def unchecked_cfg(**kw) -> MemoryConfig:
  """``make_cfg`` without the schema's checks: the values reach UlaTP as given, so its
  own checks are the ones under test."""
  return MemoryConfig.model_construct(**{**CFG, **kw})


def build(cfg=None, *, dp=1, tp=4, geo=GEO, max_batch=B, page_size=PAGE, max_context=16):
  return UlaTP(cfg or make_cfg(), geo, MeshInfo(dp, tp), max_batch=max_batch,
               page_size=page_size, max_context=max_context)


def mesh_of(dp: int, tp: int):
  devices = np.asarray(jax.devices()[:dp * tp]).reshape(dp, tp)
  return jax.sharding.Mesh(devices, ("dp", "tp"))


class TPDriver:
  """Runs one system's transitions under ``shard_map`` on a ``(dp, tp)`` mesh.

  Inputs carry a leading dp axis (one block per dp rank, the same on its tp ranks);
  outputs come back with leading ``[dp, tp]`` axes so tests can compare the ranks.
  """

  def __init__(self, system: UlaTP, mesh, group_moves: bool = False):
    self.sys, self.mesh = system, mesh
    self.group_moves = group_moves  # move_group per group, as the model calls it
    self.state = system.init_state(mesh)
    self.specs = system.state_specs(self.state)
    self._fns: dict = {}

  def _wrap(self, name, body, n_args):
    if name not in self._fns:
      s = self.sys

      def local(state, *args):
        st, out = body(s.to_local(state), *[jax.tree.map(lambda x: x[0], a) for a in args])
        return s.from_local(st), jax.tree.map(lambda x: x[None, None], out)

      self._fns[name] = jax.jit(compat.shard_map(
          local, mesh=self.mesh, in_specs=(self.specs,) + (P("dp"),) * n_args,
          out_specs=(self.specs, P("dp", "tp"))))
    return self._fns[name]

  def call(self, name, body, *args):
    self.state, out = self._wrap(name, body, len(args))(self.state, *args)
    return jax.tree.map(np.asarray, out)

  def prefill(self, addrs, valid, entries, keys, row):
    """addrs/valid: [dp, C]; entries: per layer [dp, C, W]; keys: per group [dp, C, DI]."""
    s = self.sys

    def body(st, addrs, valid, entries, keys, row):
      st = s.write_prefill(st, addrs, valid, jnp.stack(entries), row)  # [L, C, W]
      for g in range(s.geo.num_groups):
        st = s.write_index_keys(st, g, jnp.where(valid, addrs, INVALID), keys[g])
      return st, jnp.int32(0)

    self.call("prefill", body, addrs, valid, entries, keys, row)

  def step(self, sel_addr, sel_valid, new_addr, active, entries, keys):
    """One decode step in ``decode_step``'s order. sel_*: [dp, B, k]; new_addr/active:
    [dp, B]; entries: per layer [dp, B, W]; keys: per group [dp, B, DI].
    returns per layer the rows attention reads [dp, tp, B, k, W], slots per group
    [dp, tp, B, k] and the stats per group."""
    s = self.sys

    def body(st, sel_addr, sel_valid, new_addr, active, entries, keys):
      reads, slots, stats = [], [], []
      for g in range(s.geo.num_groups):
        st = s.write_index_keys(st, g, new_addr, keys[g])
        st, res = s.resolve(st, g, sel_addr, sel_valid, new_addr, active)
        layers = s.geo.group_layers(g)
        if self.group_moves:
          st = s.move_group(st, layers[0], len(layers), res)
        for l in () if self.group_moves else layers:
          st = s.move_layer(st, l, res)
        for l in s.geo.group_layers(g):
          st = s.write_token(st, l, res, entries[l], active)
          pool, base = s.read_pool(st, l)
          reads.append(pool[base + jnp.clip(res.slots, 0, None)])
        slots.append(res.slots)
        stats.append(res.stats)
      return st, (tuple(reads), tuple(slots), tuple(stats))

    return self.call("step", body, sel_addr, sel_valid, new_addr, active, entries, keys)

  def release(self, addrs, valid, row):
    s = self.sys

    def body(st, addrs, valid, row):
      return s.release(st, addrs, valid, row), jnp.int32(0)

    self.call("release", body, addrs, valid, row)

  def read_index_keys(self, group):
    s = self.sys
    return self.call(f"keys{group}", lambda st: (st, s.read_index_keys(st, group)))


# ----------------------------------------------------------------------------------
# sizes and validation
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, capacity", [("mod", 32), ("block", 32), ("request", 32)])
def test_capacity_is_tp_times_the_device_pool_beside_the_buffer(layout, capacity):
  s = build(make_cfg(layout=layout, device_pool=STEP + 8))
  assert (s.buffer_slots, s.device_slots, s.host_slots) == (STEP, 8, 0)
  assert s.capacity_tokens == s.num_logical == capacity  # 4 ranks x 8 tokens
  s.validate()


def test_capacity_rounds_to_pages_and_adds_host_pools():
  # 4 ranks x (9 + 10) = 76 -> 76 tokens (a multiple of 4) for mod and block;
  # request rounds each rank down to 4 pages of 4 first: 4 x 16 = 64.
  cfg = dict(device_pool=STEP + 9, host_pool=10)
  assert build(make_cfg(layout="mod", **cfg)).capacity_tokens == 76
  assert build(make_cfg(layout="block", **cfg)).capacity_tokens == 76
  assert build(make_cfg(layout="request", **cfg)).capacity_tokens == 64
  # 4 x 9 = 36 -> 36; request: 2 pages per rank -> 32.
  assert build(make_cfg(layout="mod", device_pool=STEP + 9)).capacity_tokens == 36
  assert build(make_cfg(layout="request", device_pool=STEP + 9)).capacity_tokens == 32


def test_defaults():
  s = build(make_cfg(device_pool=None, local_buffer=None), max_context=20)
  assert s.buffer_slots == STEP
  # max_batch x max_context = 40 tokens over 4 ranks: 10, rounded up to a page: 12.
  assert s.device_slots == 12 and s.device_budget == 12 + STEP
  assert s.capacity_tokens >= B * 20
  s = build(make_cfg(local_buffer=20, device_pool=30))
  assert (s.buffer_slots, s.device_slots) == (20, 10)


def test_sizes_in_bytes():
  # A token is 3 layers x 4 float32 = 48 bytes.
  s = build(make_cfg(device_pool=f"{48 * 20}B", host_pool="480B"))
  assert (s.device_budget, s.device_slots, s.host_slots) == (20, 12, 10)


def test_registry_picks_tp_mode_only_with_tp_above_one():
  kw = dict(max_batch=B, page_size=PAGE, max_context=16)
  tp = build_memory_system(make_cfg(), GEO, MeshInfo(2, 4), **kw)
  dp = build_memory_system(make_cfg(device_pool=32), GEO, MeshInfo(8, 1), **kw)
  assert isinstance(tp, UlaTP) and tp.name == "ula"
  assert isinstance(dp, Ula) and not isinstance(dp, UlaTP)


@pytest.mark.parametrize("kw, match", [
    (dict(layout="replicated"), r"memory.layout='replicated' is resident's TP baseline"),
    (dict(layout="diagonal"), r"memory.layout='diagonal': expected one of \['mod', 'block', "
                              r"'request'\]"),
    (dict(local_buffer=7), r"memory.local_buffer=7 holds fewer entries than one decode step "
                           r"selects: .* = 8; use memory.local_buffer >= 8"),
    (dict(local_buffer=2.5), r"memory.local_buffer=2.5: expected a token count"),
    (dict(device_pool=STEP), r"memory.device_pool=8 \(8 tokens per device\) leaves no device "
                             r"pool beside memory.local_buffer=8"),
    (dict(device_pool=STEP + 4, host_pool=16), r"with memory.host_pool > 0 an owner must hold "
                                               r"one step's entries on device: use "
                                               r"memory.device_pool >= local_buffer \+ 8 = 16"),
    (dict(policy="fifo"), r"memory.policy='fifo': expected one of \['pb_lru', 'lru'\]"),
    (dict(index_scoring="exact"), r"memory.index_scoring='exact': expected one of "
                                  r"\['aligned', 'local'\]"),
    (dict(pb_lru_buckets=0), r"memory.pb_lru_buckets=0: expected an integer >= 1"),
])
def test_validate_rejects(kw, match):
  with pytest.raises(ValueError, match=match):
    build(unchecked_cfg(**kw)).validate()


def test_validate_rejects_capacity_below_a_page():
  # One token per rank, 4 ranks: 4 tokens < a page of 8.
  with pytest.raises(ValueError, match=r"give 0 tokens over 4 tp ranks with memory.layout="
                                       r"'mod', fewer than one page \(engine.page_size=8\)"):
    build(make_cfg(device_pool=STEP + 1), page_size=8).validate()


def test_make_layout_rejects_replicated_and_unknown():
  with pytest.raises(ValueError, match=r"use memory.system=resident for it"):
    make_layout("replicated", 4, 8, 4, 2)
  with pytest.raises(ValueError, match=r"memory.layout='rows': expected one of"):
    make_layout("rows", 4, 8, 4, 2)


# ----------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------


def test_mod_and_block_locate_by_hand():
  a = jnp.asarray([0, 1, 5, 6, 11, -1, 12], jnp.int32)  # 12 = num_logical: out of range
  rank, local = ModLayout(4, 3, 4, 2).locate((), a)
  assert rank.tolist() == [0, 1, 1, 2, 3, -1, -1]
  assert local.tolist() == [0, 0, 1, 1, 2, -1, -1]
  rank, local = BlockLayout(4, 3, 4, 2).locate((), a)
  assert rank.tolist() == [0, 0, 1, 2, 3, -1, -1]
  assert local.tolist() == [0, 1, 2, 0, 2, -1, -1]


def test_request_layout_owner_per_row_spill_and_release():
  lay = RequestLayout(tp=3, rank_capacity=8, page_size=4, max_batch=2)  # 2 pages per rank
  assert lay.num_logical == 24
  st = lay.init()
  place = jax.jit(lay.place)
  # Row 0 writes pages 5 and 1 (two addresses each): the roomiest rank (0, lowest) owns both.
  a0 = jnp.asarray([20, 21, 4, 5], jnp.int32)
  st = place(st, a0, jnp.ones(4, bool), jnp.zeros(4, jnp.int32))
  rank, local = lay.locate(st, a0)
  assert rank.tolist() == [0, 0, 0, 0]
  # Pages take the owner's free local pages in order of first appearance: 5 -> 0, 1 -> 1.
  assert local.tolist() == [0, 1, 4, 5]
  assert st.row_owner.tolist() == [0, -1]
  # Row 1 then writes three pages: rank 1 is now the roomiest; its third page spills to
  # the lowest rank with room (2).
  a1 = jnp.asarray([0, 8, 12, 13], jnp.int32)
  st = place(st, a1, jnp.ones(4, bool), jnp.ones(4, jnp.int32))
  rank, local = lay.locate(st, a1)
  assert rank.tolist() == [1, 1, 2, 2]
  assert local.tolist() == [0, 4, 0, 1]
  assert st.row_owner.tolist() == [0, 1]
  # A decode step's new tokens (one per row): row 0's fresh page 4 prefers rank 0, which
  # is full, so it spills to rank 2; row 1's token is on a page it already has.
  new = jnp.asarray([16, 9], jnp.int32)
  st = place(st, new, jnp.ones(2, bool), jnp.arange(2, dtype=jnp.int32))
  assert lay.locate(st, new)[0].tolist() == [2, 1]
  # Release row 0: its pages are free again, its row has no owner.
  a0 = jnp.concatenate([a0, new[:1]])
  st = jax.jit(lay.release)(st, a0, jnp.ones(5, bool), jnp.int32(0))
  assert lay.locate(st, a0)[0].tolist() == [-1] * 5
  assert st.row_owner.tolist() == [-1, 1]
  assert np.asarray(st.free).sum(axis=1).tolist() == [2, 0, 1]


# ----------------------------------------------------------------------------------
# state layout, row broadcast, merge
# ----------------------------------------------------------------------------------


def test_init_state_sharding_and_memory_kinds():
  dp, tp = 2, 4
  s = build(make_cfg(device_pool=STEP + 8, host_pool=8), dp=dp, tp=tp)
  state = s.init_state(mesh_of(dp, tp))
  L, G = GEO.num_layers, GEO.num_groups
  pool = state.ranked.dev_pool  # every layer's device pool, stacked
  assert pool.shape == (dp, tp, L * 8, GEO.entry_width)
  assert pool.sharding.spec == P("dp", "tp") and pool.sharding.memory_kind == "device"
  host = state.ranked.host_pool
  assert host.shape == (dp, tp, L * 8, GEO.entry_width)
  assert host.sharding.spec == P("dp", "tp") and host.sharding.memory_kind == "pinned_host"
  assert state.ranked.index_keys.shape == (dp, tp, G, 16, GEO.index_dim)
  assert state.ranked.meta.table.shape == (dp, tp, G, 16)
  buf = state.shared.buffers
  assert buf.shape == (dp, L * STEP, GEO.entry_width) and buf.sharding.spec == P("dp")
  assert buf.sharding.memory_kind == "device"
  assert state.shared.meta.table.shape == (dp, G, s.num_logical)
  assert state.shared.meta.owner.shape == (dp, G, STEP)
  # Without a host pool the owned entries sit at their local address.
  d = build(make_cfg(device_pool=STEP + 8), dp=dp, tp=tp).init_state(mesh_of(dp, tp))
  assert isinstance(d.ranked, DirectState)
  assert d.ranked.pools.shape == (dp, tp, L * 8, GEO.entry_width)
  assert d.ranked.pools.sharding.spec == P("dp", "tp")
  assert d.ranked.live.shape == (dp, tp, G, 8)
  assert d.ranked.index_keys.shape == (dp, tp, G, 8, GEO.index_dim)


def test_capacity_classes_grow_by_a_quarter_to_the_whole_list():
  caps = capacity_classes(2048)
  assert caps[0] == 32 and caps[-1] == 2048
  assert all(c % FETCH_ALIGN == 0 for c in caps)
  assert all(b <= a * 5 // 4 + FETCH_ALIGN for a, b in zip(caps, caps[1:]))
  assert capacity_classes(8) == (8,) and capacity_classes(48)[0] == 8


@functools.lru_cache(maxsize=None)
def _deliver_on(tp: int):
  """``deliver_misses`` of each rank's own misses on ``tp`` ranks, jitted once per mesh:
  the cases of one tp (and dtype) run one compiled program, the misses being data."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:tp]), ("tp",))

  def f(pool, slot, dst, buf):
    return deliver_misses(pool[0], *own_misses(slot[0], dst), buf[0])[None]

  return jax.jit(compat.shard_map(f, mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P("tp")),
                                  out_specs=P("tp")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("tp, n, skew", [(2, 0, 0.5), (2, 1, 0.5), (2, 23, 0.5), (2, 48, 0.5),
                                         (2, 48, 1.0), (4, 37, 0.25), (4, 48, 0.9)])
def test_deliver_misses_moves_exactly_the_misses_bit_for_bit(rng, dtype, tp, n, skew):
  # F = 48 fetch slots; rank 0 owns a share `skew` of the misses (1.0: all of them).
  F, S, L, W = 48, 40, 64, 5
  assert F % FETCH_ALIGN == 0
  pools = rng.standard_normal((tp, S, W)).astype(np.float32)
  pools[:, 0, 0] = -0.0
  pools = np.asarray(jnp.asarray(pools).astype(dtype))
  owner = np.where(rng.random(F) < skew, 0, rng.integers(1, tp, F))
  local = rng.integers(0, S, F)
  slots = np.where(owner[None] == np.arange(tp)[:, None], local[None], -1).astype(np.int32)
  slots[:, n:] = -1
  dst = np.full((F,), -1, np.int32)
  dst[:n] = rng.permutation(L)[:n]
  buf = np.full((tp, L, W), 7.0, np.float32).astype(pools.dtype)
  got = np.asarray(_deliver_on(tp)(jnp.asarray(pools), jnp.asarray(slots), jnp.asarray(dst),
                                   jnp.asarray(buf)))
  want = buf[0].copy()
  want[dst[:n]] = pools[owner[:n], local[:n]]
  for r in range(tp):  # every rank's buffer: the misses written, nothing else touched
    np.testing.assert_array_equal(got[r].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("tp, n", [(2, 0), (2, 31), (4, 48)])
def test_deliver_misses_of_a_group_in_one_gather(rng, tp, n):
  """Three layers' misses at once ([n] row offsets, one all-gather) write what three
  one-layer deliveries write, bit for bit, and nothing else."""
  F, S, L, W, layers = 48, 40, 64, 5, 3
  pools = rng.standard_normal((tp, layers * S, W)).astype(np.float32)
  owner = rng.integers(0, tp, F)
  local = rng.integers(0, S, F)
  slots = np.where(owner[None] == np.arange(tp)[:, None], local[None], -1).astype(np.int32)
  slots[:, n:] = -1
  dst = np.full((F,), -1, np.int32)
  dst[:n] = rng.permutation(L)[:n]
  buf = np.full((tp, layers * L, W), 7.0, np.float32)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:tp]), ("tp",))

  def group(pool, slot, dst, buf):
    ls = jnp.arange(layers, dtype=jnp.int32)
    return deliver_misses(pool[0], *own_misses(slot[0], dst), buf[0], pool_base=ls * S,
                          pool_rows=S, buf_base=ls * L)[None]

  def each(pool, slot, dst, buf):
    b = buf[0]
    for l in range(layers):
      b = deliver_misses(pool[0], *own_misses(slot[0], dst), b, pool_base=l * S,
                         pool_rows=S, buf_base=l * L)
    return b[None]

  args = (jnp.asarray(pools), jnp.asarray(slots), jnp.asarray(dst), jnp.asarray(buf))
  specs = dict(mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P("tp")), out_specs=P("tp"))
  got = np.asarray(jax.jit(compat.shard_map(group, **specs))(*args))
  want = np.asarray(jax.jit(compat.shard_map(each, **specs))(*args))
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
  by_hand = buf[0].copy()
  for l in range(layers):
    by_hand[l * L + dst[:n]] = pools[owner[:n], l * S + local[:n]]
  for r in range(tp):
    np.testing.assert_array_equal(got[r], by_hand)


def test_merge_topk_by_hand():
  # Candidates from two ranks, out of position order; equal scores go to the lower position.
  scores = jnp.asarray([[1.0, 5.0, 2.0, 5.0, 0.5, -jnp.inf]], jnp.float32)
  pos = jnp.asarray([[7, 9, 3, 2, INVALID, INVALID]], jnp.int32)
  got, ok = merge_topk(scores, pos, 4)
  assert got.tolist() == [[2, 9, 3, 7]] and ok.tolist() == [[True] * 4]
  got, ok = merge_topk(scores[:, 4:], pos[:, 4:], 3)  # nothing valid, fewer than k
  assert got.tolist() == [[INVALID] * 3] and ok.tolist() == [[False] * 3]


# ----------------------------------------------------------------------------------
# random decode steps read exactly what was written, on every rank
# ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def driver(layout: str, host: int, policy: str, dp: int = 2, tp: int = 4,
           host_layout: str = "layer_major", group_moves: bool = False) -> TPDriver:
  # 8 device-pool tokens per rank (+ host): 32 tokens per dp rank without a host pool.
  cfg = make_cfg(layout=layout, device_pool=STEP + 8, host_pool=host, policy=policy,
                 host_layout=host_layout)
  s = build(cfg, dp=dp, tp=tp, max_context=24)
  s.validate()
  return TPDriver(s, mesh_of(dp, tp), group_moves)


def _rows(rng, shape):
  return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("layout, host, policy, host_layout, group_moves", [
    ("mod", 0, "pb_lru", "layer_major", False), ("block", 0, "lru", "layer_major", False),
    ("request", 0, "pb_lru", "layer_major", True), ("mod", 16, "lru", "layer_major", False),
    ("request", 16, "pb_lru", "layer_major", True),
    ("mod", 16, "pb_lru", "entry_major", True)])
def test_random_steps_read_what_was_written(rng, layout, host, policy, host_layout,
                                            group_moves):
  """Every rank reads what was written, with each layer's moves or each group's at once
  (``move_group``: the owners' host copies of a group in one launch each way)."""
  d = driver(layout, host, policy, host_layout=host_layout, group_moves=group_moves)
  if host:  # each rank's host pool takes the layout (an entry's layers side by side)
    assert d.sys.store.ula.host_layout == host_layout
    assert d.sys.store.ula.host_base_stride(1)[1] == (
        GEO.num_layers if host_layout == "entry_major" else 1)
  s, dp, k, W = d.sys, 2, GEO.top_k, GEO.entry_width
  d.state = s.init_state(d.mesh)
  N = s.num_logical
  pages = N // PAGE
  truth = [dict() for _ in range(dp)]  # per dp rank: addr -> per-layer rows
  # Two requests per dp rank, each on its own random logical pages.
  perm = [rng.permutation(pages) for _ in range(dp)]
  per_req = pages // 2
  reqs = [[np.concatenate([perm[r][i * per_req + j] * PAGE + np.arange(PAGE)
                           for j in range(per_req)]) for i in range(2)] for r in range(dp)]
  lengths = [[int(rng.integers(3, per_req * PAGE // 2)) for _ in range(2)] for _ in range(dp)]
  C = per_req * PAGE  # one prefill chunk per request (fixed shape: one compilation)
  for row in range(2):
    addrs = np.full((dp, C), INVALID, np.int32)
    valid = np.zeros((dp, C), bool)
    for r in range(dp):
      n = lengths[r][row]
      addrs[r, :n], valid[r, :n] = reqs[r][row][:n], True
    ent = tuple(_rows(rng, (dp, C, W)) for _ in range(GEO.num_layers))
    keys = tuple(_rows(rng, (dp, C, GEO.index_dim)) for _ in range(GEO.num_groups))
    d.prefill(addrs, valid, ent, keys, np.full((dp,), row, np.int32))
    for r in range(dp):
      for i in range(lengths[r][row]):
        truth[r][int(addrs[r, i])] = [e[r, i] for e in ent]
  total_misses = 0
  for _ in range(6):
    sel = np.full((dp, B, k), INVALID, np.int32)
    sel_valid = np.zeros((dp, B, k), bool)
    new = np.full((dp, B), INVALID, np.int32)
    active = np.zeros((dp, B), bool)
    for r in range(dp):
      for b in range(B):
        n = lengths[r][b]
        if n >= per_req * PAGE or rng.random() < 0.2:
          continue  # this row is full or idle this step
        active[r, b] = True
        new[r, b] = reqs[r][b][n]
        hist = reqs[r][b][:n + 1]  # the new token may be selected too
        pick = rng.choice(len(hist), size=min(k, len(hist)), replace=False)
        sel[r, b, :len(pick)], sel_valid[r, b, :len(pick)] = hist[pick], True
    ent = tuple(_rows(rng, (dp, B, W)) for _ in range(GEO.num_layers))
    keys = tuple(_rows(rng, (dp, B, GEO.index_dim)) for _ in range(GEO.num_groups))
    reads, slots, stats = d.step(sel, sel_valid, new, active, ent, keys)
    for r in range(dp):
      for b in range(B):
        if active[r, b]:
          truth[r][int(new[r, b])] = [e[r, b] for e in ent]
          lengths[r][b] += 1
    for l in range(GEO.num_layers):
      for r in range(dp):
        for t in range(d.sys.tp):  # every rank reads the same rows
          np.testing.assert_array_equal(reads[l][r, t], reads[l][r, 0])
        for b in range(B):
          for i in range(k):
            if sel_valid[r, b, i]:
              np.testing.assert_array_equal(reads[l][r, 0, b, i], truth[r][int(sel[r, b, i])][l])
    for g in range(GEO.num_groups):
      assert (slots[g][sel_valid[:, None].repeat(d.sys.tp, 1)] >= 0).all()
      total_misses += int(stats[g]["misses"][:, 0].sum())
  assert total_misses > 0
  # Every stored entry is counted once; the buffers are the only copies.
  rep = s.report(d.state)
  stored = sum(len(t) for t in truth)
  assert rep.distinct_total == stored * GEO.num_groups
  assert rep.duplicates == sum(rep.extra["buffer_used"]) * d.sys.tp
  # Indexer keys come back by logical address from their owners.
  keys0 = d.read_index_keys(0)
  assert keys0.shape == (dp, d.sys.tp, N, GEO.index_dim)


def test_release_then_reuse_never_reads_stale_rows(rng):
  d = driver("mod", 0, "pb_lru")
  s, dp, k, W = d.sys, 2, GEO.top_k, GEO.entry_width
  d.state = s.init_state(d.mesh)
  addrs = np.tile(np.arange(4, dtype=np.int32), (dp, 1))
  valid = np.ones((dp, 4), bool)
  zero_keys = tuple(np.zeros((dp, 4, GEO.index_dim), np.float32) for _ in range(2))
  row0 = np.zeros((dp,), np.int32)

  def decode_reads():
    sel = np.full((dp, B, k), INVALID, np.int32)
    sel[:, 0] = [0, 1, 2]
    sel_valid = sel >= 0
    new = np.full((dp, B), INVALID, np.int32)
    new[:, 0] = 3
    active = np.zeros((dp, B), bool)
    active[:, 0] = True
    ent = tuple(_rows(rng, (dp, B, W)) for _ in range(GEO.num_layers))
    keys = tuple(np.zeros((dp, B, GEO.index_dim), np.float32) for _ in range(2))
    return d.step(sel, sel_valid, new, active, ent, keys)[0]

  first = tuple(_rows(rng, (dp, 4, W)) for _ in range(GEO.num_layers))
  d.prefill(addrs, valid, first, zero_keys, row0)
  reads = decode_reads()  # addresses 0..2 are now in every rank's buffer
  np.testing.assert_array_equal(reads[0][:, 0, 0], first[0][:, :3])
  d.release(addrs, valid, row0)
  assert s.report(d.state).distinct_total == 0
  assert sum(s.report(d.state).extra["buffer_used"]) == 0
  second = tuple(_rows(rng, (dp, 4, W)) for _ in range(GEO.num_layers))
  d.prefill(addrs, valid, second, zero_keys, row0)
  reads = decode_reads()
  for l in range(GEO.num_layers):
    np.testing.assert_array_equal(reads[l][:, 0, 0], second[l][:, :3])
