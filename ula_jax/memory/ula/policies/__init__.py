"""Eviction policies of ula's shared device pool, chosen by ``memory.policy``."""

from __future__ import annotations

import numpy as np

from ula_jax.config.schema import MemoryConfig
from ula_jax.memory.ula.policies.base import FREE, Policy
from ula_jax.memory.ula.policies.lru import Lru, LruState
from ula_jax.memory.ula.policies.pb_lru import COLD, PbLru, PbLruState

POLICIES: tuple[str, ...] = ("pb_lru", "lru")


def make_policy(name: str, num_slots: int, *, buckets: int) -> Policy:
  """The policy ``name`` over ``num_slots`` device slots (``buckets``: PB-LRU's ring size R)."""
  if name == "pb_lru":
    return PbLru(num_slots, buckets)
  if name == "lru":
    return Lru(num_slots)
  raise ValueError(f"memory.policy={name!r}: expected one of {list(POLICIES)}")


def policy_fields(cfg: MemoryConfig) -> tuple[str, int]:
  """(``memory.policy``, ``memory.pb_lru_buckets``) of a memory config, checked again
  here: a config made without validation (``model_construct``) reaches the system as is."""
  policy = cfg.policy
  if policy not in POLICIES:
    raise ValueError(f"memory.policy={policy!r}: expected one of {list(POLICIES)}")
  r = cfg.pb_lru_buckets
  if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
    raise ValueError(f"memory.pb_lru_buckets={r!r}: expected an integer >= 1 (recent "
                     f"buckets in the PB-LRU ring, besides the cold bucket)")
  return policy, int(r)


__all__ = ["COLD", "FREE", "POLICIES", "Lru", "LruState", "PbLru", "PbLruState", "Policy",
           "make_policy", "policy_fields"]
