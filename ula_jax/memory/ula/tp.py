"""``ula`` in TP mode: one logical address space spread over a dp rank's tp ranks.

MLA's latent cannot be split by heads, so ``resident`` stores the whole history on every
tp rank. Here the ``P`` tp ranks of a dp rank store *different* entries: a layout
(``memory.layout``, ``layouts.py``) gives every logical address one owner rank and a
local address there. Each rank keeps

* its **owned entries** and their indexer keys, by local address. Without a host pool
  (``DirectStore``) local address ``a`` is device-pool slot ``a`` and nothing ever moves.
  With ``memory.host_pool > 0`` (``TieredStore``) a DP-mode ``ula`` over the local
  addresses (``ula.py``) keeps them in a device pool and a host pool, exclusive as in
  DP mode (an entry is in one of them, never both), with its own PB-LRU/LRU;
* a **local buffer** of ``L`` (``memory.local_buffer``) recently selected entries per
  layer group, managed by the eviction policy (``memory.policy``: PB-LRU or LRU). The
  buffer's metadata -- which address each buffer slot holds, and the policy -- is the
  same on every rank (a copy per rank), and so is its data.

Per decode step and layer group (the order of ``base.py``):

1. ``write_index_keys``: the owner of each new token stores its key.
2. ``select``: each rank scores the keys it owns, keeps its own top-k (lower position
   first among equal scores), the ranks all-gather their ``[B, k]`` candidates over
   ``tp`` and every rank merges them into the same global top-k. The merge orders the
   candidates by position and takes the top-k, so ties go to the lower position as in
   the unsharded ``select_topk``. By default (``index_scoring='aligned'``) a rank
   scores all ``T`` positions of a row with the keys it does not own set to zero: the
   same shapes as the unsharded indexer, so the owned positions get bitwise the same
   scores (XLA's rounding depends on shapes: scoring a subset of positions can change
   the last bit) and the selection is identical. ``'local'`` scores only the owned
   positions (``T / P`` per rank with ``mod``) at the price of that last bit.
3. ``resolve``: the selection and the buffer state are the same on every rank, so every
   rank computes the same plan: hits, misses (selected entries not in the buffer),
   victims (policy), the buffer slot of every entry. With a host pool the owners of
   the misses plan, in their own DP ``ula``, to bring them to their device pool.
4. ``move_group`` (or ``move_layer`` per layer): owners copy host entries to their device
   pool if needed (a group's layers in one launch each way), then gather the misses they
   own in each of the group's layers, and one all-gather over ``tp`` (rows copied, never
   summed, so the bits arrive unchanged) delivers every miss to every rank's buffer
   (``deliver_misses``; ``resolve`` lists each rank's own misses once per group,
   ``own_misses``). Shapes are static: each rank contributes as many rows as the
   busiest rank owns, rounded up to ``capacity_classes`` (within a quarter), or none
   when nothing misses, so the link carries each miss once to each rank that lacks it.
5. ``write_token``: the new token's entry goes into every rank's buffer and into its
   owner's pool. Attention reads the buffer (``read_pool``) at ``res.slots``.

Sizes, per device: ``memory.device_pool`` (``D``, the same per-device budget
``resident`` uses) holds the local buffer and the device pool: ``Sd = D - L``.
``memory.host_pool`` (``H``) per device. A rank owns ``C = Sd + H`` local addresses and a
dp rank's logical space is ``num_logical = capacity_tokens ~ P * C`` (a multiple of the
page size; ``request`` rounds ``C`` down to pages first). Defaults: ``L = max_batch *
(top_k + 1)`` (one step's entries), ``D`` = enough for ``max_batch x max_context``.

State, stacked (``base.py``): the buffers of every layer are one array ``[num_layers *
L, W]`` (layer ``l``'s buffer slot ``s`` at row ``l * L + s``; ``read_pool`` returns it
with base ``l * L``), the buffer metadata one ``BufferMeta`` with leaves ``[G, ...]``;
without a host pool a rank's pools are ``[num_layers * C, W]``, ``live`` ``[G, C]`` and
its keys ``[G, C, index_dim]``; with one, the DP ``UlaState``'s stacked arrays. Every
transition takes ``group``/``layer`` as Python ints or traced int32 scalars.

Accounting (``report``): each stored entry is counted once, on its owner; buffer entries
are copies, so the duplicate fraction is the buffers' share. ``Resolution.stats``:
``hits``/``misses``/``evictions`` of the buffer, ``xdev_rows`` (KV rows, one layer of
one entry, delivered from an owner to another rank: misses x (P - 1) x layers of the
group), ``xdev_index_bytes`` (the indexer's all-gather, all ranks together) and, with a
host pool, ``host_fetches``/``host_evictions`` of the owners (summed over ranks).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.addressing import all_addrs
from ula_jax.core.scatter import set_every_group, set_where, update_groups
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo, Resolution
from ula_jax.memory.base import (CapacityReport, MemorySystem, check_key_rows, count_last,
                                 count_last_many, device_zeros, group_slice, group_update,
                                 host_zeros, layer_rows, set_rows)
from ula_jax.memory.ula.layouts import LAYOUTS, Layout, make_layout
from ula_jax.memory.ula.policies import make_policy, policy_fields
from ula_jax.memory.ula.dp import Ula
from ula_jax.memory.ula.state import UlaState, _compact, stage_selection

_I32 = jnp.int32
TP_AXIS = "tp"
# How a rank scores its keys (``select``): 'aligned' over all T positions of a row with
# the keys it does not own zeroed (the unsharded indexer's shapes: bitwise the same
# scores, the same selection); 'local' over only the positions it owns (compacted; mod
# scores T / P per rank, but XLA may round the smaller products differently in the last
# bit, so near-equal scores may order differently than the unsharded indexer).
INDEX_SCORING: tuple[str, ...] = ("aligned", "local")
# Fetch lists are padded to a multiple of this many entries.
FETCH_ALIGN = 8


@struct.dataclass
class BufferMeta:
  """The layer groups' local buffers (identical on every tp rank). In the state every
  leaf has a leading group axis ``[G, ...]``; ``group_slice`` gives one group's (the
  shapes below), which ``resolve`` works on.

  table: [N] int32 buffer slot of each logical address, INVALID = not buffered
  owner: [L] int32 logical address in each buffer slot, INVALID = free
  policy: the buffer policy's state over the L slots
  """

  table: jax.Array
  owner: jax.Array
  policy: Any


@struct.dataclass
class SharedState:
  """What every tp rank of a dp rank holds the same (leaves ``[dp, ...]``, ``P('dp')``)."""

  # Every layer's buffer, stacked: [num_layers * L, W], layer l's slot s at row l * L + s;
  # memory kind 'device'.
  buffers: jax.Array
  meta: BufferMeta  # leaves [G, ...]: every group's buffer metadata
  layout: Any  # the layout's state (``layouts.py``)


@struct.dataclass
class UlaTPState:
  shared: SharedState  # replicated over tp
  # Per rank (leaves ``[dp, tp, ...]``, ``P('dp', 'tp')``): the owned entries and their
  # indexer keys; ``DirectState`` without a host pool, else the DP ``UlaState``.
  ranked: Any


@struct.dataclass
class TPPlan:
  """What ``resolve`` planned for one group (``F >= B * k``, a multiple of
  ``FETCH_ALIGN``; ``own_misses`` builds the first three).

  my_slot:  [F] int32 device-pool slots of the misses this rank owns, first (0 after)
  my_dst:   [F] int32 their buffer slots (INVALID after)
  busiest:  [] int32 most misses any rank of the dp rank owns (the same on every rank)
  new_slot: [B] int32 device-pool slot of each new token on this rank (INVALID: not owned)
  owner:    this rank's host <-> device moves (a ``UlaPlan``; ``()`` without host pool)
  """

  my_slot: jax.Array
  my_dst: jax.Array
  busiest: jax.Array
  new_slot: jax.Array
  owner: Any


def capacity_classes(F: int) -> tuple[int, ...]:
  """Static row counts one rank's misses are gathered in: from ``F / 64`` (at least
  ``FETCH_ALIGN``) up to ``F``, each about a quarter above the last (multiples of
  ``FETCH_ALIGN``), so a step sends at most ~25% more rows than its busiest rank owns."""
  caps, c = [], max(FETCH_ALIGN, -(-F // 64 // FETCH_ALIGN) * FETCH_ALIGN)
  while c < F:
    caps.append(c)
    c = max(c + FETCH_ALIGN, -(-(c * 5 // 4) // FETCH_ALIGN) * FETCH_ALIGN)
  return tuple(caps) + (F,)


def own_misses(fetch_slot: jax.Array, fetch_dst: jax.Array, axis: str = TP_AXIS
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The misses this rank owns, compacted, and the busiest rank's count (inside
  shard_map; once per layer group, for every layer's ``deliver_misses``).

  fetch_slot: [F] int32 pool slot of each miss on this rank (INVALID: owned elsewhere or
              no miss; exactly one rank owns each miss)
  fetch_dst:  [F] int32 buffer slot receiving each miss
  returns (my_slot [F] int32, 0 past this rank's misses; my_dst [F] int32, INVALID past
           them; busiest [] int32, the largest count over ``axis``, agreed by a ``pmax``)
  """
  F = fetch_dst.shape[0]
  mine = fetch_slot >= 0
  at = _compact(mine, jnp.arange(F, dtype=_I32), F)  # this rank's misses, in list order
  own = at >= 0
  idx = jnp.clip(at, 0, F - 1)
  my_slot = jnp.where(own, fetch_slot[idx], 0)
  my_dst = jnp.where(own, fetch_dst[idx], INVALID)
  return my_slot, my_dst, jax.lax.pmax(jnp.sum(mine, dtype=_I32), axis)


