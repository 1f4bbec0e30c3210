"""The GPU's memory in use around an engine's first steps at GLM-5 geometry (one system,
one process): after the engine is built, then after each of the first ``--steps`` engine
steps (synthetic prefill chunks, then decode steps), and at a failure, with the error.
A program that copies a pool shows up as a jump of the pool's size in the peak.

    python benchmarks/probes/gpu_prefill_memory.py [--requests 1] [--prompt 65536] \\
        memory=ula_pb_lru memory.device_pool=8GiB memory.host_pool=40GiB
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

CONFIG = "experiments/glm5_summarization/config.yaml"


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--requests", type=int, default=1)
  p.add_argument("--prompt", type=int, default=65536)
  p.add_argument("--output", type=int, default=2)
  p.add_argument("--steps", type=int, default=12)
  args = p.parse_intermixed_args(argv)

  import jax
  from ula_jax.bench.common import same_length_requests
  from ula_jax.config import load_config
  from ula_jax.engine import Engine, resolve_max_context
  from ula_jax.memory import memory_stats
  from ula_jax.mesh import build_mesh, configure_platform

  gib = 2.0 ** 30
  t0 = time.perf_counter()

  def mem(tag: str) -> None:
    s = memory_stats(jax.devices()[0])
    print(f"[{time.perf_counter() - t0:7.1f}s] {tag}: in use "
          f"{s.get('bytes_in_use', 0) / gib:7.2f} GiB, peak "
          f"{s.get('peak_bytes_in_use', 0) / gib:7.2f} GiB, largest alloc "
          f"{s.get('largest_alloc_size', 0) / gib:7.2f} GiB", flush=True)

  cfg = load_config(CONFIG, ["workload.prefill=synthetic", "engine.progress=false",
                             f"engine.max_batch={args.requests}"] + args.overrides)
  configure_platform(cfg)
  mem("start")
  engine = Engine(cfg, build_mesh(cfg), max_context=resolve_max_context(cfg))
  for x in jax.tree.leaves(engine.state):
    if x.nbytes >= 1 << 30:
      print(f"  state leaf {tuple(x.shape)} {x.dtype} {x.sharding.memory_kind} "
            f"{x.nbytes / gib:.2f} GiB")
  mem("engine built")
  reqs = same_length_requests(args.requests, args.prompt, args.output,
                              cfg.model.vocab_size, seed=0)
  count = [0]

  def on_step(m) -> None:
    count[0] += 1
    if count[0] <= args.steps:
      mem(f"step {m.step} {m.kind} (prefill tokens {m.prefill_tokens}, running {m.running})")

  try:
    res = engine.run(reqs, on_step=on_step)
    mem("run finished")
    print("summary:", {k: res.summary.get(k) for k in ("decode_tokens_per_s", "wall_time_s",
                                                        "finished", "hit_rate")})
  except Exception:  # noqa: BLE001 - the failure is the finding
    mem("failed")
    traceback.print_exc(limit=6)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
