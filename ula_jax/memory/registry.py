"""Which class serves ``memory.system`` on a mesh: one row per (system, mode).

A system with one implementation for every mesh has mode ``any``. ``ula`` has two:
``dp`` (``mesh.tp == 1``: each dp rank's own device and host pools) and ``tp``
(``mesh.tp > 1``: a dp rank's history spread over its tp ranks, ``memory.layout``).
Classes are imported on first use, so one system's import cost is paid only when used.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal

Mode = Literal["any", "dp", "tp"]


@dataclasses.dataclass(frozen=True)
class SystemEntry:
  name: str  # the value of memory.system
  mode: Mode  # the meshes it serves: any, tp == 1 (dp) or tp > 1 (tp)
  target: str  # "module:Class"
  summary: str


REGISTRY: tuple[SystemEntry, ...] = (
    SystemEntry("resident", "any", "ula_jax.memory.resident:Resident",
                "every entry in device memory; with tp > 1 a full copy per tp rank"),
    SystemEntry("ula", "dp", "ula_jax.memory.ula.dp:Ula",
                "one logical address space over a dp rank's device and host pools"),
    SystemEntry("ula", "tp", "ula_jax.memory.ula.tp:UlaTP",
                "a dp rank's history spread over its tp ranks, plus a local buffer"),
    SystemEntry("hisparse", "any", "ula_jax.memory.hisparse:HiSparse",
                "every entry in host memory, a device buffer per request"),
    SystemEntry("far_tier", "any", "ula_jax.memory.far_tier.system:FarTier",
                "every entry in a disaggregated far pool, fetched per layer"),
)

SYSTEM_NAMES: tuple[str, ...] = tuple(dict.fromkeys(e.name for e in REGISTRY))


def mode_of(tp: int) -> Mode:
  """The mode a mesh with ``tp`` ranks per dp rank asks for."""
  return "tp" if tp > 1 else "dp"


def lookup(name: str, tp: int = 1) -> SystemEntry:
  """The registry row serving ``memory.system=name`` on a mesh with ``tp`` ranks."""
  rows = [e for e in REGISTRY if e.name == name]
  if not rows:
    raise ValueError(f"memory.system={name!r}: expected one of {list(SYSTEM_NAMES)}")
  mode = mode_of(tp)
  for e in rows:
    if e.mode in ("any", mode):
      return e
  raise ValueError(f"memory.system={name!r} has no {mode} mode (mesh.tp={tp}); "
                   f"modes: {[e.mode for e in rows]}")


def system_class(name: str, tp: int = 1) -> type:
  """The class serving ``memory.system=name`` with ``tp`` ranks per dp rank."""
  module, cls = lookup(name, tp).target.split(":")
  return getattr(importlib.import_module(module), cls)
