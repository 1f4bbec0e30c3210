"""Memory systems: where each KV entry lives, behind one interface (``base.MemorySystem``)."""

from __future__ import annotations

import importlib
from typing import Any

from ula_jax.memory.base import (INVALID, CapacityReport, KVGeometry, MemorySystem,
                                 MeshInfo, Resolution, parse_size)

# name -> "module:Class"; imported lazily so one system's import cost is paid only when used.
SYSTEMS: dict[str, str] = {
    "resident": "ula_jax.memory.resident:Resident",
    "ula": "ula_jax.memory.ula:Ula",
    "hisparse": "ula_jax.memory.hisparse:HiSparse",
    "far_tier": "ula_jax.memory.far_tier:FarTier",
}


def system_class(name: str) -> type[MemorySystem]:
  if name not in SYSTEMS:
    raise ValueError(f"memory.system={name!r}: expected one of {sorted(SYSTEMS)}")
  module, cls = SYSTEMS[name].split(":")
  return getattr(importlib.import_module(module), cls)


def build_memory_system(cfg: Any, geometry: KVGeometry, mesh_info: MeshInfo, *,
                        max_batch: int, page_size: int, max_context: int,
                        fetch_impl: str = "xla", resolve_impl: str = "jnp",
                        resolve_fast_path: bool = True,
                        interpret: bool | None = None) -> MemorySystem:
  """Instantiates ``cfg.system`` and validates its sizes (before any compute).

  ``ula`` with ``mesh_info.tp > 1`` is TP mode (``ula_tp.UlaTP``).

  fetch_impl / resolve_impl: the ``kernels.fetch`` / ``kernels.resolve`` implementations
  its row copies and resolve use; resolve_fast_path: ``kernels.resolve_fast_path`` (steps
  that move nothing take the all-hit fast path); interpret: run Pallas kernels in
  interpret mode.
  """
  cls = system_class(cfg.system)
  if cfg.system == "ula" and mesh_info.tp > 1:
    # TP mode: the dp rank's address space spread over its tp ranks (memory.layout).
    from ula_jax.memory.ula_tp import UlaTP
    cls = UlaTP
  system = cls(cfg, geometry, mesh_info, max_batch=max_batch, page_size=page_size,
               max_context=max_context)
  system.fetch_impl, system.fetch_interpret = fetch_impl, interpret
  system.resolve_impl, system.resolve_interpret = resolve_impl, interpret
  system.resolve_fast_path = resolve_fast_path
  system.validate()
  return system


__all__ = ["INVALID", "CapacityReport", "KVGeometry", "MemorySystem", "MeshInfo",
           "Resolution", "SYSTEMS", "build_memory_system", "parse_size", "system_class"]
