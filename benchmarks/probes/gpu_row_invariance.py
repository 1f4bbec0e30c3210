"""Does a request compute the same bits whatever batch row it decodes in, and whatever
memory system's program runs it? GLM-5 geometry on one GPU.

``experiments/glm5_summarization/config.yaml`` with synthetic prefill and
``engine.record_digests``: ``--requests`` requests of ``--prompt`` tokens, ``--output``
new tokens each, all admitted at once into ``--requests`` rows. One target request is
served three times: ``resident`` admitted first (row 0), ``resident`` admitted last (the
last row, the same compiled program), and under each of ``--systems`` admitted first.
For each pair against the first run it prints the first digest difference of the
target (``ula-jax compare``'s wording) and whether its tokens agree: a difference
between the two ``resident`` runs is a row or batch dependence of the model's numerics;
one between ``resident`` and another system with none between the ``resident`` runs is a
dependence on the program around the model (or a memory-system error, when the stored
entries read differ).

    python benchmarks/probes/gpu_row_invariance.py --json OUT.json [a.b=v ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

CONFIG = "experiments/glm5_summarization/config.yaml"


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--systems", default="ula_pb_lru,hisparse",
                 help="memory presets, comma-separated; PRESET:a.b=v:c.d=w serves PRESET "
                      "with those overrides as well")
  p.add_argument("--requests", type=int, default=4)
  p.add_argument("--prompt", type=int, default=65536)
  p.add_argument("--output", type=int, default=32)
  p.add_argument("--json", default="row_invariance.json")
  args = p.parse_intermixed_args(argv)

  from ula_jax.bench.common import environment, overrides_for, same_length_requests
  from ula_jax.config import load_config
  from ula_jax.engine import Engine, resolve_max_context
  from ula_jax.mesh import build_mesh, configure_platform
  from ula_jax.report.compare import first_digest_difference, group_digests

  def serve(spec: str, target_last: bool, engine=None):
    system, *extra = spec.split(":")
    mine = overrides_for(system, args.overrides) + extra
    cfg = load_config(CONFIG, [f"memory={system}", "engine.progress=false",
                               "engine.record_digests=true",
                               f"engine.max_batch={args.requests}"] + mine)
    configure_platform(cfg)
    reqs = same_length_requests(args.requests, args.prompt, args.output,
                                cfg.model.vocab_size, seed=0)
    if engine is None:
      engine = Engine(cfg, build_mesh(cfg), max_context=resolve_max_context(cfg))
    order = list(reqs[1:]) + [reqs[0]] if target_last else list(reqs)
    result = engine.run(order)
    tokens = {r.id: list(r.output_tokens) for r in result.requests}
    return engine, reqs[0].id, tokens, result.digests

  engine, target, tok_ref, dig_ref = serve("resident", target_last=False)
  runs = {"resident, target last": serve("resident", True, engine)[2:]}
  del engine
  for system in args.systems.split(","):
    runs[f"{system}, target first"] = serve(system, False)[2:]
    gc.collect()  # the engine's pools go before the next system's are allocated
  rows = []
  ref = group_digests(dig_ref)[target]
  for name, (tokens, digests) in runs.items():
    where = first_digest_difference(ref, group_digests(digests)[target])
    rows.append({"run": name, "first_difference": where or "none",
                 "tokens_equal": tokens[target] == tok_ref[target]})
  out = {"environment": environment(), "target": target, "requests": args.requests,
         "prompt": args.prompt, "output": args.output, "rows": rows}
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"target {target}: against resident with the target in row 0")
  for r in rows:
    print(f"{r['run']:<28} tokens equal: {str(r['tokens_equal']):<5}  first difference: "
          f"{r['first_difference']}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
