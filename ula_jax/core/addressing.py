"""Logical addresses: the engine hands out pages; position ``t`` of a request lives at
``page_table[t // page_size] * page_size + t % page_size`` on its dp rank."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.core.types import INVALID


def addrs_of_positions(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
  """Logical addresses of ``positions``.

  page_table: [..., P] int32 logical page ids (INVALID where unallocated)
  positions:  [..., N] int32 (negative = none)
  returns:    [..., N] int32 (INVALID where the position or its page is invalid)
  """
  page_idx = jnp.clip(positions // page_size, 0, page_table.shape[-1] - 1)
  page = jnp.take_along_axis(page_table, page_idx, axis=-1)
  ok = (positions >= 0) & (positions // page_size < page_table.shape[-1]) & (page >= 0)
  return jnp.where(ok, page * page_size + positions % page_size, INVALID).astype(jnp.int32)


def all_addrs(page_table: jax.Array, page_size: int) -> jax.Array:
  """[..., P] page ids -> [..., P * page_size] addresses of every position they cover."""
  pages = page_table[..., :, None]
  offs = jnp.arange(page_size, dtype=jnp.int32)
  addrs = jnp.where(pages >= 0, pages * page_size + offs, INVALID)
  return addrs.reshape(*page_table.shape[:-1], -1).astype(jnp.int32)


class PageAllocator:
  """Host-side free list of logical pages for one dp rank (the engine's bookkeeping)."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def allocate(self, n: int) -> np.ndarray:
    if n > len(self._free):
      raise RuntimeError(f"asked for {n} logical pages, {len(self._free)} free")
    out = [self._free.pop() for _ in range(n)]
    return np.asarray(out, np.int32)

  def free(self, pages: np.ndarray) -> None:
    pages = [int(p) for p in np.asarray(pages) if p >= 0]
    if len(set(pages)) != len(pages) or set(pages) & set(self._free):
      raise RuntimeError(f"double free of logical pages {sorted(pages)}")
    self._free.extend(pages)
