"""The memory-system interface: the seam every KV placement strategy implements.

Vocabulary (DESIGN.md §3):

* **entry**: one token's KV for one *layer group* (consecutive layers sharing one
  indexer selection). Its data is ``group_size`` rows of ``entry_width`` values, one
  row per layer, stored in per-layer pools at the same slot index.
* **logical address**: a stable int per (request, position) on a dp rank, handed out
  by the engine in pages. Memory systems never see requests, only addresses.
* **slot**: a physical row of a pool (device or host tier).

Execution model. Every transition is a pure function over the system's state pytree
and runs *inside* ``shard_map`` over the ``('dp', 'tp')`` mesh: it sees one device's
local arrays (no leading dp axis). The engine adds and strips the leading ``dp`` axis
at the shard_map boundary. ``init_state`` builds the global, sharded arrays; the
default ``state_specs`` shards every leaf's leading axis over ``dp``.

State is stacked, never a list per layer or group, so that a decode step runs the layer
stack as a loop over groups and its program does not grow with depth:

* a pool of KV rows is ONE array ``[L * S, W]`` over all layers: layer ``l``'s slot ``s``
  is row ``l * S + s`` (``layer_rows``); host and far pools alike;
* per-group metadata has a leading group axis ``[G, ...]``; indexer keys are
  ``[G, N, index_dim]``;
* ``group`` and ``layer`` arguments are Python ints or traced int32 scalars (the model
  passes traced ones from inside ``lax.scan``): systems index arrays with them
  (``x[g]``, ``x.at[g, i]``, row offsets), never Python containers. A group's metadata
  may be taken out with ``group_slice`` and written back with ``group_update`` (a
  dynamic-update-slice: in place on a loop-carried buffer); pools and keys are
  addressed row by row, never sliced out whole.

Per decode step and layer group ``g`` the model calls, in this order::

    state = write_index_keys(state, g, new_addr, key)         # first layer of g
    sel_pos, sel_valid = select(state, g, q_I, w, ...)         # indexer top-k
    state, res = resolve(state, g, sel_addr, sel_valid, new_addr, active)
    state = move_group(state, first layer of g, layers in g, res)  # move_layer per layer
    for l in layers(g):
        state = write_token(state, l, res, entry_l)            # the new token's KV
        pool, base = read_pool(state, l)
        out   = attention(pool, base + res.slots, res.valid)

``resolve`` only plans (dedupe, hit detection, victims, table update); ``move_layer``
moves the data for one layer (write back victims, fetch misses), ``move_group`` for all
of a group's layers (by default ``move_layer`` for each). The copy for a later
layer of the group depends on nothing the current layer computes and can overlap it.
Attention reads a slot only through ``res.slots``, which is data-dependent on the
copies: it never sees a half-moved entry.

``res.slots[b, i]`` is the device slot of ``sel_addr[b, i]``: aligned with the logical
selection order, so every system hands attention the same values in the same order.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ula_jax.config.schema import MemoryConfig
from ula_jax.core import compat, pinned_region
from ula_jax.core.scatter import set_where
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo, Resolution

@dataclasses.dataclass(frozen=True)
class CapacityReport:
  """Physical and logical accounting, host-side numpy (units: group-entries).

  Every count is summed over layer groups; per-device arrays are ``[dp, tp]``.
  ``distinct`` counts distinct (logical address, group) pairs per dp rank.
  """

  system: str
  device_capacity: np.ndarray  # [dp, tp] slots in device pools
  device_used: np.ndarray  # [dp, tp]
  host_capacity: np.ndarray  # [dp, tp] slots in host pools attached to each device
  host_used: np.ndarray  # [dp, tp]
  distinct: np.ndarray  # [dp]
  entry_bytes: int  # bytes of one group-entry's rows in one group (group_size rows)
  extra: dict = dataclasses.field(default_factory=dict)  # system-specific figures

  @property
  def physical_used(self) -> int:
    return int(self.device_used.sum() + self.host_used.sum())

  @property
  def distinct_total(self) -> int:
    return int(self.distinct.sum())

  @property
  def duplicates(self) -> int:
    return self.physical_used - self.distinct_total

  @property
  def distinct_fraction(self) -> float:
    return self.distinct_total / self.physical_used if self.physical_used else 1.0

  def as_dict(self) -> dict:
    return {
        "system": self.system,
        "device_capacity": self.device_capacity.tolist(),
        "device_used": self.device_used.tolist(),
        "host_capacity": self.host_capacity.tolist(),
        "host_used": self.host_used.tolist(),
        "distinct": self.distinct.tolist(),
        "physical_used": self.physical_used,
        "distinct_total": self.distinct_total,
        "duplicates": self.duplicates,
        "distinct_fraction": self.distinct_fraction,
        "entry_bytes": self.entry_bytes,
        **self.extra,
    }


# ----------------------------------------------------------------------------------
# The interface
# ----------------------------------------------------------------------------------


def check_key_rows(geo: KVGeometry, keys: jax.Array) -> None:
  """Raises unless ``keys`` are stored key rows of ``geo`` (``index_dim`` wide): a key
  not yet encoded by the model's key layout would otherwise be cast into the table."""
  if keys.shape[-1] != geo.index_dim:
    raise ValueError(f"indexer keys: got {keys.dtype}{list(keys.shape)}, expected rows of "
                     f"{geo.index_dim} x {geo.index_dtype} (encode them with the model's "
                     f"key_layout)")


