"""Bit-exact digests of what a decode step computed, for locating where two runs part.

Two runs of the same requests (two memory systems, two kernels) should compute the same
bits at every step. When their tokens differ, the token says only *that* they parted;
a digest per (request, decode step, layer group or layer) of the selected positions,
the entries attention read and the attention output says *where*: the first layer
group whose selection differs, or the first layer that read different bytes for the
same selection. Digests are uint32 sums of mixed bit patterns (wrapping), so any changed
bit changes them with near certainty, and the entry and position digests do not depend
on the order of the selection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_U32 = jnp.uint32
_GOLDEN = 0x9E3779B1

STEP_DIGESTS = ("selection", "new", "entries", "output")
"""A decode step's digests, in the order it computes them: per layer group the selected
positions ([G]), per layer the new token's entry as the model computed it, the stored
entries attention read and the attention output ([L] each). ``decode_step`` returns them
as ``digest_<name>``; a run directory's digests.npz holds them under these names."""


def bits_u32(x: jax.Array) -> jax.Array:
  """Each element's bit pattern as uint32 (1, 2 or 4-byte dtypes)."""
  size = jnp.dtype(x.dtype).itemsize
  carrier = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(size)
  if carrier is None:
    raise ValueError(f"digest: dtype {x.dtype} has {size} bytes; expected 1, 2 or 4")
  if x.dtype == jnp.bool_:
    return x.astype(_U32)
  return jax.lax.bitcast_convert_type(x, carrier).astype(_U32)


def mix32(h: jax.Array) -> jax.Array:
  """A uint32 avalanche (murmur3's finaliser): nearby inputs give unrelated outputs."""
  h = h.astype(_U32)
  h = h ^ (h >> 16)
  h = h * _U32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * _U32(0xC2B2AE35)
  return h ^ (h >> 16)


def rows_digest(x: jax.Array, valid: jax.Array) -> jax.Array:
  """x: [..., k, W]; valid: [..., k] bool -> [...] uint32: the valid rows' bits, each row
  mixed on its own and the rows summed (independent of their order)."""
  W = x.shape[-1]
  weight = mix32(jnp.arange(1, W + 1, dtype=_U32))
  per_row = mix32(jnp.sum(bits_u32(x) * weight, axis=-1, dtype=_U32))
  return jnp.sum(jnp.where(valid, per_row, _U32(0)), axis=-1, dtype=_U32)


def values_digest(x: jax.Array) -> jax.Array:
  """x: [..., W] -> [...] uint32: the bits of each vector, in order."""
  return rows_digest(x[..., None, :], jnp.ones(x.shape[:-1] + (1,), bool))


def positions_digest(pos: jax.Array, valid: jax.Array) -> jax.Array:
  """pos: [..., k] int; valid: [..., k] -> [...] uint32: the set of valid positions."""
  h = mix32(pos.astype(_U32) * _U32(_GOLDEN) + _U32(1))
  return jnp.sum(jnp.where(valid, h, _U32(0)), axis=-1, dtype=_U32)
