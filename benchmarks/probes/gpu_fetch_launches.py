"""Where a row copy's fixed cost goes: the Pallas fetch (pinned host -> device) and evict
(device -> pinned host) launch by launch under the profiler, beside ``cudaMemcpyAsync``
of the same bytes timed with CUDA events, for each row layout and row count.

For each (layout, direction, rows) a stream of ``--calls`` back-to-back jitted calls runs
under ``jax.profiler``; from the trace come each launch's device duration and the
device's idle time before it, and the stream's device span per call (first start to last
end, over the calls). The memcpy's stream is timed with CUDA events around the same
number of calls (CuPy). A straight line through the row counts (time = fixed + rows x
per-row) separates each side's fixed cost from its per-row cost.

    PYTHONPATH=. python benchmarks/probes/gpu_fetch_launches.py --out launches.json \
        [--layouts fp8x656,u8x640,u8x768] [--entries 1K,2K,4K,8K,16K,64K] [--host-run 4]

GPU only (the trace needs device lines, the memcpy CuPy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.bench import profile
from ula_jax.bench.common import environment, parse_sizes
from ula_jax.bench.fetch import LAYOUTS, host_indices, memcpy_stream
from ula_jax.kernels.fetch.pallas import evict_rows_pallas, fetch_rows_pallas


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
  """(intercept, slope) of the least-squares line."""
  slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
  return float(intercept), float(slope)


def _memcpy_us(direction: str, nbytes: int, calls: int) -> float:
  """us per copy of a stream of ``calls`` memcpys, timed by CUDA events (best of 3)."""
  import cupy
  issue, stream = memcpy_stream(direction, nbytes)
  best = float("inf")
  for _ in range(3):
    for _ in range(3):
      issue()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(calls):
      issue()
    end.record(stream)
    end.synchronize()
    best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls)
  return best


def _kernel_launches(direction: str, host, dev, hi, di, calls: int):
  """(launches of the stream's kernel, device span per call in us, the final pools)."""
  if direction == "fetch":
    fn = jax.jit(fetch_rows_pallas, donate_argnums=2)
    step = lambda h, d: (h, fn(h, hi, d, di))
  else:
    fn = jax.jit(evict_rows_pallas, donate_argnums=2)
    step = lambda h, d: (fn(d, di, h, hi), d)
  for _ in range(3):
    host, dev = step(host, dev)
  jax.block_until_ready((host, dev))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      with jax.profiler.TraceAnnotation("timed"):
        for _ in range(calls):
          host, dev = step(host, dev)
        jax.block_until_ready((host, dev))
    ops = profile.device_op_events(trace_dir, after="timed")
  name = "ula_fetch_rows" if direction == "fetch" else "ula_evict_rows"
  launches = profile.launches_of(ops, name)
  mine = [e for e in ops if str(e.get("name", "")).startswith(name)]
  span = ((mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]) / len(mine)) if mine else None
  return launches, span, host, dev


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layouts", default="fp8x656,u8x640,u8x768")
  p.add_argument("--entries", default="1K,2K,4K,8K,16K,64K")
  p.add_argument("--directions", default="fetch,evict")
  p.add_argument("--calls", type=int, default=40)
  p.add_argument("--host-run", type=int, default=1,
                 help="host rows in runs of R adjacent rows (bench fetch --host-run)")
  p.add_argument("--out", default="fetch_launches.json")
  args = p.parse_args(argv)
  entries = parse_sizes(args.entries)
  dev_s = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
  host_s = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  rng = np.random.default_rng(0)
  rows = []
  for layout in args.layouts.split(","):
    dtype, W = LAYOUTS[layout]
    row_bytes = W * jnp.dtype(dtype).itemsize
    Sh, Sd = 4 * max(entries), max(entries)
    host = jax.device_put(rng.integers(0, 256, (Sh, W), dtype=np.uint8).astype(dtype), host_s)
    dev = jax.device_put(np.zeros((Sd, W), dtype), dev_s)
    for direction in args.directions.split(","):
      for N in entries:
        hi = jax.device_put(host_indices(rng, Sh, N, args.host_run), dev_s)
        di = jax.device_put(rng.permutation(Sd)[:N].astype(np.int32), dev_s)
        launches, span, host, dev = _kernel_launches(direction, host, dev, hi, di,
                                                     args.calls)
        durs = [l["us"] for l in launches]
        gaps = [l["idle_before_us"] for l in launches[1:] if l["idle_before_us"] is not None]
        row = {"layout": layout, "direction": direction, "rows": N, "row_bytes": row_bytes,
               "launches": len(launches),
               "kernel_us": statistics.median(durs) if durs else None,
               "gap_us": statistics.median(gaps) if gaps else None,
               "span_us": span,
               "memcpy_us": _memcpy_us(direction, N * row_bytes, args.calls)}
        rows.append(row)
        print(json.dumps(row), flush=True)
  fits = []
  for layout in args.layouts.split(","):
    for direction in args.directions.split(","):
      sel = [r for r in rows if r["layout"] == layout and r["direction"] == direction
             and r["kernel_us"] is not None]
      if len(sel) < 2:
        continue
      n = [r["rows"] for r in sel]
      fit = {"layout": layout, "direction": direction}
      for key in ("kernel_us", "span_us", "memcpy_us"):
        fit[key] = _fit(n, [r[key] for r in sel])
      fit["per_row_ratio"] = fit["memcpy_us"][1] / fit["span_us"][1]
      fits.append(fit)
  with open(args.out, "w") as f:
    json.dump({"environment": environment(), "calls": args.calls,
               "host_run": args.host_run, "rows": rows,
               "fits": fits}, f, indent=1)
  print(f"{'layout':9} {'dir':6} {'rows':>6} {'kernel':>8} {'gap':>6} {'span':>8} "
        f"{'memcpy':>8} {'frac':>6}")
  for r in rows:
    frac = r["memcpy_us"] / r["span_us"] if r["span_us"] else float("nan")
    print(f"{r['layout']:9} {r['direction']:6} {r['rows']:6d} {r['kernel_us'] or 0:8.2f} "
          f"{r['gap_us'] or 0:6.2f} {r['span_us'] or 0:8.2f} {r['memcpy_us']:8.2f} {frac:6.3f}")
  print("fits (fixed us, per-row ns): kernel / span / memcpy; per-row ratio memcpy/span")
  for f in fits:
    print(f"{f['layout']:9} {f['direction']:6} "
          + " / ".join(f"{a:.2f}, {b * 1e3:.2f}" for a, b in
                       (f["kernel_us"], f["span_us"], f["memcpy_us"]))
          + f"; {f['per_row_ratio']:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
