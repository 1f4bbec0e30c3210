"""``x @ w[index]`` in plain jax: the slice of the stacked weights, then the product."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stacked_matmul_reference(x: jax.Array, w: jax.Array, index: jax.Array, *,
                             transposed: bool = False) -> jax.Array:
  """x [M, K] with w [L, K, N], or x [B | 1, M, K] with w [L, B, K, N] (``transposed``:
  w holds [..., N, K]) -> [M, N] / [B, M, N] float32 (the operands in ``w``'s dtype)."""
  wl = jax.lax.dynamic_index_in_dim(w, index, 0, keepdims=False)
  if transposed:
    wl = jnp.swapaxes(wl, -1, -2)
  x = x.astype(w.dtype)
  if x.ndim == 2:
    return jnp.dot(x, wl, preferred_element_type=jnp.float32)
  if x.shape[0] == 1 and wl.shape[0] > 1:  # rows shared: no broadcast copy of them
    return jnp.einsum("mk,bkn->bmn", x[0], wl, preferred_element_type=jnp.float32)
  return jnp.einsum("bmk,bkn->bmn", x, wl, preferred_element_type=jnp.float32)
