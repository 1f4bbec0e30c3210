"""Helpers shared by the memory systems' unit tests: one dp rank's workload (rows,
addresses, the true KV rows) and a decode step driven with Python-int indices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core.addressing import addrs_of_positions
from ula_jax.core.types import INVALID

W = 8  # entry width of the test geometries
CHUNK = 8  # prefill chunk


def put_dp(mesh, tree):
  """Host arrays with a leading dp axis -> global arrays sharded over ``dp``."""
  return jax.device_put(tree, NamedSharding(mesh, P("dp")))


def local_state(system):
  mesh = jax.make_mesh((1, 1), ("dp", "tp"))
  return jax.tree.map(lambda x: x[0], system.init_state(mesh))


def step_fn(system):
  """One decode step over every group: resolve, move, write the token, read back."""
  geo = system.geo

  def step(state, sel, sel_valid, new_addr, active, new_entries):
    """new_entries: [L, B, W]; reads come back per (group, layer) in layer order."""
    slots, new_slots, stats, reads = [], [], [], []
    for g in range(geo.num_groups):
      state, res = system.resolve(state, g, sel[g], sel_valid[g], new_addr, active)
      for l in geo.group_layers(g):
        state = system.move_layer(state, l, res)
      for l in geo.group_layers(g):
        state = system.write_token(state, l, res, new_entries[l], active)
        pool, base = system.read_pool(state, l)
        reads.append(pool[base + jnp.maximum(res.slots, 0)])
      slots.append(res.slots)
      new_slots.append(res.new_slot)
      stats.append(res.stats)
    return state, jnp.stack(slots), jnp.stack(new_slots), stats, jnp.stack(reads)

  return step


def prefill_fn(system):
  return lambda state, addrs, valid, entries, row: system.write_prefill(state, addrs, valid,
                                                                         entries, row)


class Workload:
  """Host-side bookkeeping of one dp rank: rows, addresses and the true KV rows."""

  def __init__(self, system, rng, max_new=12):
    self.sys, self.rng, self.max_new = system, rng, max_new
    self.L, self.G = system.geo.num_layers, system.geo.num_groups
    self.truth = [dict() for _ in range(self.L)]
    self.free_pages = list(range(system.num_logical // system.page_size))
    self.ctx = [None] * system.max_batch  # per row: addresses written so far
    self.alloc = [None] * system.max_batch  # per row: addresses allocated

  def entries(self, n):
    """[L, n, W] random rows, layer-major (``write_prefill``'s and the step's layout)."""
    return self.rng.normal(size=(self.L, n, W)).astype(np.float32)

  def admit(self, row, prompt_len):
    """Allocates pages and returns prefill chunks (addrs, valid, entries) of the prompt."""
    ps = self.sys.page_size
    n_pages = -(-(prompt_len + self.max_new) // ps)
    assert n_pages <= len(self.free_pages), "the test's pool is too small for its requests"
    pages = [self.free_pages.pop(0) for _ in range(n_pages)]
    addrs = np.concatenate([np.arange(p * ps, (p + 1) * ps) for p in pages]).astype(np.int32)
    self.alloc[row], self.ctx[row] = addrs, []
    chunks = []
    for lo in range(0, prompt_len, CHUNK):
      a = np.full(CHUNK, INVALID, np.int32)
      n = min(CHUNK, prompt_len - lo)
      a[:n] = addrs[lo:lo + n]
      e = self.entries(CHUNK)
      for l in range(self.L):
        for i in range(n):
          self.truth[l][int(a[i])] = e[l][i]
      self.ctx[row].extend(int(x) for x in a[:n])
      chunks.append((a, a >= 0, e))
    return chunks

  def finish(self, row):
    addrs = self.alloc[row]
    self.free_pages.extend(sorted({int(a) // self.sys.page_size for a in addrs}))
    self.ctx[row] = self.alloc[row] = None
    return addrs

  def page_table(self, pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(page_table [B, pages] int32, positions [B] int32): each row's logical pages
    (INVALID past them and for empty rows) and its context length."""
    B, ps = self.sys.max_batch, self.sys.page_size
    table = np.full((B, pages), INVALID, np.int32)
    positions = np.zeros(B, np.int32)
    for b in range(B):
      if self.alloc[b] is not None:
        row_pages = self.alloc[b][::ps] // ps
        table[b, :len(row_pages)] = row_pages
        positions[b] = len(self.ctx[b])
    return table, positions

  def decode_inputs(self, k, p_dup=0.1, p_invalid=0.15, p_inactive=0.2):
    """Random selections (per group) among each row's context and the decoded token."""
    R = self.sys.max_batch
    sel = np.full((self.G, R, k), INVALID, np.int32)
    sel_valid = np.zeros((self.G, R, k), bool)
    new_addr = np.full(R, INVALID, np.int32)
    active = np.zeros(R, bool)
    for b in range(R):
      ctx = self.ctx[b]
      if ctx is None or len(ctx) >= len(self.alloc[b]) or self.rng.random() < p_inactive:
        continue
      active[b] = True
      new_addr[b] = self.alloc[b][len(ctx)]
      pool = np.asarray(ctx + [int(new_addr[b])])
      for g in range(self.G):
        pick = self.rng.choice(pool, size=min(k, len(pool)), replace=False)
        row_sel = np.full(k, INVALID, np.int32)
        row_sel[:len(pick)] = pick
        dup = self.rng.random(k) < p_dup
        row_sel[dup] = row_sel[0]
        ok = (row_sel >= 0) & (self.rng.random(k) >= p_invalid)
        # invalid entries carry garbage addresses: they must be ignored, not looked up
        sel[g, b] = np.where(ok, row_sel, self.rng.integers(0, self.sys.num_logical, k))
        sel_valid[g, b] = ok
    return sel, sel_valid, new_addr, active

  def commit(self, new_addr, active, new_entries):
    for b in np.flatnonzero(active):
      a = int(new_addr[b])
      for l in range(self.L):
        self.truth[l][a] = new_entries[l][b]
      self.ctx[b].append(a)

  def check_reads(self, sel, sel_valid, active, reads):
    geo = self.sys.geo
    i = 0
    for g in range(self.G):
      for l in geo.group_layers(g):
        for b in np.flatnonzero(active):
          for j in np.flatnonzero(sel_valid[g, b]):
            np.testing.assert_array_equal(reads[i][b, j], self.truth[l][int(sel[g, b, j])])
        i += 1