class MemorySystem(abc.ABC):
  """Owns pools, mapping tables and placement for one configuration.

  Instances are static (hashable by identity) and hold no arrays: all mutable data
  is in the state pytree. Subclasses set ``name`` and implement the abstract methods.

  Sizes every subclass defines in ``__init__``:
    num_logical: logical addresses per dp rank (a multiple of ``page_size``)
    capacity_tokens: tokens a dp rank can hold (admission budget, per rank)
  """

  name: ClassVar[str]
  # Host<->device row copies go through ``ula_jax.kernels.fetch`` with this
  # implementation (``kernels.fetch``); build_memory_system sets it from the config.
  fetch_impl: str = "xla"
  fetch_interpret: bool | None = None
  # The resolve implementation (``kernels.resolve``: 'jnp' or the fused 'pallas' kernel),
  # for systems that have one.
  resolve_impl: str = "jnp"
  resolve_interpret: bool | None = None
  # Steps that move nothing take the resolve's all-hit fast path (same results;
  # ``kernels.resolve_fast_path``).
  resolve_fast_path: bool = True
  # How a decode step's indexer scores are computed (``kernels.decode_scores``, resolved
  # by the engine: ``decode.scores_mode``): 'lengths' each row over its own history,
  # 'window' every row over the whole window, 'pages' the Pallas page-scores kernel over
  # ``index_key_table``; 'auto' (unresolved) lengths for windows longer than one block.
  decode_scores: str = "auto"
  # How a decode step's top-k is taken (``kernels.decode_topk`` resolved: 'sort' or
  # 'radix', the same ascending picks).
  decode_topk: str = "sort"
  indexer_interpret: bool | None = None
  # ``workload.selections: synthetic``: decode steps rank positions by seeded scores of
  # stated locality instead of the indexer's (``kernels.indexer.synthetic``); None: the
  # indexer's.
  synthetic_selection: Any = None
  # A speculative copy (``speculative()``) resolves every group by the all-hit path with
  # no conditional and reports ``stats['spec_fail']``.
  speculate: bool = False

  def __init__(self, cfg: MemoryConfig, geometry: KVGeometry, mesh_info: MeshInfo, *,
               max_batch: int, page_size: int, max_context: int, step_rows: int = 1):
    """cfg: the ``memory`` config section; max_batch: decode rows per dp rank;
    page_size: logical addresses per page; max_context: tokens per request at most;
    step_rows: query rows per request in one decode step (``1 + speculative.num_draft``):
    a verify step needs up to ``step_rows x (top_k + 1)`` entries of a request on the
    device at once (``resolve_rows``), and the pools are sized and checked for that."""
    self.cfg = cfg
    self.geo = geometry
    self.mesh_info = mesh_info
    self.max_batch = max_batch
    self.page_size = page_size
    self.max_context = max_context
    self.step_rows = step_rows
    self.num_logical: int = 0
    self.capacity_tokens: int = 0
    self.setup()

  def setup(self) -> None:
    """Sizes the system from ``self.cfg`` and the arguments above (subclasses set
    ``num_logical`` and ``capacity_tokens`` here); checks come later, in ``validate``."""

  # -- layout ----------------------------------------------------------------------

  @abc.abstractmethod
  def init_state(self, mesh: Mesh) -> Any:
    """Allocates the global state (leading ``dp`` axis, sharded; pools with memory kinds)."""

  def state_specs(self, state: Any) -> Any:
    """PartitionSpecs of the state for shard_map (default: leading axis over ``dp``)."""
    return jax.tree.map(lambda _: P("dp"), state)

  def to_local(self, state: Any) -> Any:
    """Inside shard_map: the per-device block -> the local state the transitions take
    (default: drop the leading dp axis of size 1). Layouts sharded over ``tp`` too
    (leaves ``[dp, tp, ...]``) drop both."""
    return jax.tree.map(lambda x: x[0], state)

  def from_local(self, state: Any) -> Any:
    """The inverse of ``to_local``."""
    return jax.tree.map(lambda x: x[None], state)

  # -- transitions (local, inside shard_map) ----------------------------------------

  @abc.abstractmethod
  def write_prefill(self, state: Any, addrs: jax.Array, valid: jax.Array,
                    entries: jax.Array, row: jax.Array) -> Any:
    """Stores prefill KV.

    addrs:   [C] int32 logical addresses of a chunk of one request's prompt
    valid:   [C] bool
    entries: [L, C, W] rows, layer-major
    row:     [] int32 the decode batch row the request occupies on this dp rank
             (systems with per-request quotas key them by row)
    """

  @abc.abstractmethod
  def resolve(self, state: Any, group: int | jax.Array, sel_addr: jax.Array, sel_valid: jax.Array,
              new_addr: jax.Array, active: jax.Array) -> tuple[Any, Resolution]:
    """Logical top-k of one layer group -> device slots (plans the data movement).

    sel_addr:  [B, k] int32 logical addresses selected by the indexer
    sel_valid: [B, k] bool
    new_addr:  [B] int32 logical address of the token being decoded (its entry is
               placed on the device; it may also appear in ``sel_addr``)
    active:    [B] bool rows that decode this step
    """

  def stat_keys(self) -> tuple[str, ...]:
    """The keys of ``Resolution.stats`` that ``resolve`` returns (the decode step sums
    them over layer groups in its loop carry, so it needs them before the loop; a
    resolve returning other keys is an error at trace time). Default: none."""
    return ()

  def resolve_rows(self, state: Any, group: int | jax.Array, sel_addr: jax.Array,
                   sel_valid: jax.Array, new_addr: jax.Array, active: jax.Array
                   ) -> tuple[Any, Resolution]:
    """A verify step's resolve (speculative decoding): ``R`` query rows per request.

    sel_addr:  [B, U] int32 per request the union of its rows' selections (U = R * k),
               each address once (repeats are not valid)
    sel_valid: [B, U] bool
    new_addr:  [B, R] int32 the addresses of the R positions decoded per request, in
               row order (the first is the last accepted token's, the others drafts')
    active:    [B, R] bool rows that decode this step (a request's first rows)
    returns (state, Resolution): ``slots``/``valid`` [B, U] aligned with ``sel_addr``,
    ``new_slot`` [B * R] (request b's row r at ``b * R + r``); ``write_token`` then
    takes entries [B * R, W] and ``active.reshape(-1)``.

    Every selected entry of every row is on the device when the step attends, each one
    fetched once, and none is a victim of another entry of the same step. The new
    tokens' entries are placed like any decoded token's: a draft that is not accepted
    leaves an entry at an address of the request's own pages, which the request's next
    step overwrites (its rows start at the first position not accepted) and its release
    frees. The default suits systems whose placement knows no requests: the step is
    resolved as ``B * R`` rows of ``U / R`` addresses, a plain ``resolve``.
    """
    B, U = sel_addr.shape
    R = new_addr.shape[1]
    state, res = self.resolve(state, group, sel_addr.reshape(B * R, U // R),
                              sel_valid.reshape(B * R, U // R), new_addr.reshape(-1),
                              active.reshape(-1))
    return state, res.replace(slots=res.slots.reshape(B, U), valid=res.valid.reshape(B, U))

  def speculative(self) -> MemorySystem | None:
    """A copy of this system for speculative all-hit decode steps
    (``kernels.fast_path_mode='speculate'``), or None where the system has none.

    The copy's ``resolve`` takes the all-hit path in every layer group, with no
    conditional, moves nothing, and adds ``stats['spec_fail']`` (> 0: some group was
    not all-hit); its other transitions are this system's. A step with a failure is
    undone with ``rollback`` and run again by this system.
    """
    return None

  def rollback(self, old: Any, new: Any, keep_new: jax.Array) -> Any:
    """After a speculative step: ``new`` where ``keep_new`` (a [] bool), else a state
    that holds exactly ``old``'s entries (systems with ``speculative``). Any leaf of the
    result may instead be ``old``'s leaf itself where not ``keep_new`` (the engine does
    that for the small leaves it carries packed): a system keeps ``new``'s only where
    that is cheaper (a pool updated in place) and holds the same entries."""
    raise NotImplementedError(f"{self.name} has no speculative steps")

  def move_layer(self, state: Any, layer: int | jax.Array, res: Resolution) -> Any:
    """Moves the data that ``res`` planned for one layer (default: nothing moves)."""
    del layer, res
    return state

  def move_group(self, state: Any, first_layer: int | jax.Array, num_layers: int,
                 res: Resolution) -> Any:
    """Moves the data that ``res`` planned for the group's layers ``first_layer`` ..
    ``first_layer + num_layers - 1`` (``num_layers`` a Python int), which is what the
    model calls once the group is resolved. Default: ``move_layer`` for each in a loop;
    a system may move them all in fewer, larger copies."""
    return jax.lax.fori_loop(0, num_layers,
                             lambda i, st: self.move_layer(st, first_layer + i, res), state)

  @abc.abstractmethod
  def write_token(self, state: Any, layer: int | jax.Array, res: Resolution, entry: jax.Array,
                  active: jax.Array) -> Any:
    """Writes the new token's row for one layer. entry: [B, W]."""

  @abc.abstractmethod
  def read_pool(self, state: Any, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """The device rows attention reads for ``layer``: ``(pool [R, W], base [] int32)``;
    slot ``s`` of ``res.slots`` is row ``base + s`` of ``pool``."""

  @abc.abstractmethod
  def release(self, state: Any, addrs: jax.Array, valid: jax.Array, row: jax.Array) -> Any:
    """Frees every entry (all groups) of the given logical addresses.

    addrs: [N] int32; valid: [N] bool; row: [] int32 the batch row being vacated.
    """

  # -- indexer keys (device resident, by logical address) ---------------------------

  def init_index_keys(self, mesh: Mesh) -> jax.Array:
    """[dp, G, N, index_dim] zeros: every group's keys, by logical address."""
    shape = (self.mesh_info.dp, self.geo.num_groups, self.num_logical, self.geo.index_dim)
    return device_zeros(mesh, shape, self.geo.index_dtype, "device")

  def write_index_keys(self, state: Any, group: int | jax.Array, addrs: jax.Array,
                       keys: jax.Array) -> Any:
    """keys: [N, index_dim] stored keys (``geo.index_layout``'s rows) at logical ``addrs``
    [N] (INVALID addresses are dropped)."""
    check_key_rows(self.geo, keys)
    table = state.index_keys  # [G, num_logical, index_dim]
    new = set_where(table, (group, addrs), keys.astype(table.dtype), addrs >= 0, unique=True)
    return state.replace(index_keys=new)

  def index_key_table(self, state: Any) -> jax.Array:
    """[G, N, index_dim] every group's stored keys by logical address (what
    ``kernels.decode_scores='pages'`` reads page by page)."""
    return state.index_keys

  def gather_index_keys(self, state: Any, group: int | jax.Array,
                        addrs: jax.Array) -> jax.Array:
    """The keys of ``group`` at logical ``addrs`` [...] (clipped into range): [..., index_dim]."""
    keys = state.index_keys
    return keys[group, jnp.clip(addrs, 0, keys.shape[1] - 1)]

  def select(self, state: Any, group: int | jax.Array, q_I: jax.Array, w: jax.Array,
             page_table: jax.Array, positions: jax.Array, active: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """The indexer's top-k over each row's history (positions <= ``positions[b]``).

    q_I: [B, HI, DI] index queries; w: [B, HI] float32 head weights
    page_table: [B, P] int32; positions: [B] int32; active: [B] bool
    returns (sel_pos [B, k] int32 positions, INVALID where not valid; sel_valid [B, k])

    The default scores the keys of a row on this device: by length, each row's own
    history in blocks (``kernels.indexer.decode``), or every row over the whole window,
    as ``decode_scores`` says (``scores_by_length``), then the top-k as ``decode_topk``
    says (the same positions in ascending order either way), ranked by
    ``synthetic_selection`` where one is set. A layout that shards keys
    over ranks overrides it: score local keys, gather, merge to the same top-k.
    """
    from ula_jax.kernels.indexer import index_scores, synthetic
    from ula_jax.kernels.indexer.decode import (DECODE_COUNTS, decode_topk, length_scores,
                                                scores_by_length)
    from ula_jax.core.addressing import all_addrs
    cand_addr = all_addrs(page_table, self.page_size)  # [B, T]
    T = cand_addr.shape[1]
    cand = ((cand_addr >= 0) & (jnp.arange(T, dtype=jnp.int32)[None, :] <= positions[:, None])
            & active[:, None])
    # The scoring between barriers, as the model's side of the step is: the gathered keys
    # (the same shapes in every system) and the scores are where the system's own arrays
    # end, so no fusion reaching into a system's tables (whose sizes differ between
    # systems) can change how the scores are computed and rounded.
    gather = lambda addrs: self.geo.decode_keys(self.gather_index_keys(state, group, addrs))
    length = jnp.where(active, positions + 1, 0)  # a running row's pages cover its history
    if self.decode_scores == "pages":
      from ula_jax.kernels.indexer.pallas import page_scores_pallas
      layout = self.geo.index_layout
      fp8 = layout is not None and layout.kind != "bf16"
      scores = jax.lax.optimization_barrier(page_scores_pallas(
          q_I, w, self.index_key_table(state), group, page_table, length, self.page_size,
          fp8_keys=fp8, key_dtype=layout.dtype if fp8 else None,
          interpret=self.indexer_interpret))
    elif scores_by_length(self.decode_scores, T):
      scores = length_scores(q_I, w, cand_addr, length, gather)
    else:
      keys_btk = jax.lax.optimization_barrier(gather(cand_addr))
      scores = jax.lax.optimization_barrier(index_scores(q_I, w, keys_btk))
    scores = synthetic.override(self.synthetic_selection, scores, group,
                                jnp.arange(T, dtype=jnp.int32)[None, :], positions)
    return decode_topk(scores, cand, length, self.geo.top_k, mode=self.decode_topk,
                       impl=DECODE_COUNTS, interpret=self.indexer_interpret)

  # -- accounting (host side) -------------------------------------------------------

  @abc.abstractmethod
  def report(self, state: Any) -> CapacityReport:
    """Physical slots in use, distinct entries and duplicates, per tier and device."""

  def validate(self) -> None:
    """Raises ValueError for sizes that can never work (called before any compute)."""

  def set_fetch_impl(self, impl: str) -> None:
    """Row copies through ``impl`` (a ``kernels.fetch`` implementation) in the steps traced
    from now on, this system's and those of any system it holds."""
    self.fetch_impl = impl

  def fetch_rows(self, host_pool: jax.Array, host_idx: jax.Array, dev_pool: jax.Array,
                 dev_idx: jax.Array, count: jax.Array | None = None) -> jax.Array:
    """host_pool[host_idx[i]] -> dev_pool[dev_idx[i]] (negative indices, and pairs at or
    past ``count``, skip); new dev_pool."""
    from ula_jax.kernels.fetch import fetch_rows
    return fetch_rows(host_pool, host_idx, dev_pool, dev_idx, impl=self.fetch_impl,
                      count=count, interpret=self.fetch_interpret)

  def evict_rows(self, dev_pool: jax.Array, dev_idx: jax.Array, host_pool: jax.Array,
                 host_idx: jax.Array, count: jax.Array | None = None) -> jax.Array:
    """dev_pool[dev_idx[i]] -> host_pool[host_idx[i]] (negative indices, and pairs at or
    past ``count``, skip); new host_pool."""
    from ula_jax.kernels.fetch import evict_rows
    return evict_rows(dev_pool, dev_idx, host_pool, host_idx, impl=self.fetch_impl,
                      count=count, interpret=self.fetch_interpret)

  def stage_rows(self, pool: jax.Array, idx: jax.Array,
                 count: jax.Array | None = None) -> jax.Array:
    """pool[idx[i]] -> a fresh [N, W] device buffer (rows of negative indices, and at or
    past ``count``, unspecified), through this system's ``kernels.fetch``."""
    from ula_jax.kernels.fetch import stage_rows
    return stage_rows(pool, idx, impl=self.fetch_impl, count=count,
                      interpret=self.fetch_interpret)

  def check_layer(self, layer: int | jax.Array, group: Any) -> None:
    """Raises where ``layer`` is not in ``group`` (the group a Resolution was planned
    for). Only concrete indices are checked: with traced ones (the model's scan) the
    model's loop is what pairs layers with their group."""
    try:
      layer, group = int(layer), int(group)
    except TypeError:  # a tracer or an abstract value (jax's errors are TypeErrors)
      return
    if layer not in self.geo.group_layers(group):
      raise ValueError(f"layer={layer} is not in layer group {group} "
                       f"(layers {list(self.geo.group_layers(group))}) that this "
                       f"Resolution planned")

  def write_token_through(self, dev_pool: jax.Array, dev_per_layer: int,
                          backing: jax.Array, backing_per_layer: int,
                          layer: int | jax.Array, res: Resolution, addr: jax.Array,
                          entry: jax.Array, active: jax.Array
                          ) -> tuple[jax.Array, jax.Array]:
    """The decoded token's row ``entry`` [B, W] into its device slot (``res.new_slot``)
    and through to a backing pool at row ``addr`` [B] (systems whose host or far pool
    holds every entry). Returns (dev_pool, backing)."""
    ok = active & (res.new_slot >= 0)
    dev_rows = layer_rows(layer, jnp.where(ok, res.new_slot, INVALID), dev_per_layer)
    dev_pool = set_rows(dev_pool, dev_rows, entry)
    back_rows = layer_rows(layer, jnp.where(ok, addr, INVALID), backing_per_layer)
    return dev_pool, self.evict_rows(dev_pool, dev_rows, backing, back_rows)

  def run_summary(self, steps: list, requests: list) -> dict:
    """System-specific figures for a finished run's summary (e.g. modeled times)."""
    del steps, requests
    return {}


# ----------------------------------------------------------------------------------
# Helpers shared by systems
# ----------------------------------------------------------------------------------


def layer_rows(layer: int | jax.Array, slots: jax.Array, per_layer: int) -> jax.Array:
  """Rows of a stacked pool ``[L * per_layer, W]`` holding ``slots`` of ``layer``;
  negative slots (none) stay negative, so row copies skip them."""
  return jnp.where(slots >= 0, slots + layer * per_layer, slots).astype(jnp.int32)


def set_rows(pool: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
  """``pool`` with ``values`` [N, W] written at ``rows`` [N]; negative rows (none) are
  skipped (each sent to its own row past the end and dropped: a negative index would
  wrap). The rows that are written must differ: the scatter says its indices are unique,
  which lets XLA on a GPU with deterministic ops write them in parallel (any other
  scatter becomes a loop over its rows there)."""
  n = rows.shape[0]
  idx = jnp.where(rows >= 0, rows, pool.shape[0] + jnp.arange(n, dtype=rows.dtype))
  return pool.at[idx].set(values.astype(pool.dtype), mode="drop", unique_indices=True)


def group_slice(tree: Any, group: int | jax.Array) -> Any:
  """One group's metadata out of leaves with a leading group axis."""
  return jax.tree.map(lambda x: x[group], tree)


def group_update(tree: Any, group: int | jax.Array, new: Any) -> Any:
  """``tree`` with group ``group``'s metadata replaced by ``new`` (dynamic-update-slice)."""
  return jax.tree.map(lambda x, y: x.at[group].set(y.astype(x.dtype)), tree, new)


def device_zeros(mesh: Mesh, shape: tuple[int, ...], dtype: Any, memory_kind: str,
                 fill: Any = 0, spec: P = P("dp")) -> jax.Array:
  """A global array of ``shape`` sharded by ``spec`` (default: leading axis over dp),
  created in place on the devices (no host staging), in the given memory kind."""
  return _make(mesh, tuple(shape), jnp.dtype(dtype).name, memory_kind, fill, spec, "xla")


def host_zeros(mesh: Mesh, shape: tuple[int, ...], dtype: Any, host_alloc: str = "auto",
               spec: P = P("dp")) -> jax.Array:
  """A zero-filled global ``pinned_host`` array of ``shape`` sharded by ``spec``, made as
  ``memory.host_alloc`` says: ``huge_pages``, every local shard on a region of 2 MiB pages
  pinned by this process's threads (``core.pinned_region``; CUDA GPUs only); ``xla``,
  by XLA's host allocator (as ``device_zeros``); ``auto``, the first where the devices
  allow it, else the second (a region that fails on the way is logged, and XLA's
  allocator makes the array)."""
  if host_alloc not in ("auto", "huge_pages", "xla"):
    raise ValueError(f"memory.host_alloc={host_alloc!r}: expected auto, huge_pages or xla")
  return _make(mesh, tuple(shape), jnp.dtype(dtype).name, "pinned_host", 0, spec, host_alloc)


def _make(mesh: Mesh, shape: tuple[int, ...], dtype: str, memory_kind: str, fill: Any,
          spec: P, host_alloc: str) -> jax.Array:
  # Every pool is made here: ``memory.pool_bytes_per_device`` replaces this function to
  # count the pools of a state traced abstractly, without making any.
  if memory_kind == "pinned_host" and host_alloc != "xla" and 0 not in shape:
    made = _on_regions(mesh, shape, dtype, spec, host_alloc)
    if made is not None:
      return made
  return _filler(mesh, shape, dtype, memory_kind, fill, spec)()


def _on_regions(mesh: Mesh, shape: tuple[int, ...], dtype: str, spec: P,
                host_alloc: str) -> jax.Array | None:
  """A zero-filled ``pinned_host`` array with every local shard on a pinned region, or
  None where ``host_alloc='auto'`` falls back to XLA's allocator."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if not all(pinned_region.available(d) for d in local):
    if host_alloc == "huge_pages":
      raise ValueError(
          f"memory.host_alloc='huge_pages': host pools on pinned regions of this process "
          f"need CUDA GPUs and the CUDA driver library (devices: "
          f"{sorted({d.platform for d in local})}); use 'auto' or 'xla'")
    return None
  sharding = NamedSharding(mesh, spec, memory_kind="pinned_host")
  try:
    shards = [pinned_region.zeros(d, sharding.shard_shape(shape), dtype)
              for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)
  except pinned_region.PinnedRegionError as e:
    pinned_region.release_unused()  # shards made before the one that failed
    if host_alloc == "huge_pages":
      raise ValueError(f"memory.host_alloc='huge_pages': a pinned region for a host pool of "
                       f"{shape} failed ({e}); use 'auto' (XLA's allocator makes it then) "
                       "or 'xla'") from e
    logging.getLogger(__name__).warning(
        "warning: a pinned region for a host pool of %s failed (%s); XLA's allocator makes "
        "it (memory.host_alloc=xla skips the attempt)", shape, e)
    return None


@functools.lru_cache(maxsize=256)
def _filler(mesh: Mesh, shape: tuple[int, ...], dtype: str, memory_kind: str, fill: Any,
            spec: P):
  # One compiled filler per (shape, dtype, placement): pools of equal shape share it.
  # A host pool is filled by host compute: filled on the device and moved, it would
  # need a device buffer of its size while the program runs (a 40 GiB host pool next to
  # a 60 GiB device pool did not fit on a 141 GB GPU).
  sharding = NamedSharding(mesh, spec, memory_kind=memory_kind)
  full = lambda: jnp.full(shape, fill, dtype)
  if memory_kind == "pinned_host":
    return jax.jit(lambda: compat.on_host(full), out_shardings=sharding)
  return jax.jit(full, out_shardings=sharding)


def memory_kind_of(x: jax.Array) -> str:
  return x.sharding.memory_kind


_HOLDS = {"valid": lambda x: x != INVALID, "true": lambda x: x, "nonneg": lambda x: x >= 0}


@functools.partial(jax.jit, static_argnames=("holds", "limit"))
def _count_last_jit(x: jax.Array, holds: str, limit: int | None) -> jax.Array:
  if limit is not None:
    x = x[..., :limit]
  return jnp.sum(_HOLDS[holds](x), axis=-1, dtype=jnp.int32)


def count_last(x: Any, holds: str = "valid", limit: int | None = None) -> np.ndarray:
  """How many elements along ``x``'s last axis (its first ``limit``) hold something:
  ``!= INVALID`` (``holds="valid"``), ``True`` (``"true"``) or ``>= 0`` (``"nonneg"``);
  int64 ``x.shape[:-1]``.

  A device array is counted where it lives and only the counts cross to the host: a
  capacity report copying a 5M-address table per layer group to the host every step
  took longer than the step. Host values (numpy, a gathered leaf) are counted by numpy.
  """
  return count_last_many((x, holds, limit))[0]


@functools.partial(jax.jit, static_argnames=("specs",))
def _count_many_jit(xs: tuple[jax.Array, ...], specs: tuple[tuple[str, int | None], ...]
                    ) -> tuple[jax.Array, ...]:
  return tuple(_count_last_jit(x, holds, limit) for x, (holds, limit) in zip(xs, specs))


def count_last_many(*counts: tuple[Any, str, int | None]) -> list[np.ndarray]:
  """``[count_last(x, holds, limit) for (x, holds, limit) in counts]`` with the device
  arrays' counts in one program and one transfer to the host: a capacity report runs
  every engine step, and each count on its own was a dispatch and a wait of its own."""
  for _, holds, _ in counts:
    if holds not in _HOLDS:
      raise ValueError(f"holds={holds!r}: expected one of {sorted(_HOLDS)}")
  on_device = [i for i, (x, _, _) in enumerate(counts)
               if isinstance(x, jax.Array) and memory_kind_of(x) != "pinned_host"]
  out: list[np.ndarray | None] = [None] * len(counts)
  if on_device:
    ns = _count_many_jit(tuple(counts[i][0] for i in on_device),
                         tuple((counts[i][1], counts[i][2]) for i in on_device))
    if all(n.is_fully_addressable for n in ns):
      got = jax.device_get(ns)
    else:
      got = [multihost_utils.process_allgather(n, tiled=True) for n in ns]
    for i, n in zip(on_device, got):
      out[i] = np.asarray(n).astype(np.int64)
  for i, (x, holds, limit) in enumerate(counts):
    if out[i] is None:  # host values: counted by numpy
      v = np.asarray(x)
      if limit is not None:
        v = v[..., :limit]
      out[i] = _HOLDS[holds](v).sum(axis=-1, dtype=np.int64)
  return out


def tp_replicated(counts_dp: np.ndarray, tp: int) -> np.ndarray:
  """[dp] -> [dp, tp], the same count on every tp rank (replicated layouts)."""
  return np.repeat(np.asarray(counts_dp)[:, None], tp, axis=1)