def deliver_misses(pool: jax.Array, my_slot: jax.Array, my_dst: jax.Array,
                   busiest: jax.Array, buf: jax.Array, axis: str = TP_AXIS, *,
                   pool_base: int | jax.Array = 0, pool_rows: int | None = None,
                   buf_base: int | jax.Array = 0) -> jax.Array:
  """The misses of one layer, or of several layers at once, copied from their owners'
  device pools into every rank's buffer (inside shard_map; the cross-device data path
  of TP mode).

  pool:    [R, W] this rank's device pool; a layer's slot ``s`` is row ``pool_base + s``
           (``pool_rows`` slots per layer, default ``R``: a pool of one layer)
  my_slot, my_dst, busiest: ``own_misses`` of the group's fetch lists (F a multiple of
           ``FETCH_ALIGN``), the same for every layer of the group
  buf:     [R', W] this rank's buffers; a layer's buffer slot ``d`` is row ``buf_base + d``
  pool_base, buf_base: [] int32 (Python or traced) row offsets of the layer, or [n] of
           n layers (a group's): their rows then travel in one all-gather
  returns the buffers with every miss written, bit for bit, on every rank

  Each rank gathers the misses it owns from its pool and one all-gather over ``axis``
  hands every rank everyone's rows (every layer's) with their buffer slots. The rows are
  copied, never summed, so any payload arrives unchanged. Shapes are static: the
  all-gather carries ``c`` rows per rank and layer, the smallest of
  ``capacity_classes(F)`` that holds ``busiest`` (``lax.switch``; ``busiest`` is the same
  on every rank, so all take the same branch), and nothing when no rank owns a miss.
  """
  R, F = buf.shape[0], my_dst.shape[0]
  S = pool.shape[0] if pool_rows is None else pool_rows
  caps = capacity_classes(F)
  pool_base = jnp.atleast_1d(jnp.asarray(pool_base, _I32))[:, None]  # [n, 1]
  buf_base = jnp.atleast_1d(jnp.asarray(buf_base, _I32))[:, None]

  def move(c: int):
    def branch(buf):
      rows = pool[pool_base + jnp.clip(my_slot[:c], 0, S - 1)[None]]  # [n, c, W]
      rows = jax.lax.all_gather(rows, axis, axis=1, tiled=True)  # [n, P * c, W]
      dst = jax.lax.all_gather(my_dst[:c], axis, tiled=True)  # [P * c]
      idx = jnp.where(dst >= 0, buf_base + dst[None], R)  # R: dropped
      return buf.at[idx.reshape(-1)].set(
          rows.reshape(-1, rows.shape[-1]).astype(buf.dtype), mode="drop")
    return branch

  which = jnp.where(busiest > 0, 1 + jnp.argmax(jnp.asarray(caps, _I32) >= busiest), 0)
  return jax.lax.switch(which, [lambda b: b] + [move(c) for c in caps], buf)


