"""``x @ w[index]`` in plain jax: the slice of the stacked weights, then the product."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stacked_matmul_reference(x: jax.Array, w: jax.Array, index: jax.Array) -> jax.Array:
  """x [M, K], w [L, K, N], index [] -> [M, N] float32 (the operands in ``w``'s dtype)."""
  wl = jax.lax.dynamic_index_in_dim(w, index, 0, keepdims=False)
  return jnp.dot(x.astype(w.dtype), wl, preferred_element_type=jnp.float32)
