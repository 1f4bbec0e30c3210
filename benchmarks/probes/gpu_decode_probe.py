"""The engine's decode step of ``ula`` with host pools of several sizes on one GPU: its
time with no request running (the fixed cost of a step) and the instructions of its
compiled HLO that materialise a device or host pool (``kernels.fetch.hlo``: a pool copied
per step shows up here; ``tests/test_decode_hlo.py`` asserts there are none). Run from the repository root:

    python benchmarks/probes/gpu_decode_probe.py [--host 0,4096,131072] [a.b=value ...]

Prints one line per host-pool size and system, and a table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--host", default="0,4096,131072", help="memory.host_pool sizes (tokens)")
  p.add_argument("--device", type=int, default=65536, help="memory.device_pool (tokens)")
  p.add_argument("--systems", default="resident,ula")
  p.add_argument("--steps", type=int, default=10)
  args = p.parse_intermixed_args(argv)

  import jax
  from ula_jax.config import load_config
  from ula_jax.engine import Engine
  from ula_jax.kernels.fetch.hlo import pool_materializations
  from ula_jax.mesh import build_mesh, configure_platform

  rows = []
  for system in args.systems.split(","):
    for host in ([0] if system == "resident" else [int(h) for h in args.host.split(",")]):
      over = ["mesh.dp=1", "mesh.tp=1", "engine.max_batch=4", "engine.max_context=8192",
              "engine.progress=false", f"memory.system={system}",
              f"memory.device_pool={args.device}"] + (
                  [f"memory.host_pool={host}"] if system != "resident" else []) + args.overrides
      cfg = load_config("experiments/quickstart/config.yaml", over)
      configure_platform(cfg)
      engine = Engine(cfg, build_mesh(cfg), max_context=8192)
      inputs = engine.idle_decode_inputs()
      text = engine.decode_hlo()
      pools = [x.shape[1:] for x in (*engine.state.dev_pools, *engine.state.host_pools)
               ] if system == "ula" else []
      copies = sorted({line[:160] for shape in set(pools)
                       for line in pool_materializations(text, shape)})
      state = engine.carry
      times = []
      for _ in range(args.steps):
        t0 = time.perf_counter()
        out, state, _ = engine._decode(engine.params, state, inputs)
        np.asarray(jax.device_get(out))
        times.append(time.perf_counter() - t0)
      med = statistics.median(times[2:])
      rows.append((system, host, med, len(copies)))
      print(f"{system:9s} host {host:7d}: {med * 1e3:8.2f} ms/step, pool-sized ops {len(copies)}",
            flush=True)
      for line in copies[:6]:
        print("    ", line)
      del engine, state
      jax.clear_caches()
  print(f"{'system':9s} {'host':>7s} {'ms/step':>9s} {'pool ops':>8s}")
  for system, host, med, n in rows:
    print(f"{system:9s} {host:7d} {med * 1e3:9.2f} {n:8d}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