def merge_topk(scores: jax.Array, pos: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The top-k of candidates gathered from several ranks, ties to the lower position.

  scores: [B, n] float32; pos: [B, n] int32 positions (INVALID: no candidate), distinct
  where valid. returns (positions [B, k] int32, INVALID where not valid; valid [B, k])
  in ``select_topk``'s order: by score, then by position.
  """
  ok = pos >= 0
  big = jnp.iinfo(_I32).max
  order = jnp.argsort(jnp.where(ok, pos, big), axis=-1, stable=True)
  s = jnp.take_along_axis(jnp.where(ok, scores, -jnp.inf), order, axis=-1)
  p = jnp.take_along_axis(jnp.where(ok, pos, INVALID), order, axis=-1)
  n = s.shape[-1]
  if n < k:
    s = jnp.pad(s, ((0, 0), (0, k - n)), constant_values=-jnp.inf)
    p = jnp.pad(p, ((0, 0), (0, k - n)), constant_values=INVALID)
  _, idx = jax.lax.top_k(s, k)
  out = jnp.take_along_axis(p, idx, axis=-1)
  return out.astype(_I32), out >= 0


def local_topk(scores: jax.Array, cand: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """One rank's top-k: (scores [B, k] float32, columns [B, k] int32, INVALID where not
  a candidate) from scores/cand [B, T]; equal scores go to the lower column."""
  T = scores.shape[-1]
  s = jnp.where(cand, scores, -jnp.inf)
  if T < k:
    s = jnp.pad(s, ((0, 0), (0, k - T)), constant_values=-jnp.inf)
    cand = jnp.pad(cand, ((0, 0), (0, k - T)))
  val, idx = jax.lax.top_k(s, k)
  ok = jnp.take_along_axis(cand, idx, axis=-1)
  return val, jnp.where(ok, idx, INVALID).astype(_I32)


@struct.dataclass
class DirectState:
  """A rank's owned entries without a host pool: local address ``a`` is pool slot ``a``.

  pools:      [num_layers * C, W] every layer's pool, stacked (layer l's slot a at row
              l * C + a), memory kind 'device'
  live:       [G, C] bool: the local address holds an entry of the group
  index_keys: [G, C, index_dim] the owned keys, by local address
  """

  pools: jax.Array
  live: jax.Array
  index_keys: jax.Array


class DirectStore:
  """Owned entries on device only: nothing ever moves, so nothing is planned."""

  def __init__(self, geo: KVGeometry, capacity: int):
    self.geo = geo
    self.capacity = capacity  # C
    self.device_slots = capacity

  def init_state(self, mesh: Mesh, dp: int, tp: int) -> DirectState:
    spec, C, geo = P("dp", "tp"), self.capacity, self.geo
    G = geo.num_groups
    return DirectState(
        pools=device_zeros(mesh, (dp, tp, geo.num_layers * C, geo.entry_width), geo.kv_dtype,
                           "device", spec=spec),
        live=device_zeros(mesh, (dp, tp, G, C), jnp.bool_, "device", spec=spec),
        index_keys=device_zeros(mesh, (dp, tp, G, C, geo.index_dim), geo.index_dtype,
                                "device", spec=spec))

  def _mark(self, live: jax.Array, group, local: jax.Array, mine: jax.Array, value: bool):
    """live [G, C] with ``local`` [n] (where ``mine``) set to ``value`` in ``group``
    (an index or ``slice(None)``: every group)."""
    if isinstance(group, slice):  # every group: the same positions in each
      return set_every_group(live, local, value, mine)
    return set_where(live, (group, local), value, mine, unique=True)

  def write_prefill(self, rk: DirectState, local, mine, entries, row) -> DirectState:
    """entries: [num_layers, n, W]; every layer's rows at the owned local addresses."""
    del row
    C, Lk = self.capacity, self.geo.num_layers
    W = rk.pools.shape[-1]
    slot = jnp.where(mine, local, INVALID)
    idx = layer_rows(jnp.arange(Lk, dtype=_I32)[:, None], slot[None, :], C)  # [Lk, n]
    pools = set_rows(rk.pools, idx.reshape(-1), entries.reshape(-1, W))
    return rk.replace(pools=pools, live=self._mark(rk.live, slice(None), local, mine, True))

  def resolve(self, rk: DirectState, group, f_local, f_mine, n_local, n_mine):
    rk = rk.replace(live=self._mark(rk.live, group, n_local, n_mine, True))
    return (rk, jnp.where(f_mine, f_local, INVALID).reshape(-1),
            jnp.where(n_mine, n_local, INVALID), (), {})

  def move_group(self, rk: DirectState, first_layer, num_layers: int, plan) -> DirectState:
    del first_layer, num_layers, plan
    return rk

  def dev_pool(self, rk: DirectState, layer) -> tuple[jax.Array, jax.Array]:
    """(pool [num_layers * C, W], base [] int32): ``layer``'s slot s is row base + s."""
    return rk.pools, jnp.asarray(layer, _I32) * self.capacity

  def write_token(self, rk: DirectState, layer, new_slot, entry, active) -> DirectState:
    rows = layer_rows(layer, jnp.where(active & (new_slot >= 0), new_slot, INVALID),
                      self.capacity)
    return rk.replace(pools=set_rows(rk.pools, rows, entry))

  def release(self, rk: DirectState, local, mine, row) -> DirectState:
    del row
    return rk.replace(live=self._mark(rk.live, slice(None), local, mine, False))

  def counts(self, rk: DirectState):
    """Host side: (device used, host used, stored), each [dp, tp, G]."""
    used = count_last(rk.live, "true")
    return used, np.zeros_like(used), used


