"""Does a compiled engine program copy a pool? Compile-only, per system and host-pool size.

For each system of ``--systems`` and each host-pool size of ``--host`` (bytes, e.g.
``1GiB``), an engine of ``--config`` (default: GLM-5 geometry, synthetic prefill) is built
and its ``--programs`` are lowered and compiled, not run. Per program it prints the
compiled module's memory analysis (temporaries, and outputs not aliased to an input, in
GiB), the pools (state leaves of at least 64 MiB, with their memory kind) and the HLO
instructions that materialise a pool (``kernels.fetch.hlo``). A temporary or an
unaliased output as large as a pool means the program copies it: a 60 GiB host pool
then needs another 60 GiB of device memory.

    python benchmarks/probes/gpu_program_memory.py --json OUT.json [a.b=v ...]
"""

from __future__ import annotations

import argparse
import json
import sys

CONFIG = "experiments/glm5_summarization/config.yaml"


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--systems", default="ula_pb_lru,hisparse")
  p.add_argument("--host", default="1GiB,6GiB")
  p.add_argument("--programs", default="prefill,decode")
  p.add_argument("--json", default="program_memory.json")
  args = p.parse_intermixed_args(argv)

  import jax
  from ula_jax.bench.common import environment
  from ula_jax.config import load_config
  from ula_jax.engine import Engine, resolve_max_context
  from ula_jax.kernels.fetch.hlo import pool_materializations
  from ula_jax.mesh import build_mesh, configure_platform

  gib = 2.0 ** 30
  rows = []
  for system in args.systems.split(","):
    for host in args.host.split(","):
      over = [f"memory={system}", "workload.prefill=synthetic", "engine.progress=false",
              "engine.max_batch=4", f"memory.host_pool={host}"] + args.overrides
      cfg = load_config(args.config, over)
      configure_platform(cfg)
      engine = Engine(cfg, build_mesh(cfg), max_context=resolve_max_context(cfg))
      pools = [(tuple(x.shape), x.dtype.name, x.sharding.memory_kind, x.nbytes)
               for x in jax.tree.leaves(engine.state) if x.nbytes >= 64 << 20]
      for prog in args.programs.split(","):
        compiled = engine.lower_step(prog).compile()
        ma = compiled.memory_analysis()
        text = compiled.as_text()
        found = sorted({line[:200] for shape, *_ in pools
                        for line in pool_materializations(text, shape[1:])})
        row = {"system": system, "host_pool": host, "program": prog,
               "pools": [[list(s), d, k, n / gib] for s, d, k, n in pools],
               "temp_gib": ma.temp_size_in_bytes / gib,
               "output_gib": ma.output_size_in_bytes / gib,
               "alias_gib": ma.alias_size_in_bytes / gib,
               "argument_gib": ma.argument_size_in_bytes / gib,
               "host_temp_gib": getattr(ma, "host_temp_size_in_bytes", 0) / gib,
               "materializations": found}
        rows.append(row)
        print(json.dumps(row)[:1500], flush=True)
      del engine
      jax.clear_caches()
  with open(args.json, "w") as f:
    json.dump({"environment": environment(), "config": args.config,
               "overrides": args.overrides, "rows": rows}, f, indent=1)
  print(f"{'system':12} {'host':>6} {'program':8} {'temp GiB':>9} {'unaliased out':>13} "
        f"{'copies':>6}")
  for r in rows:
    print(f"{r['system']:12} {r['host_pool']:>6} {r['program']:8} {r['temp_gib']:9.2f} "
          f"{r['output_gib'] - r['alias_gib']:13.2f} {len(r['materializations']):6d}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