def group_step(system, state, g, layers, new_addr, active, key_new, q, w, page_table,
               positions, entries):
  """One layer group of a decode step in the model's order: write_index_keys, select,
  resolve, move_layer for every layer of the group, then per layer write_token and
  read_pool. ``g`` and ``layers`` (the group's layers) are Python ints or traced int32
  scalars; key_new [B, DI], q [B, HI, DI], w [B, HI], page_table [B, P], positions [B],
  entries [n, B, W] (n = len(layers)).
  returns (state, sel_addr [B, k], sel_valid [B, k], res, reads [n, B, k, W]): the rows
  read at ``base + res.slots`` (invalid slots read row ``base``)."""
  state = system.write_index_keys(state, g, jnp.where(active, new_addr, INVALID), key_new)
  sel_pos, sel_valid = system.select(state, g, q, w, page_table, positions, active)
  sel_addr = addrs_of_positions(page_table, sel_pos, system.page_size)
  state, res = system.resolve(state, g, sel_addr, sel_valid, new_addr, active)
  for l in layers:
    state = system.move_layer(state, l, res)
  reads = []
  for i, l in enumerate(layers):
    state = system.write_token(state, l, res, entries[i], active)
    pool, base = system.read_pool(state, l)
    reads.append(pool[base + jnp.maximum(res.slots, 0)])
  return state, sel_addr, sel_valid, res, jnp.stack(reads)
