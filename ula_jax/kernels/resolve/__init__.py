"""Resolve of one layer group: logical top-k -> device slots, victims, table update.

One public entry point, ``resolve_group``, dispatches on ``impl`` (the config field
``kernels.resolve``); every implementation has the same signature and returns the same
arrays as ``Ula.resolve_meta``:

* ``'jnp'`` (``reference.py``): ``Ula.resolve_meta`` itself (sort-based dedupe, plain jnp);
  the reference and the portable fallback.
* ``'pallas'`` (``pallas.py``): four Pallas (Triton) launches and one scratch fill per
  group, no sort: dedupe by location bitmaps, order by count pyramids, PB-LRU's
  bucket search over its bitmaps (``interpret=True`` runs them on CPU).

Implementations are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax

# impl name -> "module:function"
IMPLS: dict[str, str] = {
    "jnp": "ula_jax.kernels.resolve.reference:resolve_group_reference",
    "pallas": "ula_jax.kernels.resolve.pallas:resolve_group_pallas",
}


def impl_function(impl: str) -> Callable[..., Any]:
  if impl not in IMPLS:
    raise ValueError(f"kernels.resolve={impl!r}: expected one of {sorted(IMPLS)}")
  module, fn = IMPLS[impl].split(":")
  return getattr(importlib.import_module(module), fn)


def resolve_group(system: Any, meta: Any, sel_addr: jax.Array, sel_valid: jax.Array,
                  new_addr: jax.Array, active: jax.Array, *, impl: str = "jnp",
                  interpret: bool | None = None, config: Any = None):
  """Resolves one layer group's selection for a batch of requests.

  system:    a ``ula.Ula`` (static: sizes and policy)
  meta:      its ``GroupMeta`` for the group (local arrays, no dp axis)
  sel_addr:  [B, k] int32 logical addresses selected; sel_valid: [B, k] bool
  new_addr:  [B] int32 the tokens being decoded; active: [B] bool
  impl:      'jnp' | 'pallas'
  interpret: Pallas interpret mode (None: on everywhere but on GPU); 'jnp' ignores it
  config:    ``pallas.ResolveConfig`` for 'pallas' (None: defaults)
  returns (meta, slots [B, k] int32, new_slot [B] int32, plan ``UlaPlan``, stats dict
           of int32 scalars ``hits``, ``misses``, ``evictions``)
  """
  return impl_function(impl)(system, meta, sel_addr, sel_valid, new_addr, active,
                             config=config, interpret=interpret)


__all__ = ["IMPLS", "impl_function", "resolve_group"]
