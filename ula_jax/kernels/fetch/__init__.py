"""Row copies between a pinned-host pool and a device pool, by index lists.

``fetch_rows`` copies host rows into device slots, ``evict_rows`` device rows into host
slots, ``stage_rows`` device rows into a fresh device buffer (the rows a step evicts, set
aside before the fetch overwrites their slots). Only the selected rows cross between
host and device: no implementation moves the whole host pool (Pallas interpret mode, a
CPU debugging aid, excepted).

Implementations (``impl``, the config field ``kernels.fetch``):

* ``'xla'`` (``reference.py``): plain jax inside jit: the rows are gathered by host
  compute, moved, and scattered on the other side. Portable; the fallback.
* ``'pallas'`` (``pallas.py``): a Pallas kernel whose device threads read and write the
  pinned host pool directly (Triton on GPU; ``interpret=True`` elsewhere).
* ``'ffi'`` (``ffi.py``): the ``ula_jax_fetch_rows`` / ``ula_jax_evict_rows`` XLA custom
  calls of the ``ula_jax_ffi`` package (``pip install ./custom_calls``).

Index semantics, shared by every implementation: pair ``i`` copies
``src[src_idx[i]] -> dst[dst_idx[i]]``; a pair with either index outside its pool
(negative ones included), or at or past an optional ``count``, is skipped. Valid
destination indices must be distinct.
Destination pools are updated in place when the caller donates them to jit; otherwise
XLA copies the destination first.
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax
import jax.numpy as jnp

# impl name -> (module, fetch function, evict function)
IMPLS: dict[str, tuple[str, str, str]] = {
    "xla": ("ula_jax.kernels.fetch.reference", "fetch_rows_reference", "evict_rows_reference"),
    "pallas": ("ula_jax.kernels.fetch.pallas", "fetch_rows_pallas", "evict_rows_pallas"),
    "ffi": ("ula_jax.kernels.fetch.ffi", "fetch_rows_ffi", "evict_rows_ffi"),
}

# impl name -> (module, stage function): the FFI package has no gather of its own; its
# users get the Pallas one (a Triton kernel on GPU, interpret mode elsewhere).
STAGE_IMPLS: dict[str, tuple[str, str]] = {
    "xla": ("ula_jax.kernels.fetch.reference", "stage_rows_reference"),
    "pallas": ("ula_jax.kernels.fetch.pallas", "stage_rows_pallas"),
    "ffi": ("ula_jax.kernels.fetch.pallas", "stage_rows_pallas"),
}


def _impl_functions(impl: str) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
  if impl not in IMPLS:
    raise ValueError(f"kernels.fetch={impl!r}: expected one of {sorted(IMPLS)}")
  module, fetch, evict = IMPLS[impl]
  mod = importlib.import_module(module)
  return getattr(mod, fetch), getattr(mod, evict)


def check_copy_args(src: jax.Array, src_idx: jax.Array, dst: jax.Array, dst_idx: jax.Array,
                    names: tuple[str, str, str, str]) -> None:
  """Validates the operands of a row copy (shared by every implementation).

  names: the argument names of (src, src_idx, dst, dst_idx), used in the messages.
  """
  src_name, src_idx_name, dst_name, dst_idx_name = names
  for name, pool in ((src_name, src), (dst_name, dst)):
    if pool.ndim != 2:
      raise ValueError(f"{name}.shape={tuple(pool.shape)}: expected a pool [S, W]")
  if src.shape[1] != dst.shape[1]:
    raise ValueError(f"{src_name}.shape={tuple(src.shape)} and {dst_name}.shape="
                     f"{tuple(dst.shape)}: expected the same row width W")
  if src.dtype != dst.dtype:
    raise ValueError(f"{src_name}.dtype={src.dtype} and {dst_name}.dtype={dst.dtype}: "
                     "expected one dtype")
  for name, idx in ((src_idx_name, src_idx), (dst_idx_name, dst_idx)):
    if idx.ndim != 1 or idx.dtype != jnp.int32:
      raise ValueError(f"{name}: got {idx.dtype}{list(idx.shape)}, expected int32 [N]")
  if src_idx.shape != dst_idx.shape:
    raise ValueError(f"{src_idx_name}.shape={tuple(src_idx.shape)} and {dst_idx_name}.shape="
                     f"{tuple(dst_idx.shape)}: expected the same length N")


FETCH_NAMES = ("host_pool", "host_idx", "dev_pool", "dev_idx")
EVICT_NAMES = ("dev_pool", "dev_idx", "host_pool", "host_idx")


def _counted(idx: jax.Array, count: jax.Array | None) -> jax.Array:
  """``idx`` with the entries at or past ``count`` set to -1 (skipped)."""
  if count is None:
    return idx
  i = jnp.arange(idx.shape[0], dtype=jnp.int32)
  return jnp.where(i < jnp.asarray(count, jnp.int32), idx, -1)


def _call(fn, impl: str, src, src_idx, dst, dst_idx, count, interpret):
  """One row copy through ``impl``: the Pallas launch takes ``count`` itself (its
  programs loop over the blocks below it); the others skip those pairs by their
  indices. One config field (kernels.interpret) serves every kernel: only Pallas uses
  it."""
  if impl == "pallas":
    return fn(src, src_idx, dst, dst_idx, count=count, interpret=interpret)
  return fn(src, _counted(src_idx, count), dst, dst_idx)


def fetch_rows(host_pool: jax.Array, host_idx: jax.Array, dev_pool: jax.Array,
               dev_idx: jax.Array, *, impl: str = "xla", count: jax.Array | None = None,
               interpret: bool | None = None) -> jax.Array:
  """Copies host rows into device slots: ``dev_pool[dev_idx[i]] = host_pool[host_idx[i]]``.

  host_pool: [Sh, W] any dtype, memory kind 'pinned_host'
  host_idx:  [N] int32 host rows (outside [0, Sh): pair skipped)
  dev_pool:  [Sd, W] same dtype, memory kind 'device' (donate it)
  dev_idx:   [N] int32 device slots (outside [0, Sd): pair skipped; valid ones distinct)
  impl:      'xla' | 'pallas' | 'ffi'
  count:     [] int32 or None: pairs at or past it are skipped (lists that hold their
             valid pairs first: the Pallas launch's programs copy only the blocks below
             it, however long the lists)
  interpret: Pallas interpret mode (None: on everywhere but on GPU); other impls ignore it
  returns dev_pool: [Sd, W]
  """
  check_copy_args(host_pool, host_idx, dev_pool, dev_idx, FETCH_NAMES)
  fetch, _ = _impl_functions(impl)
  return _call(fetch, impl, host_pool, host_idx, dev_pool, dev_idx, count, interpret)


def evict_rows(dev_pool: jax.Array, dev_idx: jax.Array, host_pool: jax.Array,
               host_idx: jax.Array, *, impl: str = "xla", count: jax.Array | None = None,
               interpret: bool | None = None) -> jax.Array:
  """Copies device rows into host slots: ``host_pool[host_idx[i]] = dev_pool[dev_idx[i]]``.

  dev_pool:  [Sd, W] any dtype, memory kind 'device'
  dev_idx:   [N] int32 device slots (outside [0, Sd): pair skipped)
  host_pool: [Sh, W] same dtype, memory kind 'pinned_host' (donate it)
  host_idx:  [N] int32 host rows (outside [0, Sh): pair skipped; valid ones distinct)
  impl:      'xla' | 'pallas' | 'ffi'
  count:     [] int32 or None: pairs at or past it are skipped (as in ``fetch_rows``)
  interpret: Pallas interpret mode (None: on everywhere but on GPU); other impls ignore it
  returns host_pool: [Sh, W], memory kind 'pinned_host'
  """
  check_copy_args(dev_pool, dev_idx, host_pool, host_idx, EVICT_NAMES)
  _, evict = _impl_functions(impl)
  return _call(evict, impl, dev_pool, dev_idx, host_pool, host_idx, count, interpret)


def stage_rows(pool: jax.Array, idx: jax.Array, *, impl: str = "xla",
               count: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
  """Gathers device rows into a fresh buffer: ``out[i] = pool[idx[i]]``.

  pool: [S, W] any dtype, device memory
  idx:  [N] int32 rows (outside [0, S): row i of the result is unspecified)
  impl: 'xla' (a gather of all N rows) | 'pallas' (one launch that reads and writes only
        the in-range rows) | 'ffi' (the Pallas launch)
  count: [] int32 or None: rows at or past it are unspecified too (as in ``fetch_rows``)
  returns out: [N, W], device memory

  Its cost follows the in-range rows with 'pallas', the length N with 'xla': a step's
  plan lists are sized for the worst case and mostly empty.
  """
  if pool.ndim != 2:
    raise ValueError(f"pool.shape={tuple(pool.shape)}: expected a pool [S, W]")
  if idx.ndim != 1 or idx.dtype != jnp.int32:
    raise ValueError(f"idx: got {idx.dtype}{list(idx.shape)}, expected int32 [N]")
  if impl not in STAGE_IMPLS:
    raise ValueError(f"kernels.fetch={impl!r}: expected one of {sorted(STAGE_IMPLS)}")
  module, name = STAGE_IMPLS[impl]
  stage = getattr(importlib.import_module(module), name)
  if module.endswith("reference"):
    return stage(pool, _counted(idx, count))
  return stage(pool, idx, count=count, interpret=interpret)


__all__ = ["EVICT_NAMES", "FETCH_NAMES", "IMPLS", "STAGE_IMPLS", "check_copy_args",
           "evict_rows", "fetch_rows", "stage_rows"]
