"""Memory systems: where each KV entry lives, behind one interface (``base.MemorySystem``)."""

from __future__ import annotations

from ula_jax.config.schema import MemoryConfig
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo, Resolution
from ula_jax.memory.base import CapacityReport, MemorySystem
from ula_jax.memory.registry import REGISTRY, SYSTEM_NAMES, lookup, system_class


def build_memory_system(cfg: MemoryConfig, geometry: KVGeometry, mesh_info: MeshInfo, *,
                        max_batch: int, page_size: int, max_context: int,
                        fetch_impl: str = "xla", resolve_impl: str = "jnp",
                        resolve_fast_path: bool = True,
                        interpret: bool | None = None) -> MemorySystem:
  """Instantiates ``cfg.system`` and validates its sizes (before any compute).

  The class comes from ``registry.REGISTRY`` by ``cfg.system`` and the mesh's mode
  (``ula``: ``dp`` when ``mesh_info.tp == 1``, ``tp`` otherwise).

  fetch_impl / resolve_impl: the ``kernels.fetch`` / ``kernels.resolve`` implementations
  its row copies and resolve use; resolve_fast_path: ``kernels.resolve_fast_path`` (steps
  that move nothing take the all-hit fast path); interpret: run Pallas kernels in
  interpret mode.
  """
  cls = system_class(cfg.system, mesh_info.tp)
  system = cls(cfg, geometry, mesh_info, max_batch=max_batch, page_size=page_size,
               max_context=max_context)
  system.fetch_impl, system.fetch_interpret = fetch_impl, interpret
  system.resolve_impl, system.resolve_interpret = resolve_impl, interpret
  system.resolve_fast_path = resolve_fast_path
  system.validate()
  return system


__all__ = ["INVALID", "CapacityReport", "KVGeometry", "MemorySystem", "MeshInfo",
           "REGISTRY", "Resolution", "SYSTEM_NAMES", "build_memory_system", "lookup",
           "parse_size", "system_class"]
