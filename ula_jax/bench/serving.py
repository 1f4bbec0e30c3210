"""Benchmark: capacity and throughput of the memory systems on every device of a host.

At equal memory budgets -- ``--device-budget`` tokens (or bytes, e.g. ``1GiB``) of KV
per device and ``--host-budget`` per device -- and requests of ``--context`` tokens,
each system (``--systems``) is set up on ``G`` devices (``--devices``, default all):

* ``resident_tp``: every entry on the device, ``tp = G`` (MLA's latent is replicated on
  every tp rank, as in SGLang's TP serving);
* ``resident_dp``: every entry on the device, ``dp = G`` (each device its own requests);
* ``hisparse``: ``tp = G``; every entry in host memory, a per-request device buffer of
  ``--hisparse-buffer`` slots (default 2 x top-k);
* ``ula_dp``: ``dp = G``, each device its own device and host pools;
* ``ula_tp``: ``tp = G``, layout ``mod``: every device stores distinct history.

**Capacity**: the largest number of such requests the engine admits at once -- its
admission rule (whole context in free logical pages of a dp rank, a free decode row)
applied to the system's sizing, scanning the decode rows up to ``--max-rows`` (``ula``
TP carves its local buffers, one step's selections per row, from the same device
budget, so more rows can mean fewer requests).

**Throughput**: for each running batch of ``--batches`` the system can hold, and at its
capacity (its peak), an engine with that many decode rows serves that many requests
arriving together; the figure is the median decode-step time over the steps where the
whole batch decodes (after every prompt is in; the run's first decode step, which
compiles, is never counted), as tokens per second. Requests get ``max_new_tokens`` so
that at least ``--decode-steps`` full-batch steps follow the last prefill.
Each point reports the peak number of requests the engine held (``admitted``).

Writes ``serving.json`` after every point, ``serving.png`` (tokens/s against running
batch, one curve per system, its peak marked) and prints the capacity and throughput
tables and the same-batch step-time ratios of each ``ula`` system to ``resident_tp``
(and ``resident_dp``).

    ula-jax bench serving [--config CFG] [--systems ...] [--context 16K] [--batches 1,4,16]
                          [--device-budget 64K] [--host-budget 128K] [--out DIR] [a.b=v ...]
    ula-jax bench serving --merge A/serving.json B/serving.json --out DIR   (tables + plot)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import pathlib
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from ula_jax.bench.common import (environment, fmt, overrides_for, parse_list, parse_sizes,
                                  print_table, same_length_requests)

if TYPE_CHECKING:  # the config package pulls in jax; imported where it runs
  from ula_jax.config import ExperimentConfig

DEFAULT_CONFIG = "experiments/quickstart/config.yaml"
SYSTEMS = ("resident_tp", "resident_dp", "hisparse", "ula_dp", "ula_tp")
DEFAULT_SYSTEMS = "resident_tp,resident_dp,hisparse,ula_dp,ula_tp"
# Systems whose step times the ula systems are compared with, at the same running batch.
REFERENCES = ("resident_tp", "resident_dp")


@dataclasses.dataclass(frozen=True)
class Setup:
  """One system on the host: its mesh and the config overrides that select it."""

  name: str
  dp: int
  tp: int
  overrides: tuple[str, ...]


def _size(value: str) -> str:
  """A budget as the config takes it: '64K' tokens -> 65536; '1GiB' stays bytes."""
  try:
    return str(parse_sizes(value)[0])
  except ValueError:
    return value


def setup(name: str, devices: int, *, device_budget: str, host_budget: str,
          hisparse_buffer: int) -> Setup:
  dev = f"memory.device_pool={_size(device_budget)}"
  host = f"memory.host_pool={_size(host_budget)}"
  tp_mesh, dp_mesh = (1, devices), (devices, 1)
  table = {
      "resident_tp": (tp_mesh, ["memory.system=resident", dev]),
      "resident_dp": (dp_mesh, ["memory.system=resident", dev]),
      "hisparse": (tp_mesh, ["memory.system=hisparse", dev, host,
                             f"memory.hisparse.device_buffer_size={hisparse_buffer}"]),
      "ula_dp": (dp_mesh, ["memory.system=ula", dev, host]),
      "ula_tp": (tp_mesh, ["memory.system=ula", "memory.layout=mod", dev, host]),
  }
  (dp, tp), over = table[name]
  return Setup(name, dp, tp, tuple([f"mesh.dp={dp}", f"mesh.tp={tp}"] + over))


def _load(args: argparse.Namespace, s: Setup, rows: int,
          extra: list[str] = ()) -> ExperimentConfig:
  from ula_jax.config import load_config
  system = next(o.split("=", 1)[1] for o in s.overrides if o.startswith("memory.system="))
  return load_config(args.config, overrides_for(system, args.overrides) + list(s.overrides) + [
      f"engine.max_batch={rows}", f"engine.max_context={args.context}",
      "engine.progress=false"] + list(extra))


def capacity(args: argparse.Namespace, s: Setup) -> dict:
  """The most requests of ``args.context`` tokens the engine admits at once.

  returns {"requests": total over dp ranks, "rows": decode rows per dp rank that reach it,
           "tokens_per_rank": the logical space of a dp rank at those rows,
           "limit": "memory" | "rows"}
  """
  from ula_jax.memory import MeshInfo, build_memory_system
  best = {"requests": 0, "rows": 0, "tokens_per_rank": 0, "limit": "memory", "errors": []}
  cfg = _load(args, s, 1)  # the memory system takes the rows as an argument
  page = cfg.engine.page_size
  need = -(-args.context // page)
  for rows in range(1, args.max_rows + 1):
    try:
      mem = build_memory_system(cfg.memory, cfg.model.kv_geometry(), MeshInfo(s.dp, s.tp),
                                max_batch=rows, page_size=page, max_context=args.context)
    except ValueError as e:  # this many rows do not fit the budget
      best["errors"].append(f"rows={rows}: {e}"[:300])
      break
    by_pages = mem.num_logical // page // need
    per_rank = min(rows, by_pages)
    if per_rank * s.dp > best["requests"]:
      best.update(requests=per_rank * s.dp, rows=rows, tokens_per_rank=mem.num_logical,
                  limit="rows" if rows < by_pages else "memory")
    if by_pages < rows:  # more rows only shrink (or keep) what memory holds
      break
  best["errors"] = best["errors"][-1:]
  logging.getLogger(__name__).info("%s: capacity %d requests of %d tokens (%s)", s.name,
                                   best["requests"], args.context, best["limit"])
  return best


def run_point(args: argparse.Namespace, s: Setup, batch: int,
              profile: str | None = None) -> dict:
  """Serves ``batch`` requests with ``batch / dp`` decode rows per dp rank; with
  ``profile`` (a folder), serves them once more under the profiler (``profile_run``)."""
  import jax
  from ula_jax.engine import Engine
  from ula_jax.mesh import build_mesh, configure_platform

  rows = batch // s.dp
  chunk = min(args.prefill_chunk or args.context, args.context)
  # Rank r's i-th request is in after (i + 1) * c prefill steps (at most c chunks per
  # prompt): the whole batch decodes together for output - (rows - 1) * c steps.
  c = math.ceil(args.context / chunk)
  output = (rows - 1) * c + args.decode_steps + 1
  prompt = args.context - output
  if prompt < 1:
    raise ValueError(f"--context={args.context} leaves no prompt at batch {batch} "
                     f"(output {output} tokens); raise --context or --prefill-chunk")
  cfg = _load(args, s, rows, [f"engine.prefill_chunk={chunk}"])
  configure_platform(cfg)
  mesh = build_mesh(cfg)
  reqs = same_length_requests(batch, prompt, output, cfg.model.vocab_size, args.seed)
  log = logging.getLogger(__name__)
  t0 = time.perf_counter()
  engine = Engine(cfg, mesh, max_context=args.context)
  log.info("%s batch %d: engine ready in %.1f s (%d requests of %d + %d tokens)", s.name,
           batch, time.perf_counter() - t0, batch, prompt, output)

  def on_step(m) -> None:
    log.info("%s batch %d: step %d %s running %d prefilling %d waiting %d, %.3f s "
             "(decode %.3f, prefill wait %.3f), %.1f s in", s.name, batch, m.step, m.kind,
             m.running, m.prefilling, m.waiting, m.step_time_s, m.decode_time_s,
             m.prefill_wait_s, time.perf_counter() - t0)

  res = engine.run(reqs, on_step if log.isEnabledFor(logging.INFO) else None)
  wall = time.perf_counter() - t0
  # The first decode step compiles the decode program: it is never counted.
  first = next(i for i, m in enumerate(res.steps) if m.decode_tokens)
  full = [m for m in res.steps[first + 1:] if m.running == batch and m.decode_tokens == batch]
  bad = [r for r in res.requests if r.status != "finished"]
  if bad:
    why = "; ".join(sorted({f"{r.status}: {r.reason}" if r.reason else r.status
                            for r in bad}))
    raise RuntimeError(f"{s.name} at batch {batch}: {len(bad)} of {len(res.requests)} "
                       f"requests not finished ({why}; first {[r.id for r in bad[:4]]})")
  if not full:
    raise RuntimeError(f"{s.name} at batch {batch}: no step decoded the whole batch")
  median = statistics.median(m.decode_time_s for m in full)
  keys = sorted({k for m in full for k in m.extra} & {"hits", "misses", "evictions", "xdev_rows"})
  out = {"system": s.name, "batch": batch, "rows_per_rank": rows, "prompt": prompt,
         "output": output, "steps": len(full), "median_step_s": median,
         "tokens_per_s": batch / median, "peak_admitted": max(m.admitted for m in res.steps),
         "wall_s": wall, "distinct_fraction": res.capacity.get("distinct_fraction"),
         "kernels": res.summary["kernels"], "projections": res.summary["projections"],
         "full_batch_stats": {k: sum(m.extra.get(k, 0) for m in full) for k in keys}}
  if profile:
    out["profile"] = profile_run(engine, reqs, profile, batch)
  del engine, res
  gc.collect()
  jax.clear_caches()
  return out


def profile_run(engine, reqs, trace_dir: str, batch: int, *, steps: int = 6,
                top: int = 40) -> dict:
  """One more run of ``reqs`` with the profiler on for up to ``steps`` full-batch decode
  steps, from the second one on (a trace of the whole run would hold every prefill and
  every kernel of every step). Returns the medians over those steps of wall, device-busy
  time, device operations and host waits, and the device's time per kernel and per kind
  of kernel in them (``top_ops`` / ``top_kinds``: [name, launches, us] per step)."""
  import jax
  from ula_jax.bench.profile import summarize_calls, trace_calls

  st = {"on": False, "done": False}
  during: list = []  # the decoding steps that ran with the profiler on

  def _full(m) -> bool:
    return m.running == batch and m.decode_tokens == batch

  def on_step(m) -> None:
    if st["on"]:
      if m.running > 0:
        during.append(m)
      if not _full(m) or sum(map(_full, during)) >= steps:
        jax.profiler.stop_trace()
        st.update(on=False, done=True)
    elif _full(m) and not st["done"]:
      jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
      st["on"] = True

  try:
    engine.run(reqs, on_step)
  finally:
    if st["on"]:
      jax.profiler.stop_trace()
  keep = [i for i, m in enumerate(during) if _full(m)]
  if not keep:
    raise RuntimeError(f"profile at batch {batch}: no full-batch decode step ran with the "
                       "profiler on (raise --decode-steps)")
  prof = trace_calls(trace_dir, ("decode", "speculate"), also=("redo",), top=top, only=keep)
  if len(prof["calls"]) != len(during):
    raise RuntimeError(f"{trace_dir}: {len(prof['calls'])} decode calls in the trace, "
                       f"{len(during)} decoding steps ran with the profiler on")
  return {"steps": len(keep), **summarize_calls([prof["calls"][i] for i in keep]),
          **{k: prof[k] for k in ("top_ops", "top_kinds", "host_top", "trace")}}


def batches_for(args: argparse.Namespace, s: Setup, cap: int) -> list[int]:
  """The running batches measured for one system: the ``--batches`` it can hold (those
  that are a multiple of its dp ranks) and its capacity."""
  return sorted({b for b in args.batch_list if b <= cap and b % s.dp == 0}
                | ({cap} if cap else set()))


def measure(args: argparse.Namespace, checkpoint: Callable[[dict], Any] | None = None) -> dict:
  import jax
  from ula_jax.config import load_config
  from ula_jax.mesh import configure_platform

  base = load_config(args.config, overrides_for(None, args.overrides))
  configure_platform(base, num_devices=args.devices or None)
  devices = args.devices or len(jax.devices())
  if devices < 1:
    raise ValueError("--devices must be >= 1")
  top_k = base.model.index_topk
  buf = args.hisparse_buffer or 2 * top_k
  result = {"benchmark": "serving", "environment": environment(), "config": args.config,
            "overrides": list(args.overrides), "devices": devices, "context": args.context,
            "device_budget": args.device_budget, "host_budget": args.host_budget,
            "hisparse_buffer": buf, "model": base.model.preset, "top_k": top_k,
            "decode_steps": args.decode_steps, "systems": {}}
  for name in args.system_list:
    s = setup(name, devices, device_budget=args.device_budget, host_budget=args.host_budget,
              hisparse_buffer=buf)
    cap = capacity(args, s)
    entry = {"dp": s.dp, "tp": s.tp, "overrides": list(s.overrides), "capacity": cap,
             "points": []}
    result["systems"][name] = entry
    for b in batches_for(args, s, cap["requests"]):
      # The profiled run is the capacity point's (the largest batch measured).
      prof = (f"{args.profile}/{name}" if getattr(args, "profile", None)
              and b == cap["requests"] else None)
      try:
        entry["points"].append(run_point(args, s, b, prof))
      except Exception as e:  # noqa: BLE001 -- recorded; the other points still run
        entry["points"].append({"system": name, "batch": b,
                                "error": f"{type(e).__name__}: {e}"[:500]})
      print(_point_line(entry["points"][-1]), flush=True)
      if checkpoint:
        checkpoint(result)
  return result


def _point_line(p: dict) -> str:
  if p.get("error"):
    return f"  {p['system']:12s} batch {p['batch']:4d}: {p['error']}"
  return (f"  {p['system']:12s} batch {p['batch']:4d}: {p['median_step_s'] * 1e3:8.2f} ms/step "
          f"{p['tokens_per_s']:9.1f} tok/s  admitted {p['peak_admitted']}  "
          f"({p['steps']} steps, {p['wall_s']:.0f} s)")


def ratios(result: dict) -> list[dict]:
  """Same-batch step-time ratios of each ula system to each reference system."""
  out = []
  systems = result["systems"]
  for ref in REFERENCES:
    if ref not in systems:
      continue
    ref_pts = {p["batch"]: p for p in systems[ref]["points"] if not p.get("error")}
    for name, entry in systems.items():
      if not name.startswith("ula"):
        continue
      for p in entry["points"]:
        r = ref_pts.get(p["batch"])
        if r and not p.get("error"):
          out.append({"system": name, "reference": ref, "batch": p["batch"],
                      "ratio": p["median_step_s"] / r["median_step_s"]})
  return out


def peak(entry: dict) -> dict | None:
  ok = [p for p in entry["points"] if not p.get("error")]
  return max(ok, key=lambda p: p["tokens_per_s"]) if ok else None


def report(result: dict) -> None:
  rows = []
  for name, e in result["systems"].items():
    pk = peak(e)
    rows.append([name, f"{e['dp']}x{e['tp']}", str(e["capacity"]["requests"]),
                 e["capacity"]["limit"], str(e["capacity"]["tokens_per_rank"]),
                 fmt(pk and pk["tokens_per_s"], 1), str(pk and pk["batch"])])
  env = result["environment"]
  print_table(f"capacity and peak, {result['devices']} x {env['device']}, context "
              f"{result['context']}, device {result['device_budget']} + host "
              f"{result['host_budget']} per device",
              ["system", "dp x tp", "capacity", "limit", "tokens / dp rank", "peak tok/s",
               "at batch"], rows, left=["system", "limit"])
  batches = sorted({p["batch"] for e in result["systems"].values() for p in e["points"]})
  rows = []
  for name, e in result["systems"].items():
    by = {p["batch"]: p for p in e["points"]}
    rows.append([name] + [("err" if by[b].get("error") else
                           f"{by[b]['tokens_per_s']:.0f} ({by[b]['median_step_s'] * 1e3:.1f})")
                          if b in by else "-" for b in batches])
  print_table("decode tokens/s (median ms per step) at each running batch",
              ["system"] + [str(b) for b in batches], rows, left=["system"])
  rs = ratios(result)
  if rs:
    print_table("same-batch step time, ula / resident",
                ["system", "reference", "batch", "ratio"],
                [[r["system"], r["reference"], str(r["batch"]), fmt(r["ratio"], 3)] for r in rs],
                left=["system", "reference"])
  profiled = [(name, p) for name, e in result["systems"].items() for p in e["points"]
              if p.get("profile")]
  for name, p in profiled:
    pr = p["profile"]
    print_table(f"{name} at batch {p['batch']}, per full-batch decode step under the profiler "
                f"(medians of {pr['steps']}): wall {fmt(pr.get('wall_us', 0) / 1e3, 3)} ms, "
                f"device busy {fmt(pr.get('device_busy_us', 0) / 1e3, 3)} ms",
                ["kind of kernel", "launches", "device ms"],
                [[k, fmt(n, 1), fmt(us / 1e3, 3)] for k, n, us in pr["top_kinds"][:12]],
                left=["kind of kernel"])


def plot(result: dict, path: str | pathlib.Path) -> pathlib.Path:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  path = pathlib.Path(path)
  fig = Figure(figsize=(7.5, 4.5))
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for name, e in result["systems"].items():
    ok = sorted((p for p in e["points"] if not p.get("error")), key=lambda p: p["batch"])
    if not ok:
      continue
    line, = ax.plot([p["batch"] for p in ok], [p["tokens_per_s"] for p in ok], marker="o",
                    label=f"{name} (capacity {e['capacity']['requests']})")
    pk = peak(e)
    ax.plot([pk["batch"]], [pk["tokens_per_s"]], marker="*", ms=14, color=line.get_color())
  ax.set_xscale("log", base=2)
  ax.set_xlabel("running batch (requests decoding, all devices)")
  ax.set_ylabel("decode tokens/s")
  env = result["environment"]
  ax.set_title(f"{result['devices']} x {env['device']}, context {result['context']}, "
               f"{result['model']} (top-k {result['top_k']})", fontsize="medium")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def merge(paths: list[str]) -> dict:
  """One result from several runs of this benchmark (e.g. systems run in turn).

  paths: ``serving.json`` files, each optionally followed by ``:sys1,sys2`` to take only
  those systems from it. A system in several files keeps the points of every file, one
  per running batch; for the same batch, and for the capacity, the later file wins.
  """
  out: dict = {}
  for spec in paths:
    path, _, only = spec.partition(":")
    part = json.loads(pathlib.Path(path).read_text())
    take = [s.strip() for s in only.split(",") if s.strip()] if only else list(part["systems"])
    missing = [s for s in take if s not in part["systems"]]
    if missing:
      raise ValueError(f"--merge {spec}: {path} has no system {missing}; it has "
                       f"{list(part['systems'])}")
    if not out:
      out = dict(part, systems={})
    for key in ("devices", "context", "device_budget", "host_budget", "model", "top_k"):
      if part[key] != out[key]:
        raise ValueError(f"--merge: {key} differs between {paths[0]} ({out[key]}) and "
                         f"{path} ({part[key]})")
    for name in take:
      entry = dict(part["systems"][name])
      if name in out["systems"]:
        points = {p["batch"]: p for p in out["systems"][name]["points"]}
        points.update({p["batch"]: p for p in entry["points"]})
        entry["points"] = [points[b] for b in sorted(points)]
      out["systems"][name] = entry
  return out


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench serving", description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*", help="config overrides a.b=value")
  p.add_argument("--config", default=DEFAULT_CONFIG)
  p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma list of {list(SYSTEMS)}")
  p.add_argument("--devices", type=int, default=None, help="devices G (default: all)")
  p.add_argument("--context", default="16K", help="tokens per request (prompt + output)")
  p.add_argument("--device-budget", default="64K",
                 help="KV per device: tokens, or bytes with a unit (e.g. 1GiB)")
  p.add_argument("--host-budget", default="128K", help="host KV per device, likewise")
  p.add_argument("--batches", default="1,2,4,8,16,32",
                 help="running batches (all devices) to measure below each capacity")
  p.add_argument("--max-rows", type=int, default=128, help="decode rows per dp rank, at most")
  p.add_argument("--decode-steps", type=int, default=16,
                 help="full-batch decode steps wanted after the last prefill")
  p.add_argument("--prefill-chunk", type=int, default=None,
                 help="prefill chunk (default: a whole prompt per step)")
  p.add_argument("--hisparse-buffer", type=int, default=None,
                 help="hisparse device_buffer_size (default: 2 x top-k)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench/serving", help="output folder")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="serve each system's capacity point once more under the profiler "
                 "(traces under DIR/SYSTEM) and add to it, per full-batch decode step, the "
                 "device's time by kernel")
  p.add_argument("--merge", nargs="+", default=None,
                 help="serving.json files to combine (no measurement); FILE:sys1,sys2 takes "
                 "only those systems from FILE; a system's points are combined by batch, "
                 "later files winning")
  return p


def main(argv: list[str]) -> int:
  parser = _parser()
  args = parser.parse_intermixed_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  from ula_jax.bench.common import write_json
  if args.merge:
    try:
      result = merge(args.merge)
    except (ValueError, KeyError, OSError) as e:
      parser.error(str(e))
  else:
    try:
      args.system_list = parse_list(args.systems, SYSTEMS, flag="--systems")
      args.context = parse_sizes(args.context, flag="--context", minimum=2)[0]
      args.batch_list = parse_sizes(args.batches, flag="--batches", minimum=1)
    except ValueError as e:
      parser.error(str(e))
    result = measure(args, checkpoint=lambda r: write_json(out / "serving.json", r))
  result["ratios"] = ratios(result)
  write_json(out / "serving.json", result)
  report(result)
  print(f"wrote {out / 'serving.json'} and {plot(result, out / 'serving.png')}")
  errors = [p for e in result["systems"].values() for p in e["points"] if p.get("error")]
  return 1 if errors else 0
