"""Benchmark: row fetch (pinned host -> device) and evict (device -> pinned host).

For each row layout (bf16 x 576 = 1152 B, the FP8 layout as 656 raw bytes), each count of
entries per call and each implementation, the rate of moved bytes is compared with a
contiguous copy of the same bytes between the same memory kinds, measured in the same
run; ``fraction`` = kernel GB/s / contiguous GB/s. Indices are random and distinct, the
host pool several times larger than one call. With ``--host-run R`` the host rows come in
runs of ``R`` adjacent rows (random runs, the device rows still at random): how ``ula``
reads and writes its host pool with ``memory.host_layout: entry_major``, where a layer
group's move copies each entry's ``R`` layers (``model.index_share``) as one stretch of
host memory. ``in place`` says whether the compiled
module leaves the host pool where it is (no whole-pool copy in the HLO); ``ok`` whether
the moved rows are bit-exact (checked against destinations changed before every check).

Each kernel call is a jitted program; a stream of programs pays XLA's launch of a program
between copies (a few us, and more where the host's dispatch falls behind a short copy),
which a copy inside a serving step does not. ``--copies-per-call R`` makes each call one
program of ``R`` copies in a row (each on the previous one's destination), so the figure
per copy is the kernel's as a step runs it: a call's time / ``R``. (The Pallas and FFI
launches are opaque to XLA, so each of them runs; the ``xla`` form's gather of the same
rows may be computed once, so its figure per copy is not comparable.) The ceilings stay
streams of copies.

The contiguous copy ("the ceiling") is measured two ways, and the faster one counts:

* ``contiguous[jax]``: a jitted copy of an [N, W] array into an existing buffer of the
  other memory kind (the destination is donated and aliased, so nothing is allocated per
  call: a ``device_put`` to ``pinned_host`` allocates pinned memory every time and runs
  far below the link);
* ``contiguous[memcpy]``: ``cudaMemcpyAsync`` between preallocated pinned host and device
  buffers on one stream (through CuPy; GPU only, when CuPy is installed).

Every measurement is repeated ``--reps`` times, interleaved (ceilings and kernels take
turns, so a drift of the machine hits all of them alike). ``fraction`` compares the
fastest repetition of each side, ``median fraction`` the medians.

    ula-jax bench fetch [--entries 64,1K,64K] [--impls xla,pallas,ffi] [--host-run 4]
                        [--copies-per-call 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.core import compat
from ula_jax.bench import common
from ula_jax.bench.common import (add_timing_args, best_and_median, environment, fmt,
                                  parse_list, parse_sizes, time_calls, write_json)
from ula_jax.kernels.fetch import evict_rows, fetch_rows
from ula_jax.kernels.fetch import ffi as fetch_ffi
from ula_jax.kernels.fetch.hlo import pool_materializations
from ula_jax.kernels.fetch.pallas import CopyRowsConfig
from ula_jax.memory.base import device_zeros

# bf16x576 and fp8x656: the MLA entry's two layouts; u8x640 and u8x768: rows of whole
# 128-byte lines (5 and 6), the alignment controls of the 656-byte row (which spans 6).
LAYOUTS = {"bf16x576": (jnp.bfloat16, 576), "fp8x656": (jnp.uint8, 656),
           "u8x640": (jnp.uint8, 640), "u8x768": (jnp.uint8, 768)}
IMPLS = ("xla", "pallas", "ffi")
DIRECTIONS = ("fetch", "evict")
CEILINGS = ("jax", "memcpy")
CEILING = "contiguous"  # impl label prefix of the ceiling rows: contiguous[jax], ...


@dataclasses.dataclass
class Row:
  direction: str
  layout: str
  row_bytes: int
  entries: int
  impl: str
  seconds: float | None = None  # fastest repetition
  median_seconds: float | None = None
  reps: int = 0
  gbps: float | None = None
  baseline_gbps: float | None = None  # the fastest ceiling (fastest repetitions)
  baseline: str | None = None  # which ceiling that was
  fraction: float | None = None
  median_fraction: float | None = None
  in_place: bool | None = None  # kernels: no whole-pool copy; ceilings: no allocation
  ok: bool | None = None
  error: str | None = None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench fetch", description=__doc__.split("\n\n")[0])
  p.add_argument("--entries", default="64,256,1K,4K,16K,64K",
                 help="entries per call, comma list (K = 1024)")
  p.add_argument("--layouts", default="bf16x576,fp8x656",
                 help=f"comma list of {list(LAYOUTS)}")
  p.add_argument("--impls", default=",".join(IMPLS), help=f"of {list(IMPLS)}")
  p.add_argument("--directions", default=",".join(DIRECTIONS), help=f"of {list(DIRECTIONS)}")
  p.add_argument("--ceilings", default=",".join(CEILINGS),
                 help=f"contiguous-copy measurements, of {list(CEILINGS)}")
  p.add_argument("--host-rows", type=int, default=None,
                 help="rows of the host pool (default: 4 x the largest entry count)")
  p.add_argument("--device-rows", type=int, default=None,
                 help="rows of the device pool (default: the largest entry count); with "
                      "--no-check it is filled in place, so it can be as large as a "
                      "serving run's")
  p.add_argument("--pallas-block-units", default="1024",
                 help="Pallas sweep: 16-byte units per program, comma list")
  p.add_argument("--pallas-warps", default="4", help="Pallas sweep: warps per program")
  p.add_argument("--pallas-programs", default=str(CopyRowsConfig().max_programs),
                 help="Pallas sweep: programs per launch at most, comma list")
  p.add_argument("--list-factor", type=int, default=1,
                 help="index lists F times the entries long, the entries first and a "
                      "count naming them (as a plan sized for the worst case passes "
                      "them); 1: lists of the entries alone, no count")
  p.add_argument("--host-run", type=int, default=1,
                 help="host rows in runs of R adjacent rows (an entry's R layers of a "
                      "group, as ula moves them with memory.host_layout=entry_major); "
                      "1: every host row at random")
  p.add_argument("--fresh-rows", action="store_true",
                 help="each copy of a call moves its own host rows (--copies-per-call "
                      "lists, no row in two), so the GPU's translation of the host pool's "
                      "pages is not warm from the copy before, as in a serving step whose "
                      "misses are new rows; 4K rows x 16 copies touch 64K pages")
  p.add_argument("--copies-per-call", type=int, default=1,
                 help="copies in one jitted program, each on the previous one's "
                      "destination (times are per copy: the kernels as a step runs them, "
                      "without a program launch between copies); 1: a program a copy")
  add_timing_args(p, max_iters=500, target_ms=100.0)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-check", action="store_true",
                 help="skip the bit-exactness checks; the host pool is then filled in "
                      "place by host compute with no copy of it in this process's memory, "
                      "so it can be as large as a serving run's (100 GiB: --host-rows 163840000)")
  p.add_argument("--out", default="runs/bench/fetch.json", help="JSON output path")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes and few iterations (smoke test, e.g. on CPU)")
  return p


def _shardings() -> tuple[jax.sharding.Sharding, jax.sharding.Sharding]:
  dev = jax.devices()[0]
  return (jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"),
          jax.sharding.SingleDeviceSharding(dev, memory_kind="device"))


def _random_pool(rng: np.random.Generator, rows: int, dtype, width: int) -> np.ndarray:
  # Finite values for float dtypes: XLA on CPU may pass bf16 through float32, which keeps
  # every finite value but not NaN payloads, and copies are compared bit for bit.
  if jnp.issubdtype(dtype, jnp.floating):
    return rng.standard_normal((rows, width), dtype=np.float32).astype(dtype)
  return rng.integers(0, 256, (rows, width), dtype=np.uint8).astype(dtype)


def _filled_pool(sharding: jax.sharding.Sharding, shape: tuple[int, int], dtype
                 ) -> jax.Array:
  """A pool of ``shape`` filled with 0x5A where ``sharding`` (one device) puts it, as the
  memory systems create theirs (``memory.base.device_zeros``: a ``pinned_host`` pool by
  host compute): no staging buffer and no copy of its size in this process's memory, so
  it can be as large as a serving run's."""
  mesh = jax.sharding.Mesh(np.asarray(list(sharding.device_set)), ("dp",))
  return device_zeros(mesh, shape, dtype, sharding.memory_kind, fill=0x5A,
                      spec=jax.sharding.PartitionSpec())


