"""Kernels, one folder per op: the public wrapper, a jnp reference with the same
signature (also the portable fallback) and optional accelerated implementations."""

from __future__ import annotations

from typing import Any


def byte_offsets_overflow(array: Any) -> bool:
  """Whether a Pallas kernel compiled by Triton would index ``array`` (an array or a
  ``jax.ShapeDtypeStruct``) past int32: jax's Triton lowering takes 64-bit element
  offsets only for arrays over 4 GiB, so a one-byte array of 2-4 GiB (2**31 elements or
  more) gets 32-bit offsets that overflow."""
  return array.dtype.itemsize == 1 and 2**31 <= array.size <= 2**32
