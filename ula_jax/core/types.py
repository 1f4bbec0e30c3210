"""Types every layer shares: the invalid marker, the KV geometry, the mesh's shape, and
what a memory system's ``resolve`` publishes to attention."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from ula_jax.core.kv_layout import EntryLayout, KeyLayout

INVALID = -1  # an unused address or slot


# ----------------------------------------------------------------------------------
# Static geometry
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVGeometry:
  """What a memory system must know about the model's KV (hashable, static)."""

  num_layers: int
  group_size: int  # layers per index-sharing group; the last group may be shorter
  # One layer's stored row of one token: entry_width elements of kv_dtype. With the
  # bf16 layout, kv_lora_rank + qk_rope_head_dim values; with the fp8 layout, bytes
  # (uint8). Memory systems move rows without looking inside them.
  entry_width: int
  # One stored indexer key: index_dim elements of index_dtype (with the fp8 layout, the
  # bytes of ``index_layout``'s rows). Memory systems move them without looking inside.
  index_dim: int
  top_k: int
  kv_dtype: str = "bfloat16"
  index_dtype: str = "bfloat16"
  # How a row encodes an entry (``model.kv_layout``); None: plain rows of entry_width
  # values in kv_dtype. Only what makes entries (synthetic prefill) needs it.
  layout: EntryLayout | None = None
  # How a stored key decodes into the values the indexer scores (``decode_keys``); None:
  # keys are stored as those values.
  index_layout: KeyLayout | None = None

  def __post_init__(self):
    if self.layout is not None and (self.entry_width, jnp.dtype(self.kv_dtype)) != (
        self.layout.row_width, jnp.dtype(self.layout.row_dtype)):
      raise ValueError(f"entry_width={self.entry_width}, kv_dtype={self.kv_dtype!r}: expected "
                       f"the layout's rows, {self.layout.row_width} x {self.layout.row_dtype}")
    if self.index_layout is not None and (self.index_dim, jnp.dtype(self.index_dtype)) != (
        self.index_layout.row_width, jnp.dtype(self.index_layout.row_dtype)):
      raise ValueError(f"index_dim={self.index_dim}, index_dtype={self.index_dtype!r}: "
                       f"expected the key layout's rows, {self.index_layout.row_width} x "
                       f"{self.index_layout.row_dtype}")

  def decode_keys(self, rows: jax.Array) -> jax.Array:
    """Stored indexer keys [..., index_dim] into the values the indexer scores."""
    return rows if self.index_layout is None else self.index_layout.decode(rows)

  @property
  def num_groups(self) -> int:
    return -(-self.num_layers // self.group_size)

  def group_layers(self, g: int) -> range:
    return range(g * self.group_size, min((g + 1) * self.group_size, self.num_layers))

  def layer_group(self, layer: int) -> int:
    return layer // self.group_size

  @property
  def row_bytes(self) -> int:
    """Bytes of one layer's row of one entry."""
    return self.entry_width * jnp.dtype(self.kv_dtype).itemsize

  @property
  def token_bytes(self) -> int:
    """Bytes of one token's KV over all layers (what a pool "entry" of every group costs)."""
    return self.num_layers * self.row_bytes


@dataclasses.dataclass(frozen=True)
class MeshInfo:
  """The mesh a system is laid out on (static)."""

  dp: int
  tp: int

  @property
  def num_devices(self) -> int:
    return self.dp * self.tp


# ----------------------------------------------------------------------------------
# Per-step values
# ----------------------------------------------------------------------------------


@struct.dataclass
class Resolution:
  """What ``resolve`` publishes for one layer group (local to one device).

  slots:    [B, k] int32 device slot of each selected entry (INVALID where not valid)
  valid:    [B, k] bool, the selection's validity (same as ``sel_valid``)
  new_slot: [B]    int32 device slot where the new token's entry is written
            (INVALID for inactive rows)
  plan:     system-specific pytree consumed by ``move_layer`` / ``write_token``
  stats:    dict of scalar int32 counters for this group and step (e.g. ``hits``,
            ``misses``, ``evictions``, ``fetched``); the model sums them over groups
            and the engine reports them per step. Empty for systems that move nothing.
  """

  slots: jax.Array
  valid: jax.Array
  new_slot: jax.Array
  plan: Any = None
  stats: dict = struct.field(default_factory=dict)




class DecodeMemory(Protocol):
  """What a decode step asks of a memory system (``memory.base.MemorySystem`` implements
  it; the model sees only this). Shapes: see ``MemorySystem``."""

  page_size: int

  def stat_keys(self) -> tuple[str, ...]: ...

  def write_index_keys(self, state: Any, group: int, addrs: jax.Array,
                       keys: jax.Array) -> Any: ...

  def select(self, state: Any, group: int, q_I: jax.Array, w: jax.Array,
             page_table: jax.Array, positions: jax.Array,
             active: jax.Array) -> tuple[jax.Array, jax.Array]: ...

  def resolve(self, state: Any, group: int, sel_addr: jax.Array, sel_valid: jax.Array,
              new_addr: jax.Array, active: jax.Array) -> tuple[Any, Resolution]: ...

  def resolve_rows(self, state: Any, group: int, sel_addr: jax.Array, sel_valid: jax.Array,
                   new_addr: jax.Array, active: jax.Array) -> tuple[Any, Resolution]: ...

  def move_layer(self, state: Any, layer: int, res: Resolution) -> Any: ...

  def write_token(self, state: Any, layer: int, res: Resolution, entry: jax.Array,
                  active: jax.Array) -> Any: ...

  def read_pool(self, state: Any, layer: int) -> jax.Array: ...