def _impls(names: list[str], args) -> list[tuple[str, str, dict]]:
  """(label, impl, kwargs) for every implementation and Pallas configuration."""
  out = []
  for name in names:
    if name != "pallas":
      out.append((name, name, {}))
      continue
    units = parse_sizes(args.pallas_block_units)
    warps = parse_sizes(args.pallas_warps)
    programs = parse_sizes(args.pallas_programs)
    for u, w, p in itertools.product(units, warps, programs):
      if len(units) * len(warps) * len(programs) == 1:
        label = "pallas"
      else:
        label = f"pallas[u{u},w{w}]" + (f"[p{p}]" if len(programs) > 1 else "")
      out.append((label, "pallas",
                  {"config": CopyRowsConfig(block_units=u, num_warps=w, max_programs=p)}))
  return out


def _call(direction: str, impl: str, kwargs: dict, count: int | None = None):
  """The copy of ``direction`` through ``impl``; ``count``: pairs the lists hold first
  (passed as the kernels' ``count`` operand), or None (every pair)."""
  if count is not None:
    kwargs = {**kwargs, "count": jnp.int32(count)}
  if impl == "pallas":
    from ula_jax.kernels.fetch.pallas import evict_rows_pallas, fetch_rows_pallas
    fn = fetch_rows_pallas if direction == "fetch" else evict_rows_pallas
    return functools.partial(fn, **kwargs)
  fn = fetch_rows if direction == "fetch" else evict_rows
  return functools.partial(fn, impl=impl, **kwargs)


