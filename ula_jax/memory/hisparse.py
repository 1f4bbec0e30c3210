"""``hisparse``: host memory holds every entry, device memory a per-request LRU buffer.

The HiSparse design (seeds 002, 004; SGLang's ``--enable-hisparse``):

* **Host pool** (``pinned_host``, one array per layer, indexed by logical address):
  the authoritative copy of every entry, written at prefill and for each decoded
  token. Its size follows SGLang's ``host_to_device_ratio``: host tokens =
  ratio x device-pool tokens, where the device pool is ``memory.device_pool`` when
  set (a budget the quotas must fit in) and the quotas otherwise; a non-zero
  ``memory.host_pool`` sets the host pool directly. Admission (``capacity_tokens``)
  is the host pool: a request is admitted when its whole context fits there.
* **Device buffers**: each (batch row, layer group) owns a fixed quota of
  ``device_buffer_size + 1`` slots (the extra slot makes room for the decoded token
  next to k selected entries). The device pool of a group is ``max_batch`` quotas;
  row ``b`` owns slots ``[b*Q, (b+1)*Q)``. A quota left free by one request is not
  usable by another (SGLang's fixed per-request buffers).
* **Mapping table** per group: logical address -> device slot (``INVALID`` = host
  only), plus per-slot address and recency stamp. Exact LRU with one recency value
  per decode step: everything a step touches gets that step's stamp.

``resolve`` runs HiSparse's RESOLVE stages, data-parallel over rows and selections:

1. **stage**: dedupe each row's selection (stable sort; the first occurrence stands
   for its duplicates) and spot the decoded token's own address;
2. **mark**: look every selected address up in the table; hits are stamped;
3. **scan**: order each row's untouched slots by (stamp, slot) -- free slots
   (stamp -1) first -- and hand them to the row's misses in selection order, then to
   the decoded token;
4. **fetch** (planned here, run per layer by ``move_layer``): copy missed rows from
   the host pool into their victim slots (no write-back: the host copy is
   authoritative);
5. **publish**: update the table and return the slot of every selected entry.

A group's layers share one selection, so ``resolve`` plans once at the group's first
layer and ``move_layer`` moves each layer's rows on its own (exact layer-wise
prefetch: a later layer's copy depends on nothing the current layer computes).

Prefill writes every entry to the host pool and also places the chunk's last
entries in the buffer of the batch ``row`` the request decodes in (device to device,
LRU order), so a request whose context fits in its buffer never reads from the host.

Host <-> device row copies go through ``ula_jax.kernels.fetch`` (``fetch_rows`` /
``evict_rows``) with the implementation named by ``fetch_impl`` (``kernels.fetch``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, Resolution
from ula_jax.memory.base import (CapacityReport, MemorySystem, device_zeros, replace_at,
                                 tp_replicated)

_BIG = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------


@struct.dataclass
class HiSparseState:
  host_pools: tuple[jax.Array, ...]  # per layer [N, W], 'pinned_host', by logical address
  dev_pools: tuple[jax.Array, ...]  # per layer [R*Q, W], 'device'
  slot_of: tuple[jax.Array, ...]  # per group [N] int32 device slot of each address
  slot_addr: tuple[jax.Array, ...]  # per group [R*Q] int32 address held by each slot
  stamp: tuple[jax.Array, ...]  # per group [R*Q] int32 recency (-1: free)
  clock: jax.Array  # [G] int32, advanced by every resolve / prefill chunk of the group
  live: tuple[jax.Array, ...]  # per group [N] bool: the host pool holds the entry
  index_keys: tuple[jax.Array, ...]  # per group [N, index_dim]


@struct.dataclass
class HiSparsePlan:
  """What ``move_layer`` / ``write_token`` need from one resolve (local)."""

  host_idx: jax.Array  # [B*k] int32 host rows to fetch (INVALID: none)
  dev_idx: jax.Array  # [B*k] int32 victim slots they go to
  new_addr: jax.Array  # [B] int32 address of the decoded token (INVALID: inactive)
  group: int = struct.field(pytree_node=False, default=0)


class HiSparse(MemorySystem):
  name = "hisparse"

  def setup(self) -> None:
    hs = self.cfg.hisparse
    self.top_k_cfg = hs.top_k
    self.top_k = self.geo.top_k if self.top_k_cfg is None else self.top_k_cfg
    self.buffer_size = hs.device_buffer_size
    self.ratio = hs.host_to_device_ratio
    self.quota = self.buffer_size + 1  # Q: slots per (row, group)
    self.device_slots = self.max_batch * self.quota  # per group
    budget = self.cfg.device_pool
    self.device_budget = (self.device_slots if budget is None else parse_size(
        budget, field="memory.device_pool", token_bytes=self.geo.token_bytes))
    host = self.cfg.host_pool
    if not host:  # 0, the default: sized from the device pool, as SGLang does
      host_tokens = int(self.ratio * self.device_budget)
    else:
      host_tokens = parse_size(host, field="memory.host_pool", token_bytes=self.geo.token_bytes)
    self.capacity_tokens = max(host_tokens // self.page_size, 0) * self.page_size
    self.num_logical = self.capacity_tokens

  def validate(self) -> None:
    if self.top_k_cfg is not None and self.top_k_cfg != self.geo.top_k:
      raise ValueError(f"memory.hisparse.top_k={self.top_k_cfg}: must equal the model's "
                       f"index_topk={self.geo.top_k} (or be left unset)")
    if self.buffer_size < self.top_k:
      raise ValueError(f"memory.hisparse.device_buffer_size={self.buffer_size}: must be >= "
                       f"top_k={self.top_k} (a step's selection must fit in the buffer)")
    if self.ratio <= 0:
      raise ValueError(f"memory.hisparse.host_to_device_ratio={self.ratio}: must be > 0")
    if self.device_slots > self.device_budget:
      raise ValueError(
          f"memory.device_pool holds {self.device_budget} tokens per device, fewer than "
          f"max_batch x (device_buffer_size + 1) = {self.max_batch} x {self.quota} = "
          f"{self.device_slots}; raise memory.device_pool or lower "
          "memory.hisparse.device_buffer_size / the batch")
    if self.capacity_tokens < self.page_size:
      raise ValueError(
          f"the hisparse host pool holds {self.capacity_tokens} tokens per device, fewer "
          f"than one page (engine.page_size={self.page_size}); raise memory.host_pool or "
          "memory.hisparse.host_to_device_ratio")



  # -- layout ----------------------------------------------------------------------

  def init_state(self, mesh: Mesh) -> HiSparseState:
    dp, N, W, S = self.mesh_info.dp, self.num_logical, self.geo.entry_width, self.device_slots
    G, L = self.geo.num_groups, self.geo.num_layers
    ints = lambda n, fill: device_zeros(mesh, (dp, n), jnp.int32, "device", fill)
    return HiSparseState(
        host_pools=tuple(device_zeros(mesh, (dp, N, W), self.geo.kv_dtype, "pinned_host")
                         for _ in range(L)),
        dev_pools=tuple(device_zeros(mesh, (dp, S, W), self.geo.kv_dtype, "device")
                        for _ in range(L)),
        slot_of=tuple(ints(N, INVALID) for _ in range(G)),
        slot_addr=tuple(ints(S, INVALID) for _ in range(G)),
        stamp=tuple(ints(S, -1) for _ in range(G)),
        clock=ints(G, 0),
        live=tuple(device_zeros(mesh, (dp, N), jnp.bool_, "device") for _ in range(G)),
        index_keys=self.init_index_keys(mesh),
    )

  # -- prefill ---------------------------------------------------------------------

  def write_prefill(self, state: HiSparseState, addrs: jax.Array, valid: jax.Array,
                    entries: tuple[jax.Array, ...], row: jax.Array) -> HiSparseState:
    """Stores one request's prompt chunk in the host pool and warms its row's buffer.

    addrs: [C] int32, valid: [C] bool, entries: per layer [C, W].
    row:   [] int32 batch row the request decodes in: the chunk's last ``min(C, Q)``
           valid entries are also placed in that row's device buffer (LRU victims).
    """
    ok = valid & (addrs >= 0)
    host_idx = jnp.where(ok, addrs, INVALID).astype(jnp.int32)
    src = jnp.arange(addrs.shape[0], dtype=jnp.int32)
    host_pools = tuple(self.evict_rows(e.astype(p.dtype), src, p, host_idx)
                       for p, e in zip(state.host_pools, entries))
    oob = jnp.where(ok, addrs, self.num_logical)
    live = tuple(l.at[oob].set(True, mode="drop") for l in state.live)
    state = state.replace(host_pools=host_pools, live=live)
    return self._warm(state, addrs, ok, entries, jnp.asarray(row, jnp.int32))

  def _warm(self, state: HiSparseState, addrs, ok, entries, row) -> HiSparseState:
    Q = self.quota
    n_ok = ok.sum()
    pos = jnp.cumsum(ok) - 1  # index among the chunk's valid entries
    drop = jnp.maximum(n_ok - Q, 0)
    keep = ok & (pos >= drop)  # the last Q valid entries: the most recent positions
    kidx = jnp.clip(pos - drop, 0, Q - 1)
    dev_pools = list(state.dev_pools)
    for g in range(self.geo.num_groups):
      clock = state.clock[g] + 1
      stamp_r = jax.lax.dynamic_slice(state.stamp[g], (row * Q,), (Q,))
      order = jnp.argsort(stamp_r, stable=True)  # free first, then oldest
      victim = jnp.where(keep, row * Q + order[kidx], INVALID)  # [C]
      slot_of, slot_addr, stamp = self._assign(
          state.slot_of[g], state.slot_addr[g], state.stamp[g], victim,
          jnp.where(keep, addrs, INVALID), clock)
      state = state.replace(slot_of=replace_at(state.slot_of, g, slot_of),
                            slot_addr=replace_at(state.slot_addr, g, slot_addr),
                            stamp=replace_at(state.stamp, g, stamp),
                            clock=state.clock.at[g].set(clock))
      dst = jnp.where(keep, victim, self.device_slots)
      for l in self.geo.group_layers(g):
        dev_pools[l] = dev_pools[l].at[dst].set(entries[l].astype(dev_pools[l].dtype),
                                                mode="drop")
    return state.replace(dev_pools=tuple(dev_pools))

  def _assign(self, slot_of, slot_addr, stamp, victim, addr, clock):
    """Gives ``victim`` slots (INVALID: none) to ``addr``; evicts their old entries.

    victim, addr: [M] int32, distinct valid victims."""
    S, N = self.device_slots, self.num_logical
    used = victim >= 0
    vslot = jnp.where(used, victim, 0)
    old = jnp.where(used, slot_addr[vslot], INVALID)
    slot_of = slot_of.at[jnp.where(old >= 0, old, N)].set(INVALID, mode="drop")
    set_ok = used & (addr >= 0)
    slot_of = slot_of.at[jnp.where(set_ok, addr, N)].set(victim, mode="drop")
    dst = jnp.where(used, victim, S)
    slot_addr = slot_addr.at[dst].set(addr, mode="drop")
    stamp = stamp.at[dst].set(clock, mode="drop")
    return slot_of, slot_addr, stamp

  # -- decode ----------------------------------------------------------------------

  def resolve(self, state: HiSparseState, group: int, sel_addr, sel_valid, new_addr, active):
    R, Q, S, N = self.max_batch, self.quota, self.device_slots, self.num_logical
    B, k = sel_addr.shape
    if B != R:
      raise ValueError(f"hisparse.resolve: sel_addr has {B} rows; expected max_batch={R} "
                       "(device quotas are per batch row)")
    if k > self.buffer_size:
      raise ValueError(f"hisparse.resolve: selection width k={k} exceeds "
                       f"memory.hisparse.device_buffer_size={self.buffer_size}")
    g = group
    slot_of, slot_addr, stamp = state.slot_of[g], state.slot_addr[g], state.stamp[g]
    clock = state.clock[g] + 1
    rows = jnp.arange(R, dtype=jnp.int32)[:, None]

    # 1. stage: dedupe (stable sort: the first occurrence represents its run)
    has_new = active & (new_addr >= 0)
    valid = sel_valid & (sel_addr >= 0) & active[:, None]
    key = jnp.where(valid, sel_addr, _BIG)
    order = jnp.argsort(key, axis=1, stable=True)
    skey = jnp.take_along_axis(key, order, axis=1)
    first_s = jnp.concatenate([jnp.ones((R, 1), bool), skey[:, 1:] != skey[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(first_s, jnp.arange(k), 0), axis=1)
    rep = jnp.zeros((R, k), jnp.int32).at[rows, order].set(
        jnp.take_along_axis(order, start, axis=1).astype(jnp.int32))
    first = rep == jnp.arange(k)[None, :]
    is_new = valid & has_new[:, None] & (sel_addr == new_addr[:, None])

    # 2. mark: hits are stamped now, so the scan cannot pick them
    cur = jnp.where(valid, slot_of[jnp.where(valid, sel_addr, 0)], INVALID)
    new_cur = jnp.where(has_new, slot_of[jnp.where(has_new, new_addr, 0)], INVALID)
    hit = valid & ~is_new & (cur >= 0)
    miss = valid & first & ~is_new & (cur < 0)
    stamp = stamp.at[jnp.where(hit, cur, S)].set(clock, mode="drop")
    stamp = stamp.at[jnp.where(new_cur >= 0, new_cur, S)].set(clock, mode="drop")

    # 3. scan: untouched slots by (stamp, slot); misses in selection order, then the token
    st = stamp.reshape(R, Q)
    vorder = jnp.argsort(jnp.where(st == clock, _BIG, st), axis=1, stable=True)[:, :k + 1]
    victims = (rows * Q + vorder).astype(jnp.int32)  # [R, k+1]
    rank = jnp.cumsum(miss, axis=1) - 1
    n_miss = miss.sum(axis=1)
    miss_slot = jnp.where(miss, jnp.take_along_axis(victims, jnp.maximum(rank, 0), axis=1),
                          INVALID)
    need_new = has_new & (new_cur < 0)
    new_victim = jnp.take_along_axis(victims, n_miss[:, None], axis=1)[:, 0]
    new_slot = jnp.where(need_new, new_victim, new_cur).astype(jnp.int32)
    new_slot = jnp.where(has_new, new_slot, INVALID)
    used = jnp.arange(k + 1)[None, :] < (n_miss + need_new)[:, None]
    evictions = (used & (slot_addr[victims] >= 0)).sum()

    # 5. publish: the table first drops evicted entries, then maps the new ones
    victim_all = jnp.concatenate([miss_slot.reshape(-1),
                                  jnp.where(need_new, new_slot, INVALID)])
    addr_all = jnp.concatenate([jnp.where(miss, sel_addr, INVALID).reshape(-1),
                                jnp.where(need_new, new_addr, INVALID)])
    slot_of, slot_addr, stamp = self._assign(slot_of, slot_addr, stamp, victim_all.astype(
        jnp.int32), addr_all.astype(jnp.int32), clock)
    live = state.live[g].at[jnp.where(has_new, new_addr, N)].set(True, mode="drop")
    base = jnp.where(is_new, new_slot[:, None], jnp.where(miss, miss_slot, cur))
    slots = jnp.where(valid, jnp.take_along_axis(base, rep, axis=1), INVALID).astype(jnp.int32)

    state = state.replace(slot_of=replace_at(state.slot_of, g, slot_of),
                          slot_addr=replace_at(state.slot_addr, g, slot_addr),
                          stamp=replace_at(state.stamp, g, stamp),
                          clock=state.clock.at[g].set(clock),
                          live=replace_at(state.live, g, live))
    plan = HiSparsePlan(host_idx=jnp.where(miss, sel_addr, INVALID).reshape(-1).astype(jnp.int32),
                        dev_idx=miss_slot.reshape(-1).astype(jnp.int32),
                        new_addr=jnp.where(has_new, new_addr, INVALID).astype(jnp.int32),
                        group=g)
    stats = {
        "hits": (valid & first & ~miss).sum().astype(jnp.int32),
        "misses": n_miss.sum().astype(jnp.int32),
        "evictions": evictions.astype(jnp.int32),
    }
    return state, Resolution(slots=slots, valid=sel_valid, new_slot=new_slot, plan=plan,
                             stats=stats)

  def _check_layer(self, layer: int, res: Resolution) -> None:
    g = res.plan.group
    if layer not in self.geo.group_layers(g):
      raise ValueError(f"layer={layer} is not in layer group {g} "
                       f"(layers {list(self.geo.group_layers(g))}) that this Resolution planned")

  def move_layer(self, state: HiSparseState, layer: int, res: Resolution) -> HiSparseState:
    self._check_layer(layer, res)
    pool = self.fetch_rows(state.host_pools[layer], res.plan.host_idx, state.dev_pools[layer],
                       res.plan.dev_idx)
    return state.replace(dev_pools=replace_at(state.dev_pools, layer, pool))

  def write_token(self, state: HiSparseState, layer: int, res: Resolution, entry: jax.Array,
                  active: jax.Array) -> HiSparseState:
    """Writes the decoded token's row to its device slot and through to the host pool."""
    self._check_layer(layer, res)
    ok = active & (res.new_slot >= 0)
    dev_idx = jnp.where(ok, res.new_slot, INVALID)
    pool = state.dev_pools[layer]
    pool = pool.at[jnp.where(ok, dev_idx, self.device_slots)].set(entry.astype(pool.dtype),
                                                                   mode="drop")
    host = self.evict_rows(pool, dev_idx, state.host_pools[layer],
                       jnp.where(ok, res.plan.new_addr, INVALID))
    return state.replace(dev_pools=replace_at(state.dev_pools, layer, pool),
                         host_pools=replace_at(state.host_pools, layer, host))

  def read_pool(self, state: HiSparseState, layer: int) -> jax.Array:
    return state.dev_pools[layer]

  def release(self, state: HiSparseState, addrs, valid, row) -> HiSparseState:
    """Frees the addresses' host entries and their buffer slots. ``row`` is not used:
    a row's buffer only ever holds its own request's entries, so freeing by address is
    exact, and ranks with nothing to release pass a row with no valid address."""
    del row
    N, S = self.num_logical, self.device_slots
    ok = valid & (addrs >= 0)
    a = jnp.where(ok, addrs, N)
    for g in range(self.geo.num_groups):
      slot = jnp.where(ok, state.slot_of[g][jnp.where(ok, addrs, 0)], INVALID)
      dst = jnp.where(slot >= 0, slot, S)
      state = state.replace(
          slot_of=replace_at(state.slot_of, g, state.slot_of[g].at[a].set(INVALID, mode="drop")),
          slot_addr=replace_at(state.slot_addr, g,
                               state.slot_addr[g].at[dst].set(INVALID, mode="drop")),
          stamp=replace_at(state.stamp, g, state.stamp[g].at[dst].set(-1, mode="drop")),
          live=replace_at(state.live, g, state.live[g].at[a].set(False, mode="drop")))
    return state

  # -- accounting -------------------------------------------------------------------

  def report(self, state: HiSparseState) -> CapacityReport:
    dp, tp, G = self.mesh_info.dp, self.mesh_info.tp, self.geo.num_groups
    dev_used = sum((np.asarray(s) >= 0).sum(axis=1) for s in state.slot_addr)  # [dp]
    host_used = sum(np.asarray(l).sum(axis=1) for l in state.live)  # [dp]
    dev_cap = np.full((dp,), self.device_slots * G)
    rows_in_use = np.stack([(np.asarray(s).reshape(dp, self.max_batch, self.quota) >= 0)
                            .any(axis=2) for s in state.slot_addr]).any(axis=0)  # [dp, R]
    return CapacityReport(
        system=self.name,
        device_capacity=tp_replicated(dev_cap, tp),
        device_used=tp_replicated(dev_used, tp),
        host_capacity=tp_replicated(np.full((dp,), self.num_logical * G), tp),
        host_used=tp_replicated(host_used, tp),
        distinct=np.asarray(host_used, np.int64),
        entry_bytes=self.geo.group_size * self.geo.row_bytes,
        extra={
            "layout": "replicated" if tp > 1 else "local",
            "quota_slots": self.quota,
            "quota_unused_slots": (dev_cap - dev_used).tolist(),
            "quota_rows_in_use": rows_in_use.sum(axis=1).tolist(),
            "device_budget_uncarved_slots": (self.device_budget - self.device_slots) * G,
            "device_duplicates": dev_used.tolist(),
        },
    )
