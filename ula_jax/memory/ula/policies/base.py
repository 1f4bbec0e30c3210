"""The eviction-policy interface of a shared device pool (one per layer group).

A policy tracks, for ``num_slots`` device slots, which are free and how recently each
occupied slot was used, and names victims when entries must move in. It knows slots
only, never addresses or data. All methods are pure jnp on one device's local state
(no dp axis) and run inside the memory system's ``resolve``.

One *round* is one ``resolve`` of the policy's layer group (one decode step). Per round
the system calls::

    st = begin_round(st)                    # a new round starts
    st = touch(st, hit_slots, ...)          # selected entries already on the device
    slots, ok, was_free = pick(st, n, N)    # where the n entries moving in go
    st = touch(st, placed_slots, ...)       # the entries that moved in

Slots touched in the current round are never picked: they hold entries the current
step's attention reads. Victim order: free slots first (lowest index first), then the
policy's order of occupied slots.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax
import numpy as np

FREE = -1  # ``describe``: a free slot


class Policy(abc.ABC):
  """Static (hashable) policy description; its state is a pytree from ``init``."""

  name: ClassVar[str]

  def __init__(self, num_slots: int):
    self.num_slots = num_slots

  @abc.abstractmethod
  def init(self) -> Any:
    """The state with every slot free (local arrays)."""

  @abc.abstractmethod
  def begin_round(self, st: Any) -> Any:
    """Starts a round: what was touched so far becomes evictable."""

  @abc.abstractmethod
  def touch(self, st: Any, slots: jax.Array, valid: jax.Array) -> Any:
    """Marks slots occupied and used in the current round.

    slots: [n] int32, distinct where valid; valid: [n] bool
    """

  @abc.abstractmethod
  def release(self, st: Any, slots: jax.Array, valid: jax.Array) -> Any:
    """Marks slots free. slots: [n] int32 (repeats allowed); valid: [n] bool."""

  @abc.abstractmethod
  def pick(self, st: Any, n_need: jax.Array, n: int
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Slots for ``n_need`` entries moving in, in victim order.

    n_need: [] int32 (<= n); n: static length of the result
    returns (slots [n] int32, ok [n] bool = a slot was found for the j-th entry
             (a prefix), was_free [n] bool = it was free, so nothing is evicted)
    """

  @abc.abstractmethod
  def first_free(self, st: Any, n: int) -> tuple[jax.Array, jax.Array]:
    """The ``n`` lowest free slots: (slots [n] int32 ascending, ok [n] bool prefix)."""

  @abc.abstractmethod
  def describe(self, st: Any) -> dict[str, np.ndarray]:
    """Host-side view for tests and reports (numpy), comparable with the reference."""