def _repeated(copy: Callable, copies: int, lists_arg: int | None = None) -> Callable:
  """``copy(src, src_idx, dst, dst_idx) -> dst`` ``copies`` times in a row, each on the
  previous one's result (so none can be dropped or merged). ``lists_arg`` (1: src_idx,
  3: dst_idx): that index argument is [copies, n], one list a copy."""
  if copies == 1 and lists_arg is None:
    return copy

  def run(*args):
    dst = args[2]
    for c in range(copies):
      a = list(args)
      a[2] = dst
      if lists_arg is not None:
        a[lists_arg] = args[lists_arg][c]
      dst = copy(*a)
    return dst

  return run


def host_indices(rng: np.random.Generator, rows: int, n: int, run: int) -> np.ndarray:
  """``n`` distinct rows of a pool of ``rows``: ``n // run`` random runs of ``run``
  adjacent rows (runs start at multiples of ``run``), each run's rows in order."""
  starts = rng.choice(rows // run, n // run, replace=False) * run
  return (starts[:, None] + np.arange(run)[None, :]).reshape(n).astype(np.int32)


def _bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
  return a.shape == b.shape and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def rows_of(pool: jax.Array, idx: np.ndarray, device: jax.sharding.Sharding) -> np.ndarray:
  """``pool[idx]`` as numpy, read through a device copy of the pool.

  ``np.asarray(pool)`` would cache a view of the pool's buffer on the array (an external
  reference), after which donating the pool fails ("Donation requested for buffer with
  external reference"). Here numpy only sees a temporary.
  """
  moved = pool if pool.sharding.memory_kind == "device" else jax.device_put(pool, device)
  return np.asarray(jnp.take(moved, jnp.asarray(idx), axis=0))


def _buffer_pointer(x: jax.Array) -> int | None:
  try:
    return x.unsafe_buffer_pointer()
  except Exception:  # not every backend/memory kind exposes it
    return None


def _jax_ceiling(direction: str, block: np.ndarray, host_s, dev_s, timing: dict):
  """A jitted contiguous copy into a donated (hence reused) buffer of the other kind.

  returns (run one repetition -> seconds, whether the output reused the buffer)
  """
  src_s, dst_s = (host_s, dev_s) if direction == "fetch" else (dev_s, host_s)
  space = compat.DEVICE if direction == "fetch" else compat.HOST
  src = jax.device_put(block, src_s)
  # keep_unused: the destination is only there to be donated and aliased to the output.
  copy = jax.jit(lambda dst, src: jax.device_put(src, space), donate_argnums=0,
                 keep_unused=True, out_shardings=dst_s)
  # The first call's output is the buffer every later call reuses (the first input may
  # alias numpy memory on some backends, which cannot be donated).
  state = {"dst": copy(jax.device_put(np.zeros_like(block), dst_s), src)}
  before = _buffer_pointer(state["dst"])
  state["dst"] = copy(state["dst"], src)
  after = _buffer_pointer(state["dst"])
  reused = None if before is None or after is None else before == after

  def run() -> float:
    t, state["dst"] = time_calls(lambda d: copy(d, src), state["dst"], **timing)
    return t

  return run, reused


def memcpy_stream(direction: str, nbytes: int):
  """One ``cudaMemcpyAsync`` of ``nbytes`` between preallocated pinned host and device
  buffers (CuPy), host -> device for ``fetch``, device -> host for ``evict``.

  returns (issue one copy on the stream, the CuPy stream); the buffers live as long as
  the first; raises RuntimeError where it cannot run
  """
  if jax.default_backend() != "gpu":
    raise RuntimeError(f"needs a CUDA GPU (backend {jax.default_backend()!r})")
  try:
    import cupy
  except ImportError as e:
    raise RuntimeError(f"CuPy is not installed ({e})") from None
  host = cupy.cuda.alloc_pinned_memory(nbytes)
  dev = cupy.cuda.alloc(nbytes)
  stream = cupy.cuda.Stream(non_blocking=True)
  rt = cupy.cuda.runtime
  if direction == "fetch":
    dst, src, kind = dev.ptr, host.ptr, rt.memcpyHostToDevice
  else:
    dst, src, kind = host.ptr, dev.ptr, rt.memcpyDeviceToHost

  def issue(_keep=(host, dev)) -> None:  # the buffers live as long as this function
    rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)

  return issue, stream


