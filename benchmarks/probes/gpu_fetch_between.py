"""The Pallas row fetch and evict with device-pool reads between their copies, as a
serving step runs them: between two layer groups' copies, attention and the indexer read
some 100K rows scattered over a device pool of tens of GiB, which may evict the GPU's
cached translations that the next copy of host rows needs.

Each program runs ``--copies`` rounds of: an XLA gather of G random rows of the device
pool (its own rows each round; their maximum written to one row of the pool, so the
next copy waits for it), then one copy of ``--rows`` fresh host rows (in runs of
``--run``, as ``memory.host_layout: entry_major`` moves a group) into random rows of that
pool (fetch) or from them (evict). The same program without the copies times the
gathers alone; the difference, per copy, is the copy's time among the gathers, beside a
memcpy of the same bytes. G = 0 is ``bench fetch --fresh-rows``'s setting.

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
from ula_jax.kernels.fetch.pallas import evict_rows_pallas, fetch_rows_pallas

W = 656  # the FP8 row


def program(copies: int, gather: int, with_copy: bool, direction: str = "fetch"):
  """``(dev, host, staged) = f((dev, host, staged), hidx [C, N], didx [C, N], gidx [C,
  max(G, 1)])``, all three donated. A fetch writes ``didx``'s rows of the device pool
  ``dev`` after the round's gather, whose maximum goes to the gather's first row of
  ``dev``; an evict writes the N rows of ``staged`` (a step's victims, set aside in a
  buffer of their own) to the host after the gather, whose maximum goes to a row of
  ``staged``."""

  def run(pools, hidx, didx, gidx):
    dev, host, staged = pools
    n = staged.shape[0]
    for c in range(copies):
      if gather:
        top = jnp.max(jnp.take(dev, gidx[c], axis=0), axis=0)
        if direction == "fetch":
          dev = dev.at[gidx[c, 0]].set(top)
        else:
          staged = staged.at[c % n].set(top)
      if with_copy and direction == "fetch":
        dev = fetch_rows_pallas(host, hidx[c], dev, didx[c])
      elif with_copy:
        host = evict_rows_pallas(staged, jnp.arange(n, dtype=jnp.int32), host, hidx[c])
    return dev, host, staged

  return jax.jit(run, donate_argnums=0)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--host-rows", type=int, default=163_840_000)
  p.add_argument("--device-rows", type=int, default=65_472_000)
  p.add_argument("--rows", type=int, default=4096, help="host rows a fetch")
  p.add_argument("--run", type=int, default=4, help="host rows in runs of this many")
  p.add_argument("--copies", type=int, default=8, help="rounds a program")
  p.add_argument("--directions", default="fetch,evict", help="fetch, evict or both")
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
  directions = args.directions.split(",")
  if not directions or set(directions) - {"fetch", "evict"}:
    raise ValueError(f"--directions={args.directions!r}: expected fetch, evict or both")
  C, N = args.copies, args.rows
  if N % args.run or C * N > args.host_rows or N > args.device_rows:
    raise ValueError(f"--rows={N}: expected a multiple of --run={args.run}, with --copies "
                     f"x --rows <= --host-rows and --rows <= --device-rows")
  timing = dict(min_iters=2 if args.quick else 5, max_iters=2 if args.quick else 200,
                target_s=0.001 if args.quick else 0.2, warmup=1)
  host_s, dev_s = _shardings()
  rng = np.random.default_rng(args.seed)
  state = {"pools": (_filled_pool(dev_s, (args.device_rows, W), jnp.uint8),
                     _filled_pool(host_s, (args.host_rows, W), jnp.uint8),
                     _filled_pool(dev_s, (args.rows, W), jnp.uint8))}
  hidx = jax.device_put(host_indices(rng, args.host_rows, C * N, args.run).reshape(C, N),
                        dev_s)
  didx = jax.device_put(np.stack([rng.choice(args.device_rows, N, replace=False)
                                  for _ in range(C)]).astype(np.int32), dev_s)
  nbytes = N * W
  results = []
  for direction in directions:
    try:
      memcpy = _memcpy_ceiling(direction, nbytes, timing)
    except RuntimeError:
      memcpy = None
    for G in gathers:
      gidx = jax.device_put(
          rng.integers(0, args.device_rows, (C, max(G, 1)), dtype=np.int32), dev_s)
      fns, in_place = {}, True
      for with_copy in (True, False):
        fn = program(C, G, with_copy, direction)
        compiled = fn.lower(state["pools"], hidx, didx, gidx).compile()
        text = compiled.as_text()
        # On a GPU nothing copies a pool; on a CPU (interpret mode) a host pool written
        # by a kernel is staged through device memory.
        in_place &= not (pool_materializations(text, (args.device_rows, W))
                         or pool_materializations(text, (args.host_rows, W)))
        fns[with_copy] = compiled
      times: dict[str, list[float]] = {"program": [], "gathers": [], "memcpy": []}
      for _ in range(args.reps):  # taking turns
        for with_copy, key in ((True, "program"), (False, "gathers")):
          t, state["pools"] = time_calls(
              lambda s, f=fns[with_copy], g=gidx: f(s, hidx, didx, g), state["pools"],
              **timing)
          times[key].append(t)
        if memcpy is not None:
          times["memcpy"].append(memcpy())
      per_copy = [(a - b) / C for a, b in zip(times["program"], times["gathers"])]
      best, median = best_and_median(per_copy)
      ceiling = min(times["memcpy"]) if times["memcpy"] else None
      results.append({
          "direction": direction, "gather_rows": G, "in_place": in_place,
          "times": times, "copy_s": best,
          "copy_median_s": median, "copy_gbps": nbytes / best / 1e9 if best > 0 else None,
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
  print(f"copies of {N} fresh host rows (runs of {args.run}) among device-pool gathers, "
        f"{env['device']}, jax {env['jax']}; host pool {args.host_rows} rows, device pool "
        f"{args.device_rows}; best of {args.reps}")
  print(f"{'dir':>5} {'gathered':>9} {'gathers us':>11} {'copy us':>9} {'GB/s':>7} "
        f"{'memcpy GB/s':>12} {'fraction':>9} {'in place':>9}")
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  for r in results:
    print(f"{r['direction']:>5} {r['gather_rows']:>9} {r['gathers_s'] * 1e6:>11.1f} "
          f"{r['copy_s'] * 1e6:>9.1f} {fmt(r['copy_gbps'], '7.1f')} "
          f"{fmt(r['memcpy_gbps'], '12.1f')} {fmt(r['fraction'], '9.3f')} "
          f"{'yes' if r['in_place'] else 'NO':>9}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
