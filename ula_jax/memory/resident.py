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

from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, Resolution
from ula_jax.memory.base import (CapacityReport, MemorySystem, device_zeros, replace_at,
                                 tp_replicated)


@struct.dataclass
class ResidentState:
  pools: tuple[jax.Array, ...]  # per layer [S, W], memory kind 'device'
  live: tuple[jax.Array, ...]  # per group [S] bool: slot holds an entry
  index_keys: tuple[jax.Array, ...]  # per group [S, index_dim]


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
    return ResidentState(
        pools=tuple(device_zeros(mesh, (dp, S, W), self.geo.kv_dtype, "device")
                    for _ in range(self.geo.num_layers)),
        live=tuple(device_zeros(mesh, (dp, S), jnp.bool_, "device")
                   for _ in range(self.geo.num_groups)),
        index_keys=self.init_index_keys(mesh),
    )

  # -- transitions ------------------------------------------------------------------

  def _mark(self, live: tuple, addrs: jax.Array, valid: jax.Array, value: bool) -> tuple:
    idx = jnp.where(valid & (addrs >= 0), addrs, self.num_logical)
    return tuple(l.at[idx].set(value, mode="drop") for l in live)

  def write_prefill(self, state: ResidentState, addrs, valid, entries, row) -> ResidentState:
    del row
    idx = jnp.where(valid & (addrs >= 0), addrs, self.num_logical)
    pools = tuple(p.at[idx].set(e.astype(p.dtype), mode="drop")
                  for p, e in zip(state.pools, entries))
    return state.replace(pools=pools, live=self._mark(state.live, addrs, valid, True))

  def resolve(self, state: ResidentState, group, sel_addr, sel_valid, new_addr, active):
    slots = jnp.where(sel_valid, sel_addr, INVALID).astype(jnp.int32)
    new_slot = jnp.where(active, new_addr, INVALID).astype(jnp.int32)
    live = state.live[group]
    live = live.at[jnp.where(new_slot >= 0, new_slot, self.num_logical)].set(True, mode="drop")
    state = state.replace(live=replace_at(state.live, group, live))
    return state, Resolution(slots=slots, valid=sel_valid, new_slot=new_slot)

  def write_token(self, state: ResidentState, layer, res, entry, active) -> ResidentState:
    pool = state.pools[layer]
    idx = jnp.where(active & (res.new_slot >= 0), res.new_slot, self.num_logical)
    pool = pool.at[idx].set(entry.astype(pool.dtype), mode="drop")
    return state.replace(pools=replace_at(state.pools, layer, pool))

  def read_pool(self, state: ResidentState, layer) -> jax.Array:
    return state.pools[layer]

  def release(self, state: ResidentState, addrs, valid, row) -> ResidentState:
    del row
    return state.replace(live=self._mark(state.live, addrs, valid, False))

  # -- accounting -------------------------------------------------------------------

  def report(self, state: ResidentState) -> CapacityReport:
    dp, tp, G = self.mesh_info.dp, self.mesh_info.tp, self.geo.num_groups
    used = sum(np.asarray(l).sum(axis=1) for l in state.live)  # [dp]
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
