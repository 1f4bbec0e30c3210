"""The jnp resolve (``Ula.resolve_meta``) behind the kernel signature: the reference
every other implementation must match array for array, and the portable fallback."""

from __future__ import annotations

from typing import Any

import jax


def resolve_group_reference(system: Any, meta: Any, sel_addr: jax.Array,
                            sel_valid: jax.Array, new_addr: jax.Array, active: jax.Array, *,
                            config: Any = None, interpret: bool | None = None):
  """``system.resolve_meta(meta, sel_addr, sel_valid, new_addr, active)``.

  system: a ``ula.Ula``; meta: its ``GroupMeta`` for one layer group
  sel_addr: [B, k] int32; sel_valid: [B, k] bool; new_addr: [B] int32; active: [B] bool
  config, interpret: accepted for a common signature (nothing to tune, nothing to
  interpret)
  returns (meta, slots [B, k] int32, new_slot [B] int32, plan, stats)
  """
  del config, interpret
  return system.resolve_meta(meta, sel_addr, sel_valid, new_addr, active)