def _memcpy_ceiling(direction: str, nbytes: int, timing: dict):
  """A stream of ``memcpy_stream`` copies, timed by the host.

  returns run one repetition -> seconds; raises RuntimeError where it cannot run
  """
  issue, stream = memcpy_stream(direction, nbytes)

  def run() -> float:
    t, _ = time_calls(lambda _: issue(), None, wait=lambda _: stream.synchronize(),
                      **timing)
    return t

  return run


@dataclasses.dataclass
class _Measured:
  row: Row
  run: Callable[[], float]
  times: list[float] = dataclasses.field(default_factory=list)


def run(args, checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Measures everything ``args`` asks for; ``checkpoint`` gets the partial result after
  every entry count (so a run cut short still leaves its measurements)."""
  entries = parse_sizes(args.entries)
  layouts = parse_list(args.layouts, LAYOUTS, flag="--layouts")
  names = parse_list(args.impls, IMPLS, flag="--impls")
  directions = parse_list(args.directions, DIRECTIONS, flag="--directions")
  ceilings = parse_list(args.ceilings, CEILINGS, flag="--ceilings")
  if args.reps < 1:
    raise ValueError(f"--reps={args.reps}: expected >= 1")
  if args.list_factor < 1:
    raise ValueError(f"--list-factor={args.list_factor}: expected >= 1")
  if args.host_run < 1:
    raise ValueError(f"--host-run={args.host_run}: expected >= 1")
  if args.copies_per_call < 1:
    raise ValueError(f"--copies-per-call={args.copies_per_call}: expected >= 1")
  lists = args.copies_per_call if args.fresh_rows else 1  # host row lists a call
  bad = [n for n in entries if n % args.host_run]
  if bad:
    raise ValueError(f"--entries {bad}: with --host-run={args.host_run} every entry count "
                     "must be a multiple of the run")
  skipped: dict[str, str] = {}
  if "ffi" in names and not fetch_ffi.available():
    names = [n for n in names if n != "ffi"]
    skipped["ffi"] = "ula_jax_ffi is not installed or lacks this platform's handlers"
  impls = _impls(names, args)
  host_s, dev_s = _shardings()
  rng = np.random.default_rng(args.seed)
  max_n = max(entries) if entries else 0
  Sh = args.host_rows or max(4 * max_n, 1)
  Sh = max(Sh - Sh % args.host_run, args.host_run)  # whole runs
  Sd = args.device_rows or max(max_n, 1)
  if Sd < max_n:
    raise ValueError(f"--device-rows={Sd}: expected at least the largest entry count "
                     f"({max_n})")
  timing = dict(min_iters=args.min_iters, max_iters=args.max_iters,
                target_s=args.target_ms / 1e3, warmup=args.warmup)
  rows: list[Row] = []

  def result() -> dict[str, Any]:
    return {"benchmark": "fetch", "environment": environment(), "host_rows": Sh,
            "list_factor": args.list_factor, "host_run": args.host_run,
            "copies_per_call": args.copies_per_call, "fresh_rows": args.fresh_rows,
            "device_rows": Sd, "reps": args.reps, "skipped": skipped,
            "rows": [dataclasses.asdict(r) for r in rows]}

  for layout in layouts:
    dtype, W = LAYOUTS[layout]
    row_bytes = W * jnp.dtype(dtype).itemsize
    # numpy mirrors of both pools: kept equal to them by applying every copy here too.
    # Without checks the host pool has no mirror: it is filled where it lives.
    # A device pool of --device-rows has no mirror either (filled on the device).
    mirror = {"host": None if args.no_check else _random_pool(rng, Sh, dtype, W),
              "dev": (None if args.no_check and args.device_rows
                      else _random_pool(rng, Sd, dtype, W))}

    def host_pool():
      if mirror["host"] is None:
        return _filled_pool(host_s, (Sh, W), dtype)
      return jax.device_put(mirror["host"], host_s)

    def dev_pool():
      if mirror["dev"] is None:
        return _filled_pool(dev_s, (Sd, W), dtype)
      return jax.device_put(mirror["dev"], dev_s)

    pools = {"host": host_pool(), "dev": dev_pool()}

    def rebuild():
      # A failed donated call may have consumed a pool: both come back from the mirrors.
      pools["host"] = host_pool()
      pools["dev"] = dev_pool()

    for N in entries:
      if lists * N > Sh:
        raise ValueError(f"--host-rows={Sh}: {lists} lists of {N} distinct rows "
                         "(--fresh-rows) need at least their number")
      # [N], or with --fresh-rows [copies, N]: one list a copy, no row in two.
      h_idx = host_indices(rng, Sh, lists * N, args.host_run)
      h_idx = h_idx.reshape(lists, N) if args.fresh_rows else h_idx
      d_idx = (rng.permutation(Sd)[:N] if args.device_rows is None
               else rng.choice(Sd, N, replace=False)).astype(np.int32)
      # With --list-factor F: lists of F * N entries, the N pairs first and skipped
      # (-1) ones after them, and a count of N (a worst-case plan's lists).
      pad = np.full((args.list_factor - 1) * N, -1, np.int32)
      hi = jax.device_put(np.concatenate(
          [h_idx, np.broadcast_to(pad, (*h_idx.shape[:-1], len(pad)))], axis=-1), dev_s)
      di = jax.device_put(np.concatenate([d_idx, pad]), dev_s)
      count = None if args.list_factor == 1 else N
      nbytes = N * row_bytes
      for direction in directions:
        measured: list[_Measured] = []
        if N:
          source = mirror["host" if direction == "fetch" else "dev"]
          block = source[:N] if source is not None else _random_pool(rng, N, dtype, W)
          for method in ceilings:
            row = Row(direction, layout, row_bytes, N, f"{CEILING}[{method}]")
            try:
              if method == "jax":
                fn, row.in_place = _jax_ceiling(direction, block, host_s, dev_s, timing)
              else:
                fn = _memcpy_ceiling(direction, nbytes, timing)
            except RuntimeError as e:
              skipped[f"{CEILING}[{method}]"] = str(e)
              continue
            except Exception as e:  # keep measuring the others; the table shows the error
              row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rows.append(row)
            if row.error is None:
              measured.append(_Measured(row, fn))
        dst_key = "dev" if direction == "fetch" else "host"
        for label, impl, kwargs in impls:
          row = Row(direction, layout, row_bytes, N, label)
          rows.append(row)
          try:
            lists_arg = None if not args.fresh_rows else 1 if direction == "fetch" else 3
            fn = jax.jit(_repeated(_call(direction, impl, kwargs, count),
                                   args.copies_per_call, lists_arg), donate_argnums=2)
            if direction == "fetch":
              args_of = lambda state: (pools["host"], hi, state, di)
            else:
              args_of = lambda state: (pools["dev"], di, state, hi)
            compiled = fn.lower(*args_of(pools[dst_key])).compile()  # compiled once, timed as is
            if impl != "xla":
              row.in_place = not pool_materializations(compiled.as_text(), (Sh, W))
            if not args.no_check:
              row.ok = _check(direction, compiled, args_of, pools, mirror, h_idx, d_idx,
                              dev_s)
          except Exception as e:
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rebuild()
            continue

          def one_rep(compiled=compiled, args_of=args_of, dst_key=dst_key) -> float:
            t, pools[dst_key] = time_calls(lambda s: compiled(*args_of(s)), pools[dst_key],
                                           **timing)
            return t / args.copies_per_call

          measured.append(_Measured(row, one_rep))
        _repeat(measured, args.reps, timing["target_s"], rebuild)
        _fractions([m.row for m in measured], [m.times for m in measured], nbytes)
      if checkpoint is not None:
        checkpoint(result())
    del pools
  return result()


def _check(direction: str, compiled, args_of, pools: dict, mirror: dict, h_idx: np.ndarray,
           d_idx: np.ndarray, dev_s) -> bool:
  """One call after changing what it must overwrite (so a call that copies nothing is
  caught even when an earlier implementation already moved the same rows); returns
  whether the destination rows are bit-exact. Updates the pools and their mirrors.
  ``h_idx`` [N], or [copies, N] with one list a copy (the last fetch's rows stay; every
  evict's rows are written)."""
  lists = 1 if h_idx.ndim == 1 else h_idx.shape[0]
  if direction == "fetch":
    # Poison the destination rows of the device pool.
    dev = mirror["dev"].copy()
    dev.view(np.uint8).reshape(dev.shape[0], -1)[d_idx] = 0xA5
    out = compiled(*args_of(jax.device_put(dev, dev_s)))
    want = mirror["host"][h_idx if lists == 1 else h_idx[-1]]
    mirror["dev"][d_idx] = want
    pools["dev"] = out
  else:
    # New source rows in the device pool: flip the lowest bit of every element (floats
    # stay finite and normal, so no backend can alter them on the way).
    dev = mirror["dev"].copy()
    dev.view(np.uint8).reshape(dev.shape[0], -1)[d_idx, ::dev.dtype.itemsize] ^= 1
    mirror["dev"] = dev
    pools["dev"] = jax.device_put(dev, dev_s)
    out = compiled(*args_of(pools["host"]))
    want = np.concatenate([dev[d_idx]] * lists)
    mirror["host"][h_idx.reshape(-1)] = want
    pools["host"] = out
  got = rows_of(out, d_idx if direction == "fetch" else h_idx.reshape(-1), dev_s)
  return _bytes_equal(got, want)


def _repeat(measured: list[_Measured], reps: int, target_s: float, rebuild) -> None:
  """Runs every measurement ``reps`` times, taking turns. One whose repetition already
  lasts longer than ``target_s`` per call (a slow fallback) is not repeated."""
  for rep in range(reps):
    for m in measured:
      if m.row.error is not None or (rep and m.times and m.times[0] > target_s):
        continue
      try:
        m.times.append(m.run())
      except Exception as e:  # keep measuring the others; the table shows the error
        m.row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        rebuild()


def _fractions(rows: list[Row], times: list[list[float]], nbytes: int) -> None:
  """Fills the rates and the fractions of the fastest ceiling, best and median."""
  rate = lambda t: nbytes / t / 1e9 if nbytes and t else None
  best_ceiling: tuple[float, str] | None = None
  median_ceiling: float | None = None
  for row, ts in zip(rows, times):
    row.seconds, row.median_seconds = best_and_median(ts)
    row.reps = len(ts)
    row.gbps = rate(row.seconds)
    if row.impl.startswith(CEILING) and row.gbps:
      if best_ceiling is None or row.gbps > best_ceiling[0]:
        best_ceiling = (row.gbps, row.impl)
      median_ceiling = max(median_ceiling or 0.0, rate(row.median_seconds))
  for row in rows:
    if best_ceiling is None or row.gbps is None:
      continue
    row.baseline_gbps, row.baseline = best_ceiling
    row.fraction = row.gbps / best_ceiling[0]
    row.median_fraction = rate(row.median_seconds) / median_ceiling


def print_table(result: dict) -> None:
  env = result["environment"]
  yes_no = {True: "yes", False: "NO", None: "-"}
  cells = []
  for r in result["rows"]:
    us = None if r["seconds"] is None else r["seconds"] * 1e6
    cells.append([r["direction"], r["layout"], str(r["entries"]), r["impl"], fmt(us, 1),
                  fmt(r["gbps"]), fmt(r["baseline_gbps"]), fmt(r["fraction"]),
                  fmt(r["median_fraction"]), yes_no[r["in_place"]],
                  "ERROR" if r["error"] else yes_no[r["ok"]]])
  common.print_table(
      f"row fetch/evict on {env['device']} ({env['backend']}, jax {env['jax']}); "
      f"host pool {result['host_rows']} rows"
      + (f" in runs of {result['host_run']}" if result.get("host_run", 1) > 1 else "")
      + (f"; kernels {result['copies_per_call']} copies a program (times per copy)"
         if result.get("copies_per_call", 1) > 1 else "")
      + ("; each copy its own host rows" if result.get("fresh_rows") else "")
      + f"; best of {result['reps']} repetitions",
      ("dir", "layout", "entries", "impl", "us/call", "GB/s", "ceiling GB/s", "fraction",
       "median frac", "in place", "ok"), cells, left=("dir", "layout", "impl"))
  for r in result["rows"]:
    if r["error"]:
      print(f"error: {r['direction']} {r['layout']} N={r['entries']} {r['impl']}: {r['error']}")
  for name, why in result["skipped"].items():
    print(f"skipped {name}: {why}")


def main(argv: list[str]) -> int:
  """Runs the fetch/evict benchmark; returns 0, or 1 when a measurement failed or a copy
  was not bit-exact."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.quick:  # smaller defaults; explicit flags still win
    quick = dict(entries="0,1,300", host_rows=1024, reps=2, min_iters=1, max_iters=2,
                 target_ms=1.0, warmup=1)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  result = run(args, checkpoint=lambda partial: write_json(args.out, partial))
  print_table(result)
  path = write_json(args.out, result)
  print(f"wrote {path}")
  bad = [r for r in result["rows"] if r["error"] or r["ok"] is False]
  return 1 if bad else 0
