"""``ula``'s state and the staging it shares with every resolve implementation.

Stacked layout (local arrays, no dp axis; ``init_state`` adds the leading ``dp``):

* ``UlaState.dev_pool``   [L * Sd, W]  memory kind 'device'; layer l slot s = row l*Sd + s
* ``UlaState.host_pool``  [L * Hr, W]  memory kind 'pinned_host'; row l*Hr + h
* ``UlaState.meta``       one ``GroupMeta`` whose every leaf has a leading [G] axis:
  table [G, N], dev_owner [G, Sd], host_owner [G, Hr], host_free levels [G, ...],
  policy leaves [G, ...]. ``group_slice(meta, g)`` gives the per-group ``GroupMeta``
  the resolve implementations take; ``group_update(meta, g, new)`` writes it back.
* ``UlaState.index_keys`` [G, N, index_dim]
* ``Ula.init_group_meta()`` one group (no G axis); ``Ula.init_meta()`` the stacked [G, ...].

A layer group's address space on one dp rank (``GroupMeta``), the data movement one
resolve plans (``UlaPlan``), the whole system's state (``UlaState``), and resolve's first
stage (``stage_selection``: the addresses one step needs, deduplicated).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ula_jax.core.scatter import set_where
from ula_jax.core.types import INVALID

_I32 = jnp.int32


@struct.dataclass
class GroupMeta:
  """One layer group's address space on one dp rank (leading dp axis when global).

  ``UlaState.meta`` is one ``GroupMeta`` of every group: each leaf with a leading [G]."""

  table: jax.Array  # [N] int32 location of each logical address (see module doc)
  dev_owner: jax.Array  # [Sd] int32 address held by each device slot, INVALID = free
  host_owner: jax.Array  # [Hr] int32 address held by each host slot, INVALID = free
  host_free: tuple  # bitmap levels over the Hr host slots (set = free)
  policy: Any  # the device-slot policy's state


@struct.dataclass
class UlaPlan:
  """Data movement of one resolve (``M = B * k + B``; lists are compacted, valid first).

  fetch_src: [M] int32 host slots of the misses (INVALID past ``n_fetch``)
  fetch_dst: [M] int32 device slots they move to
  evict_src: [M] int32 device slots of the victims (INVALID past ``n_evict``)
  evict_dst: [M] int32 host slots they move to
  n_fetch, n_evict: [] int32
  """

  fetch_src: jax.Array
  fetch_dst: jax.Array
  evict_src: jax.Array
  evict_dst: jax.Array
  n_fetch: jax.Array
  n_evict: jax.Array


@struct.dataclass
class UlaState:
  """Local shapes (``init_state`` adds a leading dp axis to every leaf)."""

  dev_pool: jax.Array  # [L * Sd, W] memory kind 'device'; layer l slot s at row l * Sd + s
  host_pool: jax.Array  # [L * Hr, W] memory kind 'pinned_host'; row l * Hr + h
  meta: GroupMeta  # every leaf [G, ...]
  index_keys: jax.Array  # [G, N, index_dim]


def _compact(mask: jax.Array, values: jax.Array, size: int) -> jax.Array:
  """``values[mask]`` moved to the front of a [size] int32 array, INVALID after."""
  rank = jnp.cumsum(mask) - 1
  out = jnp.full((size,), INVALID, _I32)
  return set_where(out, (rank,), values.astype(_I32), mask, unique=True)


def stage_selection(sel_addr: jax.Array, sel_valid: jax.Array, new_addr: jax.Array,
                    active: jax.Array, num_logical: int):
  """Resolve's first stage: the addresses one step needs, deduplicated by sorting.

  sel_addr/sel_valid: [B, k]; new_addr/active: [B]; elements are the B*k selections
  followed by the B new tokens (M = B*k + B).
  returns (want [M] bool: element is a valid address,
           uid [M] int32: element -> its unique entry,
           u [M] int32: the unique addresses, ascending, INVALID past the last,
           u_ok [M] bool: u is an entry, u_new [M] bool: some element of it is a new token)
  """
  B, k = sel_addr.shape
  M, N = B * k + B, num_logical
  addr = jnp.concatenate([sel_addr.reshape(-1), new_addr]).astype(_I32)
  want = jnp.concatenate([sel_valid.reshape(-1), active]) & (addr >= 0) & (addr < N)
  is_new = jnp.concatenate([jnp.zeros((B * k,), jnp.bool_), jnp.ones((B,), jnp.bool_)])
  key = jnp.where(want, addr, N)
  order = jnp.argsort(key, stable=True)
  skey = key[order]
  head = (skey < N) & jnp.concatenate([jnp.ones((1,), jnp.bool_), skey[1:] != skey[:-1]])
  uid_sorted = (jnp.cumsum(head) - 1).astype(_I32)
  uid = jnp.zeros((M,), _I32).at[order].set(uid_sorted, unique_indices=True)
  n_u = jnp.sum(head)
  u = set_where(jnp.full((M,), INVALID, _I32), (uid_sorted,), skey, head, unique=True)
  u_ok = jnp.arange(M) < n_u
  u_new = jnp.zeros((M,), _I32).at[jnp.where(want, uid, M)].max(
      (is_new & want).astype(_I32), mode="drop") > 0
  return want, uid, u, u_ok, u_new
