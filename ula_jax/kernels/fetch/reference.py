"""Row copies in plain jax: the reference and the portable fallback (``impl='xla'``).

fetch: the selected host rows are gathered by host compute, moved to the device (only
those rows), and scattered into the device pool. evict: the reverse. Works inside jit and
shard_map; the host-side gather/scatter runs on the CPU.

Cost note: the host-side scatter of evict works on unsigned-integer views of the rows,
because XLA:CPU widens a bf16 scatter to float32 (a conversion of the whole pool and
back on every call). For pools that are not unsigned already, the views themselves are
copies of the host pool on XLA:CPU (~8x cheaper than the conversion, still a pass over
the pool); host pools stored as unsigned words (e.g. uint16 for bf16) avoid both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ula_jax.core import compat


def is_host(x: jax.Array) -> bool:
  """Whether ``x`` (an array or a tracer) lives in host memory."""
  return getattr(jax.typeof(x), "memory_space", None) == compat.HOST


def in_range(idx: jax.Array, size: int) -> jax.Array:
  """[N] int32 -> [N] bool: the index addresses a row of a pool of ``size`` rows."""
  return (idx >= 0) & (idx < size)


def _bits(x: jax.Array) -> jax.Array:
  """The same bytes as unsigned integers of the same width."""
  if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
    return x
  return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _gather(pool: jax.Array, idx: jax.Array) -> jax.Array:
  # Indices are in range by construction; "promise" keeps the gather free of clamping
  # constants, which would live in device memory and cannot mix with host operands.
  return pool.at[idx].get(mode="promise_in_bounds")


def _scatter(pool: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
  return pool.at[idx].set(rows, mode="drop")


def _scatter_bits(pool: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
  # The host-side scatter works on the raw bits: XLA:CPU widens a bf16 scatter to
  # float32, which would convert the whole pool there and back on every call.
  out = _scatter(_bits(pool), idx, _bits(rows))
  return out if out.dtype == pool.dtype else jax.lax.bitcast_convert_type(out, pool.dtype)


def fetch_rows_reference(host_pool: jax.Array, host_idx: jax.Array, dev_pool: jax.Array,
                         dev_idx: jax.Array) -> jax.Array:
  """``dev_pool[dev_idx[i]] = host_pool[host_idx[i]]`` for in-range pairs.

  host_pool: [Sh, W] ('pinned_host', or device memory: then the gather runs there)
  host_idx:  [N] int32
  dev_pool:  [Sd, W] same dtype
  dev_idx:   [N] int32
  returns dev_pool: [Sd, W]
  """
  Sh, Sd = host_pool.shape[0], dev_pool.shape[0]
  if host_idx.shape[0] == 0 or Sh == 0 or Sd == 0:
    return dev_pool
  ok = in_range(host_idx, Sh) & in_range(dev_idx, Sd)
  src = jnp.where(ok, host_idx, 0)
  if is_host(host_pool):
    rows = compat.to_device(compat.on_host(_gather, host_pool, compat.to_host(src)))
  else:
    rows = _gather(host_pool, src)
  # Skipped pairs point past the end of the pool and are dropped by the scatter.
  return _scatter(dev_pool, jnp.where(ok, dev_idx, Sd), rows)


def evict_rows_reference(dev_pool: jax.Array, dev_idx: jax.Array, host_pool: jax.Array,
                         host_idx: jax.Array) -> jax.Array:
  """``host_pool[host_idx[i]] = dev_pool[dev_idx[i]]`` for in-range pairs.

  dev_pool:  [Sd, W]
  dev_idx:   [N] int32
  host_pool: [Sh, W] same dtype ('pinned_host', or device memory)
  host_idx:  [N] int32
  returns host_pool: [Sh, W] in the memory it came from
  """
  Sd, Sh = dev_pool.shape[0], host_pool.shape[0]
  if dev_idx.shape[0] == 0 or Sh == 0 or Sd == 0:
    return host_pool
  ok = in_range(dev_idx, Sd) & in_range(host_idx, Sh)
  rows = _gather(dev_pool, jnp.where(ok, dev_idx, 0))
  dst = jnp.where(ok, host_idx, Sh)
  if is_host(host_pool):
    return compat.on_host(_scatter_bits, host_pool, compat.to_host(dst), compat.to_host(rows))
  return _scatter(host_pool, dst, rows)


def stage_rows_reference(pool: jax.Array, idx: jax.Array) -> jax.Array:
  """``out[i] = pool[idx[i]]`` for in-range indices; the other rows hold row 0.

  pool: [S, W] device memory; idx: [N] int32
  returns out: [N, W]
  """
  if pool.shape[0] == 0:
    return jnp.zeros((idx.shape[0], pool.shape[1]), pool.dtype)
  return _gather(pool, jnp.where(in_range(idx, pool.shape[0]), idx, 0))
