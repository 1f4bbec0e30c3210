"""``resident`` and ``far_tier`` with traced group / layer indices (the model's scan).

A decode step's group, in the model's order (``write_index_keys``, ``select``,
``resolve``, ``move_layer`` for every layer, then ``write_token`` and ``read_pool``), runs
once with Python ints and once with int32 indices traced by ``jax.jit`` (or carried by a
``lax.scan`` over groups): states, selections, slots, counters and the rows read at
``base + res.slots`` must be identical, and the rows read are the rows written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.memory_util import CHUNK, W, Workload, group_step, local_state
from ula_jax.config.schema import FarTierConfig, MemoryConfig
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory import build_memory_system

GEO = KVGeometry(num_layers=3, group_size=2, entry_width=W, index_dim=4, top_k=4,
                 kv_dtype="float32", index_dtype="float32")  # a short last group
GEO_EVEN = KVGeometry(num_layers=4, group_size=2, entry_width=W, index_dim=4, top_k=4,
                      kv_dtype="float32", index_dtype="float32")  # scannable: equal groups
SYSTEMS = ("resident", "on_demand", "full_prefetch")
HI = 2  # index heads


def make_system(kind, geo, max_batch=3, page_size=4, max_context=40):
  if kind == "resident":
    cfg = MemoryConfig(system="resident", host_pool=0)
  else:
    cfg = MemoryConfig(system="far_tier", host_pool=0, far_tier=FarTierConfig(mode=kind))
  return build_memory_system(cfg, geo, MeshInfo(1, 1), max_batch=max_batch,
                             page_size=page_size, max_context=max_context)


def group_body(system, state, g, layers, *args):
  """``group_step``, returning (state, sel_addr, sel_valid, slots, stats, reads)."""
  state, sel_addr, sel_valid, res, reads = group_step(system, state, g, layers, *args)
  return state, sel_addr, sel_valid, res.slots, res.stats, reads


@functools.lru_cache(maxsize=None)
def python_group_fn(system, g):
  """The group with Python-int indices (one program per group)."""
  layers = list(system.geo.group_layers(g))
  return jax.jit(lambda state, *a: group_body(system, state, g, layers, *a))


@functools.lru_cache(maxsize=None)
def traced_group_fn(system):
  """The group with ``g`` and ``layers`` as int32 arguments: one program per group size."""
  def fn(state, g, layers, *a):
    return group_body(system, state, g, [layers[i] for i in range(layers.shape[0])], *a)
  return jax.jit(fn)


class Driver:
  """A workload of one dp rank plus random indexer keys and queries."""

  def __init__(self, system, rng):
    self.sys, self.rng = system, rng
    self.wl = Workload(system, rng)
    self.prefill = jax.jit(lambda st, a, v, e, keys: self._prefill(st, a, v, e, keys))

  def _prefill(self, state, addrs, valid, entries, keys):
    state = self.sys.write_prefill(state, addrs, valid, entries, jnp.int32(0))
    for g in range(self.sys.geo.num_groups):
      state = self.sys.write_index_keys(state, g, jnp.where(valid, addrs, INVALID), keys[g])
    return state

  def admit_all(self, state, lens):
    G, DI = self.sys.geo.num_groups, self.sys.geo.index_dim
    for row, n in enumerate(lens):
      for a, v, e in self.wl.admit(row, n):
        keys = self.rng.normal(size=(G, CHUNK, DI)).astype(np.float32)
        state = self.prefill(state, a, v, e, keys)
    return state

  def step_inputs(self):
    """Per group: (new_addr, active, key_new, q, w, page_table, positions, entries)."""
    geo, wl, B, ps = self.sys.geo, self.wl, self.sys.max_batch, self.sys.page_size
    _, _, new_addr, active = wl.decode_inputs(geo.top_k, p_inactive=0.25)
    P = max(len(a) for a in wl.alloc if a is not None) // ps
    page_table, positions = wl.page_table(P)
    entries = wl.entries(B)  # [L, B, W]
    per_group = []
    for g in range(geo.num_groups):
      layers = list(geo.group_layers(g))
      per_group.append((
          new_addr, active,
          self.rng.normal(size=(B, geo.index_dim)).astype(np.float32),
          self.rng.normal(size=(B, HI, geo.index_dim)).astype(np.float32),
          self.rng.random((B, HI)).astype(np.float32),
          page_table, positions, entries[layers[0]:layers[-1] + 1]))
    return per_group, entries, new_addr, active

  def check_reads(self, g, sel_addr, sel_valid, active, reads):
    """The rows read are the rows written (the workload's truth, the new token's too)."""
    for i, l in enumerate(self.sys.geo.group_layers(g)):
      for b in np.flatnonzero(active):
        for j in np.flatnonzero(sel_valid[b]):
          np.testing.assert_array_equal(reads[i, b, j], self.wl.truth[l][int(sel_addr[b, j])])


def assert_same(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("kind", SYSTEMS)
def test_traced_group_and_layer_match_python_ints(kind, rng):
  """jit with int32 ``group`` / ``layer`` arguments == the same calls with Python ints, on
  a geometry with a short last group, over steps with a row released and reused."""
  system = make_system(kind, GEO)
  drv = Driver(system, rng)
  state = drv.admit_all(local_state(system), [9, 14, 5])
  release = jax.jit(system.release)
  traced_fn = traced_group_fn(system)
  selected = 0
  for t in range(5):
    if t == 3:
      addrs = drv.wl.finish(1)
      state = release(state, addrs, addrs >= 0, 1)
      for a, v, e in drv.wl.admit(1, 6):
        keys = rng.normal(size=(GEO.num_groups, CHUNK, GEO.index_dim)).astype(np.float32)
        state = drv.prefill(state, a, v, e, keys)
    per_group, entries, new_addr, active = drv.step_inputs()
    drv.wl.commit(new_addr, active, entries)  # the truth of the token decoded now
    for g in range(GEO.num_groups):
      inputs = per_group[g]
      want = python_group_fn(system, g)(state, *inputs)
      layers = np.asarray(list(GEO.group_layers(g)), np.int32)
      got = traced_fn(state, np.int32(g), layers, *inputs)
      assert_same(got, want)
      state, sel_addr, sel_valid, _, _, reads = got
      drv.check_reads(g, np.asarray(sel_addr), np.asarray(sel_valid), active, np.asarray(reads))
      selected += int(np.asarray(sel_valid).sum())
  assert selected > 0


@pytest.mark.parametrize("kind", SYSTEMS)
def test_scan_over_groups_matches_python_loop(kind, rng):
  """A ``lax.scan`` over the groups (state carried, group and layers traced) == the Python
  loop over groups, step after step."""
  geo = GEO_EVEN
  system = make_system(kind, geo)
  G, gs = geo.num_groups, geo.group_size
  drv = Driver(system, rng)
  state = drv.admit_all(local_state(system), [10, 3, 13])

  @jax.jit
  def scan_step(state, xs):
    def body(state, x):
      g, *inputs = x
      layers = [g * gs + i for i in range(gs)]
      state, sel_addr, sel_valid, slots, stats, reads = group_body(system, state, g, layers,
                                                                   *inputs)
      return state, (sel_addr, sel_valid, slots, stats, reads)
    return jax.lax.scan(body, state, xs)

  for _ in range(4):
    per_group, entries, new_addr, active = drv.step_inputs()
    drv.wl.commit(new_addr, active, entries)
    py_state, outs = state, []
    for g in range(G):
      py_state, *out = python_group_fn(system, g)(py_state, *per_group[g])
      outs.append(out)
    xs = (np.arange(G, dtype=np.int32),) + tuple(
        np.stack([per_group[g][i] for g in range(G)]) for i in range(len(per_group[0])))
    state, scanned = scan_step(state, xs)
    assert_same(state, py_state)
    want = jax.tree.map(lambda *x: np.stack(x), *outs)
    assert_same(list(scanned), want)
    sel_addr, sel_valid, _, _, reads = (np.asarray(x) if not isinstance(x, dict) else x
                                        for x in scanned)
    for g in range(G):
      drv.check_reads(g, sel_addr[g], sel_valid[g], active, reads[g])
