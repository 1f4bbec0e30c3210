"""Row copies as a Pallas kernel that reads and writes pinned host memory directly.

On GPU (Triton lowering) a ``pinned_host`` operand reaches the kernel as its raw host
pointer, so device threads load the selected host rows straight over PCIe (HiSparse's
"GPU-assisted IO"); nothing stages the pool. This behaviour is not documented by JAX:
``tests/test_fetch.py`` checks the compiled HLO for a whole-pool copy on GPU, and
``impl='xla'`` is the fallback.

The copy is flattened into units of ``vec`` elements (16 bytes when the row allows),
``block_units`` units a block: block ``b`` is units ``[b * block_units, (b + 1) *
block_units)`` of the concatenated selected rows, so consecutive lanes read consecutive
16-byte words across row boundaries and rows that are not a multiple of 512 B (the
656-B FP8 layout) keep every lane busy. A launch has at most ``max_programs`` programs,
and program ``p`` copies blocks ``p, p + P, p + 2P, ...`` up to the pairs' ``count``:
index lists sized for a worst case (a plan's ``B * k + B`` rows a layer) cost a launch
of ``P`` programs, not one program per block of the whole list, and a launch with
nothing to copy is one short wave (lists of at most ``P`` blocks: a block per program,
no loop). In interpret mode (CPU) the same kernel runs on
device-memory arrays; host pools are staged through device memory there, which costs
nothing on CPU where both are plain RAM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ula_jax.core import compat
from ula_jax.kernels import byte_offsets_overflow
from ula_jax.kernels.fetch.reference import is_host


@dataclasses.dataclass(frozen=True)
class CopyRowsConfig:
  """Tuning of the Pallas row copy (static and hashable).

  block_units:  units (``vec`` elements, 16 B for the pools used here) per block, the
                work of one loop iteration of a program; a power of 2
  num_warps:    warps per program (Triton)
  max_programs: programs per launch at most (each loops over every P-th block); about
                one wave of programs of 4 warps on an H100 / H200 (132 SMs)
  """

  block_units: int = 1024
  num_warps: int = 4
  max_programs: int = 2048

  def __post_init__(self):
    if self.block_units < 1 or self.block_units & (self.block_units - 1):
      raise ValueError(f"block_units={self.block_units}: expected a power of 2")
    if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
      raise ValueError(f"num_warps={self.num_warps}: expected a power of 2")
    if self.max_programs < 1:
      raise ValueError(f"max_programs={self.max_programs}: expected at least 1")


def unit_elements(width: int, dtype) -> int:
  """Elements per copy unit: the largest power of 2 that divides ``width`` and spans
  at most 16 bytes (8 for bf16 rows of 576, 16 for 656-byte uint8 rows)."""
  vec = max(1, 16 // jnp.dtype(dtype).itemsize)
  while width % vec:
    vec //= 2
  return vec


def default_interpret() -> bool:
  """Interpret mode everywhere but on GPU (the only Triton target)."""
  return jax.default_backend() != "gpu"


def _rows_kernel(*refs, staged: bool, counted: bool, num_units: int, units_per_row: int,
                 vec: int, block_units: int, num_programs: int):
  # Copy (staged=False): count_ref [1] int32 (pairs past it are skipped), src_idx_ref,
  # dst_idx_ref [N] int32, src_ref [Ss, W], dst_in_ref, out_ref [Sd, W] (aliases
  # dst_in_ref: rows this kernel does not write keep their values).
  # Stage (staged=True): count_ref, src_idx_ref, src_ref, out_ref [N, W], a fresh buffer
  # whose row i is the pair's destination: written only when i < count and src_idx[i]
  # is in range, by the programs that own its units.
  # Program p copies blocks p, p + P, ... (P = num_programs) below the count's units.
  # Without a count (counted=False) every pair is copied and count_ref is not read; with
  # one, a program of a single block reads its indices while the count is on its way
  # (the indices of a list's N pairs are always in range to read), so a launch waits for
  # one device-memory round trip before its rows' reads, not two.
  if staged:
    count_ref, src_idx_ref, src_ref, out_ref = refs
    dst_idx_ref = None
  else:
    count_ref, src_idx_ref, dst_idx_ref, src_ref, _, out_ref = refs
  if counted:
    n = jnp.minimum(plgpu.load(count_ref.at[jnp.int32(0)]) * units_per_row, num_units)
  else:
    n = jnp.int32(num_units)
  pid = pl.program_id(0)

  def block(b):
    u = b * block_units + jnp.arange(block_units, dtype=jnp.int32)
    _copy_units(src_idx_ref, dst_idx_ref, src_ref, out_ref, u, u < num_units, u < n,
                units_per_row, vec)

  if num_programs * block_units >= num_units:  # a block per program at most: no loop
    block(pid)
    return
  blocks = (n + (block_units - 1)) // block_units  # n >= 0: floor division
  trips = (blocks - pid + (num_programs - 1)) // num_programs  # >= 0 as pid < P

  def step(i, carry):
    block(pid + i * num_programs)
    return carry

  jax.lax.fori_loop(jnp.int32(0), trips, step, jnp.int32(0))


def _copy_units(src_idx_ref, dst_idx_ref, src_ref, out_ref, u, listed, live,
                units_per_row: int, vec: int) -> None:
  # listed: units of the list's N pairs (their indices may be read); live: those below
  # the count (copied). dst_idx_ref None: each pair's destination is its own list row.
  src_rows, dst_rows = src_ref.shape[0], out_ref.shape[0]
  # u >= 0: truncating division is floor division, without jnp's sign fix-ups.
  row = jnp.where(listed, jax.lax.div(u, units_per_row), 0)
  col = jnp.where(listed, jax.lax.rem(u, units_per_row), 0)
  s = plgpu.load(src_idx_ref.at[row], mask=listed, other=-1)
  d = row if dst_idx_ref is None else plgpu.load(dst_idx_ref.at[row], mask=listed, other=-1)
  ok = live & (s >= 0) & (s < src_rows) & (d >= 0) & (d < dst_rows)
  cols = (col * vec)[:, None] + jnp.arange(vec, dtype=jnp.int32)[None, :]  # [U, vec]
  mask = ok[:, None]
  x = plgpu.load(src_ref.at[jnp.where(ok, s, 0)[:, None], cols], mask=mask)
  # Skipped units point one past the last row: masked on GPU, dropped when interpreted.
  plgpu.store(out_ref.at[jnp.where(ok, d, dst_rows)[:, None], cols], x, mask=mask)


def _launch_rows(operands: tuple, out_shape: jax.ShapeDtypeStruct, *, staged: bool,
                 count, idx_name: str, pools: tuple, pool_hint: str,
                 config: CopyRowsConfig, interpret: bool, name: str) -> jax.Array:
  """One launch of ``_rows_kernel`` over the ``N`` pairs of ``operands`` (index lists
  first, then the pools; the copy's destination last, aliased with the result), after
  the checks both forms share: byte pools of 2-4 GiB (named in ``pools``) on a GPU, and
  at most 2**31 units."""
  N, src = operands[0].shape[0], operands[1 if staged else 2]
  W = src.shape[1]
  if not interpret:
    for what, pool in pools:
      if byte_offsets_overflow(pool):  # wrong rows would be read
        raise ValueError(
            f"{what}: a pool of {pool.size} one-byte elements ({pool.size / 2**30:.2f} "
            "GiB): the Pallas row copy cannot index byte pools of 2-4 GiB (32-bit element "
            f"offsets); size {pool_hint} outside that range or use kernels.fetch='xla'")
  vec = unit_elements(W, src.dtype)
  units_per_row = W // vec
  num_units = N * units_per_row
  if num_units >= 2**31:
    raise ValueError(f"{idx_name}.shape[0]={N} rows of {units_per_row} units: more than "
                     "2**31 units per call (the kernel indexes them in int32); split the "
                     "call")
  num_programs = min(pl.cdiv(num_units, config.block_units), config.max_programs)
  kernel = functools.partial(_rows_kernel, staged=staged, counted=count is not None,
                             num_units=num_units, units_per_row=units_per_row, vec=vec,
                             block_units=config.block_units, num_programs=num_programs)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(num_programs,),
      in_specs=[any_spec] * (len(operands) + 1),
      out_specs=any_spec,
      input_output_aliases={} if staged else {len(operands): 0},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      name=name,
  )(_count_operand(count, N), *operands)


def _count_operand(count, N: int) -> jax.Array:
  """[1] int32: the pairs a launch looks at (``count``, default all ``N``)."""
  if count is None:
    return jnp.full((1,), N, jnp.int32)
  return jnp.clip(jnp.asarray(count, jnp.int32).reshape(1), 0, N)


def copy_rows_pallas(src: jax.Array, src_idx: jax.Array, dst: jax.Array, dst_idx: jax.Array,
                     *, count: jax.Array | None = None,
                     config: CopyRowsConfig = CopyRowsConfig(),
                     interpret: bool | None = None, name: str = "ula_copy_rows") -> jax.Array:
  """``dst[dst_idx[i]] = src[src_idx[i]]`` for in-range pairs ``i < count``, as one
  kernel launch of at most ``config.max_programs`` programs that loop over the blocks
  below ``count``.

  src: [Ss, W]; src_idx: [N] int32; dst: [Sd, W] same dtype (aliased with the result);
  dst_idx: [N] int32; count: [] int32 or None (every pair). Pools of any memory kind on
  GPU; device memory in interpret mode.
  returns dst: [Sd, W]
  """
  if interpret is None:
    interpret = default_interpret()
  if src_idx.shape[0] == 0 or src.shape[1] == 0 or src.shape[0] == 0 or dst.shape[0] == 0:
    return dst
  return _launch_rows((src_idx, dst_idx, src, dst), jax.ShapeDtypeStruct(dst.shape, dst.dtype),
                      staged=False, count=count, idx_name="src_idx",
                      pools=(("src", src), ("dst", dst)),
                      pool_hint="memory.device_pool / memory.host_pool", config=config,
                      interpret=interpret, name=name)


def stage_rows_pallas(pool: jax.Array, idx: jax.Array, *, count: jax.Array | None = None,
                      config: CopyRowsConfig = CopyRowsConfig(),
                      interpret: bool | None = None) -> jax.Array:
  """``out[i] = pool[idx[i]]`` for in-range indices ``i < count``, as one kernel launch
  (see ``stage_rows``): only those rows are read and written; the other rows of the
  fresh result are left as the allocation found them.

  pool: [S, W] device memory; idx: [N] int32; count: [] int32 or None (every index)
  returns out: [N, W] device memory
  """
  if interpret is None:
    interpret = default_interpret()
  N, W = idx.shape[0], pool.shape[1]
  if N == 0 or W == 0 or pool.shape[0] == 0:
    return jnp.zeros((N, W), pool.dtype)
  return _launch_rows((idx, pool), jax.ShapeDtypeStruct((N, W), pool.dtype), staged=True,
                      count=count, idx_name="idx", pools=(("pool", pool),),
                      pool_hint="memory.device_pool", config=config, interpret=interpret,
                      name="ula_stage_rows")


def fetch_rows_pallas(host_pool: jax.Array, host_idx: jax.Array, dev_pool: jax.Array,
                      dev_idx: jax.Array, *, count: jax.Array | None = None,
                      config: CopyRowsConfig = CopyRowsConfig(),
                      interpret: bool | None = None) -> jax.Array:
  """``dev_pool[dev_idx[i]] = host_pool[host_idx[i]]`` (see ``fetch_rows``).

  host_pool: [Sh, W] 'pinned_host' (read in place on GPU); host_idx: [N] int32
  dev_pool:  [Sd, W]; dev_idx: [N] int32
  returns dev_pool: [Sd, W]
  """
  if interpret is None:
    interpret = default_interpret()
  if interpret and is_host(host_pool):
    host_pool = compat.to_device(host_pool)
  return copy_rows_pallas(host_pool, host_idx, dev_pool, dev_idx, count=count,
                          config=config, interpret=interpret, name="ula_fetch_rows")


def evict_rows_pallas(dev_pool: jax.Array, dev_idx: jax.Array, host_pool: jax.Array,
                      host_idx: jax.Array, *, count: jax.Array | None = None,
                      config: CopyRowsConfig = CopyRowsConfig(),
                      interpret: bool | None = None) -> jax.Array:
  """``host_pool[host_idx[i]] = dev_pool[dev_idx[i]]`` (see ``evict_rows``).

  dev_pool:  [Sd, W]; dev_idx: [N] int32
  host_pool: [Sh, W] 'pinned_host' (written in place on GPU); host_idx: [N] int32
  returns host_pool: [Sh, W] in the memory it came from
  """
  if interpret is None:
    interpret = default_interpret()
  on_host = is_host(host_pool)
  if interpret and on_host:
    host_pool = compat.to_device(host_pool)
  out = copy_rows_pallas(dev_pool, dev_idx, host_pool, host_idx, count=count,
                         config=config, interpret=interpret, name="ula_evict_rows")
  # pallas_call types every result as device memory; the buffer is the aliased host pool.
  return compat.to_host(out) if on_host else out
