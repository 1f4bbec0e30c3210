"""``ula`` in DP mode: one logical address space over a device pool and a host pool.

Each dp rank serves its own requests from its own memory. Per layer group it keeps

* a **mapping table** ``table[a]``: where logical address ``a`` lives. A location is
  one int32: device slot ``s`` as ``s`` (``0 <= s < Sd``), host slot ``h`` as ``Sd + h``,
  ``INVALID`` when nothing is stored. Moving an entry rewrites this table (and the
  owner arrays), never the address;
* **owners** ``dev_owner[s]`` / ``host_owner[h]``: the address a slot holds (``INVALID``
  when free), so a victim's address is one gather away;
* a bitmap of free host slots and the **policy** state over the device slots
  (``policies/``: PB-LRU or exact LRU).

State is stacked (``state.py``): one device pool ``[L * Sd, W]`` (memory kind ``device``)
and one host pool ``[L * Hr, W]`` (memory kind ``pinned_host``) over all layers, layer
``l``'s slot ``s`` at row ``l * Sd + s`` (host slot ``h`` at ``h * L + l`` with
``memory.host_layout = 'entry_major'``, the default, or at ``l * Hr + h`` with
``'layer_major'``: ``host_row``; ``Hr =
max(Sh, 1)``: an empty host tier keeps one unused row per layer so every gather has a
shape), and one ``GroupMeta`` whose leaves have a leading group axis ``[G, ...]``. The
layers of a group store an entry at the same slot. ``group`` and ``layer`` may be traced
int32 scalars: ``resolve`` hands the stacked metadata and the group to ``resolve_group``
(the Pallas kernels update the group's part in place; the other forms take it out with
``group_slice`` and write it back with ``group_update``); ``move_layer`` /
``write_token`` / ``read_pool`` address rows at ``layer * Sd + slot``.
Tiers are exclusive: an entry is on the device or on the host, never both. Fetching a
host entry moves it to a device slot; the occupant it displaces moves to the host (into
the slot the fetched entry vacated, or any free one).

Sizes per dp rank: ``Sd`` = ``memory.device_pool`` tokens, ``Sh`` = ``memory.host_pool``
tokens, ``num_logical = capacity_tokens = (Sd + Sh)`` rounded down to a page. Because
every stored entry has a distinct address below ``num_logical <= Sd + Sh``, a slot is
always found: prefill places entries in free device slots first and the rest on the
host (no eviction), and a decode step's ``n`` entries moving in evict at most as many
device entries as the host has room for (the misses' own host slots included). The only
condition, ``Sd >= max_batch * (top_k + 1)``, is checked by ``validate``.

Per decode step and group, ``resolve`` plans (stage/dedupe -> mark hits -> pick victims
-> plan fetch and write-back -> update the table -> publish slots aligned with
``sel_addr``; ``resolve_meta`` in jnp, or the fused Pallas kernels of
``kernels.resolve`` when ``resolve_impl == 'pallas'``, with identical results; with
``resolve_fast_path``, a step that moves nothing takes the all-hit fast path of
``kernels.resolve.fastpath``, again with identical results) and ``move_group`` copies
the group's rows through ``kernels.fetch`` (``stage_rows`` / ``fetch_rows`` /
``evict_rows``, implementation ``self.fetch_impl``), one launch each for all its
layers (``move_layer`` does one layer's). Every shape is static: a step moves at most
``M = B * k + B`` entries each way, as fixed-size lists compacted to the front, with
counts (``UlaPlan``).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ula_jax.core.scatter import set_where, update_groups
from ula_jax.memory.ula.resolve import fastpath, resolve_group
from ula_jax.memory.ula.resolve.fastpath import resolve_speculative
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, Resolution
from ula_jax.memory.base import (CapacityReport, MemorySystem, count_last_many, device_zeros,
                                 group_slice, group_update, host_zeros, layer_rows, set_rows,
                                 tp_replicated)
from ula_jax.memory.ula.policies import bitmap, make_policy, policy_fields
from ula_jax.memory.ula.state import GroupMeta, UlaPlan, UlaState, _compact, stage_selection

_I32 = jnp.int32


class Ula(MemorySystem):
  name = "ula"

  def setup(self) -> None:
    self.device_slots, self.host_slots = self._pool_sizes()
    self.policy_name, self.buckets = self._policy_fields()
    total = self.device_slots + self.host_slots
    self.capacity_tokens = (total // self.page_size) * self.page_size
    self.num_logical = self.capacity_tokens
    # A host pool of 0 tokens still gets one (never used) row so every gather has a shape.
    self.host_rows = max(self.host_slots, 1)
    self.host_layout = self.cfg.host_layout
    self.policy = make_policy(self.policy_name, self.device_slots, buckets=self.buckets)
    # Row-copy implementation for fetch and write-back (``kernels.fetch``: 'xla',
    # 'pallas' or 'ffi'); the memory section does not name it, so the builder may set it.
    self.fetch_impl = "xla"

  # -- configuration ---------------------------------------------------------------

  def _pool_sizes(self) -> tuple[int, int]:
    tb = self.geo.token_bytes
    dev = self.cfg.device_pool
    if dev is None:
      dev_tokens = self.max_batch * self.max_context
    else:
      dev_tokens = parse_size(dev, field="memory.device_pool", token_bytes=tb)
    host_tokens = parse_size(self.cfg.host_pool, field="memory.host_pool", token_bytes=tb)
    return dev_tokens, host_tokens

  def _policy_fields(self) -> tuple[str, int]:
    return policy_fields(self.cfg)

  @property
  def step_entries(self) -> int:
    """``M``: entries one decode step may need on the device (selection + new tokens;
    ``step_rows`` of each per request in a verify step)."""
    return self.max_batch * self.step_rows * (self.geo.top_k + 1)

  def validate(self) -> None:
    """Raises ValueError naming the field, its value and what is allowed.

    Sizes that do not parse, a negative size, an unknown ``memory.policy`` and
    ``memory.pb_lru_buckets < 1`` already fail at construction (checked again here);
    this adds the checks across fields: the device pool must hold one decode step's
    entries for the whole batch, and the capacity at least one page.
    """
    self._pool_sizes()
    self._policy_fields()
    need = self.step_entries
    if self.device_slots < need:
      rows = ("", "") if self.step_rows == 1 else (" * (1 + speculative.num_draft)",
                                                   f" * {self.step_rows}")
      raise ValueError(
          f"memory.device_pool={self.cfg.device_pool!r} holds "
          f"{self.device_slots} tokens per device and layer group, fewer than one decode "
          f"step needs on the device: engine.max_batch{rows[0]} * (top_k + 1) = "
          f"{self.max_batch}{rows[1]} * ({self.geo.top_k} + 1) = {need}; use "
          f"memory.device_pool >= {need} tokens ({need * self.geo.token_bytes} bytes)")
    if self.capacity_tokens < self.page_size:
      raise ValueError(
          f"memory.device_pool + memory.host_pool = {self.device_slots} + {self.host_slots}"
          f" tokens per device, fewer than one page (engine.page_size={self.page_size}); "
          f"raise memory.host_pool or memory.device_pool")

  # -- layout ----------------------------------------------------------------------

  def host_base_stride(self, layer) -> tuple[jax.Array, int]:
    """(base, stride): layer ``layer``'s host slot h is row ``base + h * stride`` of the
    host pool: ``(layer * Hr, 1)`` with ``memory.host_layout = 'layer_major'``,
    ``(layer, L)`` with ``'entry_major'`` (an entry's layers side by side: a group's
    rows of one entry are one stretch of host memory)."""
    layer = jnp.asarray(layer, _I32)
    if self.host_layout == "entry_major":
      return layer, self.geo.num_layers
    return layer * self.host_rows, 1

  def host_row(self, layer, slots: jax.Array) -> jax.Array:
    """Rows of the host pool holding host slots ``slots`` of ``layer`` (broadcast
    together; negative slots stay negative, so row copies skip them)."""
    base, stride = self.host_base_stride(layer)
    return jnp.where(slots >= 0, base + slots * stride, slots).astype(_I32)

  def init_group_meta(self) -> GroupMeta:
    """One group's empty address space (local arrays, no dp axis)."""
    return GroupMeta(
        table=jnp.full((self.num_logical,), INVALID, _I32),
        dev_owner=jnp.full((self.device_slots,), INVALID, _I32),
        host_owner=jnp.full((self.host_rows,), INVALID, _I32),
        host_free=bitmap.from_mask(jnp.arange(self.host_rows) < self.host_slots),
        policy=self.policy.init(),
    )

  def init_meta(self) -> GroupMeta:
    """Every group's empty address space, stacked: each leaf ``[G, ...]`` (local arrays;
    also used by ``trace.replay``)."""
    G = self.geo.num_groups
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (G, *x.shape)), self.init_group_meta())

  def init_state(self, mesh: Mesh) -> UlaState:
    dp, W, dt = self.mesh_info.dp, self.geo.entry_width, self.geo.kv_dtype
    L = self.geo.num_layers

    def meta():
      local = self.init_meta()
      return jax.tree.map(lambda x: jnp.broadcast_to(x, (dp, *x.shape)), local)

    sharding = NamedSharding(mesh, P("dp"), memory_kind="device")
    return UlaState(
        dev_pool=device_zeros(mesh, (dp, L * self.device_slots, W), dt, "device"),
        host_pool=host_zeros(mesh, (dp, L * self.host_rows, W), dt, self.cfg.host_alloc),
        meta=jax.jit(meta, out_shardings=sharding)(),
        index_keys=self.init_index_keys(mesh),
    )

  # -- metadata transitions (local; also replayed by trace.py) ---------------------

  def prefill_meta(self, meta: GroupMeta, addrs: jax.Array, valid: jax.Array
                   ) -> tuple[GroupMeta, jax.Array, jax.Array]:
    """Places a prefill chunk: free device slots first, then free host slots.

    addrs: [C] int32 (distinct where valid); valid: [C] bool
    returns (meta, dev_dst [C] int32, host_dst [C] int32): where each row is written
            (INVALID for the other tier). An address already stored is rewritten in place.
    """
    C = addrs.shape[0]
    N, Sd, Hr = self.num_logical, self.device_slots, self.host_rows
    ok = valid & (addrs >= 0) & (addrs < N)
    loc = jnp.where(ok, meta.table[jnp.clip(addrs, 0, N - 1)], INVALID)
    fresh = ok & (loc < 0)
    rank = jnp.cumsum(fresh) - 1
    dfree, dok = self.policy.first_free(meta.policy, C)
    n_dev = jnp.sum(dok)
    to_dev = fresh & (rank < n_dev)
    dslot = jnp.where(to_dev, dfree[jnp.clip(rank, 0, C - 1)], INVALID)
    hfree, n_host = bitmap.select_first(meta.host_free, C)
    hrank = rank - n_dev
    to_hst = fresh & ~to_dev & (hrank >= 0) & (hrank < n_host)
    hslot = jnp.where(to_hst, hfree[jnp.clip(hrank, 0, C - 1)], INVALID)

    # Distinct addresses and slots: unique scatters (``core.scatter``).
    table = set_where(meta.table, (addrs,), dslot, to_dev, unique=True)
    table = set_where(table, (addrs,), Sd + hslot, to_hst, unique=True)
    dev_owner = set_where(meta.dev_owner, (dslot,), addrs, to_dev, unique=True)
    host_owner = set_where(meta.host_owner, (hslot,), addrs, to_hst, unique=True)
    used = bitmap.words_of(Hr, hslot, to_hst, distinct=True)
    host_free = bitmap.summarize(meta.host_free[0] & ~used)

    dev_dst = jnp.where(to_dev, dslot, jnp.where(ok & (loc >= 0) & (loc < Sd), loc, INVALID))
    host_dst = jnp.where(to_hst, hslot, jnp.where(ok & (loc >= Sd), loc - Sd, INVALID))
    policy = self.policy.touch(meta.policy, dev_dst, dev_dst >= 0)
    meta = GroupMeta(table=table, dev_owner=dev_owner, host_owner=host_owner,
                     host_free=host_free, policy=policy)
    return meta, dev_dst.astype(_I32), host_dst.astype(_I32)

  def resolve_meta(self, meta: GroupMeta, sel_addr: jax.Array, sel_valid: jax.Array,
                   new_addr: jax.Array, active: jax.Array
                   ) -> tuple[GroupMeta, jax.Array, jax.Array, UlaPlan, dict]:
    """The metadata half of ``resolve`` for one group.

    sel_addr: [B, k] int32; sel_valid: [B, k] bool; new_addr: [B] int32; active: [B] bool
    returns (meta, slots [B, k] int32, new_slot [B] int32, plan, stats)

    An address that is neither stored nor a new token (the engine never selects one)
    gets slot INVALID and is not placed.
    """
    B, k = sel_addr.shape
    M = B * k + B
    N, Sd, Hr = self.num_logical, self.device_slots, self.host_rows

    # Stage: the addresses the step needs on the device, deduplicated (sorted).
    want, uid, u, u_ok, u_new = stage_selection(sel_addr, sel_valid, new_addr, active, N)

    # Mark: where each needed entry is now.
    loc = jnp.where(u_ok, meta.table[jnp.clip(u, 0, N - 1)], INVALID)
    on_dev = u_ok & (loc >= 0) & (loc < Sd)
    on_host = u_ok & (loc >= Sd)
    place = on_host | (u_ok & (loc < 0) & u_new)

    # Victims: hits join the current round first, so they can never be picked.
    pst = self.policy.begin_round(meta.policy)
    pst = self.policy.touch(pst, loc, on_dev)
    cand, cand_ok, cand_free = self.policy.pick(pst, jnp.sum(place), M)
    victim = cand_ok & ~cand_free
    victim_addr = jnp.where(victim, meta.dev_owner[jnp.clip(cand, 0, Sd - 1)], INVALID)

    # Write-back targets: free host slots, including those the misses vacate.
    miss_host = jnp.where(on_host, loc - Sd, INVALID)
    freed = bitmap.words_of(Hr, miss_host, on_host, distinct=True)
    hfree = bitmap.summarize(meta.host_free[0] | freed)
    hpos, _ = bitmap.select_first(hfree, M)
    vhost = jnp.where(victim, hpos[jnp.clip(jnp.cumsum(victim) - 1, 0, M - 1)], INVALID)

    # The j-th entry to place (ascending address) takes the j-th candidate.
    pidx = jnp.clip(jnp.cumsum(place) - 1, 0, M - 1)
    placed = place & cand_ok[pidx]
    dst = jnp.where(placed, cand[pidx], INVALID)

    # Table update (victims and placed entries are disjoint: victims are on the device).
    table = set_where(meta.table, (victim_addr,), Sd + vhost, victim, unique=True)
    table = set_where(table, (u,), dst, placed, unique=True)
    dev_owner = set_where(meta.dev_owner, (dst,), u, placed, unique=True)
    host_owner = set_where(meta.host_owner, (miss_host,), INVALID, on_host, unique=True)
    host_owner = set_where(host_owner, (vhost,), victim_addr, victim, unique=True)
    used = bitmap.words_of(Hr, vhost, victim, distinct=True)
    host_free = bitmap.summarize(hfree[0] & ~used)
    pst = self.policy.touch(pst, dst, placed)
    meta = GroupMeta(table=table, dev_owner=dev_owner, host_owner=host_owner,
                     host_free=host_free, policy=pst)

    # Publish, aligned with the selection order.
    slot_u = jnp.where(on_dev, loc, dst)
    elem = jnp.where(want, slot_u[uid], INVALID)
    slots = elem[:B * k].reshape(B, k)
    new_slot = elem[B * k:]

    fetch = on_host & placed
    plan = UlaPlan(
        fetch_src=_compact(fetch, loc - Sd, M), fetch_dst=_compact(fetch, dst, M),
        evict_src=_compact(victim, cand, M), evict_dst=_compact(victim, vhost, M),
        n_fetch=jnp.sum(fetch).astype(_I32), n_evict=jnp.sum(victim).astype(_I32))
    stats = {"hits": jnp.sum(on_dev).astype(_I32), "misses": jnp.sum(on_host).astype(_I32),
             "evictions": jnp.sum(victim).astype(_I32)}
    return meta, slots, new_slot, plan, stats

  def release_meta(self, meta: GroupMeta, addrs: jax.Array, valid: jax.Array) -> GroupMeta:
    """Frees the slots of ``addrs`` ([N] int32, valid: [N] bool) in one group."""
    N, Sd, Hr = self.num_logical, self.device_slots, self.host_rows
    ok = valid & (addrs >= 0) & (addrs < N)
    loc = jnp.where(ok, meta.table[jnp.clip(addrs, 0, N - 1)], INVALID)
    on_dev = (loc >= 0) & (loc < Sd)
    on_host = loc >= Sd
    table = set_where(meta.table, (addrs,), INVALID, ok, unique=True)
    dev_owner = set_where(meta.dev_owner, (loc,), INVALID, on_dev, unique=True)
    host_owner = set_where(meta.host_owner, (loc - Sd,), INVALID, on_host, unique=True)
    freed = bitmap.words_of(Hr, loc - Sd, on_host, distinct=False)
    return GroupMeta(table=table, dev_owner=dev_owner, host_owner=host_owner,
                     host_free=bitmap.summarize(meta.host_free[0] | freed),
                     policy=self.policy.release(meta.policy, loc, on_dev))

  # -- transitions (local, inside shard_map) ---------------------------------------

  def write_prefill(self, state: UlaState, addrs, valid, entries, row) -> UlaState:
    """entries: [L, C, W] layer-major. Every group places the chunk (``update_groups``: one
    program, the groups one after another), then every layer's rows land in one scatter
    per pool."""
    del row  # one pool shared by every request of the rank
    L, C = entries.shape[0], entries.shape[1]
    Sd = self.device_slots
    def place(m, _):
      m, dev, host = self.prefill_meta(m, addrs, valid)
      return m, (dev, host)

    meta, (dev_dst, host_dst) = update_groups(place, state.meta)  # [G, C] each
    # Layer l belongs to group l // group_size (``geo.group_layers``).
    of_layer = np.arange(L) // self.geo.group_size
    layer = jnp.arange(L, dtype=_I32)[:, None]
    rows = entries.astype(state.dev_pool.dtype).reshape(L * C, -1)
    d_rows = layer_rows(layer, dev_dst[of_layer], Sd).reshape(-1)  # [L * C]
    dev_pool = set_rows(state.dev_pool, d_rows, rows)
    host_pool = state.host_pool
    if self.host_slots:
      h_rows = self.host_row(layer, host_dst[of_layer])  # [L, C]
      src = jnp.arange(L * C, dtype=_I32).reshape(L, C)
      if self.host_layout == "entry_major":
        # Entry by entry (an entry's L rows side by side on the host), so the copy writes
        # stretches of host memory rather than rows L apart.
        src, h_rows = src.T, h_rows.T
      host_pool = self.evict_rows(rows, src.reshape(-1), host_pool, h_rows.reshape(-1))
    return state.replace(dev_pool=dev_pool, host_pool=host_pool, meta=meta)

  def stat_keys(self) -> tuple[str, ...]:
    keys = ("hits", "misses", "evictions")
    return (*keys, "spec_fail") if self.speculate else keys

  def speculative(self) -> Ula | None:
    if not fastpath.supports(self):
      return None
    spec = copy.copy(self)
    spec.speculate = True
    return spec

  def rollback(self, old: UlaState, new: UlaState, keep_new: jax.Array) -> UlaState:
    # A speculative step moves nothing: the pools differ from ``old``'s only in the new
    # tokens' rows, written to slots that were free, so restoring the metadata restores
    # every entry; of that, the all-hit path changes a group's table, device owners and
    # policy state only. The index keys of the new tokens' (unstored) addresses are
    # rewritten alike when the step runs again.
    pick = lambda o, n: jax.tree.map(lambda a, b: jnp.where(keep_new, b, a), o, n)
    o, n = old.meta, new.meta  # every leaf [G, ...]: all groups at once
    meta = o.replace(table=pick(o.table, n.table), dev_owner=pick(o.dev_owner, n.dev_owner),
                     policy=pick(o.policy, n.policy))
    return new.replace(meta=meta)

  def resolve(self, state: UlaState, group, sel_addr, sel_valid, new_addr, active):
    # ``resolve_meta`` itself ('jnp') or the Pallas kernels ('pallas', 'pallas_fused'):
    # same arrays. ``group`` may be traced. The Pallas kernels without the fast path
    # update the group's part of the stacked metadata in place; the other forms take the
    # group's metadata out and write it back.
    if self.speculate:
      meta = group_slice(state.meta, group)
      meta, slots, new_slot, plan, stats = resolve_speculative(
          self, meta, sel_addr, sel_valid, new_addr, active)
      meta = group_update(state.meta, group, meta)
    else:
      meta, slots, new_slot, plan, stats = resolve_group(
          self, state.meta, sel_addr, sel_valid, new_addr, active,
          impl=self.resolve_impl, interpret=self.resolve_interpret,
          fast_path=self.resolve_fast_path, group=group)
    state = state.replace(meta=meta)
    return state, Resolution(slots=slots, valid=sel_valid, new_slot=new_slot, plan=plan,
                             stats=stats)

  def move_layer(self, state: UlaState, layer, res: Resolution) -> UlaState:
    return self._move(state, layer, 1, res)

  def move_group(self, state: UlaState, first_layer, num_layers: int,
                 res: Resolution) -> UlaState:
    """``move_layer`` for the group's ``num_layers`` layers at once: one stage, one fetch
    and one evict launch move every layer's rows (each plan row once per layer), so a
    launch copies the group's thousands of rows rather than a layer's hundreds, and a
    step issues one launch of each kind per group, not per layer."""
    return self._move(state, first_layer, num_layers, res)

  def _move(self, state: UlaState, first_layer, n: int, res: Resolution) -> UlaState:
    """The planned copies of layers ``first_layer .. first_layer + n - 1``."""
    if not self.host_slots or self.speculate:
      return state  # one tier, or a speculative step: nothing moves
    p: UlaPlan = res.plan
    Sd, M = self.device_slots, p.evict_src.shape[0]
    dev, host = state.dev_pool, state.host_pool
    layer = jnp.asarray(first_layer, _I32) + jnp.arange(n, dtype=_I32)

    def dev_rows(slots: jax.Array) -> jax.Array:
      # [M] -> [M * n] rows of the flat device pool (``layer_rows`` for each layer: skips
      # stay negative): entry j * n + i is plan row j in layer first + i, so a plan's
      # first c rows are the lists' first c * n entries.
      return layer_rows(layer[None, :], slots[:, None], Sd).reshape(M * n)

    def host_rows(slots: jax.Array) -> jax.Array:
      # The same for host slots (``host_row``), in the same order.
      return self.host_row(layer[None, :], slots[:, None]).reshape(M * n)

    # Both sides are read before either is written: a victim may take the host slot a
    # miss vacates, and a miss the device slot a victim vacates. The victims' rows are
    # set aside on the device, the misses fetched over their slots, then written back.
    # The barriers order each in-place write after the reads of the same pool (the
    # victims' staging before the fetch writes dev, the fetch before the evict writes
    # host); without them XLA copies the pool to let the two run in either order.
    # The lists are sized for the worst case (B * k + B rows) and hold the step's moves
    # first (``n_fetch`` / ``n_evict``): every copy reads and writes only those, and the
    # Pallas launches copy only the blocks that hold them.
    v_src = dev_rows(p.evict_src)
    victims = self.stage_rows(dev, v_src, p.n_evict * n)
    victims, dev = jax.lax.optimization_barrier((victims, dev))
    dev = self.fetch_rows(host, host_rows(p.fetch_src), dev, dev_rows(p.fetch_dst),
                          p.n_fetch * n)
    dev, host = jax.lax.optimization_barrier((dev, host))
    staged = jnp.where(v_src >= 0, jnp.arange(M * n, dtype=_I32), INVALID)
    host = self.evict_rows(victims, staged, host, host_rows(p.evict_dst), p.n_evict * n)
    return state.replace(dev_pool=dev, host_pool=host)

  def write_token(self, state: UlaState, layer, res: Resolution, entry, active) -> UlaState:
    ok = active & (res.new_slot >= 0)
    rows = layer_rows(layer, jnp.where(ok, res.new_slot, INVALID), self.device_slots)
    return state.replace(dev_pool=set_rows(state.dev_pool, rows, entry))

  def read_pool(self, state: UlaState, layer) -> tuple[jax.Array, jax.Array]:
    """(dev_pool [L * Sd, W], base [] int32): layer ``layer``'s slot s is row base + s."""
    return state.dev_pool, jnp.asarray(layer, _I32) * self.device_slots

  def read_host_pool(self, state: UlaState, layer
                     ) -> tuple[jax.Array, jax.Array, int]:
    """(host_pool [L * Hr, W] memory kind ``pinned_host``, base [] int32, stride):
    layer ``layer``'s host slot h is row base + h * stride (``host_base_stride``;
    tests, tools)."""
    return (state.host_pool, *self.host_base_stride(layer))

  def release(self, state: UlaState, addrs, valid, row) -> UlaState:
    del row
    meta, _ = update_groups(lambda m, _: (self.release_meta(m, addrs, valid), None),
                            state.meta)
    return state.replace(meta=meta)

  # -- accounting ------------------------------------------------------------------

  def report(self, state: UlaState) -> CapacityReport:
    dp, tp, G = self.mesh_info.dp, self.mesh_info.tp, self.geo.num_groups
    m = state.meta  # leaves [dp, G, ...]: summed over the groups
    dev_used, host_used, distinct = (c.sum(axis=1) for c in count_last_many(
        (m.dev_owner, "valid", None), (m.host_owner, "valid", self.host_slots),
        (m.table, "valid", None)))
    # With tp > 1 every tp rank holds the dp rank's pools (replicated over tp).
    return CapacityReport(
        system=self.name,
        device_capacity=tp_replicated(np.full((dp,), self.device_slots * G), tp),
        device_used=tp_replicated(dev_used, tp),
        host_capacity=tp_replicated(np.full((dp,), self.host_slots * G), tp),
        host_used=tp_replicated(host_used, tp),
        distinct=distinct,
        entry_bytes=self.geo.group_size * self.geo.row_bytes,
        extra={"layout": "dp" if tp == 1 else "dp_replicated", "policy": self.policy_name,
               "pb_lru_buckets": self.buckets, "device_slots": self.device_slots,
               "host_slots": self.host_slots},
    )
