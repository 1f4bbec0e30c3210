"""``resident``: every KV entry in device memory (SGLang's GPU-only baseline).

Each dp rank owns a device pool of ``capacity_tokens`` slots per layer group, and the
mapping is the identity: logical address ``a`` lives in slot ``a``. With ``tp > 1``
the MLA latent cannot be split by heads, so every tp rank stores the whole pool
(``PartitionSpec('dp')`` leaves the tp axis replicated) and the accounting counts one
physical copy per tp rank: 8-way TP holds 12.5% distinct history.
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
from ula_jax.memory.base import (CapacityReport, MemorySystem, count_last, device_zeros, layer_rows,
                                 set_rows, tp_replicated)


@struct.dataclass
class ResidentState:
  """Local shapes (``init_state`` adds the leading dp axis); S = ``num_logical``."""

  pools: jax.Array  # [L * S, W] memory kind 'device': layer l's slot s is row l * S + s
  live: jax.Array  # [G, S] bool: the group's slot holds an entry
  index_keys: jax.Array  # [G, S, index_dim]


class Resident(MemorySystem):
  name = "resident"

  def setup(self) -> None:
    pool = self.cfg.device_pool
    if pool is None:
      tokens = self.max_batch * self.max_context
    else:
      tokens = parse_size(pool, field="memory.device_pool", token_bytes=self.geo.token_bytes)
    self.capacity_tokens = (tokens // self.page_size) * self.page_size
    self.num_logical = self.capacity_tokens

  def validate(self) -> None:
    if self.capacity_tokens < self.page_size:
      raise ValueError(
          f"memory.device_pool holds {self.capacity_tokens} tokens per device, fewer than "
          f"one page (engine.page_size={self.page_size}); raise memory.device_pool")

  def init_state(self, mesh: Mesh) -> ResidentState:
    dp, S, W = self.mesh_info.dp, self.num_logical, self.geo.entry_width
    L, G = self.geo.num_layers, self.geo.num_groups
    return ResidentState(
        pools=device_zeros(mesh, (dp, L * S, W), self.geo.kv_dtype, "device"),
        live=device_zeros(mesh, (dp, G, S), jnp.bool_, "device"),
        index_keys=self.init_index_keys(mesh),
    )

  # -- transitions ------------------------------------------------------------------

  def _mark(self, live: jax.Array, addrs: jax.Array, valid: jax.Array, value: bool
            ) -> jax.Array:
    """live [G, S] with ``addrs`` [N] (distinct where valid) set to ``value`` in every
    group."""
    return set_every_group(live, addrs, value, valid & (addrs >= 0))

  def write_prefill(self, state: ResidentState, addrs, valid, entries, row) -> ResidentState:
    """addrs [C] int32, valid [C] bool, entries [L, C, W]: slot = address in every layer."""
    del row
    L, S = self.geo.num_layers, self.num_logical
    slot = jnp.where(valid & (addrs >= 0), addrs, INVALID).astype(jnp.int32)
    # [L, C] rows; a skipped entry gets a row past the pool so that mode='drop' drops it
    # (a negative row would wrap around).
    rows = layer_rows(jnp.arange(L, dtype=jnp.int32)[:, None], slot[None, :], S)
    pools = set_rows(state.pools, rows.reshape(-1), entries.reshape(-1, entries.shape[-1]))
    return state.replace(pools=pools, live=self._mark(state.live, addrs, valid, True))

  def resolve(self, state: ResidentState, group, sel_addr, sel_valid, new_addr, active):
    slots = jnp.where(sel_valid, sel_addr, INVALID).astype(jnp.int32)
    new_slot = jnp.where(active, new_addr, INVALID).astype(jnp.int32)
    state = state.replace(live=set_where(state.live, (group, new_slot), True, new_slot >= 0,
                                         unique=True))
    return state, Resolution(slots=slots, valid=sel_valid, new_slot=new_slot)

  def write_token(self, state: ResidentState, layer, res, entry, active) -> ResidentState:
    """entry [B, W] at the new slots of ``layer`` (a Python int or traced int32)."""
    rows = layer_rows(layer, jnp.where(active, res.new_slot, INVALID), self.num_logical)
    pools = set_rows(state.pools, rows, entry)
    return state.replace(pools=pools)

  def read_pool(self, state: ResidentState, layer) -> tuple[jax.Array, jax.Array]:
    """(pools [L * S, W], base = layer * S): slot s of ``layer`` is row base + s."""
    return state.pools, jnp.asarray(layer, jnp.int32) * self.num_logical

  def release(self, state: ResidentState, addrs, valid, row) -> ResidentState:
    del row
    return state.replace(live=self._mark(state.live, addrs, valid, False))

  # -- accounting -------------------------------------------------------------------

  def report(self, state: ResidentState) -> CapacityReport:
    dp, tp, G = self.mesh_info.dp, self.mesh_info.tp, self.geo.num_groups
    used = count_last(state.live, "true").sum(axis=1)  # [dp]: over groups and slots
    cap = np.full((dp,), self.num_logical * G)
    return CapacityReport(
        system=self.name,
        device_capacity=tp_replicated(cap, tp),
        device_used=tp_replicated(used, tp),
        host_capacity=np.zeros((dp, tp), np.int64),
        host_used=np.zeros((dp, tp), np.int64),
        distinct=np.asarray(used, np.int64),
        entry_bytes=self.geo.group_size * self.geo.row_bytes,
        extra={"layout": "replicated" if tp > 1 else "local",
               # Per device: every tp rank holds the whole pool (as ula TP reports it).
               "device_bytes_per_rank": self.num_logical * self.geo.token_bytes},
    )
