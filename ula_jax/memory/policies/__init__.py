"""Eviction policies of ula's shared device pool, chosen by ``memory.policy``."""

from __future__ import annotations

from ula_jax.memory.policies.base import FREE, Policy
from ula_jax.memory.policies.lru import Lru, LruState
from ula_jax.memory.policies.pb_lru import COLD, PbLru, PbLruState

POLICIES: tuple[str, ...] = ("pb_lru", "lru")


def make_policy(name: str, num_slots: int, *, buckets: int) -> Policy:
  """The policy ``name`` over ``num_slots`` device slots (``buckets``: PB-LRU's ring size R)."""
  if name == "pb_lru":
    return PbLru(num_slots, buckets)
  if name == "lru":
    return Lru(num_slots)
  raise ValueError(f"memory.policy={name!r}: expected one of {list(POLICIES)}")


__all__ = ["COLD", "FREE", "POLICIES", "Lru", "LruState", "PbLru", "PbLruState", "Policy",
           "make_policy"]
