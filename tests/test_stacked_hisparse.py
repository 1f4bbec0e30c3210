"""``hisparse`` with traced group/layer indices (the model's scan over layer groups):
the same slots, counters, rows and state as with Python ints, and the LRU oracle's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.memory_util import (CHUNK, W, Workload, group_step, local_state, prefill_fn,
                               step_fn)
from tests.test_hisparse import Oracle, make_cfg, make_system
from ula_jax.core.types import KVGeometry

HI = 2  # indexer heads


def assert_trees_equal(a, b, msg=""):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=f"{msg} {jax.tree_util.keystr(path)}")


def check_oracle(oracle, wl, g, sel, sel_valid, new_addr, active, slots, new_slot, stats, t):
  o_slots, o_new, o_hits, o_misses = oracle.resolve(g, sel, sel_valid, new_addr, active)
  np.testing.assert_array_equal(np.asarray(slots), o_slots, err_msg=f"step {t} group {g}")
  np.testing.assert_array_equal(np.asarray(new_slot), o_new)
  assert (int(stats["hits"]), int(stats["misses"])) == (o_hits, o_misses)
  return o_hits, o_misses


def admit(system, wl, oracle, state, row, prompt_len, prefill):
  for a, v, e in wl.admit(row, prompt_len):
    state = prefill(state, a, v, e, row)
    oracle.prefill(a, v, row)
  return state


def test_traced_indices_per_transition_match_python_ints(rng):
  """Each transition jitted with ``group`` / ``layer`` as int32 arguments (traced), over
  a random workload (duplicates, invalid picks, idle rows, a released and reused row;
  3 layers in groups [0, 1], [2]): slots, new slots, counters, the rows read at
  ``base + res.slots`` and the whole state equal the Python-int step's and the oracle's."""
  system = make_system(make_cfg(buffer=6))
  geo, R, k = system.geo, system.max_batch, system.geo.top_k
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  resolve = jax.jit(system.resolve)
  move = jax.jit(system.move_layer)
  write = jax.jit(system.write_token)

  @jax.jit
  def read(state, layer, slots):
    pool, base = system.read_pool(state, layer)
    return pool[base + jnp.maximum(slots, 0)]

  step = jax.jit(step_fn(system))  # Python ints: the reference
  prefill, release = jax.jit(prefill_fn(system)), jax.jit(system.release)
  state = local_state(system)
  wl, oracle = Workload(system, rng), Oracle(system)
  for row in range(R - 1):
    state = admit(system, wl, oracle, state, row, int(rng.integers(1, 2 * CHUNK + 3)), prefill)
  total = [0, 0]
  for t in range(12):
    if t == 6:
      addrs = wl.finish(0)
      state = release(state, addrs, addrs >= 0, 0)
      oracle.release(addrs.tolist())
      state = admit(system, wl, oracle, state, 0, 9, prefill)
      state = admit(system, wl, oracle, state, R - 1, 5, prefill)
    sel, sel_valid, new_addr, active = wl.decode_inputs(k)
    new_e = wl.entries(R)
    ref_state, ref_slots, ref_new, ref_stats, ref_reads = step(state, sel, sel_valid, new_addr,
                                                               active, new_e)
    reads = []
    for g in range(geo.num_groups):
      state, res = resolve(state, i32(g), sel[g], sel_valid[g], new_addr, active)
      for l in geo.group_layers(g):
        state = move(state, i32(l), res)
      for l in geo.group_layers(g):
        state = write(state, i32(l), res, new_e[l], active)
        reads.append(read(state, i32(l), res.slots))
      np.testing.assert_array_equal(np.asarray(res.slots), np.asarray(ref_slots[g]))
      np.testing.assert_array_equal(np.asarray(res.new_slot), np.asarray(ref_new[g]))
      assert {n: int(v) for n, v in res.stats.items()} == {
          n: int(v) for n, v in ref_stats[g].items()}
      h, m = check_oracle(oracle, wl, g, sel[g], sel_valid[g], new_addr, active, res.slots,
                          res.new_slot, res.stats, t)
      total[0] += h
      total[1] += m
    np.testing.assert_array_equal(np.stack(reads), np.asarray(ref_reads))
    assert_trees_equal(state, ref_state, f"step {t}")
    wl.commit(new_addr, active, new_e)
    wl.check_reads(sel, sel_valid, active, np.stack(reads))
  assert total[0] > 0 and total[1] > 0  # the buffers both hit and missed
  for g in range(geo.num_groups):
    np.testing.assert_array_equal(np.asarray(state.slot_addr[g]), oracle.slot_addr[g])


def test_scan_over_groups_matches_python_ints(rng):
  """The decode step as the model runs it: ``lax.scan`` over groups (traced ``g``, layers
  ``g * group_size + j``) doing write_index_keys, select, resolve, move_layer for every
  layer, write_token and read_pool. The selections, slots, counters, rows read and the
  state equal the same body unrolled with Python ints; slots and counters equal the
  oracle's and the rows read are the rows written."""
  geo = KVGeometry(num_layers=4, group_size=2, entry_width=W, index_dim=4, top_k=4,
                   kv_dtype="float32")
  system = make_system(make_cfg(buffer=5), geo=geo, max_batch=3)
  G, gs, R, ps, DI = geo.num_groups, geo.group_size, 3, 4, geo.index_dim
  P = system.max_context // ps

  def body(state, g, keys, q_I, w, page_table, positions, new_addr, active, new_e):
    """One group; g a Python int or traced int32."""
    layers = [g * gs + j for j in range(gs)]
    state, sel_addr, sel_valid, res, reads = group_step(
        system, state, g, layers, new_addr, active, keys, q_I, w, page_table, positions,
        jnp.stack([new_e[l] for l in layers]))
    return state, (sel_addr, sel_valid, res.slots, res.new_slot, res.stats, reads)

  @jax.jit
  def scanned(state, keys, q_I, w, page_table, positions, new_addr, active, new_e):
    def f(s, xs):
      g, kg, qg, wg = xs
      return body(s, g, kg, qg, wg, page_table, positions, new_addr, active, new_e)
    return jax.lax.scan(f, state, (jnp.arange(G, dtype=jnp.int32), keys, q_I, w))

  @jax.jit
  def unrolled(state, keys, q_I, w, page_table, positions, new_addr, active, new_e):
    outs = []
    for g in range(G):
      state, out = body(state, g, keys[g], q_I[g], w[g], page_table, positions, new_addr,
                        active, new_e)
      outs.append(out)
    return state, jax.tree.map(lambda *x: jnp.stack(x), *outs)

  write_keys = jax.jit(system.write_index_keys)
  prefill = jax.jit(prefill_fn(system))
  state = local_state(system)
  wl, oracle = Workload(system, rng, max_new=8), Oracle(system)

  def admit_row(state, row, n):
    state = admit(system, wl, oracle, state, row, n, prefill)
    addrs = np.asarray(wl.ctx[row], np.int32)
    for g in range(G):  # the prompt's index keys (the model writes them at prefill)
      state = write_keys(state, jnp.int32(g), addrs,
                         rng.normal(size=(len(addrs), DI)).astype(np.float32))
    return state

  for row, n in enumerate((11, 3, 7)):
    state = admit_row(state, row, n)
  picked = 0
  for t in range(6):
    _, _, new_addr, active = wl.decode_inputs(geo.top_k, p_inactive=0.25)
    page_table, positions = wl.page_table(P)
    keys = rng.normal(size=(G, R, DI)).astype(np.float32)
    q_I = rng.normal(size=(G, R, HI, DI)).astype(np.float32)
    w = rng.random((G, R, HI)).astype(np.float32)
    new_e = wl.entries(R)
    args = (keys, q_I, w, page_table, positions, new_addr, active, new_e)
    new_state, out = scanned(state, *args)
    ref_state, ref_out = unrolled(state, *args)
    assert_trees_equal(out, ref_out, f"step {t}")
    assert_trees_equal(new_state, ref_state, f"step {t}")
    state = new_state
    sel_addr, sel_valid, slots, new_slots, stats, reads = jax.tree.map(np.asarray, out)
    picked += int(sel_valid[:, active].sum())
    for g in range(G):
      check_oracle(oracle, wl, g, sel_addr[g], sel_valid[g], new_addr, active, slots[g],
                   new_slots[g], {n: v[g] for n, v in stats.items()}, t)
    wl.commit(new_addr, active, new_e)
    wl.check_reads(sel_addr, sel_valid, active, reads.reshape(G * gs, *reads.shape[2:]))
  assert picked > 0  # the indexer picked something: the comparisons compared something


def test_prefill_program_does_not_grow_with_groups():
  """write_prefill updates every group at once: its program is the same size for 2 and
  for 6 layer groups (the layers' rows go in one copy)."""
  def size(num_layers):
    geo = KVGeometry(num_layers=num_layers, group_size=2, entry_width=W, index_dim=4, top_k=4,
                     kv_dtype="float32")
    system = make_system(make_cfg(buffer=6), geo=geo)
    addrs = jnp.arange(CHUNK, dtype=jnp.int32)
    entries = jnp.zeros((num_layers, CHUNK, W), jnp.float32)
    jaxpr = jax.make_jaxpr(system.write_prefill)(local_state(system), addrs, addrs >= 0,
                                                 entries, jnp.int32(1))
    return len(jaxpr.jaxpr.eqns)

  assert size(4) == size(12)
