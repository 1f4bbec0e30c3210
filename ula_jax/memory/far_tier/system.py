"""``far_tier``: KV entries in a disaggregated far pool (SAC, seed 001).

SAC keeps the KV cache of sparse-attention models in a CXL memory pool shared by
all compute devices and compares two ways of reading it during decode:

* ``on_demand`` (SAC): at every step and layer only the selected entries are loaded
  from the far pool into a per-step device staging area of ``B x (k+1)`` slots per
  layer (row ``b`` uses slots ``[b*(k+1), (b+1)*(k+1))``; the last one holds the
  decoded token). Nothing is cached across steps: every selected entry crosses the
  link every step. With speculative decoding a row's area is ``(1 + num_draft) x
  (k+1)`` slots: the union of its query rows' selections, each loaded once, then the
  step's new tokens.
* ``full_prefetch`` (the RDMA baseline): a request's whole prefix is copied into
  local device memory before its decode starts, and decode reads it there. The local
  pool is indexed by logical address, so admission is bounded by local memory too.

In both modes prefill writes every entry to the far pool (SAC's prefill instance
writes its KV into the pool), and each decoded token is written to the device and
through to the far pool. In ``full_prefetch`` the prefix is copied far -> device as
part of ``write_prefill``, chunk by chunk, which is before the request's first decode
step.

What is real and what is modeled. There is no CXL or RDMA hardware here: the far
pool's bytes live in host memory (``pinned_host``) and move through the same row
copies as host tiers (``fetch_rows`` / ``evict_rows``), so what attention reads is
exact. The engine runs inside ``shard_map`` over dp, so the far pool is held as one
shard per dp rank (``memory.far_tier.far_pool`` split evenly over dp ranks): a rank
cannot use another rank's free far space, unlike a truly shared pool. Which far
device serves a request, how far devices are interleaved across compute devices
(dp rank ``d`` -> far device ``d % num_far_devices``) and the contention between
devices sharing one are modeled by ``link_model`` from the per-step counters this
system reports in ``Resolution.stats`` (see ``link_model.COUNTER_KEYS``) and from
``prefill_traffic`` for prefill.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from ula_jax.core.scatter import set_every_group, set_where
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, Resolution
from ula_jax.memory.base import (CapacityReport, MemorySystem, count_last, device_zeros,
                                 host_zeros, layer_rows)
from ula_jax.memory.far_tier.link_model import (COUNTER_KEYS, FarTopology, LinkSpec, link_preset,
                                       modeled_run)

MODES = ("on_demand", "full_prefetch")


@struct.dataclass
class FarTierState:
  """Local shapes (``init_state`` adds the leading dp axis). N = ``num_logical``,
  R = ``device_slots``; pools are stacked over layers (layer l's row s is l * N + s,
  resp. l * R + s)."""

  far_pools: jax.Array  # [L * N, W] 'pinned_host', by logical address
  dev_pools: jax.Array  # [L * R, W] 'device': on_demand R = B*(k+1); full_prefetch R = N
  live: jax.Array  # [G, N] bool: the far pool holds the entry
  staged: jax.Array  # [G] int32 staging slots filled by the group's last resolve
  index_keys: jax.Array  # [G, N, index_dim]


@struct.dataclass
class FarTierPlan:
  """Per-layer slots (``move_layer`` / ``write_token`` add the layer's row offset)."""

  far_idx: jax.Array  # [B*k] int32 far slots to load (INVALID: none)
  dev_idx: jax.Array  # [B*k] int32 staging slots they go to
  new_addr: jax.Array  # [B * R] int32 addresses of the decoded tokens, R per request in a
  # verify step (else 1) (INVALID: inactive)
  group: jax.Array  # [] int32 the layer group planned (checks the layers it is used for)


class FarTier(MemorySystem):
  name = "far_tier"

  def setup(self) -> None:
    ft = self.cfg.far_tier
    self.mode = ft.mode
    self.link_name = ft.link
    self.num_far_devices = ft.num_far_devices
    far = ft.far_pool
    tb = self.geo.token_bytes
    if far is None:
      far_rank = self.max_batch * self.max_context
    else:
      far_rank = (parse_size(far, field="memory.far_tier.far_pool", token_bytes=tb)
                  // self.mesh_info.dp)
    self.far_tokens = far_rank  # per dp rank
    local = self.cfg.device_pool
    self.local_tokens = (self.max_batch * self.max_context if local is None else
                         parse_size(local, field="memory.device_pool", token_bytes=tb))
    tokens = far_rank if self.mode != "full_prefetch" else min(far_rank, self.local_tokens)
    self.capacity_tokens = (tokens // self.page_size) * self.page_size
    self.num_logical = self.capacity_tokens
    # Slots per row in the staging area: a verify step stages the union of the request's
    # rows' selections and its new tokens.
    self.stage_width = self.step_rows * (self.geo.top_k + 1)

  def validate(self) -> None:
    if self.mode not in MODES:
      raise ValueError(f"memory.far_tier.mode={self.mode!r}: expected one of {list(MODES)}")
    link_preset(self.link_name)
    FarTopology(self.mesh_info.dp, self.mesh_info.tp, self.num_far_devices)
    if self.capacity_tokens < self.page_size:
      what = ("memory.far_tier.far_pool" if self.mode == "on_demand" or
              self.far_tokens < self.local_tokens else "memory.device_pool")
      raise ValueError(
          f"far_tier ({self.mode}) holds {self.capacity_tokens} tokens per dp rank, fewer "
          f"than one page (engine.page_size={self.page_size}); raise {what}")

  @property
  def link(self) -> LinkSpec:
    return link_preset(self.link_name)

  @property
  def topology(self) -> FarTopology:
    return FarTopology(self.mesh_info.dp, self.mesh_info.tp, self.num_far_devices)

  @property
  def device_slots(self) -> int:
    """Device rows per layer: the staging area (on_demand) or the local pool."""
    if self.mode == "on_demand":
      return self.max_batch * self.stage_width
    return self.num_logical



  # -- layout ----------------------------------------------------------------------

  def init_state(self, mesh: Mesh) -> FarTierState:
    dp, N, W, L = self.mesh_info.dp, self.num_logical, self.geo.entry_width, self.geo.num_layers
    G, R = self.geo.num_groups, self.device_slots
    return FarTierState(
        far_pools=host_zeros(mesh, (dp, L * N, W), self.geo.kv_dtype, self.cfg.host_alloc),
        dev_pools=device_zeros(mesh, (dp, L * R, W), self.geo.kv_dtype, "device"),
        live=device_zeros(mesh, (dp, G, N), jnp.bool_, "device"),
        staged=device_zeros(mesh, (dp, G), jnp.int32, "device"),
        index_keys=self.init_index_keys(mesh),
    )

  # -- transitions ------------------------------------------------------------------

  def write_prefill(self, state: FarTierState, addrs, valid, entries, row) -> FarTierState:
    """Writes a prompt chunk to the far pool (and, in full_prefetch, copies it back into
    local device memory). addrs: [C] int32, valid: [C] bool, entries: [L, C, W];
    ``row`` is not used (no per-row state)."""
    del row
    L, C, W = entries.shape
    ok = valid & (addrs >= 0)
    far_idx = jnp.where(ok, addrs, INVALID).astype(jnp.int32)
    layers = jnp.arange(L, dtype=jnp.int32)[:, None]
    # All layers in one copy: entry row l * C + c -> far row l * N + addrs[c].
    src = jnp.arange(L * C, dtype=jnp.int32)
    far_rows = layer_rows(layers, far_idx[None, :], self.num_logical).reshape(-1)
    far = self.evict_rows(entries.reshape(L * C, W).astype(state.far_pools.dtype), src,
                          state.far_pools, far_rows)
    state = state.replace(far_pools=far, live=set_every_group(state.live, addrs, True, ok))
    if self.mode == "full_prefetch":
      # The RDMA baseline's prefetch: the prefix comes back from the far pool, not
      # from the prefill's own device copy.
      dev_rows = layer_rows(layers, far_idx[None, :], self.device_slots).reshape(-1)
      state = state.replace(dev_pools=self.fetch_rows(far, far_rows, state.dev_pools, dev_rows))
    return state

  def _group_len(self, group: int | jax.Array) -> jax.Array:
    """[] int32 layers in ``group`` (the last group may be shorter)."""
    gs, L = self.geo.group_size, self.geo.num_layers
    return jnp.clip(L - jnp.asarray(group, jnp.int32) * gs, 0, gs).astype(jnp.int32)

  def resolve(self, state: FarTierState, group: int | jax.Array, sel_addr, sel_valid, new_addr,
              active):
    return self.resolve_rows(state, group, sel_addr, sel_valid, new_addr[:, None],
                             active[:, None])

  def resolve_rows(self, state: FarTierState, group: int | jax.Array, sel_addr, sel_valid,
                   new_addr, active):
    """``resolve`` of a verify step (``MemorySystem.resolve_rows``): a request's staging
    area takes the union of its rows' selections (``sel_addr`` [B, U], each loaded once)
    and its ``R`` new tokens (``new_addr`` [B, R]); ``resolve`` is the case R = 1."""
    B, k = sel_addr.shape
    R = new_addr.shape[1]
    layers = self._group_len(group)
    # A Python group stays concrete in the plan, so that move_layer / write_token can
    # check their layer at trace time; a traced one is carried as it is.
    group_arr = (np.asarray(group, np.int32) if isinstance(group, (int, np.integer))
                 else jnp.asarray(group, jnp.int32))
    has_new = active & (new_addr >= 0)  # [B, R]
    valid = sel_valid & (sel_addr >= 0) & jnp.any(active, axis=1)[:, None]
    # A selected entry that is one of the step's new tokens (and which one).
    same = (valid[:, :, None] & has_new[:, None, :]
            & (sel_addr[:, :, None] == new_addr[:, None, :]))  # [B, k, R]
    is_new = jnp.any(same, axis=2)
    which = jnp.argmax(same, axis=2)
    live = set_where(state.live, (group, new_addr), True, has_new, unique=True)
    writes = has_new.sum().astype(jnp.int32) * layers
    new_plan = jnp.where(has_new, new_addr, INVALID).reshape(-1).astype(jnp.int32)
    if self.mode == "full_prefetch":
      slots = jnp.where(valid, sel_addr, INVALID).astype(jnp.int32)
      new_slot = new_plan
      plan = FarTierPlan(far_idx=jnp.full((B * k,), INVALID, jnp.int32),
                         dev_idx=jnp.full((B * k,), INVALID, jnp.int32),
                         new_addr=new_plan, group=group_arr)
      fetched = jnp.zeros((), jnp.int32)
      staged = jnp.zeros((), jnp.int32)
    else:
      if R == 1 and k + 1 > self.stage_width:
        raise ValueError(f"far_tier.resolve: selection width k={k} exceeds the model's "
                         f"top_k={self.stage_width - 1} the staging area is sized for")
      if k + R > self.stage_width:
        raise ValueError(f"far_tier.resolve: selection width k={k} and {R} new tokens "
                         f"exceed a request's staging area of {self.stage_width} slots "
                         f"((1 + speculative.num_draft) x (top_k + 1))")
      if B != self.max_batch:
        raise ValueError(f"far_tier.resolve: sel_addr has {B} rows; expected "
                         f"max_batch={self.max_batch} (the staging area is per batch row)")
      base = jnp.arange(B, dtype=jnp.int32)[:, None] * self.stage_width
      new_rb = jnp.where(has_new, base + k + jnp.arange(R, dtype=jnp.int32)[None, :],
                         INVALID).astype(jnp.int32)  # [B, R]
      new_slot = new_rb.reshape(-1)
      load = valid & ~is_new
      stage = base + jnp.arange(k, dtype=jnp.int32)[None, :]
      slots = jnp.where(is_new, jnp.take_along_axis(new_rb, which, axis=1),
                        jnp.where(load, stage, INVALID))
      plan = FarTierPlan(far_idx=jnp.where(load, sel_addr, INVALID).reshape(-1).astype(jnp.int32),
                         dev_idx=jnp.where(load, stage, INVALID).reshape(-1).astype(jnp.int32),
                         new_addr=new_plan, group=group_arr)
      fetched = load.sum().astype(jnp.int32)
      staged = fetched + has_new.sum().astype(jnp.int32)
    state = state.replace(live=live,
                          staged=state.staged.at[group].set(staged))
    rows = fetched * layers
    stats = {
        "far_read_rows": rows,
        "far_read_ops": rows,  # row-granular loads: one operation per row
        "far_rounds": (fetched > 0).astype(jnp.int32),  # the group's fetch waits on its selection
        "far_write_rows": writes,
        "far_write_ops": writes,
        "far_bulk_rows": jnp.zeros((), jnp.int32),
        "far_bulk_ops": jnp.zeros((), jnp.int32),
    }
    return state, Resolution(slots=slots.astype(jnp.int32), valid=sel_valid, new_slot=new_slot,
                             plan=plan, stats=stats)

  def stat_keys(self) -> tuple[str, ...]:
    return COUNTER_KEYS

  def move_layer(self, state: FarTierState, layer: int | jax.Array, res: Resolution
                 ) -> FarTierState:
    self.check_layer(layer, res.plan.group)
    if self.mode == "full_prefetch":
      return state
    pool = self.fetch_rows(state.far_pools, layer_rows(layer, res.plan.far_idx, self.num_logical),
                           state.dev_pools, layer_rows(layer, res.plan.dev_idx, self.device_slots))
    return state.replace(dev_pools=pool)

  def write_token(self, state: FarTierState, layer: int | jax.Array, res: Resolution,
                  entry: jax.Array, active: jax.Array) -> FarTierState:
    """Writes the decoded token's row (entry [B, W]) on the device and through to the far
    pool."""
    self.check_layer(layer, res.plan.group)
    pool, far = self.write_token_through(state.dev_pools, self.device_slots, state.far_pools,
                                         self.num_logical, layer, res, res.plan.new_addr,
                                         entry, active)
    return state.replace(dev_pools=pool, far_pools=far)

  def read_pool(self, state: FarTierState, layer: int | jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """(dev_pools [L * R, W], base = layer * R): slot s of ``layer`` is row base + s."""
    return state.dev_pools, jnp.asarray(layer, jnp.int32) * self.device_slots

  def release(self, state: FarTierState, addrs, valid, row) -> FarTierState:
    del row
    return state.replace(live=set_every_group(state.live, addrs, False,
                                              valid & (addrs >= 0)))

  # -- traffic and modeled time (host side) -----------------------------------------

  def prefill_traffic(self, tokens: Any) -> dict[str, np.ndarray]:
    """Far counters of prefilling ``tokens`` prompt tokens per dp rank ([dp] or scalar):
    every layer's rows written out in bulk (one operation per page per layer), and in
    ``full_prefetch`` read back the same way. Add them to the step's decode counters."""
    tokens = np.asarray(tokens, np.int64)
    pages = -(-tokens // self.page_size)
    passes = 2 if self.mode == "full_prefetch" else 1
    out = {k: np.zeros_like(tokens) for k in COUNTER_KEYS}
    out["far_bulk_rows"] = tokens * self.geo.num_layers * passes
    out["far_bulk_ops"] = pages * self.geo.num_layers * passes
    return out

  def modeled(self, steps, requests=()) -> dict:
    """``link_model.modeled_run`` with this system's link, topology and row size."""
    return modeled_run(steps, self.link, self.topology, self.geo.row_bytes, requests)

  def modeled_from_run(self, steps, requests=(), *, compute_s: float | None = None) -> dict:
    """A run's records -> modeled TTFT, TBT and throughput (keys named ``modeled_*``).

    steps:     the engine's ``StepMetrics``: ``step``, ``step_time_s``,
               ``decode_tokens``, ``prefill_tokens`` and ``extra`` (the step's
               ``Resolution.stats`` summed over groups and dp ranks)
    requests:  the engine's ``RequestResult``s (for TTFT)
    compute_s: device compute seconds of a step that does work; None = its measured
               ``step_time_s`` (which here includes the host-memory stand-in copies)

    Prefill traffic is ``prefill_traffic`` of the step's prompt tokens (pages counted
    on the step's total).
    """
    records = []
    for m in steps:
      traffic = self.prefill_traffic(m.prefill_tokens)
      busy = bool(m.decode_tokens or m.prefill_tokens)
      rec = {"step": m.step, "decode_tokens": m.decode_tokens,
             "compute_s": m.step_time_s if compute_s is None else (compute_s if busy else 0.0)}
      for k in COUNTER_KEYS:
        rec[k] = int(traffic[k]) + int(m.extra.get(k, 0))
      records.append(rec)
    return self.modeled(records, requests)

  def run_summary(self, steps, requests) -> dict:
    return self.modeled_from_run(steps, requests)

  # -- accounting -------------------------------------------------------------------

  def report(self, state: FarTierState) -> CapacityReport:
    """The far pool is one shared tier: its entries are counted once per dp rank, in
    the tp-rank-0 column (the simulation's tp replicas of the host-memory stand-in are
    not counted). Device rows (staging copies or the local prefix copy) count per
    device."""
    dp, tp, G = self.mesh_info.dp, self.mesh_info.tp, self.geo.num_groups
    far_used = count_last(state.live, "true").sum(axis=1)  # [dp]: over groups and slots
    if self.mode == "full_prefetch":
      dev_used = far_used
    else:
      dev_used = np.asarray(state.staged).sum(axis=1).astype(np.int64)
    first_tp = np.zeros((dp, tp), np.int64)
    host_cap, host_used = first_tp.copy(), first_tp.copy()
    host_cap[:, 0] = self.num_logical * G
    host_used[:, 0] = far_used
    return CapacityReport(
        system=self.name,
        device_capacity=np.full((dp, tp), self.device_slots * G, np.int64),
        device_used=np.repeat(dev_used[:, None], tp, axis=1),
        host_capacity=host_cap,
        host_used=host_used,
        distinct=far_used,
        entry_bytes=self.geo.group_size * self.geo.row_bytes,
        extra={
            "mode": self.mode,
            "link": self.link_name,
            "num_far_devices": self.num_far_devices,
            "far_device_of_rank": self.topology.far_device_of_rank().tolist(),
            "far_pool_tokens_per_rank": self.num_logical,
        },
    )
