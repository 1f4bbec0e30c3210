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
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def masked_index(dims: Sequence[int], index: Sequence[jax.Array | int], keep: jax.Array
                 ) -> tuple[jax.Array, ...]:
  """``index`` (one integer array or scalar per leading axis, of sizes ``dims``) broadcast
  with ``keep``, every component of an entry not kept set to its axis's size."""
  keep = jnp.asarray(keep, bool)
  shape = jnp.broadcast_shapes(keep.shape, *(jnp.shape(i) for i in index))
  keep = jnp.broadcast_to(keep, shape)
  return tuple(jnp.where(keep, jnp.broadcast_to(jnp.asarray(i), shape), dims[axis])
               for axis, i in enumerate(index))


def set_where(x: jax.Array, index: Sequence[jax.Array | int], values: jax.Array | int | bool,
              keep: jax.Array) -> jax.Array:
  """``x`` with ``x[index] = values`` for the entries where ``keep``; the others write
  nothing. ``index`` has one integer array (or scalar) per leading axis of ``x``,
  broadcastable with ``keep``; kept entries must be in range. Where kept entries repeat
  an element, which value lands is as for ``x.at[index].set``."""
  return x.at[masked_index(x.shape, index, keep)].set(values, mode="drop")
