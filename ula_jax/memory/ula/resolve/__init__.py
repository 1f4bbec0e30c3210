"""Resolve of one layer group: logical top-k -> device slots, victims, table update.

One public entry point, ``resolve_group``, dispatches on ``impl`` (the config field
``kernels.resolve``); every implementation has the same signature and returns the same
arrays as ``Ula.resolve_meta``:

* ``'jnp'`` (``reference.py``): ``Ula.resolve_meta`` itself (sort-based dedupe, plain jnp);
  the reference and the portable fallback.
* ``'pallas'`` (``pallas.py``): four Pallas (Triton) launches and one scratch fill per
  group, no sort: dedupe by location bitmaps, order by count pyramids, PB-LRU's
  bucket search over its bitmaps (``interpret=True`` runs them on CPU).
* ``'pallas_fused'``: the same stages in one launch for PB-LRU (persistent programs,
  grid barriers between the stages); exact LRU's resolve stays four launches.

With ``fast_path=True`` (the config field ``kernels.resolve_fast_path``) a step that needs
no data movement -- every selection already on the device, the new tokens unstored and
enough free device slots for them -- takes the all-hit fast path (``fastpath.py``): the
same arrays from ``O(B * k)`` gathers and ``O(Sd / 32)``-word reductions, chosen per call
on device with ``jax.lax.cond``; any other step runs ``impl`` in full. ``fast_path_for``
resolves the field's ``'auto'``.

Implementations are imported on first use. ``docs/kernels/resolve.md`` describes the
stages, the production forms and the variants measured against them.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax

from ula_jax.memory.base import group_slice, group_update

# impl name -> "module:function"
IMPLS: dict[str, str] = {
    "jnp": "ula_jax.memory.ula.resolve.reference:resolve_group_reference",
    "pallas": "ula_jax.memory.ula.resolve.pallas:resolve_group_pallas",
    "pallas_fused": "ula_jax.memory.ula.resolve.pallas:resolve_group_pallas_fused",
}


def fast_path_for(setting: bool | str, impl: str, platform: str) -> bool:
  """``kernels.resolve_fast_path=setting`` with ``kernels.resolve=impl`` (resolved) on
  ``platform``: ``'auto'`` is false on a GPU with a Pallas resolve and true elsewhere.

  On an H200 at GLM-5 geometry the fused resolve in every step costs less than the
  fast path behind its per-group ``lax.cond`` (which ends a CUDA graph and waits for the
  device): an all-hit step at batch 64 takes 1.083x ``resident``'s against 1.123x, at
  batch 1 1.055x against 1.072x, and a step that misses runs the full resolve either
  way (RESULTS.md, "Decode at the device's speed"). The jnp resolve is the slow one
  (1.2-1.9 ms a group), so on a CPU the fast path stays.
  """
  if setting == "auto":
    return not (platform == "gpu" and impl.startswith("pallas"))
  if not isinstance(setting, bool):
    raise ValueError(f"kernels.resolve_fast_path={setting!r}: expected true, false or 'auto'")
  return setting


def impl_function(impl: str) -> Callable[..., Any]:
  if impl not in IMPLS:
    raise ValueError(f"kernels.resolve={impl!r}: expected one of {sorted(IMPLS)}")
  module, fn = IMPLS[impl].split(":")
  return getattr(importlib.import_module(module), fn)


def resolve_group(system: Any, meta: Any, sel_addr: jax.Array, sel_valid: jax.Array,
                  new_addr: jax.Array, active: jax.Array, *, impl: str = "jnp",
                  interpret: bool | None = None, config: Any = None,
                  fast_path: bool = True, group: Any = None):
  """Resolves one layer group's selection for a batch of requests.

  system:    a ``ula.Ula`` (static: sizes and policy)
  meta:      its ``GroupMeta`` for the group (local arrays, no dp axis); with ``group``
             set, every group's, stacked (``[G, ...]`` leaves, ``UlaState.meta``'s)
  sel_addr:  [B, k] int32 logical addresses selected; sel_valid: [B, k] bool
  new_addr:  [B] int32 the tokens being decoded; active: [B] bool
  impl:      'jnp' | 'pallas' | 'pallas_fused'
  interpret: Pallas interpret mode (None: on everywhere but on GPU); 'jnp' ignores it
  config:    ``pallas.ResolveConfig`` for the Pallas impls (None: the impl's own,
             ``ResolveConfig()`` for 'pallas', ``FUSED_CONFIG`` for 'pallas_fused')
  fast_path: take the all-hit fast path (``fastpath.py``) when the step moves nothing;
             the result is the same either way
  group:     None, or the group of the stacked ``meta`` to resolve (int or traced int32
             scalar). The Pallas impls without the fast path update the group's part of
             the stacked arrays in place (stacks of fewer than 2^31 elements per
             array); the others resolve a slice of it and write it back (a copy out and
             a copy in)
  returns (meta, slots [B, k] int32, new_slot [B] int32, plan ``UlaPlan``, stats dict
           of int32 scalars ``hits``, ``misses``, ``evictions``); ``meta`` stacked like
           the one passed
  """
  fn = impl_function(impl)
  if group is not None and impl.startswith("pallas") and not fast_path:
    from ula_jax.memory.ula.resolve.pallas import stack_indexable  # loaded with the impl
    in_place = stack_indexable(meta)
  else:
    in_place = False
  if in_place:
    return fn(system, meta, sel_addr, sel_valid, new_addr, active, config=config,
              interpret=interpret, group=group)
  if group is not None:
    new, *rest = resolve_group(system, group_slice(meta, group), sel_addr, sel_valid,
                               new_addr, active, impl=impl, interpret=interpret,
                               config=config, fast_path=fast_path)
    return (group_update(meta, group, new), *rest)

  def full(meta, sel_addr, sel_valid, new_addr, active):
    return fn(system, meta, sel_addr, sel_valid, new_addr, active, config=config,
              interpret=interpret)

  if not fast_path:
    return full(meta, sel_addr, sel_valid, new_addr, active)
  from ula_jax.memory.ula.resolve.fastpath import resolve_fast_or  # first use, like the impls
  return resolve_fast_or(full, system, meta, sel_addr, sel_valid, new_addr, active)


__all__ = ["IMPLS", "fast_path_for", "impl_function", "resolve_group"]
