"""Relaxed atomics for Pallas (Triton) kernels.

``jax.experimental.pallas.triton``'s atomics are acquire-release at GPU scope: each one
orders every earlier and later memory access of its thread (on Hopper a memory barrier
before the atomic and an L1 invalidation after it). Kernels that use atomics only for
their atomicity -- setting bits and counting, with the old value naming the first lane
-- need none of that ordering; their results are ordered by launch boundaries or by an
explicit grid barrier. ``atomic(kind, ref, idx, val, mask=...)`` emits Triton's
``atomic_rmw`` with relaxed semantics through a primitive of its own; only where this
jax's Pallas internals differ from what the primitive needs (``RELAXED_AVAILABLE``) is it
Pallas' public atomic, so that the kernels still lower. GPU only: interpret mode has no
lowering for it (kernels emulate atomics there). A grid barrier needs the ordering, so it
calls Pallas' atomics itself.
"""

from __future__ import annotations

from typing import Any

from jax.experimental.pallas import triton as plgpu

_PUBLIC = {"or": plgpu.atomic_or, "and": plgpu.atomic_and, "add": plgpu.atomic_add}

try:  # Pallas' Triton lowering internals (jax 0.10 - 0.11)
  from jax._src import core as jax_core
  from jax._src import tree_util
  from jax._src.lib.triton import dialect as tt_dialect
  from jax._src.pallas import primitives as pallas_primitives
  from jax._src.pallas.triton import lowering as triton_lowering
  from jax._src.state import indexing
  from jax._src.state import primitives as state_primitives
  from jax._src.state import types as state_types

  _OPS = {"or": tt_dialect.RMWOp.OR, "and": tt_dialect.RMWOp.AND, "add": tt_dialect.RMWOp.ADD}
  relaxed_atomic_p = jax_core.Primitive("ula_relaxed_atomic_rmw")

  @relaxed_atomic_p.def_effectful_abstract_eval
  def _abstract_eval(*avals_flat, args_tree, kind):
    del kind
    return pallas_primitives._swap_abstract_eval(*avals_flat, args_tree=args_tree)

  @triton_lowering.register_lowering(relaxed_atomic_p)
  def _lowering(ctx, *args_flat, args_tree, kind):
    block_info, *_ = ctx.block_infos
    ptr, indexers, val, mask = args_tree.unflatten(args_flat)
    *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
    indexers = list(indexers)
    if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
      ref_aval = state_types.transform_type(indexers, ctx.avals_in[0])
      indexers.append(indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
    if len(indexers) != 1:
      raise NotImplementedError("relaxed atomics take one indexer")
    ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
    val = triton_lowering._ensure_ir_value(val, value_aval)
    if mask is not None:
      mask = triton_lowering._ensure_ir_value(mask, mask_aval)
    return triton_lowering._atomic_rmw(_OPS[kind], ptr, val, mask=mask,
                                       semantic=tt_dialect.MemSemantic.RELAXED)

  def _relaxed(kind: str, ref, idx, val, mask):
    ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
    args_flat, args_tree = tree_util.tree_flatten((ref, transforms, val, mask))
    return relaxed_atomic_p.bind(*args_flat, args_tree=args_tree, kind=kind)

  RELAXED_AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - other jax versions
  RELAXED_AVAILABLE = False


def atomic(kind: str, ref, idx: tuple, val, *, mask: Any = None):
  """``ref[idx] (kind)= val`` atomically, with no ordering of the thread's other accesses
  (``kind``: 'or', 'and' or 'add', integer refs); returns the old values."""
  if kind not in _PUBLIC:
    raise ValueError(f"atomic kind={kind!r}: expected one of {sorted(_PUBLIC)}")
  if RELAXED_AVAILABLE:
    return _relaxed(kind, ref, idx, val, mask)
  return _PUBLIC[kind](ref, idx, val, mask=mask)


__all__ = ["RELAXED_AVAILABLE", "atomic"]
