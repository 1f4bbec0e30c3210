"""Speculative decoding on one GPU: tokens against plain decoding, decode tokens/s and
the entries moved per verify step, for ``resident``, ``ula`` and ``hisparse``.

The trained small model (``experiments/train_small``) serves ``--batches`` rows of
held-out standard-library source (windows of ``--prompt`` tokens from the files its
training held out), ``--output`` tokens each, all arriving at once. For each system and
``num_draft`` of ``--drafts`` one engine runs the batch twice (the first run compiles);
the second run's steps where the whole batch decodes (after the last prefill) give the
decode tokens/s, and its hit and miss counters the entries fetched per decode or verify
step and row. Every system's tokens with each ``num_draft`` are compared with its own
``num_draft=0`` tokens and with ``resident``'s, request by request.

Pools are sized so that ``ula`` and ``hisparse`` miss: ``ula`` a device pool of
``--ula-device`` tokens per row (the rest in host memory), ``hisparse`` a buffer of
``--hisparse-buffer`` slots per request (it must hold one verify step's entries,
(1 + num_draft) x (top-k + 1)); the same pools for every ``num_draft``.

    python benchmarks/probes/gpu_speculative.py --json OUT.json [a.b=value ...]

Prints one line per run and a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


CONFIG = "experiments/train_small/config.yaml"


def windows(num: int, prompt: int, output: int, start_token: bool = False):
  """``num`` requests: evenly spaced ``prompt``-token windows of the held-out standard-
  library source the model was not trained on (``train.yaml``'s split); with
  ``start_token`` each starts with the document separator, as a model trained with
  ``data.start_token`` saw its windows."""
  from ula_jax.engine import Request
  from ula_jax.train.config import DataConfig
  from ula_jax.train.data import eval_windows, load_corpus, start_windows
  corpus = load_corpus(DataConfig(heldout_fraction=0.03))
  wins = eval_windows(corpus.heldout, num, prompt)
  if start_token:
    wins = start_windows(wins)
  if wins.shape[0] < num:
    raise SystemExit(f"the held-out text holds {wins.shape[0]} windows of {prompt} tokens, "
                     f"fewer than {num}")
  return [Request(id=f"w{i:03d}", prompt=w[:prompt].copy(), max_new_tokens=output)
          for i, w in enumerate(wins)]


def write(args, runs: list, tokens: dict) -> None:
  """Each run's tokens against its system's num_draft=0 run and resident's, then the
  JSON (written after every run, so a run cut short keeps what was measured)."""
  from ula_jax.bench.common import environment
  for row in runs:
    key = (row["batch"], row["system"], row["num_draft"])
    ref0 = tokens.get((row["batch"], row["system"], 0))
    res0 = tokens.get((row["batch"], "resident", 0))
    row["tokens_equal_num_draft_0"] = None if ref0 is None else tokens[key] == ref0
    row["tokens_equal_resident"] = None if res0 is None else tokens[key] == res0
  out = {"environment": environment(), "config": CONFIG, "overrides": args.overrides,
         "prompt": args.prompt, "start_token": args.start_token,
         "output": args.output or "auto",
         "ula_device_per_row": args.ula_device, "hisparse_buffer": args.hisparse_buffer,
         "runs": runs}
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--systems", default="resident,ula,hisparse")
  p.add_argument("--drafts", default="0,1,2,3")
  p.add_argument("--rate-drafts", default="0,2", help="num_draft values timed at every batch")
  p.add_argument("--batches", default="1,32")
  p.add_argument("--prompt", type=int, default=12288)
  p.add_argument("--output", type=int, default=None,
                 help="tokens per request (default: (1 + the largest timed num_draft) x "
                 "batch + 48, so that with every draft accepted the first request is still "
                 "decoding when the last prefill ends and full-batch steps exist to time)")
  p.add_argument("--ula-device", type=int, default=8448, help="ula device tokens per row")
  p.add_argument("--hisparse-buffer", type=int, default=8200)
  p.add_argument("--start-token", action="store_true",
                 help="each prompt starts with the document separator (for a model "
                      "trained with data.start_token, as the committed one)")
  p.add_argument("--json", default="speculative.json")
  args = p.parse_intermixed_args(argv)

  import jax
  from ula_jax.config import load_config
  from ula_jax.engine import Engine
  from ula_jax.mesh import build_mesh, configure_platform

  drafts = [int(d) for d in args.drafts.split(",")]
  rate_drafts = [int(d) for d in args.rate_drafts.split(",")]
  batches = [int(b) for b in args.batches.split(",")]
  runs, tokens = [], {}
  for B in batches:
    # One prefill per engine step: the first request decodes B - 1 steps before the
    # batch is full, up to 1 + num_draft tokens a step.
    output = args.output or (1 + max(rate_drafts)) * B + 48
    reqs = windows(B, args.prompt, output, args.start_token)
    context = -(-(args.prompt + output + 1) // 64) * 64  # whole pages
    for system in args.systems.split(","):
      # Every num_draft at the smallest batch for ula and hisparse (tokens); the timed
      # ones elsewhere.
      exact = B == min(batches) and system != "resident"
      for d in (drafts if exact else rate_drafts):
        over = [f"engine.max_batch={B}", f"engine.max_context={context}",
                "engine.progress=false", f"memory.system={system}",
                f"speculative.num_draft={d}", f"engine.prefill_chunk={args.prompt}"]
        if system == "ula":
          over += [f"memory.device_pool={B * args.ula_device}",
                   f"memory.host_pool={B * context}"]
        elif system == "hisparse":
          over += [f"memory.hisparse.device_buffer_size={args.hisparse_buffer}",
                   "memory.hisparse.host_to_device_ratio=4"]
        else:
          over += [f"memory.device_pool={B * context}"]
        cfg = load_config(CONFIG, over + args.overrides)
        configure_platform(cfg)
        engine = Engine(cfg, build_mesh(cfg), max_context=context)
        t0 = time.perf_counter()
        engine.run(reqs)
        first = time.perf_counter() - t0
        res = engine.run(reqs)
        last_prefill = max((m.step for m in res.steps if m.prefill_tokens), default=-1)
        full = [m for m in res.steps if m.step > last_prefill and m.running == B]
        dec_t = sum(m.decode_time_s for m in full)
        dec_n = sum(m.decode_tokens for m in full)
        misses = sum(m.extra.get("misses", 0) for m in full)
        hits = sum(m.extra.get("hits", 0) for m in full)
        spec = res.summary
        if not full:
          print(f"warning: batch {B}, {system}, num_draft {d}: no step after the last "
                f"prefill decodes the whole batch (requests of {output} tokens finished "
                f"first); nothing timed: raise --output", file=sys.stderr)
        row = {"batch": B, "system": system, "num_draft": d, "output": output,
               "first_run_s": round(first, 2),
               "full_steps": len(full),
               "decode_tokens_per_s": dec_n / dec_t if dec_t else None,
               "median_step_ms": 1e3 * statistics.median([m.decode_time_s for m in full])
               if full else None,
               "tokens_per_step_row": dec_n / max(1, len(full) * B),
               "misses_per_step_row": misses / max(1, len(full) * B),
               "hits_per_step_row": hits / max(1, len(full) * B),
               "acceptance_rate": spec.get("acceptance_rate"),
               "tokens_per_verify_step": spec.get("tokens_per_verify_step"),
               "mtp_weights": spec.get("mtp_weights")}
        tokens[(B, system, d)] = {r.id: list(r.output_tokens) for r in res.requests}
        runs.append(row)
        print(json.dumps(row), flush=True)
        write(args, runs, tokens)
        del engine
        jax.clear_caches()
  write(args, runs, tokens)
  print(f"{'B':>3} {'system':9} {'d':>2} {'tok/s':>9} {'ms/step':>8} {'tok/step':>8} "
        f"{'miss/row':>8} {'accept':>6} {'=d0':>4} {'=res':>4}")
  for r in runs:
    f = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"{r['batch']:>3} {r['system']:9} {r['num_draft']:>2} "
          f"{f(r['decode_tokens_per_s'], '9.1f')} {f(r['median_step_ms'], '8.2f')} "
          f"{r['tokens_per_step_row']:8.2f} {r['misses_per_step_row']:8.1f} "
          f"{f(r['acceptance_rate'], '6.3f')} {str(r['tokens_equal_num_draft_0'])[:4]:>4} "
          f"{str(r['tokens_equal_resident'])[:4]:>4}")
  bad = [r for r in runs if r["tokens_equal_num_draft_0"] is False
         or r["tokens_equal_resident"] is False]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