class TieredStore:
  """Owned entries in a device pool and a host pool, exclusive: a DP-mode ``ula`` over
  the rank's local addresses (its table, PB-LRU/LRU over the device pool, write-backs)."""

  def __init__(self, ula: Ula):
    self.ula = ula
    self.device_slots = ula.device_slots

  def init_state(self, mesh: Mesh, dp: int, tp: int) -> UlaState:
    spec, u, geo = P("dp", "tp"), self.ula, self.ula.geo
    W, kv, Lk, G = geo.entry_width, geo.kv_dtype, geo.num_layers, geo.num_groups

    def meta():
      return jax.tree.map(lambda x: jnp.broadcast_to(x, (dp, tp, *x.shape)), u.init_meta())

    return UlaState(
        dev_pool=device_zeros(mesh, (dp, tp, Lk * u.device_slots, W), kv, "device", spec=spec),
        host_pool=host_zeros(mesh, (dp, tp, Lk * u.host_rows, W), kv, u.cfg.host_alloc,
                             spec=spec),
        meta=jax.jit(meta, out_shardings=NamedSharding(mesh, spec, memory_kind="device"))(),
        index_keys=device_zeros(mesh, (dp, tp, G, u.num_logical, geo.index_dim),
                                geo.index_dtype, "device", spec=spec))

  def write_prefill(self, rk: UlaState, local, mine, entries, row) -> UlaState:
    return self.ula.write_prefill(rk, local, mine, entries, row)

  def resolve(self, rk: UlaState, group, f_local, f_mine, n_local, n_mine):
    rk, res = self.ula.resolve(rk, group, f_local, f_mine, n_local, n_mine)
    slots = jnp.where(f_mine.reshape(-1), res.slots.reshape(-1), INVALID)
    return rk, slots, res.new_slot, res.plan, res.stats

  def move_group(self, rk: UlaState, first_layer, num_layers: int, plan) -> UlaState:
    """The group's layers in one fetch and one evict launch (``Ula.move_group``)."""
    dummy = jnp.zeros((0,), _I32)
    return self.ula.move_group(rk, first_layer, num_layers, Resolution(
        slots=dummy, valid=dummy, new_slot=dummy, plan=plan))

  def dev_pool(self, rk: UlaState, layer) -> tuple[jax.Array, jax.Array]:
    """(pool [num_layers * Sd, W], base [] int32): ``layer``'s slot s is row base + s."""
    return self.ula.read_pool(rk, layer)

  def write_token(self, rk: UlaState, layer, new_slot, entry, active) -> UlaState:
    dummy = jnp.zeros((0,), _I32)
    return self.ula.write_token(rk, layer, Resolution(slots=dummy, valid=dummy,
                                                      new_slot=new_slot), entry, active)

  def release(self, rk: UlaState, local, mine, row) -> UlaState:
    return self.ula.release(rk, local, mine, row)

  def counts(self, rk: UlaState):
    """Host side: (device used, host used, stored), each [dp, tp, G]."""
    m = rk.meta
    dev, host, stored = count_last_many(
        (m.dev_owner, "valid", None), (m.host_owner, "valid", self.ula.host_slots),
        (m.table, "valid", None))
    return dev, host, stored


