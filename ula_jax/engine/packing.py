"""A memory system's state carried across jitted calls in few buffers.

Every leaf of a jitted call's arguments costs host time at each call (its buffer is
checked, held, donated and handed to the device program), and a memory system's state
has many small leaves: a mapping table per layer group, owners, bitmap levels of every
policy bucket. ``StatePacking`` concatenates the small leaves that share a dtype, a
memory kind and a sharding into one flat buffer each (``pack``) and slices them back
(``unpack``), inside the jitted call; leaves above ``max_leaf_bytes`` per device (the KV
pools) stay as they are, so they are still updated in place, and so do leaves outside
device memory (host pools of any size: joining them would run on the host). With
``engine.pack_state`` the engine keeps its state packed between steps; what it returns as
``Engine.state`` is unpacked, with the same values.

A leaf's global shape is ``lead + rest`` where ``lead`` are the dimensions its
``PartitionSpec`` names (up to the last named one): a packed buffer has shape
``lead + (sum of the leaves' rest sizes,)`` and the same sharding of ``lead``, so each
device holds its own leaves' values and nothing moves between devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class _Slot:
  buffer: int  # index of the packed buffer, or -1: the leaf is kept as it is
  offset: int  # first element in the buffer's last axis
  shape: tuple[int, ...]  # the leaf's global shape


class _Buffer(NamedTuple):
  dtype: np.dtype
  spec: P  # the lead dimensions' spec, then None
  kind: str | None  # memory kind
  lead: tuple[int, ...]  # lead shape
  size: int  # elements in the last axis


@dataclasses.dataclass(frozen=True)
class StatePacking:
  """How a state pytree maps onto packed buffers (static: built once per engine)."""

  treedef: Any
  slots: tuple[_Slot, ...]
  buffers: tuple[_Buffer, ...]

  @classmethod
  def plan(cls, state: Any, specs: Any, *, max_leaf_bytes: int = 1 << 20) -> StatePacking:
    """Group the small leaves of ``state`` (global arrays) by dtype, memory kind, lead
    shape and sharding; ``specs`` is the state's PartitionSpec tree."""
    leaves, treedef = jax.tree.flatten(state)
    spec_leaves = treedef.flatten_up_to(specs)
    keys: dict[tuple, int] = {}
    sizes: list[int] = []
    buffers: list[tuple] = []
    slots: list[_Slot] = []
    for x, spec in zip(leaves, spec_leaves):
      named = [i for i, a in enumerate(spec) if a is not None]
      lead = named[-1] + 1 if named else 0
      kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
      per_device = x.nbytes // max(1, math.prod(x.shape[:lead]))
      if per_device > max_leaf_bytes or kind not in (None, "device"):
        slots.append(_Slot(-1, 0, tuple(x.shape)))
        continue
      key = (np.dtype(x.dtype), tuple(spec)[:lead], kind, tuple(x.shape[:lead]))
      if key not in keys:
        keys[key] = len(buffers)
        sizes.append(0)
        buffers.append(key)
      b = keys[key]
      slots.append(_Slot(b, sizes[b], tuple(x.shape)))
      sizes[b] += math.prod(x.shape[lead:])
    return cls(treedef=treedef, slots=tuple(slots),
               buffers=tuple(_Buffer(d, P(*spec, None), kind, lead, n)
                             for (d, spec, kind, lead), n in zip(buffers, sizes)))

  @property
  def num_packed(self) -> int:
    """Leaves that go into packed buffers."""
    return sum(s.buffer >= 0 for s in self.slots)

  def _parts(self, state: Any, convert: Callable[[Any], Any]) -> list[list]:
    """Per buffer, its leaves of ``state`` (``convert``ed) shaped ``lead + (-1,)``."""
    parts: list[list] = [[] for _ in self.buffers]
    for x, s in zip(self.treedef.flatten_up_to(state), self.slots):
      if s.buffer >= 0:
        parts[s.buffer].append(convert(x).reshape(*self.buffers[s.buffer].lead, -1))
    return parts

  def pack(self, state: Any, mesh: Mesh | None = None) -> tuple[list, list]:
    """state -> (kept leaves, packed buffers); traceable. With ``mesh`` the buffers are
    constrained to their sharding (inside a jitted call over that mesh)."""
    packed = [jnp.concatenate(p, axis=-1) for p in self._parts(state, lambda x: x)]
    if mesh is not None:
      packed = [jax.lax.with_sharding_constraint(p, NamedSharding(mesh, b.spec))
                for p, b in zip(packed, self.buffers)]
    return self.kept(state), packed

  def kept(self, state: Any) -> list:
    """The leaves of ``state`` that stay as they are (no copy)."""
    return [x for x, s in zip(self.treedef.flatten_up_to(state), self.slots) if s.buffer < 0]

  def split(self, packed: list) -> list:
    """packed buffers -> the packed leaves, in state order; traceable, and on numpy
    buffers a numpy split (views, no copy)."""
    out = []
    for s in self.slots:
      if s.buffer >= 0:
        n = math.prod(s.shape[len(self.buffers[s.buffer].lead):])
        out.append(packed[s.buffer][..., s.offset:s.offset + n].reshape(s.shape))
    return out

  def pack_host(self, state: Any, mesh: Mesh) -> list:
    """The packed buffers of ``state`` joined on the host and put on ``mesh`` (no
    compilation; every leaf must be fully addressable)."""
    return [jax.device_put(np.concatenate(p, axis=-1),
                           NamedSharding(mesh, b.spec, memory_kind=b.kind))
            for p, b in zip(self._parts(state, np.asarray), self.buffers)]

  def merge(self, kept: list, small: list) -> Any:
    """(kept leaves, ``split``'s leaves) -> state."""
    kept_it, small_it = iter(kept), iter(small)
    return self.treedef.unflatten([next(kept_it) if s.buffer < 0 else next(small_it)
                                   for s in self.slots])

  def unpack(self, kept: list, packed: list) -> Any:
    """(kept leaves, packed buffers) -> state; traceable."""
    return self.merge(kept, self.split(packed))


@functools.partial(jax.jit, static_argnums=0)
def split_jit(packing: StatePacking, packed: list) -> list:
  """``packing.split``, jitted; engines with equal packings share the compiled code."""
  return packing.split(packed)


@functools.partial(jax.jit, static_argnums=(0, 1))
def pack_jit(packing: StatePacking, mesh: Mesh, state: Any) -> list:
  """The packed buffers of ``packing.pack(state, mesh)``, jitted (shared likewise)."""
  return packing.pack(state, mesh)[1]


__all__ = ["StatePacking", "pack_jit", "split_jit"]
