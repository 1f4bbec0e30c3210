"""ula in TP mode with traced layer-group and layer indices (the model's ``lax.scan`` over
groups): a decode step -- ``write_index_keys``, the sharded ``select``, ``resolve``,
``move_layer`` for every layer of the group, ``write_token``, ``read_pool`` -- run with
``group``/``layer`` as traced int32 scalars gives the same selection, the same rows at
``base + res.slots``, the same counters and the same state, leaf for leaf, as the same
calls with Python ints; and the rows are the ones written (the oracle). Layouts ``mod``
and ``request``, with and without a host pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.core.addressing import all_addrs
from ula_jax.core.types import KVGeometry
from tests.memory_util import group_step
from tests.test_ula_tp import TPDriver, build, make_cfg, mesh_of

B, PAGE, PAGES = 2, 4, 6  # decode rows, page size, pages per row
T = PAGE * PAGES  # positions per row
HI = 2  # index heads
DP, TP = 2, 4
# Unequal groups (0, 1) and (2,): traced scalars passed in; equal groups: a lax.scan.
GEO3 = KVGeometry(num_layers=3, group_size=2, entry_width=4, index_dim=4, top_k=3,
                  kv_dtype="float32", index_dtype="float32")
GEO4 = KVGeometry(num_layers=4, group_size=2, entry_width=4, index_dim=4, top_k=3,
                  kv_dtype="float32", index_dtype="float32")


def make_driver(geo: KVGeometry, layout: str, host: int) -> TPDriver:
  step = B * (geo.top_k + 1)
  # 16 device-pool slots per rank, or 8 beside a host pool: the owners' device pools
  # cannot hold a row's history, so entries come from the host.
  cfg = make_cfg(layout=layout, device_pool=step + (8 if host else 16), host_pool=host,
                 policy="pb_lru", local_buffer=None)
  s = build(cfg, dp=DP, tp=TP, geo=geo, max_batch=B, page_size=PAGE, max_context=T)
  s.validate()
  return TPDriver(s, mesh_of(DP, TP))


def tp_group_step(s, st, g, layers, page_table, positions, new_addr, active, q, w, entries,
                  keys):
  """``group_step`` with this file's argument order; returns (state, (sel_addr,
  sel_valid, slots, reads [len(layers), B, k, W], stats))."""
  st, sel_addr, sel_valid, res, reads = group_step(s, st, g, layers, new_addr, active, keys, q,
                                                   w, page_table, positions, entries)
  return st, (sel_addr, sel_valid, res.slots, reads, res.stats)


def python_step(s, st, *args):
  """Every group with Python ints (the reference). args: page_table, positions,
  new_addr, active, q [G, B, HI, DI], w, entries [L, B, W], keys [G, B, DI]."""
  page_table, positions, new_addr, active, q, w, entries, keys = args
  outs = []
  for g in range(s.geo.num_groups):
    ls = list(s.geo.group_layers(g))
    st, out = tp_group_step(s, st, g, ls, page_table, positions, new_addr, active, q[g], w,
                         entries[ls[0]:ls[-1] + 1], keys[g])
    outs.append(out)
  return st, outs


def traced_step(s, st, gidx, lidx, *args):
  """Every group with ``group``/``layer`` taken from the traced int32 arrays ``gidx``
  [G] and ``lidx`` [L] (their values are 0..G-1 and 0..L-1)."""
  page_table, positions, new_addr, active, q, w, entries, keys = args
  outs = []
  for g in range(s.geo.num_groups):
    ls = list(s.geo.group_layers(g))
    st, out = tp_group_step(s, st, gidx[g], [lidx[l] for l in ls], page_table, positions,
                         new_addr, active, q[g], w, entries[ls[0]:ls[-1] + 1], keys[g])
    outs.append(out)
  return st, outs


def scan_step(s, st, *args):
  """Every group inside one ``lax.scan`` over groups (equal groups): the group and its
  layers are traced values of the loop, the state is the loop's carry."""
  page_table, positions, new_addr, active, q, w, entries, keys = args
  G, gs = s.geo.num_groups, s.geo.group_size
  ent = entries.reshape(G, gs, *entries.shape[1:])

  def body(st, xs):
    g, q_g, ent_g, keys_g = xs
    layers = [g * gs + j for j in range(gs)]
    return tp_group_step(s, st, g, layers, page_table, positions, new_addr, active, q_g, w,
                      ent_g, keys_g)

  st, out = jax.lax.scan(body, st, (jnp.arange(G, dtype=jnp.int32), q, ent, keys))
  return st, [jax.tree.map(lambda x, g=g: x[g], out) for g in range(G)]