class UlaTP(MemorySystem):
  """``ula`` with ``mesh.tp > 1`` (see the module doc)."""

  name = "ula"

  def setup(self) -> None:
    self.tp = self.mesh_info.tp
    self.layout_name = self.cfg.layout
    self.index_scoring = self.cfg.index_scoring
    self.policy_name, self.buckets = self._policy_fields()
    self.buffer_slots, self.device_budget, self.device_slots, self.host_slots = self._sizes()
    self.rank_capacity = self.device_slots + self.host_slots  # C: local addresses per rank
    self.layout: Layout | None = None
    self.store: DirectStore | TieredStore | None = None
    if self.layout_name in LAYOUTS and self.device_slots > 0:
      self.layout = make_layout(self.layout_name, self.tp, self.rank_capacity, self.page_size,
                                self.max_batch)
      self.num_logical = self.layout.num_logical
      self.capacity_tokens = self.num_logical
      if self.host_slots:
        # A DP-mode ula over the rank's local addresses keeps its two tiers exclusive.
        owner_cfg = MemoryConfig(
            system="ula", device_pool=self.device_slots, host_pool=self.host_slots,
            policy=self.policy_name, pb_lru_buckets=self.buckets,
            host_layout=self.cfg.host_layout)
        self.store = TieredStore(Ula(owner_cfg, self.geo, MeshInfo(1, 1), max_batch=self.max_batch,
                                     page_size=1, max_context=self.max_context,
                                     step_rows=self.step_rows))
      else:
        self.store = DirectStore(self.geo, self.rank_capacity)
    self.policy = make_policy(self.policy_name, self.buffer_slots, buckets=self.buckets)

  # -- configuration ---------------------------------------------------------------

  def _policy_fields(self) -> tuple[str, int]:
    return policy_fields(self.cfg)

  @property
  def step_entries(self) -> int:
    """Distinct entries one decode step may need in the buffer: max_batch * (top_k + 1),
    times ``step_rows`` in a verify step."""
    return self.max_batch * self.step_rows * (self.geo.top_k + 1)

  def _sizes(self) -> tuple[int, int, int, int]:
    """(L buffer slots, D device budget, Sd device-pool slots, H host slots) per device."""
    tb = self.geo.token_bytes
    buf = self.cfg.local_buffer
    if buf is None:
      L = self.step_entries
    elif isinstance(buf, bool) or not isinstance(buf, (int, np.integer)):
      raise ValueError(f"memory.local_buffer={buf!r}: expected a token count (int) or null "
                       f"(max_batch * (top_k + 1) = {self.step_entries})")
    else:
      L = int(buf)
    dev = self.cfg.device_pool
    if dev is None:
      share = -(-self.max_batch * self.max_context // self.tp)
      share = -(-share // self.page_size) * self.page_size
      D = share + L
    else:
      D = parse_size(dev, field="memory.device_pool", token_bytes=tb)
    H = parse_size(self.cfg.host_pool, field="memory.host_pool", token_bytes=tb)
    return L, D, D - L, H

  def validate(self) -> None:
    self._policy_fields()
    make_layout(self.layout_name, self.tp, 1, 1, 1)  # rejects unknown and 'replicated'
    if self.index_scoring not in INDEX_SCORING:
      raise ValueError(f"memory.index_scoring={self.index_scoring!r}: expected one of "
                       f"{list(INDEX_SCORING)}")
    need = self.step_entries
    if self.buffer_slots < need:
      rows = ("", "") if self.step_rows == 1 else (" * (1 + speculative.num_draft)",
                                                   f" * {self.step_rows}")
      raise ValueError(
          f"memory.local_buffer={self.buffer_slots} holds fewer entries than one decode step "
          f"selects: engine.max_batch{rows[0]} * (top_k + 1) = {self.max_batch}{rows[1]} * "
          f"({self.geo.top_k} + 1) = {need}; use memory.local_buffer >= {need} (or null)")
    if self.device_slots < 1:
      raise ValueError(
          f"memory.device_pool={self.cfg.device_pool!r} ({self.device_budget}"
          f" tokens per device) leaves no device pool beside memory.local_buffer="
          f"{self.buffer_slots} tokens; raise memory.device_pool above the local buffer")
    if self.host_slots and self.device_slots < need:
      raise ValueError(
          f"memory.device_pool={self.cfg.device_pool!r} leaves "
          f"{self.device_slots} device-pool tokens per device beside memory.local_buffer="
          f"{self.buffer_slots}; with memory.host_pool > 0 an owner must hold one step's "
          f"entries on device: use memory.device_pool >= local_buffer + {need} = "
          f"{self.buffer_slots + need} tokens")
    if self.num_logical < self.page_size:
      raise ValueError(
          f"memory.device_pool - memory.local_buffer + memory.host_pool = "
          f"{self.device_slots} + {self.host_slots} tokens per device give "
          f"{self.num_logical} tokens over {self.tp} tp ranks with memory.layout="
          f"{self.layout_name!r}, fewer than one page (engine.page_size={self.page_size}); "
          f"raise memory.device_pool or memory.host_pool")
    if isinstance(self.store, TieredStore):
      u = self.store.ula
      u.fetch_impl, u.fetch_interpret = self.fetch_impl, self.fetch_interpret
      u.resolve_impl, u.resolve_interpret = self.resolve_impl, self.resolve_interpret
      u.resolve_fast_path = self.resolve_fast_path

  def set_fetch_impl(self, impl: str) -> None:
    super().set_fetch_impl(impl)
    if isinstance(self.store, TieredStore):
      self.store.ula.set_fetch_impl(impl)

  # -- layout ----------------------------------------------------------------------

  def init_buffer_meta(self) -> BufferMeta:
    """One group's empty buffer metadata (local arrays, no group axis)."""
    return BufferMeta(table=jnp.full((self.num_logical,), INVALID, _I32),
                      owner=jnp.full((self.buffer_slots,), INVALID, _I32),
                      policy=self.policy.init())

  def init_state(self, mesh: Mesh) -> UlaTPState:
    dp, W, kv, L = self.mesh_info.dp, self.geo.entry_width, self.geo.kv_dtype, self.buffer_slots
    G = self.geo.num_groups

    def shared():
      local = SharedState(
          buffers=jnp.zeros((self.geo.num_layers * L, W), kv),
          meta=jax.tree.map(lambda x: jnp.broadcast_to(x, (G, *x.shape)),
                            self.init_buffer_meta()),
          layout=self.layout.init())
      return jax.tree.map(lambda x: jnp.broadcast_to(x, (dp, *x.shape)), local)

    shared_state = jax.jit(shared, out_shardings=NamedSharding(mesh, P("dp"),
                                                              memory_kind="device"))()
    return UlaTPState(shared=shared_state, ranked=self.store.init_state(mesh, dp, self.tp))

  def state_specs(self, state: UlaTPState) -> UlaTPState:
    return UlaTPState(shared=jax.tree.map(lambda _: P("dp"), state.shared),
                      ranked=jax.tree.map(lambda _: P("dp", "tp"), state.ranked))

  def to_local(self, state: UlaTPState) -> UlaTPState:
    return UlaTPState(shared=jax.tree.map(lambda x: x[0], state.shared),
                      ranked=jax.tree.map(lambda x: x[0, 0], state.ranked))

  def from_local(self, state: UlaTPState) -> UlaTPState:
    return UlaTPState(shared=jax.tree.map(lambda x: x[None], state.shared),
                      ranked=jax.tree.map(lambda x: x[None, None], state.ranked))

  # -- helpers (local, inside shard_map) -------------------------------------------

  def _mine(self, lst: Any, addrs: jax.Array, valid: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """(local [n] int32 where this rank owns the address else INVALID, owned [n] bool)."""
    rank, local = self.layout.locate(lst, addrs)
    mine = valid & (rank >= 0) & (rank == jax.lax.axis_index(TP_AXIS))
    return jnp.where(mine, local, INVALID).astype(_I32), mine

  def _unbuffer(self, meta: BufferMeta, addrs: jax.Array, valid: jax.Array) -> BufferMeta:
    """Drops ``addrs`` from every group's buffer (their entries are about to change);
    meta: leaves [G, ...]."""
    N, L = self.num_logical, self.buffer_slots
    ok = valid & (addrs >= 0) & (addrs < N)

    def one(m: BufferMeta) -> BufferMeta:
      slot = jnp.where(ok, m.table[jnp.clip(addrs, 0, N - 1)], INVALID)
      held = slot >= 0
      return BufferMeta(
          table=set_where(m.table, (addrs,), INVALID, ok, unique=True),
          owner=set_where(m.owner, (slot,), INVALID, held, unique=True),
          policy=self.policy.release(m.policy, slot, held))

    return update_groups(lambda m, _: (one(m), None), meta)[0]  # group by group

  def _group_layers(self, group: int | jax.Array) -> jax.Array:
    """[] int32 layers of ``group`` (Python or traced; the last group may be shorter)."""
    gs = self.geo.group_size
    return jnp.minimum(gs, self.geo.num_layers - jnp.asarray(group, _I32) * gs)

  def _place(self, state: UlaTPState, addrs: jax.Array, valid: jax.Array,
             rows: jax.Array) -> UlaTPState:
    lst = self.layout.place(state.shared.layout, addrs, valid, rows)
    return state.replace(shared=state.shared.replace(layout=lst))

  def _decode_rows(self, n: int) -> jax.Array:
    """Decode rows of ``n`` addresses passed in decode order (one per row, or ``step_rows``
    per row in a verify step), else unknown."""
    if n == self.max_batch * self.step_rows:
      return jnp.arange(n, dtype=_I32) // self.step_rows
    return jnp.full((n,), INVALID, _I32)

  # -- transitions (local, inside shard_map) ---------------------------------------

  def write_prefill(self, state: UlaTPState, addrs, valid, entries, row) -> UlaTPState:
    state = self._place(state, addrs, valid, jnp.full(addrs.shape, row, _I32))
    local, mine = self._mine(state.shared.layout, addrs, valid)
    ranked = self.store.write_prefill(state.ranked, local, mine, entries, row)
    meta = self._unbuffer(state.shared.meta, addrs, valid)
    return UlaTPState(shared=state.shared.replace(meta=meta), ranked=ranked)

  def write_index_keys(self, state: UlaTPState, group: int | jax.Array, addrs: jax.Array,
                       keys: jax.Array) -> UlaTPState:
    valid = addrs >= 0
    # In decode the new tokens arrive one per row: a fresh page takes its row's owner.
    state = self._place(state, addrs, valid, self._decode_rows(addrs.shape[0]))
    local, _ = self._mine(state.shared.layout, addrs, valid)
    check_key_rows(self.geo, keys)
    table = state.ranked.index_keys  # [G, C, DI]
    new = set_where(table, (group, local), keys.astype(table.dtype), local >= 0, unique=True)
    return state.replace(ranked=state.ranked.replace(index_keys=new))

  def read_index_keys(self, state: UlaTPState, group: int | jax.Array) -> jax.Array:
    """[num_logical, index_dim] keys by logical address, gathered from their owners
    (tests and tools: it moves every key of the group)."""
    keys = jax.lax.all_gather(state.ranked.index_keys[group], TP_AXIS)  # [P, C, DI]
    rank, local = self.layout.locate(state.shared.layout,
                                     jnp.arange(self.num_logical, dtype=_I32))
    ok = rank >= 0
    out = keys[jnp.clip(rank, 0, self.tp - 1), jnp.clip(local, 0, self.rank_capacity - 1)]
    return jnp.where(ok[:, None], out, jnp.zeros((), out.dtype))

  def select(self, state: UlaTPState, group: int | jax.Array, q_I, w, page_table, positions,
             active):
    """The sharded indexer: local scores, local top-k, all-gather over tp, merge.

    Same arguments and result as ``MemorySystem.select``; the same on every rank. With
    ``index_scoring='aligned'`` identical to the unsharded selection.
    """
    from ula_jax.kernels.indexer import index_scores, synthetic
    from ula_jax.kernels.indexer.decode import length_scores, scores_by_length
    from ula_jax.kernels.indexer.prefill import ascending
    k = self.geo.top_k
    cand_addr = all_addrs(page_table, self.page_size)  # [B, T]
    B, T = cand_addr.shape
    t = jnp.arange(T, dtype=_I32)
    cand = (cand_addr >= 0) & (t[None, :] <= positions[:, None]) & active[:, None]
    local, mine = self._mine(state.shared.layout, cand_addr, cand)
    if self.index_scoring == "aligned":
      pos_bt, local_bt, ok_bt = jnp.broadcast_to(t, (B, T)), local, mine
    else:  # the owned positions of each row, compacted in position order
      Tw = min(T, self.layout.owned_per_row(page_table.shape[1]))
      col = jnp.cumsum(mine, axis=1) - 1
      keep = mine & (col < Tw)
      rows = jnp.arange(B)[:, None]
      pos_bt = set_where(jnp.full((B, Tw), INVALID, _I32), (rows, col),
                         jnp.broadcast_to(t, (B, T)), keep)
      local_bt = set_where(jnp.full((B, Tw), INVALID, _I32), (rows, col), local, keep)
      ok_bt = pos_bt >= 0
    keys = state.ranked.index_keys  # [G, C, DI]: gather the group's rows, no slice

    def gather(local_rc):  # this rank's keys, decoded; zeros where it owns none
      out = self.geo.decode_keys(keys[group, jnp.clip(local_rc, 0, self.rank_capacity - 1)])
      return jnp.where((local_rc >= 0)[..., None], out, jnp.zeros((), out.dtype))

    owned = jnp.where(ok_bt, local_bt, INVALID)
    if self.index_scoring == "aligned" and scores_by_length(self.decode_scores, T):
      # The unsharded selection's blocks (``MemorySystem.select``), so the same bits.
      length = jnp.where(active, positions + 1, 0)
      scores = length_scores(q_I, w, owned, length, gather)
    else:
      scores = index_scores(q_I, w, gather(owned))
    scores = synthetic.override(self.synthetic_selection, scores, group, pos_bt, positions)
    val, col = local_topk(scores, ok_bt, k)  # [B, k]
    pos = jnp.where(col >= 0, jnp.take_along_axis(pos_bt, jnp.clip(col, 0, None), axis=1),
                    INVALID)
    val_all = jax.lax.all_gather(val, TP_AXIS, axis=1, tiled=True)  # [B, P * k]
    pos_all = jax.lax.all_gather(pos, TP_AXIS, axis=1, tiled=True)
    # The unsharded select's order (either kernels.decode_topk): ascending positions.
    return ascending(*merge_topk(val_all, pos_all, k))

  def stat_keys(self) -> tuple[str, ...]:
    keys = ("hits", "misses", "evictions", "xdev_rows", "xdev_index_bytes")
    return (*keys, "host_fetches", "host_evictions") if self.host_slots else keys

  def resolve(self, state: UlaTPState, group, sel_addr, sel_valid, new_addr, active):
    B, k = sel_addr.shape
    M, F = B * k + B, B * k
    N, L, Ptp = self.num_logical, self.buffer_slots, self.tp
    # The new tokens' pages are placed by write_index_keys; placing again is a no-op
    # that keeps resolve correct on its own.
    state = self._place(state, new_addr, active & (new_addr >= 0), self._decode_rows(B))
    sh, rk = state.shared, state.ranked
    bm = group_slice(sh.meta, group)

    # Stage: the addresses the step needs in the buffer, deduplicated (sorted).
    want, uid, u, u_ok, u_new = stage_selection(sel_addr, sel_valid, new_addr, active, N)

    # Mark hits; the rest take buffer slots (hits join the round first: never victims).
    bslot = jnp.where(u_ok, bm.table[jnp.clip(u, 0, N - 1)], INVALID)
    hit = u_ok & (bslot >= 0)
    place = u_ok & ~hit
    fetch = place & ~u_new  # stored entries to bring from their owners
    pst = self.policy.begin_round(bm.policy)
    pst = self.policy.touch(pst, bslot, hit)
    cand, cand_ok, cand_free = self.policy.pick(pst, jnp.sum(place), M)
    victim = cand_ok & ~cand_free
    victim_addr = jnp.where(victim, bm.owner[jnp.clip(cand, 0, L - 1)], INVALID)
    pidx = jnp.clip(jnp.cumsum(place) - 1, 0, M - 1)
    placed = place & cand_ok[pidx]
    dst = jnp.where(placed, cand[pidx], INVALID)
    table = set_where(bm.table, (victim_addr,), INVALID, victim, unique=True)
    table = set_where(table, (u,), dst, placed, unique=True)
    owner = set_where(bm.owner, (dst,), u, placed, unique=True)
    pst = self.policy.touch(pst, dst, placed)
    bm = BufferMeta(table=table, owner=owner, policy=pst)

    slot_u = jnp.where(hit, bslot, dst)
    elem = jnp.where(want, slot_u[uid], INVALID)
    slots = elem[:B * k].reshape(B, k)
    new_slot = elem[B * k:]

    # Owners: the misses and new tokens this rank owns must be in its device pool.
    fetch = fetch & placed
    f_addr = _compact(fetch, u, F)
    f_dst = _compact(fetch, dst, F)
    n_fetch = jnp.sum(fetch).astype(_I32)
    f_local, f_mine = self._mine(sh.layout, f_addr, f_addr >= 0)
    n_local, n_mine = self._mine(sh.layout, new_addr, active & (new_addr >= 0))
    rk, f_slot, o_new, o_plan, o_stats = self.store.resolve(
        rk, group, f_local.reshape(B, k), f_mine.reshape(B, k), n_local, n_mine)
    pad = (-F) % FETCH_ALIGN
    my_slot, my_dst, busiest = own_misses(
        jnp.pad(f_slot, (0, pad), constant_values=INVALID),
        jnp.pad(f_dst, (0, pad), constant_values=INVALID))
    plan = TPPlan(my_slot=my_slot, my_dst=my_dst, busiest=busiest, new_slot=o_new,
                  owner=o_plan)
    layers = self._group_layers(group)
    stats = {"hits": jnp.sum(hit).astype(_I32), "misses": n_fetch,
             "evictions": jnp.sum(victim).astype(_I32),
             "xdev_rows": n_fetch * ((Ptp - 1) * layers),
             "xdev_index_bytes": jnp.int32(Ptp * (Ptp - 1) * B * k * 8)}
    if self.host_slots:
      stats["host_fetches"] = jax.lax.psum(o_stats["misses"], TP_AXIS)
      stats["host_evictions"] = jax.lax.psum(o_stats["evictions"], TP_AXIS)
    state = UlaTPState(shared=sh.replace(meta=group_update(sh.meta, group, bm)), ranked=rk)
    return state, Resolution(slots=slots, valid=sel_valid, new_slot=new_slot, plan=plan,
                             stats=stats)

  def move_layer(self, state: UlaTPState, layer, res: Resolution) -> UlaTPState:
    return self.move_group(state, layer, 1, res)

  def move_group(self, state: UlaTPState, first_layer, num_layers: int,
                 res: Resolution) -> UlaTPState:
    """The group's layers at once: the owners' host moves in one fetch and one evict
    launch (with a host pool), then every layer's misses delivered to the buffers in
    one all-gather (``move_layer``: one layer's)."""
    p: TPPlan = res.plan
    ranked = self.store.move_group(state.ranked, first_layer, num_layers, p.owner)
    layers = jnp.asarray(first_layer, _I32) + jnp.arange(num_layers, dtype=_I32)
    pool, base = self.store.dev_pool(ranked, layers)  # base: each layer's first row
    buf = deliver_misses(pool, p.my_slot, p.my_dst, p.busiest, state.shared.buffers,
                         pool_base=base, pool_rows=self.store.device_slots,
                         buf_base=layers * self.buffer_slots)
    return UlaTPState(shared=state.shared.replace(buffers=buf), ranked=ranked)

  def write_token(self, state: UlaTPState, layer, res: Resolution, entry, active
                  ) -> UlaTPState:
    p: TPPlan = res.plan
    buf = state.shared.buffers
    rows = layer_rows(layer, jnp.where(active & (res.new_slot >= 0), res.new_slot, INVALID),
                      self.buffer_slots)
    buf = set_rows(buf, rows, entry)
    ranked = self.store.write_token(state.ranked, layer, p.new_slot, entry, active)
    return UlaTPState(shared=state.shared.replace(buffers=buf), ranked=ranked)

  def read_pool(self, state: UlaTPState, layer) -> tuple[jax.Array, jax.Array]:
    """(buffers [num_layers * L, W], base [] int32): attention reads ``base + res.slots``."""
    return state.shared.buffers, jnp.asarray(layer, _I32) * self.buffer_slots

  def release(self, state: UlaTPState, addrs, valid, row) -> UlaTPState:
    local, mine = self._mine(state.shared.layout, addrs, valid)
    ranked = self.store.release(state.ranked, local, mine, row)
    sh = state.shared
    sh = sh.replace(meta=self._unbuffer(sh.meta, addrs, valid),
                    layout=self.layout.release(sh.layout, addrs, valid, row))
    return UlaTPState(shared=sh, ranked=ranked)

  # -- accounting ------------------------------------------------------------------

  def report(self, state: UlaTPState) -> CapacityReport:
    dp, tp, G = self.mesh_info.dp, self.tp, self.geo.num_groups
    H, L, Sd = self.host_slots, self.buffer_slots, self.device_slots
    row_bytes = self.geo.row_bytes
    rows = np.asarray([len(self.geo.group_layers(g)) for g in range(G)], np.int64)  # [G]
    dev, hst, stored = (x.astype(np.int64) for x in self.store.counts(state.ranked))
    buf = count_last(state.shared.meta.owner)  # [dp, G]
    pool_used = dev.sum(axis=2)  # [dp, tp]
    host_used = hst.sum(axis=2)
    buffer_used = buf.sum(axis=1)  # [dp]
    distinct = stored.sum(axis=(1, 2))
    used_bytes = ((dev + buf[:, None, :]) * rows).sum(axis=2) * row_bytes
    device_used = pool_used + buffer_used[:, None]
    full = lambda n: np.full((dp, tp), n, np.int64)
    return CapacityReport(
        system=self.name,
        device_capacity=full((Sd + L) * G),
        device_used=device_used,
        host_capacity=full(H * G),
        host_used=host_used,
        distinct=distinct,
        entry_bytes=self.geo.group_size * row_bytes,
        extra={"layout": self.layout_name, "policy": self.policy_name,
               "pb_lru_buckets": self.buckets, "local_buffer": L, "device_slots": Sd,
               "host_slots": H, "buffer_used": buffer_used.tolist(),
               "pool_used": pool_used.tolist(),
               "device_bytes_per_rank": (Sd + L) * self.geo.token_bytes,
               "host_bytes_per_rank": H * self.geo.token_bytes,
               "device_used_bytes": used_bytes.tolist()},
    )

  def run_summary(self, steps: list, requests: list) -> dict:
    del requests
    kv = sum(int(s.extra.get("xdev_rows", 0)) for s in steps) * self.geo.row_bytes
    index = sum(int(s.extra.get("xdev_index_bytes", 0)) for s in steps)
    decode_steps = sum(1 for s in steps if s.decode_tokens)
    total = kv + index
    return {"layout": self.layout_name, "local_buffer": self.buffer_slots,
            "total_xdev_kv_bytes": kv, "total_xdev_index_bytes": index,
            "total_xdev_bytes": total,
            "xdev_bytes_per_decode_step": total / decode_steps if decode_steps else 0.0}
