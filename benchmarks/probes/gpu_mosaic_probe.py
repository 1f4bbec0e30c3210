"""Where the Mosaic GPU sparse attention's time goes, part by part (Hopper GPU).

Times the kernel (``mosaic.sparse_mla_attention_probe``) with parts of a tile step left
out, for each launch (``--configs``, the attention benchmark's Mosaic tokens) and
variant (``--variants``). The outputs of a variant other than ``full`` are not attention;
each variant keeps the data dependences of what it leaves in, so that nothing is
optimised away:

  full           the kernel as it is
  scores_only    scores (wgmma) and the online softmax, no output matmul
  no_softmax     scores and the output matmul, the probabilities are the raw scores
  outputs_only   softmax and output matmul over constant scores, no score matmul
  scores_nosoft  the score matmul alone

Suffix ``+c``: the compute ablation (each split's first two tiles gathered once and
reused: no copies in flight). Every variant's time includes the inputs' preparation,
not the splits' merge.

``--parts`` times, for each launch and batch, what one call is made of instead: the
whole call (merge included), the inputs' preparation alone (``mosaic._prepare``), the
kernel alone on prepared inputs (``mosaic._launch``), the splits' merge alone, and the
kernel over two tiles per split (what a program costs besides its tiles). Each part's
loop carries its first input from call to call (``looped``), which XLA may copy each
time: the call's and the kernel's times are the ones to compare (the preparation and
merge alone include such copies).

``--cupti`` times every kernel of a call by its own GPU duration (CUPTI), the kernel
alone at each of ``--ks`` and a device copy of the call's bytes; ``--timeline`` records
the kernel's named scopes per warpgroup in clock cycles (Mosaic GPU's profiler).

    PYTHONPATH=. python benchmarks/probes/gpu_mosaic_probe.py --configs auto,r232 \\
        --variants full,full+c,scores_only+c --out probe.json

Prints one line per run (fastest and median of 5 runs of 5 jitted loops of 16 calls,
microseconds per call) and writes them with the environment to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from ula_jax.bench.attention import parse_mosaic_config
from ula_jax.bench.common import best_and_median, environment, time_calls
from ula_jax.kernels.sparse_attention import mosaic as M

TIMING = dict(min_iters=5, max_iters=5, target_s=0.0, warmup=1)  # 5 loops
LOOP = 16  # calls per jitted loop (one dispatch per loop: the GPU's time, not the host's)
VARIANTS = ("full", "scores_only", "no_softmax", "outputs_only", "scores_nosoft")


def tile_step(variant: str):
  """The kernel's tile step (``sparse_mla_attention_probe``'s ``tile_step``) doing only
  part of a step; None for ``full`` (the kernel's own)."""
  if variant == "full":
    return None

  def step(q_smem, ring, pt_smem, meta_smem, s, t, w, scale2, m, l, acc_refs):
    if variant == "outputs_only":
      sc = plgpu.layout_cast(jnp.full((M.BLOCK_K, M.HALF), 0.5, jnp.float32),
                             plgpu.Layout.WGMMA)
    else:
      sc = M._rows_scores(q_smem, ring, meta_smem, s, w)
    alpha = None
    if variant in ("no_softmax", "outputs_only", "scores_nosoft"):
      p, l = sc, l + M._rows_warp_sums(sc)
    else:
      p, m, l, alpha = M._rows_softmax(sc, meta_smem, t, w, scale2, m, l)
    if variant not in ("scores_only", "scores_nosoft"):
      M._rows_outputs(p, ring, pt_smem, meta_smem, s, w, acc_refs, alpha)
    return m, l

  return step


def _parse_variant(token: str) -> tuple[str, bool]:
  """-> (variant, compute ablation)."""
  name, *flags = token.split("+")
  if name not in VARIANTS or any(f != "c" for f in flags) or len(flags) > 1:
    raise ValueError(f"--variants: {token!r}: expected one of {list(VARIANTS)}, "
                     "optionally with the suffix +c (compute ablation)")
  return name, bool(flags)


def make_inputs(B: int, k: int, S: int):
  """The kernel's arguments (queries, pool, slots, validity) at random, every entry valid."""
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  return (jax.random.normal(ks[0], (B, M.HEADS, M.LATENT), jnp.bfloat16),
          jax.random.normal(ks[1], (B, M.HEADS, M.ROPE), jnp.bfloat16),
          jax.random.normal(ks[2], (S, M.WIDTH), jnp.bfloat16),
          jax.random.randint(ks[3], (B, k), 0, S, jnp.int32), jnp.ones((B, k), bool))


def looped(f, steps: int = LOOP):
  """``steps`` calls of ``f(x, *rest)`` in one jitted loop, each call's ``x`` carrying a
  zero taken from the previous result (so that XLA can neither hoist nor merge them)."""

  def run(x, *rest):
    def body(_, carry):
      out = f(carry, *rest)
      leaf = jax.tree.leaves(out)[0]
      zero = (leaf.reshape(-1)[0] * 0).astype(carry.dtype)
      return carry.at[(0,) * carry.ndim].add(zero)

    return jax.lax.fori_loop(0, steps - 1, body, x), f(x, *rest)

  return jax.jit(run)


def _time(f, *args) -> tuple[float, float]:
  """(fastest, median) microseconds per call of f(*args), over 5 x 5 loops of ``LOOP``
  calls (``looped``)."""
  g = looped(f)
  return best_and_median(
      [time_calls(lambda _: g(*args), None, **TIMING)[0] * 1e6 / LOOP for _ in range(5)])


def parts(token: str, config, B: int, k: int, S: int) -> list[dict]:
  """What one call of launch ``config`` at batch B is made of (``--parts``)."""
  from ula_jax.kernels.sparse_attention.pallas import merge_splits_pallas
  q_lat, q_rope, pool, slots, valid = make_inputs(B, k, S)
  call = lambda *a: M.sparse_mla_attention_mosaic(*a, scale=0.1, config=config)
  prep = lambda ql, qr, sl, va: M._prepare(ql, qr, S, sl, va, config)
  merge = lambda o, lse: merge_splits_pallas(o, lse, interpret=False)
  q, sl, bits = jax.block_until_ready(jax.jit(prep)(q_lat, q_rope, slots, valid))
  # The queries' two parts passed apart: looped's carry is one array.
  launch = lambda ql, qr, *a: M._launch((ql, qr), *a, scale=0.1, config=config)
  o, lse = jax.block_until_ready(jax.jit(launch)(*q, pool, sl, bits))
  two = 2 * M.BLOCK_K * sl.shape[1]  # two tiles per split
  tiles2 = jax.block_until_ready(jax.jit(prep)(q_lat, q_rope, slots[:, :two], valid[:, :two]))
  timed = [("call", call, (q_lat, q_rope, pool, slots, valid)),
           ("prepare", prep, (q_lat, q_rope, slots, valid)),
           ("kernel", launch, (*q, pool, sl, bits)),
           ("kernel, two tiles per split", launch, (*tiles2[0], pool, *tiles2[1:]))]
  if o.shape[1] > 1:
    timed.append(("merge", merge, (o, lse)))
  rows = []
  for part, f, args in timed:
    best, median = _time(f, *args)
    rows.append({"config": token, "batch": B, "part": part, "splits": int(o.shape[1]),
                 "us": best, "median_us": median})
    print(f"{token}:b{B}:{part:30s} {best:8.1f} us  median {median:8.1f}", flush=True)
  return rows


def gpu_kernels(f, *args, iterations: int = 10) -> list[tuple[str, float, float]]:
  """(kernel name, fastest, median microseconds) of every kernel one call of ``f``
  launches, from CUPTI (the GPU's own durations: no launch gaps, no host)."""
  import numpy as np
  from jax.experimental.mosaic.gpu import profiler
  _, timings = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
  names = [n for n, _ in timings[0]]
  us = np.asarray([[t for _, t in it] for it in timings]) * 1e3
  return [(n, float(us[:, i].min()), float(np.median(us[:, i])))
          for i, n in enumerate(names)]


def cupti(token: str, config, B: int, ks: list[int], S: int) -> list[dict]:
  """Every kernel of one call, of the kernel alone at each k, and of a device copy of
  the call's bytes (read and written), timed by CUPTI (``--cupti``)."""
  rows = []

  def record(what, k, path, kernels):
    total = sum(t for _, t, _ in kernels)
    for name, best, median in kernels:
      rows.append({"config": token, "batch": B, "k": k, "what": what, "path": path,
                   "kernel": name, "us": best, "median_us": median})
      print(f"{token}:b{B}:k{k}:{what}:{path}  {name[:48]:48s} {best:8.1f} us  "
            f"median {median:8.1f}", flush=True)
    print(f"{token}:b{B}:k{k}:{what}:{path}  {'(sum of fastest)':48s} {total:8.1f} us",
          flush=True)

  q_lat, q_rope, pool, slots, valid = make_inputs(B, max(ks), S)
  k_call = 2048 if 2048 in ks else ks[0]
  call = lambda *a: M.sparse_mla_attention_mosaic(*a, scale=0.1, config=config)
  record("call", k_call, "-", gpu_kernels(call, q_lat, q_rope, pool, slots[:, :k_call],
                                          valid[:, :k_call]))
  prep = jax.jit(lambda ql, qr, sl, va: M._prepare(ql, qr, S, sl, va, config))
  launch = lambda q, *a: M._launch(q, *a, scale=0.1, config=config)
  for k in ks:
    q, sl, bits = jax.block_until_ready(prep(q_lat, q_rope, slots[:, :k], valid[:, :k]))
    record("kernel", k, "prepared", gpu_kernels(launch, q, pool, sl, bits))
  buf = jnp.zeros((B * k_call * M.WIDTH * 2 // 4,), jnp.uint32)  # the call's rows' bytes
  record("copy", k_call, "-", gpu_kernels(lambda b: b ^ jnp.uint32(1), buf))
  return rows


def timeline(token: str, config, B: int, k: int, S: int, folder: str) -> list[dict]:
  """One call with the kernel's named scopes recorded per warpgroup (``--timeline``):
  each scope's cycles (fastest, median, slowest over programs and iterations) and when
  the programs started."""
  import glob
  import os
  os.makedirs(folder, exist_ok=True)
  tiles = -(-k // (M.BLOCK_K * config.splits(B)))
  f = jax.jit(lambda *a: M.sparse_mla_attention_probe(*a, scale=0.1, config=config,
                                                      profile=(tiles + 8, folder)))
  jax.block_until_ready(f(*make_inputs(B, k, S)))
  jax.effects_barrier()
  path = max(glob.glob(os.path.join(folder, "*-trace.json")), key=os.path.getmtime)
  with open(path) as fh:
    return trace_rows(token, B, k, json.load(fh)["traceEvents"])


def trace_rows(token: str, B: int, k: int, events: list[dict]) -> list[dict]:
  """``--timeline``'s summary of one Mosaic GPU profiler trace: how far apart the
  warpgroups started, and per named scope its cycles per occurrence (fastest, median,
  slowest) and per warpgroup (summed over the occurrences)."""
  import numpy as np
  spans, starts, open_ = {}, {}, {}
  for e in events:  # ts: the program's start (ns) plus cycles since, over 1000
    key = (e["tid"], e["name"])
    starts.setdefault(e["tid"], e["ts"])
    if e["ph"] == "B":
      open_[key] = e["ts"]
    else:
      spans.setdefault(e["name"], []).append((e["tid"], (e["ts"] - open_.pop(key)) * 1e3))
  first = np.asarray(sorted(starts.values())) * 1e3  # ns (global timer)
  print(f"{token}:b{B}: {len(starts)} warpgroups started over "
        f"{(first[-1] - first[0]) / 1e3:.2f} us", flush=True)
  rows = [{"config": token, "batch": B, "k": k, "scope": "(start spread)",
           "ns": float(first[-1] - first[0])}]
  for name, recorded in sorted(spans.items()):
    c = np.asarray([v for _, v in recorded])
    totals = {}
    for tid, v in recorded:
      totals[tid] = totals.get(tid, 0.0) + v
    per = np.asarray(list(totals.values()))  # per warpgroup, summed over iterations
    rows.append({"config": token, "batch": B, "k": k, "scope": name, "count": len(c),
                 "cycles_min": float(c.min()), "cycles_median": float(np.median(c)),
                 "cycles_max": float(c.max()),
                 "cycles_per_warpgroup_median": float(np.median(per)),
                 "cycles_per_warpgroup_max": float(per.max())})
    print(f"{token}:b{B}: {name:12s} x{len(c):6d}  cycles min {c.min():9.0f}  median "
          f"{np.median(c):9.0f}  max {c.max():9.0f}  per warpgroup median "
          f"{np.median(per):9.0f} max {per.max():9.0f}", flush=True)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", default="auto", help="Mosaic launch tokens, comma list")
  p.add_argument("--variants", default="full,full+c", help="comma list")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--pool-rows", type=int, default=262144)
  p.add_argument("--parts", default=None,
                  help="batches (comma list): time the parts of a call instead")
  p.add_argument("--cupti", default=None,
                 help="batches (comma list): every kernel of a call timed by CUPTI instead "
                      "(the kernel alone at each of --ks, a copy)")
  p.add_argument("--ks", default="2048", help="--cupti: selected entries, comma list")
  p.add_argument("--timeline", default=None,
                 help="batches (comma list): the kernel's named scopes per warpgroup "
                      "(Mosaic GPU's profiler; traces under --trace-dir)")
  p.add_argument("--trace-dir", default="mosaic_traces")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  configs = [(t, parse_mosaic_config(t)) for t in args.configs.split(",") if t]
  variants = [_parse_variant(t) for t in args.variants.split(",") if t]
  B, k, S = args.batch, args.k, args.pool_rows
  rows = []
  ks = [int(x) for x in args.ks.split(",") if x]
  if not ks or any(x < 1 for x in ks):
    raise ValueError(f"--ks={args.ks!r}: expected a comma list of positive integers")
  for flag, value in (("cupti", args.cupti), ("timeline", args.timeline)):
    for token, config in (configs if value else []):
      for b in [int(x) for x in value.split(",") if x]:
        rows += (cupti(token, config, b, ks, S) if flag == "cupti" else
                 timeline(token, config, b, k, S, args.trace_dir))
  if args.cupti or args.timeline:
    variants = []
  if args.parts:
    for token, config in configs:
      for b in [int(x) for x in args.parts.split(",") if x]:
        rows += parts(token, config, b, k, S)
    variants = []
  inputs = make_inputs(B, k, S) if variants else None
  for token, config in configs:
    for name, compute in variants:
      f = lambda *a: M.sparse_mla_attention_probe(
          *a, scale=0.1, config=config, tile_step=tile_step(name),
          ablation="compute" if compute else None)[0]
      best, median = _time(f, *inputs)
      label = f"{token}:{name}" + ("+c" if compute else "")
      rows.append({"config": token, "variant": name, "compute_ablation": compute,
                   "us": best, "median_us": median})
      print(f"{label:28s} {best:8.1f} us  median {median:8.1f}", flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({"benchmark": "mosaic_probe", "environment": environment(), "batch": B,
                 "k": k, "pool_rows": S, "rows": rows}, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
