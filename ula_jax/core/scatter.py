"""Scatters that skip some of their entries, safe under XLA's deterministic scatter.

A masked update ``x.at[i, j].set(v)`` "where ``keep``" is usually written with an index
past the end of one axis for the entries to skip, and ``mode="drop"``. On a GPU with
``--xla_gpu_deterministic_ops`` (``mesh.configure_platform`` sets it) XLA rewrites a
scatter whose indices may repeat into a sort by each entry's row-major offset and keeps
the last entry per offset; for scalar updates it computes that offset from the index
tuple without bounds checks. An entry skipped through its minor index, ``[g, S]`` of an
``[G, S]`` array, then has the offset of ``[g + 1, 0]``, and where both are in one scatter
the skipped entry can take the place of the real update of ``[g + 1, 0]``, which is lost.
``set_where`` points every index component of a skipped entry past the end of its axis,
so its offset lies past the whole array and meets no real element.

Where the kept entries are distinct elements, ``set_where(..., unique=True)`` also gives
every skipped entry an index of its own past the end and declares the scatter's indices
unique: XLA then writes the entries in parallel and drops the out-of-range ones itself,
with no sort and no rewrite at all (the form every table update with distinct elements
should take).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def masked_index(dims: Sequence[int], index: Sequence[jax.Array | int], keep: jax.Array,
                 *, distinct: bool = False) -> tuple[jax.Array, ...]:
  """``index`` (one integer array or scalar per leading axis, of sizes ``dims``) broadcast
  with ``keep``, every component of an entry not kept set to its axis's size; with
  ``distinct``, the first component of the n-th entry (row-major) to its axis's size + n,
  so no two skipped entries share an index."""
  keep = jnp.asarray(keep, bool)
  shape = jnp.broadcast_shapes(keep.shape, *(jnp.shape(i) for i in index))
  keep = jnp.broadcast_to(keep, shape)
  past = [jnp.full(shape, d, jnp.int32) for d in dims[:len(index)]]
  if distinct:
    past[0] = past[0] + jnp.arange(keep.size, dtype=jnp.int32).reshape(shape)
  return tuple(jnp.where(keep, jnp.broadcast_to(jnp.asarray(i), shape), p)
               for i, p in zip(index, past))


def set_where(x: jax.Array, index: Sequence[jax.Array | int], values: jax.Array | int | bool,
              keep: jax.Array, *, unique: bool = False) -> jax.Array:
  """``x`` with ``x[index] = values`` for the entries where ``keep``; the others write
  nothing. ``index`` has one integer array (or scalar) per leading axis of ``x``,
  broadcastable with ``keep``; kept entries must be in range. Where kept entries repeat
  an element, which value lands is as for ``x.at[index].set``.

  unique: the caller guarantees that no two kept entries name the same element; the
    scatter is then declared unique (see the module docstring). Kept entries that repeat
    an element under ``unique`` leave that element undefined."""
  idx = masked_index(x.shape, index, keep, distinct=unique)
  return x.at[idx].set(values, mode="drop", unique_indices=unique)


def set_every_group(x: jax.Array, index: jax.Array, values: jax.Array | int | bool,
                    keep: jax.Array) -> jax.Array:
  """``x`` ([G, N, ...]) with ``x[g, index] = values`` in every group ``g`` for the entries
  where ``keep`` (index, keep: [M]; the kept indices distinct): ``set_where`` with a
  unique scatter, not the column scatter ``x.at[:, index]``, whose masked entries XLA's
  deterministic rewrite bounds-checks against the wrong axis."""
  gi = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
  return set_where(x, (gi, index[None, :]), values, keep[None, :], unique=True)


def update_groups(fn: Callable[[Any, Any], tuple[Any, Any]], stacked: Any, xs: Any = None
                  ) -> tuple[Any, Any]:
  """Applies a per-group update to every group of ``stacked`` (leaves with a leading group
  axis), one group after another, in place: ``fn(group_slice, xs_slice) -> (new_slice,
  extras)``; returns (``stacked`` with every slice replaced, the extras stacked [G, ...]).
  ``xs`` (optional, leaves [G, ...]) are per-group inputs.

  For per-group updates written with 1-D masked scatters, which must not run under
  ``jax.vmap``: there a scatter into ``[N]`` becomes one into ``[G, N]``, and an entry
  skipped through index ``N`` becomes ``[g, N]``, which XLA's deterministic scatter
  (module docstring) orders with ``[g + 1, 0]``: a real update of the next group's first
  element, or of a bitmap's first word, can be lost or merged with the skipped one. Here
  every scatter stays 1-D, where an index past the end is past the whole array, and the
  stacked arrays are a loop's carry, updated in place (no second copy of them)."""
  G = jax.tree.leaves(stacked)[0].shape[0]
  take = lambda tree, g: jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(x, g, 0, keepdims=False), tree)
  put = lambda tree, g, new: jax.tree.map(
      lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), g, 0), tree, new)

  def body(st, g):
    new, extras = fn(take(st, g), take(xs, g))
    return put(st, g, new), extras

  return jax.lax.scan(body, stacked, jnp.arange(G, dtype=jnp.int32))
