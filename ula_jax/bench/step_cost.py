"""What a decode step costs when every selection hits, against ``resident``, in one run.

``ula-jax bench step_cost [--config CONFIG] [--batch B] [--prompt T] [--output N]
[--systems resident,ula] [a.b=value ...]`` builds one engine per memory system on the same
model, mesh and requests (every request the same length, all arriving at once, so the
running batch is flat once every prompt is in, one chunk per rank and step), with a
device pool that holds every entry (no step misses), runs
the workload twice (the first run compiles) and compares the median decode-step time of
the second run over the steps where the whole batch decodes. Prints a table and writes
JSON with the ratio of each system to ``resident``.

``--profile DIR`` runs the workload a third time under ``jax.profiler`` (one trace per
system under ``DIR/<system>``) and adds, per full-batch decode step, the device's
operations, its busy time and the host's waits on the device (``bench/profile.py``): a
step whose wall time is far above its device-busy time is bound by launches and host
round trips.

With ``engine.steps_per_dispatch = N > 1`` an engine step is one dispatch of N decode
steps; a decode step's time is then a full dispatch's (every row decoding all N steps)
divided by N, so the ratios compare per-step costs at any N (``steps_per_dispatch`` in
the JSON).

``--rounds R > 1`` keeps every system's engine (all their pools at once) and, after each
one's compiling run, runs the systems R times in turn (resident, ula, resident, ula,
...), so that a drift of the machine over the run (clocks, temperature, other tenants)
falls on every system alike. A system's median is then over the full-batch steps of all
its rounds, and the JSON adds each round's median and ratio (``round_median_step_s``,
``round_ratios``).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from ula_jax.bench.common import (environment, fmt, overrides_for, print_table,
                                  same_length_requests, write_json)

DEFAULT_CONFIG = "experiments/quickstart/config.yaml"


def measure(config: str, overrides: list[str], systems: list[str], *, batch: int,
            prompt: int, output: int, seed: int = 0, profile: str | None = None,
            rounds: int = 1) -> dict:
  """Median full-batch decode step time per system, and each one's ratio to resident
  (``rounds``: timed runs of each system, in turn; see the module docstring)."""
  if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
    raise ValueError(f"rounds={rounds!r}: expected an integer >= 1")
  import jax
  from ula_jax.config import load_config
  from ula_jax.engine import Engine
  from ula_jax.mesh import build_mesh, configure_platform

  base = load_config(config, overrides_for(None, overrides))
  configure_platform(base)
  mesh = build_mesh(base)
  dp = mesh.shape["dp"]
  page = base.engine.page_size
  context = -(-(prompt + output) // page) * page
  # Every entry of every running request fits on the device (and one step's selection).
  pool = max(batch * context, batch * (base.model.index_topk + 1))
  reqs = same_length_requests(batch * dp, prompt, output, base.model.vocab_size, seed)

  def build(system: str):
    sized = lambda p: load_config(config, overrides_for(system, overrides) + [
        f"memory.system={system}", f"memory.device_pool={p}", "memory.host_pool=0",
        f"engine.max_batch={batch}", f"engine.max_context={context}",
        f"engine.prefill_chunk={prompt}", "engine.progress=false"])
    cfg = sized(pool)
    if system == "hisparse":  # its per-request buffers must fit the device pool too
      need = batch * (cfg.memory.hisparse.device_buffer_size + 1)
      cfg = sized(need) if need > pool else cfg
    engine = Engine(cfg, mesh, max_context=context)
    engine.run(reqs)  # compiles
    return engine

  def timed(system: str, engine) -> tuple[list[float], Any, int]:
    """One run's full-batch decode step times (s), the run and its misses."""
    n = engine.cfg.engine.steps_per_dispatch
    res = engine.run(reqs)
    # decode_time_s times the decode part alone, also in steps that prefilled too; with
    # N steps per dispatch, only dispatches in which every row decoded all N steps.
    full = [m for m in res.steps
            if m.running == batch * dp and m.decode_tokens == m.running * n]
    if not full:
      # One request is admitted per rank and engine step, and every engine step decodes
      # n tokens of each running request: the first request must outlast the admissions.
      need = (batch + 1) * n
      raise RuntimeError(f"{system}: no step decoded the whole batch; raise --output to at "
                         f"least {need} ((--batch {batch} + 1) x {n}: one request admitted "
                         f"per rank and engine step, each step decoding "
                         f"engine.steps_per_dispatch = {n} tokens per running request)")
    misses = sum(m.extra.get("misses", 0) for m in full)
    return [m.decode_time_s / n for m in full], res, misses

  def summary_of(engine, runs: list) -> dict:
    n = engine.cfg.engine.steps_per_dispatch
    times = [t for ts, _, _ in runs for t in ts]
    res = runs[-1][1]
    return {"median_step_s": statistics.median(times), "steps": len(times) * n,
            "steps_per_dispatch": n, "misses": sum(m for _, _, m in runs),
            "kernels": res.summary["kernels"], "projections": res.summary["projections"],
            "tokens": [r.output_tokens for r in res.requests],
            "round_median_step_s": [statistics.median(ts) for ts, _, _ in runs]}

  # One engine at a time with one round (only one system's pools ever allocated); with
  # more, every engine kept and the systems take turns.
  rows = {}
  for names in ([[s] for s in systems] if rounds == 1 else [systems]):
    engines = {system: build(system) for system in names}
    runs: dict[str, list] = {system: [] for system in names}
    for _ in range(rounds):
      for system, engine in engines.items():
        runs[system].append(timed(system, engine))
    for system, engine in engines.items():
      rows[system] = summary_of(engine, runs[system])
      if profile:
        rows[system]["profile"] = _profile(engine, reqs, f"{profile}/{system}", batch * dp)
    del engines, engine
    jax.clear_caches()
  ref = rows.get("resident")
  for system, row in rows.items():
    row["ratio_to_resident"] = row["median_step_s"] / ref["median_step_s"] if ref else None
    row["round_ratios"] = ([a / b for a, b in zip(row["round_median_step_s"],
                                                  ref["round_median_step_s"])]
                           if ref else None)
    row["tokens_equal_resident"] = (row["tokens"] == ref["tokens"]) if ref else None
  return {"environment": environment(), "config": config, "overrides": overrides,
          "batch_per_rank": batch, "dp": dp, "prompt": prompt, "output": output,
          "rounds": rounds,
          "systems": {s: {k: v for k, v in r.items() if k != "tokens"} for s, r in rows.items()}}


