"""Where a GLM-5-geometry decode step's time goes, per memory system, on one GPU.

``experiments/glm5_summarization/config.yaml`` (``glm5_narrow``: 78 layers, top-k 2048,
20 index groups) with synthetic prefill: ``--requests`` requests of ``--prompt`` tokens
and ``--output`` new tokens each, arriving together, served once under ``jax.profiler``
per system. For the decode steps after the first two (which compile and warm up) it
reports the median wall time, the device's busy time, the host's waits on the device,
the hit and miss counts per step, the device operations that take the most time per
step (``bench/profile.py``), and the device's peak memory in use.

    python benchmarks/probes/gpu_glm5_steps.py --json OUT.json [--systems ...] [a.b=v ...]
        [--decode-counts pallas]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time

CONFIG = "experiments/glm5_summarization/config.yaml"


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--systems", default="resident,ula_pb_lru,hisparse")
  p.add_argument("--requests", type=int, default=8)
  p.add_argument("--prompt", type=int, default=65536)
  p.add_argument("--output", type=int, default=24)
  p.add_argument("--trace-dir", default="/tmp/glm5_steps_trace")
  p.add_argument("--top", type=int, default=14)
  p.add_argument("--json", default="glm5_steps.json")
  p.add_argument("--decode-counts", choices=("xla", "pallas"), default=None,
                 help="the decode radix select's counting passes (decode.DECODE_COUNTS; "
                      "pallas: the Pallas counting kernel, not reachable from a config)")
  args = p.parse_intermixed_args(argv)

  import jax
  from ula_jax.bench.common import environment, overrides_for, same_length_requests
  from ula_jax.bench.profile import trace_calls
  from ula_jax.config import load_config
  from ula_jax.engine import Engine, resolve_max_context
  from ula_jax.memory import memory_stats
  from ula_jax.mesh import build_mesh, configure_platform
  if args.decode_counts:
    from ula_jax.kernels.indexer import decode
    decode.DECODE_COUNTS = args.decode_counts

  rows = {}
  for system in args.systems.split(","):
    mine = overrides_for(system, args.overrides)
    over = [f"memory={system}", "workload.prefill=synthetic", "engine.progress=false",
            f"engine.max_batch={args.requests}"] + mine
    cfg = load_config(CONFIG, over)
    configure_platform(cfg)
    reqs = same_length_requests(args.requests, args.prompt, args.output,
                                cfg.model.vocab_size, seed=0)
    t0 = time.perf_counter()
    try:
      engine = Engine(cfg, build_mesh(cfg), max_context=resolve_max_context(cfg))
      built = time.perf_counter() - t0
      tdir = f"{args.trace_dir}/{system}"
      shutil.rmtree(tdir, ignore_errors=True)
      with jax.profiler.trace(tdir, create_perfetto_trace=True):
        res = engine.run(reqs)
      wall = time.perf_counter() - t0
      prof = trace_calls(tdir, ("decode", "speculate"), also=("redo",), top=args.top)
    except Exception as e:  # noqa: BLE001 - one system's failure is reported, not fatal
      rows[system] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
      print(system, rows[system]["error"][:600], flush=True)
      jax.clear_caches()
      continue
    decoding = [m for m in res.steps if m.running > 0]
    calls = prof["calls"]
    if len(calls) != len(decoding):  # e.g. a CPU trace: the steps' own times only
      calls = [{"device_busy_us": 0.0, "device_ops": 0, "host_waits": 0}] * len(decoding)
    pairs = list(zip(calls, decoding))[2:]
    steady = [(c, m) for c, m in pairs if m.running == args.requests and not m.prefill_tokens]
    pick = steady or pairs
    if not pick:
      rows[system] = {"error": f"{len(decoding)} decode steps: raise --output"}
      continue
    stats = memory_stats(jax.devices()[0])
    rows[system] = {
        "engine_build_s": built, "run_wall_s": wall,
        "summary": {k: res.summary.get(k) for k in (
            "decode_tokens_per_s", "decode_time_s", "wall_time_s", "hit_rate",
            "peak_running", "capacity_tokens_per_rank", "compilation")},
        "steps_measured": len(pick),
        "median_step_ms": statistics.median(m.decode_time_s for _, m in pick) * 1e3,
        "median_device_busy_ms": statistics.median(c["device_busy_us"] for c, _ in pick) / 1e3,
        "median_device_ops": statistics.median(c["device_ops"] for c, _ in pick),
        "median_host_waits": statistics.median(c["host_waits"] for c, _ in pick),
        "misses_per_step": statistics.mean(m.extra.get("misses", 0) for _, m in pick),
        "hits_per_step": statistics.mean(m.extra.get("hits", 0) for _, m in pick),
        "top_ops_us_per_step": prof["top_ops"], "host_top": prof["host_top"][:8],
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "tokens": {r.id: list(r.output_tokens) for r in res.requests},
    }
    r = rows[system]
    print(f"{system}: step {r['median_step_ms']:.1f} ms, device busy "
          f"{r['median_device_busy_ms']:.1f} ms, {r['median_device_ops']:.0f} ops, "
          f"{r['median_host_waits']:.0f} host waits, misses/step {r['misses_per_step']:.0f}, "
          f"peak {(r['peak_bytes_in_use'] or 0) / 2**30:.1f} GiB", flush=True)
    for name, n, us in prof["top_ops"][:args.top]:
      print(f"    {us / 1e3:8.2f} ms  x{n:6.0f}  {name[:110]}")
    del engine
    jax.clear_caches()
  ref = rows.get("resident", {}).get("tokens")
  for r in rows.values():
    if "tokens" in r:
      r["tokens_equal_resident"] = None if ref is None else r["tokens"] == ref
      # Runs in other processes (other flags, other overrides) compare by this digest.
      r["tokens_sha256"] = hashlib.sha256(
          json.dumps(r.pop("tokens"), sort_keys=True).encode()).hexdigest()
  out = {"environment": environment(), "config": CONFIG, "overrides": args.overrides,
         "decode_counts": args.decode_counts,
         "requests": args.requests, "prompt": args.prompt, "output": args.output,
         "systems": rows}
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1, default=str)
  print(f"{'system':12} {'step ms':>8} {'busy ms':>8} {'ops':>6} {'waits':>5} "
        f"{'miss/step':>9} {'tok/s':>7} {'=res':>5}")
  for s, r in rows.items():
    if "error" in r:
      print(f"{s:12} failed: {r['error'][:80]}")
      continue
    print(f"{s:12} {r['median_step_ms']:8.1f} {r['median_device_busy_ms']:8.1f} "
          f"{r['median_device_ops']:6.0f} {r['median_host_waits']:5.0f} "
          f"{r['misses_per_step']:9.0f} {r['summary']['decode_tokens_per_s'] or 0:7.1f} "
          f"{str(r['tokens_equal_resident'])[:5]:>5}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