def _prefill(d: TPDriver, rng, page_table, lengths, truth):
  """Writes each row's first ``lengths`` tokens (one prefill per row: the request layout
  owns by row). truth[r][addr] = per-layer rows."""
  geo, C = d.sys.geo, T
  addrs = np.asarray(all_addrs(jnp.asarray(page_table), PAGE))  # [dp, B, T]
  for b in range(B):
    valid = np.arange(C)[None, :] < lengths[:, b:b + 1]
    a = np.where(valid, addrs[:, b], -1).astype(np.int32)
    ent = tuple(rng.standard_normal((DP, C, geo.entry_width)).astype(np.float32)
                for _ in range(geo.num_layers))
    keys = tuple(rng.standard_normal((DP, C, geo.index_dim)).astype(np.float32)
                 for _ in range(geo.num_groups))
    d.prefill(a, valid, ent, keys, np.full((DP,), b, np.int32))
    for r in range(DP):
      for i in range(int(lengths[r, b])):
        truth[r][int(a[r, i])] = [e[r, i] for e in ent]


def _leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Traced scalars with a host pool (the DP store inside a rank) and a scan without (the
# direct store), one layout each; the engine runs TP through the scan end to end
# (tests/test_deep_model.py, tests/test_exactness_tp.py).
@pytest.mark.parametrize("layout, host, mode", [("request", 16, "scalars"),
                                                ("mod", 0, "scan")])
def test_traced_indices_match_python_ints_and_the_oracle(rng, layout, host, mode):
  geo = GEO3 if mode == "scalars" else GEO4
  d = make_driver(geo, layout, host)
  s, k, G, L = d.sys, geo.top_k, geo.num_groups, geo.num_layers
  pages = s.num_logical // PAGE
  page_table = np.stack([rng.permutation(pages)[:B * PAGES].reshape(B, PAGES)
                         for _ in range(DP)]).astype(np.int32)
  lengths = rng.integers(17, 19, (DP, B))  # + 5 steps < T
  truth = [dict() for _ in range(DP)]
  _prefill(d, rng, page_table, lengths, truth)
  gidx = np.tile(np.arange(G, dtype=np.int32), (DP, 1))
  lidx = np.tile(np.arange(L, dtype=np.int32), (DP, 1))
  traced = ((lambda st, gi, li, *a: traced_step(s, st, gi, li, *a)) if mode == "scalars"
            else (lambda st, gi, li, *a: scan_step(s, st, *a)))
  addrs = np.asarray(all_addrs(jnp.asarray(page_table), PAGE))  # [dp, B, T]
  misses = host_fetches = 0
  for _ in range(5):
    active = rng.random((DP, B)) < 0.9
    positions = lengths.astype(np.int32)
    new_addr = np.where(active, np.take_along_axis(addrs, positions[..., None], 2)[..., 0],
                        -1).astype(np.int32)
    args = (page_table, positions, new_addr, active,
            rng.standard_normal((DP, G, B, HI, geo.index_dim)).astype(np.float32),
            rng.standard_normal((DP, B, HI)).astype(np.float32),
            rng.standard_normal((DP, L, B, geo.entry_width)).astype(np.float32),
            rng.standard_normal((DP, G, B, geo.index_dim)).astype(np.float32))
    start = d.state
    want = d.call(f"python{mode}", lambda st, *a: python_step(s, st, *a), *args)
    want_state = d.state
    d.state = start
    got = d.call(f"traced{mode}", traced, gidx, lidx, *args)
    # The same selection, slots, rows, counters and state as with Python ints.
    _leaves_equal(got, want)
    _leaves_equal(d.state, want_state)
    # The rows read are the ones written (prefill, earlier steps, this step's token).
    for r in range(DP):
      for b in range(B):
        if active[r, b]:
          truth[r][int(new_addr[r, b])] = [args[6][r, l, b] for l in range(L)]
    for g in range(G):
      sel_addr, sel_valid, slots, reads, stats = got[g]
      misses += int(stats["misses"][:, 0].sum())
      host_fetches += int(stats.get("host_fetches", np.zeros((DP, TP)))[:, 0].sum())
      for r in range(DP):
        for t in range(TP):  # every tp rank reads the same
          np.testing.assert_array_equal(reads[r, t], reads[r, 0])
        assert (slots[r, 0][sel_valid[r, 0]] >= 0).all()
        for j, l in enumerate(geo.group_layers(g)):
          for b in range(B):
            for i in range(k):
              if sel_valid[r, 0, b, i]:
                np.testing.assert_array_equal(reads[r, 0, j, b, i],
                                              truth[r][int(sel_addr[r, 0, b, i])][l])
    lengths = lengths + active
  assert misses > 0  # the buffers turned over: rows crossed between ranks
  if host:
    assert host_fetches > 0  # and owners brought entries from their host pools