def _profile(engine, reqs, trace_dir: str, full_batch: int) -> dict:
  """One more run under the profiler: per-step medians over the full-batch decode steps."""
  import jax
  from ula_jax.bench.profile import summarize_calls, trace_calls

  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    res = engine.run(reqs)
  # One decode (or speculate, and redo where it failed) per decoding step, in order.
  prof = trace_calls(trace_dir, ("decode", "speculate"), also=("redo",), top=400)
  decoding = [m for m in res.steps if m.running > 0]
  if len(decoding) != len(prof["calls"]):
    raise RuntimeError(f"{trace_dir}: {len(prof['calls'])} decode calls in the trace, "
                       f"{len(decoding)} decode steps in the run")
  full = [c for c, m in zip(prof["calls"], decoding) if m.running == full_batch]
  return {**summarize_calls(full), **{k: prof[k] for k in ("top_ops", "top_kinds",
                                                              "host_top", "lines", "trace")}}


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog="ula-jax bench step_cost", description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*", help="config overrides a.b=value")
  p.add_argument("--config", default=DEFAULT_CONFIG)
  p.add_argument("--systems", default="resident,ula")
  p.add_argument("--batch", type=int, default=8, help="decode rows per dp rank")
  p.add_argument("--prompt", type=int, default=200)
  p.add_argument("--output", type=int, default=24)
  p.add_argument("--json", default="runs/bench/step_cost.json")
  p.add_argument("--rounds", type=int, default=1,
                 help="timed runs of each system, the systems in turn, every engine kept "
                 "(default 1: one engine at a time)")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="also trace a third run per system under DIR and count, per step, "
                 "the device's operations, busy time and the host's waits")
  args = p.parse_intermixed_args(argv)
  systems = [s.strip() for s in args.systems.split(",") if s.strip()]
  if "resident" not in systems:
    p.error(f"--systems={args.systems!r} must include resident (the reference)")
  if args.rounds < 1:
    p.error(f"--rounds={args.rounds}: expected an integer >= 1")
  out = measure(args.config, args.overrides, systems, batch=args.batch, prompt=args.prompt,
                output=args.output, profile=args.profile, rounds=args.rounds)
  rows = [[s, fmt(r["median_step_s"] * 1e3, 3), str(r["steps"]), str(r["misses"]),
           fmt(r["ratio_to_resident"], 3),
           " ".join(fmt(x, 3) for x in r["round_ratios"]), str(r["tokens_equal_resident"])]
          for s, r in out["systems"].items()]
  print_table(f"decode step, every selection hits (batch {args.batch} x dp {out['dp']}"
              + (f", {args.rounds} rounds in turn)" if args.rounds > 1 else ")"),
              ["system", "median step (ms)", "steps", "misses", "ratio to resident",
               "each round's ratio", "tokens = resident"], rows, left=["system"])
  prof = [(s, r["profile"]) for s, r in out["systems"].items() if r.get("profile")]
  if prof:
    n = next(iter(out["systems"].values()))["steps_per_dispatch"]
    print_table("per full-batch decode " + (f"dispatch ({n} steps)" if n > 1 else "step")
                + ", under the profiler (medians)",
                ["system", "wall (ms)", "device busy (ms)", "device ops", "memcpy",
                 "host waits"],
                [[s, fmt(r["wall_us"] / 1e3, 3), fmt(r["device_busy_us"] / 1e3, 3),
                  fmt(r["device_ops"], 0), fmt(r["memcpy"], 0), fmt(r["host_waits"], 0)]
                 for s, r in prof], left=["system"])
  write_json(args.json, out)
  print(f"wrote {args.json}")
  return 0
