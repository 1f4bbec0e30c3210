"""Compile time and program size of the decode step and a prefill chunk against depth.

``ula-jax bench compile [--config CONFIG] [--layers 8,32,78] [--systems resident,ula]
[--batch B] [--context T] [a.b=value ...]`` builds one engine per (system, layer count) on
the config's model with ``model.num_layers`` set (everything else equal, the persistent
compilation cache off), lowers and compiles its decode step and its prefill chunk, and
reports seconds to lower, seconds to compile and the operations in the compiled HLO
(every instruction of every computation). The layer stack is a loop over layer groups,
so both should stay flat as the model deepens. Prints a table and writes JSON with each
count's ratio to the shallowest model's.
"""

from __future__ import annotations

import argparse
import re
import time

from ula_jax.bench.common import environment, fmt, parse_sizes, print_table, write_json

DEFAULT_CONFIG = "experiments/quickstart/config.yaml"
KINDS = ("decode", "prefill")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s", re.M)


def hlo_ops(text: str) -> int:
  """Instructions in a compiled HLO module's text (all computations)."""
  return len(_INSTRUCTION.findall(text))


def measure(config: str, overrides: list[str], systems: list[str], layers: list[int], *,
            batch: int, context: int, kinds: tuple[str, ...] = KINDS) -> dict:
  """{system: {layers: {kind: {lower_s, compile_s, hlo_ops}}}} plus ratios to the first
  layer count; ``kinds``: the steps compiled (decode, prefill)."""
  import jax
  from ula_jax.config import load_config
  from ula_jax.engine import Engine
  from ula_jax.mesh import build_mesh, configure_platform

  rows: dict = {}
  for system in systems:
    rows[system] = {}
    for n in layers:
      cfg = load_config(config, list(overrides) + [
          f"memory.system={system}", f"model.num_layers={n}", f"engine.max_batch={batch}",
          f"engine.max_context={context}", "engine.progress=false",
          "engine.compilation_cache=false"])
      configure_platform(cfg)
      engine = Engine(cfg, build_mesh(cfg), max_context=context)
      row = {}
      for kind in kinds:
        t0 = time.perf_counter()
        lowered = engine.lower_step(kind)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        row[kind] = {"lower_s": t1 - t0, "compile_s": t2 - t1,
                     "hlo_ops": hlo_ops(compiled.as_text())}
      rows[system][n] = row
      del engine, compiled, lowered
      jax.clear_caches()
  for system, by_n in rows.items():
    base = by_n[layers[0]]
    for n, row in by_n.items():
      for kind, r in row.items():
        first = base[kind]
        r["total_s"] = r["lower_s"] + r["compile_s"]
        r["time_ratio"] = r["total_s"] / (first["lower_s"] + first["compile_s"])
        r["ops_ratio"] = r["hlo_ops"] / first["hlo_ops"]
  return {"environment": environment(), "config": config, "overrides": overrides,
          "batch": batch, "context": context, "layers": layers, "systems": rows}


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="ula-jax bench compile",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*", help="config overrides a.b=value")
  p.add_argument("--config", default=DEFAULT_CONFIG)
  p.add_argument("--systems", default="resident,ula")
  p.add_argument("--layers", default="8,32,78", help="model.num_layers values")
  p.add_argument("--batch", type=int, default=8, help="engine.max_batch")
  p.add_argument("--context", type=int, default=1024, help="engine.max_context")
  p.add_argument("--steps", default=",".join(KINDS),
                 help="the steps compiled: decode, prefill or both (comma-separated)")
  p.add_argument("--json", default="runs/bench/compile.json")
  args = p.parse_intermixed_args(argv)
  kinds = tuple(k.strip() for k in args.steps.split(",") if k.strip())
  if not kinds or any(k not in KINDS for k in kinds):
    p.error(f"--steps={args.steps!r}: expected a comma-separated subset of {', '.join(KINDS)}")
  systems = [s.strip() for s in args.systems.split(",") if s.strip()]
  layers = parse_sizes(args.layers, flag="--layers", minimum=1)
  out = measure(args.config, args.overrides, systems, layers, batch=args.batch,
                context=args.context, kinds=kinds)
  table = []
  for system, by_n in out["systems"].items():
    for n, row in by_n.items():
      for kind, r in row.items():
        table.append([system, str(n), kind, fmt(r["lower_s"]), fmt(r["compile_s"]),
                      str(r["hlo_ops"]), fmt(r["time_ratio"]), fmt(r["ops_ratio"])])
  print_table(f"compile time and program size against depth ({out['environment'].get('device', '')})",
              ["system", "layers", "step", "lower (s)", "compile (s)", "HLO ops",
               f"time / {layers[0]} layers", f"ops / {layers[0]} layers"], table,
              left=["system", "step"])
  write_json(args.json, out)
  print(f"wrote {args.json}")
  return 0
