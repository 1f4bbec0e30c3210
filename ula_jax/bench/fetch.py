"""Benchmark: row fetch (pinned host -> device) and evict (device -> pinned host).

For each row layout (bf16 x 576 = 1152 B, the FP8 layout as 656 raw bytes), each count of
entries per call and each implementation, the rate of moved bytes is compared with a
contiguous copy of the same bytes in the same run (``jax.device_put`` of an [N, W] array
between memory kinds): ``fraction`` = kernel GB/s / contiguous GB/s. Indices are random
and distinct, the host pool several times larger than one call. ``in place`` says whether
the compiled module leaves the host pool where it is (no whole-pool copy in the HLO);
``ok`` whether the moved rows are bit-exact.

    ula-jax bench fetch [--entries 64,1K,64K] [--impls xla,pallas,ffi] [--out FILE]
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

from ula_jax.bench import common
from ula_jax.bench.common import (environment, fmt, parse_list, parse_sizes, time_calls,
                                  write_json)
from ula_jax.kernels.fetch import evict_rows, fetch_rows
from ula_jax.kernels.fetch import ffi as fetch_ffi
from ula_jax.kernels.fetch.hlo import pool_materializations
from ula_jax.kernels.fetch.pallas import CopyRowsConfig

LAYOUTS = {"bf16x576": (jnp.bfloat16, 576), "fp8x656": (jnp.uint8, 656)}
IMPLS = ("xla", "pallas", "ffi")
DIRECTIONS = ("fetch", "evict")


@dataclasses.dataclass
class Row:
  direction: str
  layout: str
  row_bytes: int
  entries: int
  impl: str
  seconds: float | None = None
  gbps: float | None = None
  baseline_gbps: float | None = None
  fraction: float | None = None
  in_place: bool | None = None  # None: not checked (the xla path gathers on the host)
  ok: bool | None = None
  error: str | None = None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench fetch", description=__doc__.split("\n\n")[0])
  p.add_argument("--entries", default="64,256,1K,4K,16K,64K",
                 help="entries per call, comma list (K = 1024)")
  p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {list(LAYOUTS)}")
  p.add_argument("--impls", default=",".join(IMPLS), help=f"of {list(IMPLS)}")
  p.add_argument("--directions", default=",".join(DIRECTIONS), help=f"of {list(DIRECTIONS)}")
  p.add_argument("--host-rows", type=int, default=None,
                 help="rows of the host pool (default: 4 x the largest entry count)")
  p.add_argument("--pallas-block-units", default="1024",
                 help="Pallas sweep: 16-byte units per program, comma list")
  p.add_argument("--pallas-warps", default="4", help="Pallas sweep: warps per program")
  p.add_argument("--min-iters", type=int, default=5)
  p.add_argument("--max-iters", type=int, default=500)
  p.add_argument("--target-ms", type=float, default=200.0,
                 help="time each measurement for about this long")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-check", action="store_true", help="skip the bit-exactness checks")
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


def _impls(names: list[str], args) -> list[tuple[str, str, dict]]:
  """(label, impl, kwargs) for every implementation and Pallas configuration."""
  out = []
  for name in names:
    if name != "pallas":
      out.append((name, name, {}))
      continue
    units = parse_sizes(args.pallas_block_units)
    warps = parse_sizes(args.pallas_warps)
    for u, w in itertools.product(units, warps):
      label = "pallas" if len(units) * len(warps) == 1 else f"pallas[u{u},w{w}]"
      out.append((label, "pallas", {"config": CopyRowsConfig(block_units=u, num_warps=w)}))
  return out


def _call(direction: str, impl: str, kwargs: dict):
  if impl == "pallas":
    from ula_jax.kernels.fetch.pallas import evict_rows_pallas, fetch_rows_pallas
    fn = fetch_rows_pallas if direction == "fetch" else evict_rows_pallas
    return functools.partial(fn, **kwargs)
  fn = fetch_rows if direction == "fetch" else evict_rows
  return functools.partial(fn, impl=impl)


def _bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
  return a.shape == b.shape and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def run(args, checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Measures everything ``args`` asks for; ``checkpoint`` gets the partial result after
  every entry count (so a run cut short still leaves its measurements)."""
  entries = parse_sizes(args.entries)
  layouts = parse_list(args.layouts, LAYOUTS, flag="--layouts")
  names = parse_list(args.impls, IMPLS, flag="--impls")
  directions = parse_list(args.directions, DIRECTIONS, flag="--directions")
  if "ffi" in names and not fetch_ffi.available():
    names = [n for n in names if n != "ffi"]
    skipped = {"ffi": "ula_jax_ffi is not installed or lacks this platform's handlers"}
  else:
    skipped = {}
  impls = _impls(names, args)
  host_s, dev_s = _shardings()
  rng = np.random.default_rng(args.seed)
  max_n = max(entries) if entries else 0
  Sh = args.host_rows or max(4 * max_n, 1)
  Sd = max(max_n, 1)
  timing = dict(min_iters=args.min_iters, max_iters=args.max_iters,
                target_s=args.target_ms / 1e3, warmup=args.warmup)
  rows: list[Row] = []

  def result() -> dict[str, Any]:
    return {"benchmark": "fetch", "environment": environment(), "host_rows": Sh,
            "device_rows": Sd, "skipped": skipped,
            "rows": [dataclasses.asdict(r) for r in rows]}

  for layout in layouts:
    dtype, W = LAYOUTS[layout]
    row_bytes = W * jnp.dtype(dtype).itemsize
    host_np = _random_pool(rng, Sh, dtype, W)
    dev_np = _random_pool(rng, Sd, dtype, W)
    host = jax.device_put(host_np, host_s)
    dev = jax.device_put(dev_np, dev_s)
    for N in entries:
      h_idx = rng.choice(Sh, N, replace=False).astype(np.int32)
      d_idx = rng.permutation(Sd)[:N].astype(np.int32)
      hi, di = jax.device_put(h_idx, dev_s), jax.device_put(d_idx, dev_s)
      nbytes = N * row_bytes
      for direction in directions:
        # The contiguous copy of the same bytes, between the same memory kinds.
        if direction == "fetch":
          block = jax.device_put(host_np[:N], host_s)
          t_base, _ = time_calls(lambda _: jax.device_put(block, dev_s), None, **timing)
        else:
          block = jax.device_put(dev_np[:N], dev_s)
          t_base, _ = time_calls(lambda _: jax.device_put(block, host_s), None, **timing)
        base_gbps = nbytes / t_base / 1e9 if N else None
        rows.append(Row(direction, layout, row_bytes, N, "contiguous copy", t_base, base_gbps,
                        base_gbps, 1.0 if N else None))
        for label, impl, kwargs in impls:
          row = Row(direction, layout, row_bytes, N, label, baseline_gbps=base_gbps)
          rows.append(row)
          try:
            fn = jax.jit(_call(direction, impl, kwargs), donate_argnums=2)
            if direction == "fetch":
              args_of = lambda state: (host, hi, state, di)
              state = dev
            else:
              args_of = lambda state: (dev, di, state, hi)
              state = host
            compiled = fn.lower(*args_of(state)).compile()  # compiled once, timed as is
            if impl != "xla":
              row.in_place = not pool_materializations(compiled.as_text(), (Sh, W))
            t, state = time_calls(lambda s: compiled(*args_of(s)), state, **timing)
            if direction == "fetch":
              dev = state
            else:
              host = state
            row.seconds = t
            row.gbps = nbytes / t / 1e9 if N else None
            row.fraction = row.gbps / base_gbps if N and base_gbps else None
            if not args.no_check:
              if direction == "fetch":
                row.ok = _bytes_equal(np.asarray(dev)[d_idx], host_np[h_idx])
              else:
                row.ok = _bytes_equal(np.asarray(host)[h_idx], np.asarray(dev)[d_idx])
              host_np = np.asarray(host) if direction == "evict" else host_np
          except Exception as e:  # keep measuring the others; the table shows the error
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            # A failed donated call may have consumed the pool: rebuild both.
            host = jax.device_put(host_np, host_s)
            dev = jax.device_put(dev_np, dev_s)
      # Evict wrote device rows into the host pool; the numpy mirror follows it.
      if "evict" in directions:
        host_np = np.asarray(host)
      dev_np = np.asarray(dev)
      if checkpoint is not None:
        checkpoint(result())
    del host, dev
  return result()


