"""The leaf of the package: shared types, geometry, sizes, logical addressing and the one
jax-version compatibility module. Imports nothing else of ``ula_jax``."""

from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo, Resolution

__all__ = ["INVALID", "KVGeometry", "MeshInfo", "Resolution", "parse_size"]
