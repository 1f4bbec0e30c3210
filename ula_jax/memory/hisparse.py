"""``hisparse``: host memory holds every entry, device memory a per-request LRU buffer.

The HiSparse design (seeds 002, 004; SGLang's ``--enable-hisparse``):

* **Host pool** (``pinned_host``, one array over all layers ``[L * N, W]``, layer ``l``'s
  logical address ``a`` at row ``l * N + a``):
  the authoritative copy of every entry, written at prefill and for each decoded
  token. Its size follows SGLang's ``host_to_device_ratio``: host tokens =
  ratio x device-pool tokens, where the device pool is ``memory.device_pool`` when
  set (a budget the quotas must fit in) and the quotas otherwise; a non-zero
  ``memory.host_pool`` sets the host pool directly. Admission (``capacity_tokens``)
  is the host pool: a request is admitted when its whole context fits there.
* **Device buffers**: each (batch row, layer group) owns a fixed quota of
  ``device_buffer_size + 1`` slots (the extra slot makes room for the decoded token
  next to k selected entries). A layer's device slots are ``max_batch`` quotas (S =
  R*Q; the pool is ``[L * S, W]``, layer ``l``'s slot ``s`` at row ``l * S + s``);
  row ``b`` owns slots ``[b*Q, (b+1)*Q)``. A quota left free by one request is not
  usable by another (SGLang's fixed per-request buffers).
* **Mapping table** per group (arrays with a leading group axis): logical address ->
  device slot (``INVALID`` = host only), plus per-slot address and recency stamp. Exact LRU with one recency value
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
``group`` and ``layer`` may be traced int32 scalars (the model's scan over groups): the
tables are addressed at ``[g, ...]`` and the pools at rows ``l * rows_per_layer + ...``.

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

from ula_jax.core.scatter import set_every_group, set_where
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, Resolution
from ula_jax.memory.base import (CapacityReport, MemorySystem, count_last_many, device_zeros,
                                 host_zeros, layer_rows, set_rows, tp_replicated)

_BIG = np.iinfo(np.int32).max


# ----------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------


@struct.dataclass
class HiSparseState:
  """Local shapes (``init_state`` adds the leading dp axis): N = ``num_logical``,
  S = R*Q = ``device_slots`` per layer, G groups, L layers."""

  host_pool: jax.Array  # [L * N, W] 'pinned_host': layer l's address a at row l * N + a
  dev_pool: jax.Array  # [L * S, W] 'device': layer l's slot s at row l * S + s
  slot_of: jax.Array  # [G, N] int32 device slot of each address (INVALID: host only)
  slot_addr: jax.Array  # [G, S] int32 address held by each slot (INVALID: free)
  stamp: jax.Array  # [G, S] int32 recency (-1: free)
  clock: jax.Array  # [G] int32, advanced by every resolve / prefill chunk of the group
  live: jax.Array  # [G, N] bool: the host pool holds the entry
  index_keys: jax.Array  # [G, N, index_dim]


@struct.dataclass
class HiSparsePlan:
  """What ``move_layer`` / ``write_token`` need from one resolve (local).

  Slots and addresses are per layer; the layer's row offset is added when moving."""

  host_idx: jax.Array  # [B*k] int32 host addresses to fetch (INVALID: none)
  dev_idx: jax.Array  # [B*k] int32 victim slots they go to
  new_addr: jax.Array  # [B * R] int32 addresses of the decoded tokens, R per request in a
  # verify step (else 1) (INVALID: inactive)
  group: jax.Array  # [] int32 the group that planned it (checked where concrete)


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
    need = self.step_rows * (self.top_k + 1)
    if self.quota < need:
      raise ValueError(
          f"memory.hisparse.device_buffer_size={self.buffer_size}: with "
          f"speculative.num_draft={self.step_rows - 1} a request's buffer (device_buffer_size"
          f" + 1 slots) must hold one verify step's entries, (1 + num_draft) x (top_k + 1) = "
          f"{need}; use memory.hisparse.device_buffer_size >= {need - 1}")
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
    ints = lambda shape, fill: device_zeros(mesh, (dp, *shape), jnp.int32, "device", fill)
    return HiSparseState(
        host_pool=host_zeros(mesh, (dp, L * N, W), self.geo.kv_dtype, self.cfg.host_alloc),
        dev_pool=device_zeros(mesh, (dp, L * S, W), self.geo.kv_dtype, "device"),
        slot_of=ints((G, N), INVALID),
        slot_addr=ints((G, S), INVALID),
        stamp=ints((G, S), -1),
        clock=ints((G,), 0),
        live=device_zeros(mesh, (dp, G, N), jnp.bool_, "device"),
        index_keys=self.init_index_keys(mesh),
    )

  def _layer_group(self) -> np.ndarray:
    """[L] int32 the group of each layer (static)."""
    return np.arange(self.geo.num_layers, dtype=np.int32) // self.geo.group_size

  # -- prefill ---------------------------------------------------------------------

  def write_prefill(self, state: HiSparseState, addrs: jax.Array, valid: jax.Array,
                    entries: jax.Array, row: jax.Array) -> HiSparseState:
    """Stores one request's prompt chunk in the host pool and warms its row's buffer.

    addrs: [C] int32, valid: [C] bool, entries: [L, C, W] layer-major.
    row:   [] int32 batch row the request decodes in: the chunk's last ``min(C, Q)``
           valid entries are also placed in that row's device buffer (LRU victims).
    """
    L, N = self.geo.num_layers, self.num_logical
    C, W = entries.shape[1], entries.shape[2]
    ok = valid & (addrs >= 0)
    host_idx = jnp.where(ok, addrs, INVALID).astype(jnp.int32)
    # One copy for all layers: entry (l, c) is source row l * C + c.
    layers = jnp.arange(L, dtype=jnp.int32)[:, None]
    host_rows = layer_rows(layers, host_idx[None, :], N).reshape(-1)  # [L*C]
    src = jnp.arange(L * C, dtype=jnp.int32)
    host_pool = self.evict_rows(entries.reshape(L * C, W).astype(state.host_pool.dtype), src,
                                state.host_pool, host_rows)
    live = set_every_group(state.live, addrs, True, ok)
    state = state.replace(host_pool=host_pool, live=live)
    return self._warm(state, addrs, ok, entries, jnp.asarray(row, jnp.int32))

  def _warm(self, state: HiSparseState, addrs, ok, entries, row) -> HiSparseState:
    """Every group at once (the groups' tables are independent; the program does not
    grow with the number of groups)."""
    Q, S, G, L = self.quota, self.device_slots, self.geo.num_groups, self.geo.num_layers
    C, W = entries.shape[1], entries.shape[2]
    n_ok = ok.sum()
    pos = jnp.cumsum(ok) - 1  # index among the chunk's valid entries
    drop = jnp.maximum(n_ok - Q, 0)
    keep = ok & (pos >= drop)  # the last Q valid entries: the most recent positions
    kidx = jnp.clip(pos - drop, 0, Q - 1)
    clock = state.clock + (n_ok > 0)  # [G]; a chunk with nothing to write changes nothing
    stamp_r = jax.lax.dynamic_slice(state.stamp, (0, row * Q), (G, Q))  # [G, Q]
    order = jnp.argsort(stamp_r, axis=1, stable=True)  # free first, then oldest
    victim = jnp.where(keep[None, :], row * Q + order[:, kidx], INVALID).astype(jnp.int32)
    addr = jnp.broadcast_to(jnp.where(keep, addrs, INVALID), (G, C)).astype(jnp.int32)
    gi = jnp.arange(G, dtype=jnp.int32)[:, None]
    slot_of, slot_addr, stamp = self._assign(state.slot_of, state.slot_addr, state.stamp, gi,
                                             victim, addr, clock[:, None])
    # Layer l takes its group's victims; skipped entries point past the pool (dropped).
    rows = layer_rows(jnp.arange(L, dtype=jnp.int32)[:, None], victim[self._layer_group()], S)
    dev_pool = set_rows(state.dev_pool, rows.reshape(-1), entries.reshape(L * C, W))
    return state.replace(slot_of=slot_of, slot_addr=slot_addr, stamp=stamp, clock=clock,
                         dev_pool=dev_pool)

  def _assign(self, slot_of, slot_addr, stamp, gi, victim, addr, clock):
    """Gives ``victim`` slots (INVALID: none) to ``addr``; evicts their old entries.

    slot_of [G, N], slot_addr / stamp [G, S]: the stacked tables.
    gi: the group of each victim, broadcastable to ``victim`` (a scalar, or [G, 1]).
    victim, addr: [..., M] int32, distinct valid victims per group.
    clock: broadcastable to ``victim``."""
    shape = victim.shape
    gi = jnp.broadcast_to(gi, shape)
    addr = jnp.broadcast_to(addr, shape)
    clock = jnp.broadcast_to(clock, shape)
    used = victim >= 0
    vslot = jnp.where(used, victim, 0)
    old = jnp.where(used, slot_addr[gi, vslot], INVALID)
    # Every update names distinct elements (distinct victims per group, the addresses
    # they held, distinct new addresses): unique scatters, which XLA runs as they are.
    slot_of = set_where(slot_of, (gi, old), INVALID, old >= 0, unique=True)
    slot_of = set_where(slot_of, (gi, addr), victim, used & (addr >= 0), unique=True)
    slot_addr = set_where(slot_addr, (gi, victim), addr, used, unique=True)
    stamp = set_where(stamp, (gi, victim), clock, used, unique=True)
    return slot_of, slot_addr, stamp

  # -- decode ----------------------------------------------------------------------

  def resolve(self, state: HiSparseState, group: int | jax.Array, sel_addr, sel_valid,
              new_addr, active):
    """Plans group ``group`` (a Python int or traced int32 []): see the module docstring."""
    return self.resolve_rows(state, group, sel_addr, sel_valid, new_addr[:, None],
                             active[:, None])

  def resolve_rows(self, state: HiSparseState, group: int | jax.Array, sel_addr, sel_valid,
                   new_addr, active):
    """``resolve`` of a verify step (``MemorySystem.resolve_rows``): a request's buffer
    takes the union of its rows' selections (``sel_addr`` [B, U]) and the entries of its
    ``R`` new tokens (``new_addr`` [B, R]); ``resolve`` is the case R = 1."""
    Rb, Q, S, N = self.max_batch, self.quota, self.device_slots, self.num_logical
    B, k = sel_addr.shape
    R = new_addr.shape[1]
    if B != Rb:
      raise ValueError(f"hisparse.resolve: sel_addr has {B} rows; expected max_batch={Rb} "
                       "(device quotas are per batch row)")
    if R == 1 and k > self.buffer_size:
      raise ValueError(f"hisparse.resolve: selection width k={k} exceeds "
                       f"memory.hisparse.device_buffer_size={self.buffer_size}")
    if k + R > Q:
      raise ValueError(f"hisparse.resolve: selection width k={k} and {R} new tokens "
                       f"exceed a request's buffer of memory.hisparse.device_buffer_size + 1"
                       f" = {Q} slots")
    g = group
    # The tables are addressed at [g, ...] (in place on a loop-carried state); only the
    # group's stamps ([S]) are read out whole, for the scan.
    clock = state.clock[g] + 1
    rows = jnp.arange(Rb, dtype=jnp.int32)[:, None]

    # 1. stage: dedupe (stable sort: the first occurrence represents its run)
    has_new = active & (new_addr >= 0)  # [B, R]
    valid = sel_valid & (sel_addr >= 0) & jnp.any(active, axis=1)[:, None]
    key = jnp.where(valid, sel_addr, _BIG)
    order = jnp.argsort(key, axis=1, stable=True)
    skey = jnp.take_along_axis(key, order, axis=1)
    first_s = jnp.concatenate([jnp.ones((Rb, 1), bool), skey[:, 1:] != skey[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(first_s, jnp.arange(k), 0), axis=1)
    rep = jnp.zeros((Rb, k), jnp.int32).at[rows, order].set(
        jnp.take_along_axis(order, start, axis=1).astype(jnp.int32), unique_indices=True)
    first = rep == jnp.arange(k)[None, :]
    # A selected entry that is one of the step's new tokens (and which one).
    same = (valid[:, :, None] & has_new[:, None, :]
            & (sel_addr[:, :, None] == new_addr[:, None, :]))  # [B, k, R]
    is_new = jnp.any(same, axis=2)
    which = jnp.argmax(same, axis=2)

    # 2. mark: hits are stamped now, so the scan cannot pick them
    cur = jnp.where(valid, state.slot_of[g, jnp.where(valid, sel_addr, 0)], INVALID)
    new_cur = jnp.where(has_new, state.slot_of[g, jnp.where(has_new, new_addr, 0)], INVALID)
    hit = valid & ~is_new & (cur >= 0)
    miss = valid & first & ~is_new & (cur < 0)
    # (each hit once: its first occurrence; a row's new tokens have distinct slots)
    stamp = set_where(state.stamp, (g, cur), clock, hit & first, unique=True)
    stamp = set_where(stamp, (g, new_cur), clock, new_cur >= 0, unique=True)

    # 3. scan: untouched slots by (stamp, slot); misses in selection order, then the tokens
    st = stamp[g].reshape(Rb, Q)
    vorder = jnp.argsort(jnp.where(st == clock, _BIG, st), axis=1, stable=True)[:, :k + R]
    victims = (rows * Q + vorder).astype(jnp.int32)  # [B, k+R]
    rank = jnp.cumsum(miss, axis=1) - 1
    n_miss = miss.sum(axis=1)
    miss_slot = jnp.where(miss, jnp.take_along_axis(victims, jnp.maximum(rank, 0), axis=1),
                          INVALID)
    need_new = has_new & (new_cur < 0)  # [B, R]
    new_rank = n_miss[:, None] + jnp.cumsum(need_new, axis=1) - 1
    new_victim = jnp.take_along_axis(victims, jnp.clip(new_rank, 0, k + R - 1), axis=1)
    new_slot = jnp.where(need_new, new_victim, new_cur).astype(jnp.int32)
    new_slot = jnp.where(has_new, new_slot, INVALID)
    used = jnp.arange(k + R)[None, :] < (n_miss + need_new.sum(axis=1))[:, None]
    evictions = (used & (state.slot_addr[g, victims] >= 0)).sum()

    # 5. publish: the table first drops evicted entries, then maps the new ones
    victim_all = jnp.concatenate([miss_slot.reshape(-1),
                                  jnp.where(need_new, new_slot, INVALID).reshape(-1)])
    addr_all = jnp.concatenate([jnp.where(miss, sel_addr, INVALID).reshape(-1),
                                jnp.where(need_new, new_addr, INVALID).reshape(-1)])
    slot_of, slot_addr, stamp = self._assign(state.slot_of, state.slot_addr, stamp, g,
                                             victim_all.astype(jnp.int32),
                                             addr_all.astype(jnp.int32), clock)
    live = set_where(state.live, (g, new_addr), True, has_new, unique=True)
    new_sel = jnp.take_along_axis(new_slot, which, axis=1)  # [B, k]
    base = jnp.where(is_new, new_sel, jnp.where(miss, miss_slot, cur))
    slots = jnp.where(valid, jnp.take_along_axis(base, rep, axis=1), INVALID).astype(jnp.int32)

    state = state.replace(slot_of=slot_of, slot_addr=slot_addr, stamp=stamp,
                          clock=state.clock.at[g].set(clock), live=live)
    plan = HiSparsePlan(host_idx=jnp.where(miss, sel_addr, INVALID).reshape(-1).astype(jnp.int32),
                        dev_idx=miss_slot.reshape(-1).astype(jnp.int32),
                        new_addr=jnp.where(has_new, new_addr, INVALID).reshape(-1).astype(
                            jnp.int32),
                        group=jnp.asarray(g, jnp.int32))
    stats = {
        "hits": (valid & first & ~miss).sum().astype(jnp.int32),
        "misses": n_miss.sum().astype(jnp.int32),
        "evictions": evictions.astype(jnp.int32),
    }
    return state, Resolution(slots=slots, valid=sel_valid, new_slot=new_slot.reshape(-1),
                             plan=plan, stats=stats)

  def stat_keys(self) -> tuple[str, ...]:
    return ("hits", "misses", "evictions")

  def move_layer(self, state: HiSparseState, layer: int | jax.Array, res: Resolution
                 ) -> HiSparseState:
    """Fetches the misses of ``res`` for one layer: host row ``l * N + addr`` -> device row
    ``l * S + slot`` (INVALID pairs stay negative and are skipped)."""
    self.check_layer(layer, res.plan.group)
    host_rows = layer_rows(layer, res.plan.host_idx, self.num_logical)
    dev_rows = layer_rows(layer, res.plan.dev_idx, self.device_slots)
    pool = self.fetch_rows(state.host_pool, host_rows, state.dev_pool, dev_rows)
    return state.replace(dev_pool=pool)

  def write_token(self, state: HiSparseState, layer: int | jax.Array, res: Resolution,
                  entry: jax.Array, active: jax.Array) -> HiSparseState:
    """Writes the decoded token's row (entry [B, W]) to its device slot and through to
    the host pool."""
    self.check_layer(layer, res.plan.group)
    pool, host = self.write_token_through(state.dev_pool, self.device_slots, state.host_pool,
                                          self.num_logical, layer, res, res.plan.new_addr,
                                          entry, active)
    return state.replace(dev_pool=pool, host_pool=host)

  def read_pool(self, state: HiSparseState, layer: int | jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """(dev_pool [L * S, W], base = layer * S): slot s of ``layer`` is row base + s."""
    return state.dev_pool, jnp.asarray(layer, jnp.int32) * self.device_slots

  def release(self, state: HiSparseState, addrs, valid, row) -> HiSparseState:
    """Frees the addresses' host entries and their buffer slots in every group. ``row``
    is not used: a row's buffer only ever holds its own request's entries, so freeing
    by address is exact, and ranks with nothing to release pass a row with no valid
    address."""
    del row
    ok = valid & (addrs >= 0)
    slot = jnp.where(ok[None, :], state.slot_of[:, jnp.where(ok, addrs, 0)], INVALID)  # [G, M]
    gi = jnp.arange(self.geo.num_groups, dtype=jnp.int32)[:, None]
    # A request's addresses are distinct, and so are the slots they map to.
    return state.replace(
        slot_of=set_every_group(state.slot_of, addrs, INVALID, ok),
        slot_addr=set_where(state.slot_addr, (gi, slot), INVALID, slot >= 0, unique=True),
        stamp=set_where(state.stamp, (gi, slot), -1, slot >= 0, unique=True),
        live=set_every_group(state.live, addrs, False, ok))

  # -- accounting -------------------------------------------------------------------

  def report(self, state: HiSparseState) -> CapacityReport:
    dp, tp, G = self.mesh_info.dp, self.mesh_info.tp, self.geo.num_groups
    # slot_addr [dp, G, S] with S = R * quota: counted per (rank, group, row) quota
    per_row, live = count_last_many(
        (state.slot_addr.reshape(dp, G, self.max_batch, self.quota), "nonneg", None),
        (state.live, "true", None))
    dev_used = per_row.sum(axis=(1, 2))  # [dp], over groups
    host_used = live.sum(axis=1)  # [dp]
    dev_cap = np.full((dp,), self.device_slots * G)
    rows_in_use = (per_row > 0).any(axis=1)  # [dp, R]: a slot in use in any group
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
