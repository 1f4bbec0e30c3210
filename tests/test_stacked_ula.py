"""ula (DP mode) with traced group and layer indices: the stacked state's decode
transitions inside ``jax.jit`` (group as an int32 argument) and inside ``lax.scan`` over
the groups give the same state, slots and rows as the same calls with Python ints, and
the rows attention reads at ``base + res.slots`` are the NumPy reference's.

Two requests (rows 0 and 1: addresses 0..7 and 8..15) prefill 6 positions each: 9
entries per group fit on the device, 3 go to the host. Step 1 selects the host entries
(misses: fetched, the device's oldest entries evicted to the host); step 2 selects
entries that step 1 evicted (fetched back). The indexer's keys are written so that
``select`` picks exactly those.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.addressing import addrs_of_positions
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo
from ula_jax.memory.ula.dp import Ula
from ula_jax.memory.ula.oracle import RefUla

GEO = KVGeometry(num_layers=4, group_size=2, entry_width=4, index_dim=2, top_k=3,
                 kv_dtype="float32")  # groups: layers (0, 1) and (2, 3)
B, K, PAGE, GS = 2, 3, 4, 2
PAGE_TABLE = np.asarray([[0, 1], [2, 3]], np.int32)  # row 0: 0..7, row 1: 8..15
PROMPT = np.asarray([0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], np.int32)  # 6 positions each


@functools.lru_cache(maxsize=None)
def build(policy: str) -> Ula:
  cfg = MemoryConfig(system="ula", device_pool=9, host_pool=7, policy=policy,
                     pb_lru_buckets=2)
  s = Ula(cfg, GEO, MeshInfo(1, 1), max_batch=B, page_size=PAGE, max_context=8)
  s.validate()
  return s


def group_step(s: Ula, state, g, keys, positions, tok):
  """One group of one decode step, as the model runs it: ``g`` a Python int or a traced
  int32 scalar. keys: [B, DI] new tokens' index keys; positions: [B]; tok: [GS, B, W].
  returns (state, res, sel_addr [B, k], rows read [GS, B, k, W])"""
  page_table = jnp.asarray(PAGE_TABLE)
  new = addrs_of_positions(page_table, positions[:, None], PAGE)[:, 0]
  active = jnp.ones((B,), bool)
  state = s.write_index_keys(state, g, new, keys)
  q = jnp.ones((B, 1, GEO.index_dim), jnp.float32).at[:, :, 1].set(0.0)  # score = key[0]
  sel_pos, sel_valid = s.select(state, g, q, jnp.ones((B, 1), jnp.float32), page_table,
                                positions, active)
  sel = addrs_of_positions(page_table, sel_pos, PAGE)
  state, res = s.resolve(state, g, sel, sel_valid, new, active)
  for i in range(GS):
    state = s.move_layer(state, g * GS + i, res)
  out = []
  for i in range(GS):
    state = s.write_token(state, g * GS + i, res, tok[i], active)
    pool, base = s.read_pool(state, g * GS + i)
    out.append(pool[base + res.slots])
  return state, res, sel, jnp.stack(out)


@functools.lru_cache(maxsize=None)
def programs(s: Ula) -> dict:
  def scan_step(state, keys, positions, tok):
    """Every group in a ``lax.scan``: keys [G, B, DI], tok [G, GS, B, W]."""
    def body(state, xs):
      g, key, t = xs
      state, res, sel, rows = group_step(s, state, g, key, positions, t)
      return state, (res.slots, res.new_slot, res.stats, sel, rows)
    G = GEO.num_groups
    return jax.lax.scan(body, state, (jnp.arange(G, dtype=jnp.int32), keys, tok))

  return {
      "static": jax.jit(functools.partial(group_step, s), static_argnums=1),
      "traced": jax.jit(functools.partial(group_step, s)),
      "scan": jax.jit(scan_step),
      "prefill": jax.jit(s.write_prefill),
  }


def local_state(s: Ula):
  mesh = jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1])
  return jax.jit(lambda t: jax.tree.map(lambda x: x[0], t))(s.init_state(mesh))


def with_scores(s: Ula, state, scores: np.ndarray):
  """Index keys ``[score, 0]`` for every address of every group (Python-int groups)."""
  keys = np.zeros((s.num_logical, GEO.index_dim), np.float32)
  keys[:, 0] = scores
  addrs = jnp.arange(s.num_logical, dtype=jnp.int32)
  for g in range(GEO.num_groups):
    state = s.write_index_keys(state, g, addrs, jnp.asarray(keys))
  return state


def assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


# One policy: what traced indices change (slicing a group's metadata and writing it back,
# row offsets) is the same for both; exact LRU's resolve is checked step by step against
# the reference by the property tests.
@pytest.mark.parametrize("policy", ["pb_lru"])
def test_traced_indices_match_python_ints_and_reference(policy, rng):
  s = build(policy)
  f = programs(s)
  G, W, Sd = GEO.num_groups, GEO.entry_width, s.device_slots
  ref = RefUla.like(s)
  prompt = rng.standard_normal((GEO.num_layers, PROMPT.shape[0], W)).astype(np.float32)
  state = f["prefill"](local_state(s), jnp.asarray(PROMPT), jnp.ones(PROMPT.shape, bool),
                       jnp.asarray(prompt), jnp.int32(0))
  ref.write_prefill(PROMPT, np.ones(PROMPT.shape, bool), prompt)
  written = {(l, int(a)): prompt[l, i] for l in range(GEO.num_layers)
             for i, a in enumerate(PROMPT)}
  assert (np.asarray(state.meta.table)[:, [11, 12, 13]] >= Sd).all()  # on the host

  # Step 1 selects 3, 4, 5 (hits) and the host entries 11, 12, 13 (misses); step 2 the
  # first three of each row (the oldest: the entries step 1 evicts).
  scores = {1: np.zeros(16), 2: np.zeros(16)}
  scores[1][[3, 4, 5, 11, 12, 13]] = 10.0
  scores[2][[0, 1, 2, 8, 9, 10]] = 10.0
  table_before = np.asarray(state.meta.table)
  totals = {"hits": 0, "misses": 0, "evictions": 0}
  for t in (1, 2):
    state = with_scores(s, state, scores[t])
    positions = jnp.full((B,), 5 + t, jnp.int32)
    new = np.asarray([0, 8], np.int32) + 5 + t  # position 5 + t of each row
    keys = jnp.zeros((G, B, GEO.index_dim), jnp.float32)  # new tokens score 0
    tok = jnp.asarray(rng.standard_normal((G, GS, B, W)).astype(np.float32))

    # Every group in a scan (traced group, traced layers).
    scanned, (s_slots, s_new, s_stats, s_sel, s_rows) = f["scan"](state, keys, positions, tok)
    # Group by group: Python ints, then traced int32 scalars.
    st_static, st_traced = state, state
    for g in range(G):
      st_static, r_static, sel, rows = f["static"](st_static, g, keys[g], positions, tok[g])
      st_traced, r_traced, sel_t, rows_t = f["traced"](st_traced, jnp.int32(g), keys[g],
                                                        positions, tok[g])
      assert_trees_equal((st_traced, r_traced, sel_t, rows_t), (st_static, r_static, sel, rows))
      assert_trees_equal((s_slots[g], s_new[g], s_sel[g], s_rows[g]),
                         (r_static.slots, r_static.new_slot, sel, rows))
      assert_trees_equal({k: v[g] for k, v in s_stats.items()}, r_static.stats)

      # The reference: same slots and counts, and the rows read are the rows written.
      sel = np.asarray(sel)
      step = ref.resolve(g, sel, sel >= 0, new, np.ones(B, bool))
      np.testing.assert_array_equal(np.asarray(r_static.slots), step.slots)
      np.testing.assert_array_equal(np.asarray(r_static.new_slot), step.new_slot)
      assert {k: int(v) for k, v in r_static.stats.items()} == step.stats
      for i, l in enumerate(GEO.group_layers(g)):
        ref.move_layer(l, step)
        ref.write_token(l, step, np.asarray(tok[g, i]), np.ones(B, bool))
        for b in range(B):
          written[(l, int(new[b]))] = np.asarray(tok[g, i, b])
        for b, j in np.ndindex(B, K):
          np.testing.assert_array_equal(np.asarray(rows)[i, b, j], written[(l, int(sel[b, j]))])
          np.testing.assert_array_equal(np.asarray(rows)[i, b, j],
                                        ref.dev_pools[l][step.slots[b, j]])
      for k in totals:
        totals[k] += step.stats[k]
    assert_trees_equal(scanned, st_static)
    state = st_static
    if t == 1:
      assert totals["misses"] == 3 * G and totals["evictions"] > 0
      table_mid = np.asarray(state.meta.table)
  # Step 2 fetched back entries that step 1 had evicted from the device.
  table_after = np.asarray(state.meta.table)
  back = (table_before < Sd) & (table_mid >= Sd) & (table_after >= 0) & (table_after < Sd)
  assert back[:, [0, 1, 2, 8, 9, 10]].any(axis=1).all()
  assert totals["misses"] > 3 * G
  # Pools: the flat [L * Sd] / [L * Hr] arrays hold the reference's rows (the host pool
  # in its memory.host_layout, rows from host_row).
  dev, host = np.asarray(state.dev_pool), np.asarray(state.host_pool)
  for l in range(GEO.num_layers):
    np.testing.assert_array_equal(dev[l * Sd:(l + 1) * Sd], ref.dev_pools[l])
    np.testing.assert_array_equal(host[np.asarray(s.host_row(l, jnp.arange(s.host_slots)))],
                                  ref.host_pools[l])
  assert state.host_pool.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("policy", ["pb_lru", "lru"])
def test_speculative_step_and_rollback_with_traced_group(policy, rng):
  s = build(policy)
  spec = s.speculative()
  assert spec is not None
  W, G = GEO.entry_width, GEO.num_groups
  # 7 entries on the 9 device slots: room for the 2 new tokens, so the step is all-hit.
  prompt = rng.standard_normal((GEO.num_layers, 7, W)).astype(np.float32)
  addrs = jnp.asarray([0, 1, 2, 3, 8, 9, 10], jnp.int32)
  state = programs(s)["prefill"](local_state(s), addrs, jnp.ones(7, bool),
                                 jnp.asarray(prompt), jnp.int32(0))

  @jax.jit
  def run(state, g, sel, new):
    active = jnp.ones((B,), bool)
    new_state, res = spec.resolve(state, g, sel, sel >= 0, new, active)
    for i in range(GS):
      new_state = spec.move_layer(new_state, g * GS + i, res)
      new_state = spec.write_token(new_state, g * GS + i, res, jnp.ones((B, W)), active)
    back = spec.rollback(state, new_state, jnp.asarray(False))
    keep = spec.rollback(state, new_state, jnp.asarray(True))
    return new_state, res, back, keep

  new = jnp.asarray([4, 12], jnp.int32)
  hit = jnp.asarray([[0, 1, 2], [8, 9, 10]], jnp.int32)  # all on the device
  for g in range(G):
    new_state, res, back, keep = run(state, jnp.int32(g), hit, new)
    assert int(res.stats["spec_fail"]) == 0 and int(res.stats["misses"]) == 0
    want_state, want = jax.jit(s.resolve, static_argnums=1)(state, g, hit, hit >= 0, new,
                                                            jnp.ones((B,), bool))
    assert_trees_equal(new_state.meta, want_state.meta)
    np.testing.assert_array_equal(np.asarray(res.slots), np.asarray(want.slots))
    # Only group g's metadata changed; rollback restores it, keep_new keeps it.
    for leaf_old, leaf_new in zip(jax.tree.leaves(state.meta), jax.tree.leaves(new_state.meta)):
      others = [h for h in range(G) if h != g]
      np.testing.assert_array_equal(np.asarray(leaf_old)[others], np.asarray(leaf_new)[others])
    assert_trees_equal(back.meta, state.meta)
    assert_trees_equal(keep.meta, new_state.meta)

  # A selection of an address that is not stored is not all-hit: the step reports failure.
  miss = jnp.asarray([[0, 1, 2], [8, 9, 14]], jnp.int32)
  _, res, back, _ = run(state, jnp.int32(1), miss, new)
  assert int(res.stats["spec_fail"]) == 1
  assert_trees_equal(back.meta, state.meta)
  assert int(np.asarray(state.meta.table)[1, 14]) == INVALID
