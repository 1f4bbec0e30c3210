"""The Pallas row fetch with device-pool reads between its copies, as a serving step runs
it: between two layer groups' fetches, attention and the indexer read some 100K rows
scattered over a device pool of tens of GiB, which may evict the GPU's cached
translations that the next fetch of host rows needs.

Each program runs ``--copies`` rounds of: an XLA gather of G random rows of the device
pool (its own rows each round; their maximum written to one row of the pool, so the
next copy waits for it), then one fetch of ``--rows`` fresh host rows (in runs of
``--run``, as ``memory.host_layout: entry_major`` moves a group) into random rows of that
pool. The same program without the fetches times the gathers alone; the difference,
per copy, is the fetch's time among the gathers, beside a memcpy of the same bytes.
G = 0 is ``bench fetch --fresh-rows``'s setting.

    PYTHONPATH=. python benchmarks/probes/gpu_fetch_between.py --out between.json \\
        [--host-rows 163840000] [--device-rows 65472000] [--gather-rows 0,26K,104K]

``--quick``: a CPU-sized smoke run (interpret mode; no memcpy ceiling). Prints a table;
the JSON holds every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.bench.common import best_and_median, environment, parse_sizes, time_calls
from ula_jax.bench.fetch import _filled_pool, _memcpy_ceiling, _shardings, host_indices
from ula_jax.kernels.fetch.hlo import pool_materializations
from ula_jax.kernels.fetch.pallas import fetch_rows_pallas

W = 656  # the FP8 row


def program(copies: int, gather: int, with_fetch: bool):
  """``dst = f(dst, host, hidx [C, N], didx [C, N], gidx [C, max(G, 1)])``."""

  def run(dst, host, hidx, didx, gidx):
    for c in range(copies):
      if gather:
        g = jnp.take(dst, gidx[c], axis=0)
        dst = dst.at[gidx[c, 0]].set(jnp.max(g, axis=0))
      if with_fetch:
        dst = fetch_rows_pallas(host, hidx[c], dst, didx[c])
    return dst

  return jax.jit(run, donate_argnums=0)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--host-rows", type=int, default=163_840_000)
  p.add_argument("--device-rows", type=int, default=65_472_000)
  p.add_argument("--rows", type=int, default=4096, help="host rows a fetch")
  p.add_argument("--run", type=int, default=4, help="host rows in runs of this many")
  p.add_argument("--copies", type=int, default=8, help="rounds a program")
  p.add_argument("--gather-rows", default="0,26K,104K",
                 help="device-pool rows gathered before each fetch, comma list")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench/fetch_between.json")
  p.add_argument("--quick", action="store_true", help="CPU-sized smoke run")
  args = p.parse_args(argv)
  if args.quick:
    args.host_rows, args.device_rows, args.rows, args.copies = 4096, 2048, 64, 2
    args.gather_rows, args.reps = "0,100", 2
  gathers = parse_sizes(args.gather_rows)
  C, N = args.copies, args.rows
  if N % args.run or C * N > args.host_rows or N > args.device_rows:
    raise ValueError(f"--rows={N}: expected a multiple of --run={args.run}, with --copies "
                     f"x --rows <= --host-rows and --rows <= --device-rows")
  timing = dict(min_iters=2 if args.quick else 5, max_iters=2 if args.quick else 200,
                target_s=0.001 if args.quick else 0.2, warmup=1)
  host_s, dev_s = _shardings()
  rng = np.random.default_rng(args.seed)
  host = _filled_pool(host_s, (args.host_rows, W), jnp.uint8)
  state = {"dev": _filled_pool(dev_s, (args.device_rows, W), jnp.uint8)}
  hidx = jax.device_put(host_indices(rng, args.host_rows, C * N, args.run).reshape(C, N),
                        dev_s)
  didx = jax.device_put(np.stack([rng.choice(args.device_rows, N, replace=False)
                                  for _ in range(C)]).astype(np.int32), dev_s)
  nbytes = N * W
  try:
    memcpy = _memcpy_ceiling("fetch", nbytes, timing)
  except RuntimeError:
    memcpy = None
  results = []
  for G in gathers:
    gidx = jax.device_put(rng.integers(0, args.device_rows, (C, max(G, 1)), dtype=np.int32),
                          dev_s)
    fns = {}
    for with_fetch in (True, False):
      fn = program(C, G, with_fetch)
      compiled = fn.lower(state["dev"], host, hidx, didx, gidx).compile()
      if pool_materializations(compiled.as_text(), (args.device_rows, W)):
        raise RuntimeError(f"G={G}: the program copies the device pool")
      fns[with_fetch] = compiled
    times: dict[str, list[float]] = {"program": [], "gathers": [], "memcpy": []}
    for _ in range(args.reps):  # taking turns
      for with_fetch, key in ((True, "program"), (False, "gathers")):
        t, state["dev"] = time_calls(
            lambda d, f=fns[with_fetch], g=gidx: f(d, host, hidx, didx, g), state["dev"],
            **timing)
        times[key].append(t)
      if memcpy is not None:
        times["memcpy"].append(memcpy())
    per_copy = [(a - b) / C for a, b in zip(times["program"], times["gathers"])]
    best, median = best_and_median(per_copy)
    ceiling = min(times["memcpy"]) if times["memcpy"] else None
    results.append({
        "gather_rows": G, "times": times, "fetch_s": best, "fetch_median_s": median,
        "fetch_gbps": nbytes / best / 1e9 if best > 0 else None,
        "memcpy_gbps": nbytes / ceiling / 1e9 if ceiling else None,
        "fraction": ceiling / best if ceiling and best > 0 else None,
        "gathers_s": min(times["gathers"]) / C})
  out = {"probe": "fetch_between", "environment": environment(), "host_rows": args.host_rows,
         "device_rows": args.device_rows, "rows": N, "run": args.run, "copies": C,
         "reps": args.reps, "results": results}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  env = out["environment"]
  print(f"fetch of {N} fresh host rows (runs of {args.run}) among device-pool gathers, "
        f"{env['device']}, jax {env['jax']}; host pool {args.host_rows} rows, device pool "
        f"{args.device_rows}; best of {args.reps}")
  print(f"{'gathered':>9} {'gathers us':>11} {'fetch us':>9} {'GB/s':>7} {'memcpy GB/s':>12} "
        f"{'fraction':>9}")
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  for r in results:
    print(f"{r['gather_rows']:>9} {r['gathers_s'] * 1e6:>11.1f} {r['fetch_s'] * 1e6:>9.1f} "
          f"{fmt(r['fetch_gbps'], '7.1f')} {fmt(r['memcpy_gbps'], '12.1f')} "
          f"{fmt(r['fraction'], '9.3f')}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