def print_table(result: dict) -> None:
  env = result["environment"]
  yes_no = {True: "yes", False: "NO", None: "-"}
  cells = []
  for r in result["rows"]:
    us = None if r["seconds"] is None else r["seconds"] * 1e6
    cells.append([r["direction"], r["layout"], str(r["entries"]), r["impl"], fmt(us, 1),
                  fmt(r["gbps"]), fmt(r["baseline_gbps"]), fmt(r["fraction"]),
                  yes_no[r["in_place"]], yes_no[r["ok"]] if not r["error"] else "ERROR"])
  common.print_table(
      f"row fetch/evict on {env['device']} ({env['backend']}, jax {env['jax']}); "
      f"host pool {result['host_rows']} rows",
      ("dir", "layout", "entries", "impl", "us/call", "GB/s", "contig GB/s", "fraction",
       "in place", "ok"), cells, left=("dir", "layout", "impl"))
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
    quick = dict(entries="0,1,300", host_rows=1024, min_iters=1, max_iters=2, target_ms=1.0,
                 warmup=1)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  result = run(args, checkpoint=lambda partial: write_json(args.out, partial))
  print_table(result)
  path = write_json(args.out, result)
  print(f"wrote {path}")
  bad = [r for r in result["rows"] if r["error"] or r["ok"] is False]
  return 1 if bad else 0
