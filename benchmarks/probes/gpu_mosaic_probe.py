"""Where the Mosaic GPU sparse attention's time goes, part by part (Hopper GPU).

Times ``sparse_mla_attention_mosaic`` with parts of a tile step replaced, for each
launch form (``--configs``, the attention benchmark's Mosaic tokens) and variant
(``--variants``). The outputs of a variant other than ``full`` are not attention; each
variant keeps the data dependences of what it leaves in, so that nothing is optimised
away:

  full           the kernel as it is
  scores_only    scores (wgmma) and the online softmax, no output matmul
  no_softmax     scores and the output matmul, the probabilities are the raw scores
  outputs_only   softmax and output matmul over constant scores, no score matmul
  scores_nosoft  the score matmul alone

For the TMA row form (tokens with ``t1``) the same variants replace its tile step
(``mosaic._rows_tile_step``).

Suffixes: ``+c`` the benchmark's 'compute' ablation (the first tiles gathered once and
reused: no copies in flight), ``+nw`` no step waits for its copies to land (the
results are then wrong; the time says whether waiting, or issuing, is what costs;
``cp.async`` forms only), ``+fN`` the row form with N ``wgmma`` calls left in flight
before the next register operand is loaded (``mosaic._IN_FLIGHT``; N + 1 live),
``+k16`` its register operands 16 columns wide (``mosaic._FRAG_K``: one ``ldmatrix``
and one ``wgmma`` instruction each, instead of four), ``+dd`` / ``+sd`` its shared-memory
operands at offsets read from the zero word or at static ones
(``mosaic._DYNAMIC_DESCRIPTORS`` on / off), ``+nz``
the row form's ``ldmatrix`` addresses without the zero word (``mosaic._VOLATILE_BASE``
off: the compiler may hoist them), ``+qc`` the row forms' queries concatenated before
the launch (``mosaic._QUERY_PARTS`` off: one buffer instead of the latent and rope parts
as given). Every variant's time includes the inputs' preparation, not the splits' merge.

``--parts`` times, for each launch form and batch, what one call is made of instead: the
whole call (merge included), the inputs' preparation alone (``mosaic._prepare``), the
kernel alone on prepared inputs (``mosaic._launch``), the splits' merge alone, and the
kernel over two tiles per split (what a program costs besides its tiles); ``--concat``
with the queries concatenated (``mosaic._QUERY_PARTS`` off). Each part's loop carries its first input from call to
call (``looped``), which XLA may copy each time: the call's and the kernel's times are
the ones to compare (the preparation and merge alone include such copies).

    PYTHONPATH=. python benchmarks/probes/gpu_mosaic_probe.py --configs auto,k32 \\
        --variants full,full+nw,full+c,scores_only+c --out probe.json

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
_TILE_STEP, _WAIT_GROUPS = M._tile_step, M._wait_groups
_ROWS_TILE_STEP, _IN_FLIGHT, _VOLATILE = M._rows_tile_step, M._IN_FLIGHT, M._VOLATILE_BASE
_FRAG_K, _DYNAMIC, _PARTS = M._FRAG_K, M._DYNAMIC_DESCRIPTORS, M._QUERY_PARTS
INPUT_PATHS = {"parts": True, "concatenated": False}  # the queries: mosaic._QUERY_PARTS
_ISSUERS = M._ISSUERS


def _tile_step(variant: str):
  """A replacement of ``mosaic._tile_step`` that does only part of a step."""

  def step(q_smem, stage, bits_smem, t, w, scale2, m, l, acc, block_k=M.BLOCK_K):
    if variant == "full":
      return _TILE_STEP(q_smem, stage, bits_smem, t, w, scale2, m, l, acc, block_k)
    if variant == "outputs_only":
      sc = plgpu.layout_cast(jnp.full((M.HEADS, block_k), 0.5, jnp.float32),
                             plgpu.Layout.WGMMA)
    else:
      sc = M._scores(q_smem, stage, block_k)
    if variant in ("no_softmax", "outputs_only", "scores_nosoft"):
      p, m = sc, m + sc.max(axis=1)
    else:
      m, l, acc, p = M._softmax_update(sc, m, l, acc)
    if variant in ("scores_only", "scores_nosoft"):
      return m, l, acc + jax.lax.broadcast_in_dim(p.sum(axis=1), acc.shape, [0])
    return m, l, M._outputs(p, stage, w, acc)

  return step


def _rows_tile_step(variant: str):
  """A replacement of ``mosaic._rows_tile_step`` that does only part of a step."""

  def step(q_smem, ring, pt_smem, meta_smem, s, t, w, scale2, m, l, acc_refs):
    if variant == "full":
      return _ROWS_TILE_STEP(q_smem, ring, pt_smem, meta_smem, s, t, w, scale2, m, l,
                             acc_refs)
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


def _parse_variant(token: str) -> tuple[str, bool, bool, int | None, bool, bool,
                                        bool | None, bool]:
  """-> (variant, compute ablation, no copy waits, wgmma calls in flight or None,
  no zero word, 16-column operands, dynamic descriptors or None: the kernel's, the row
  forms' queries concatenated)."""
  name, *flags = token.split("+")
  flight = [f for f in flags if f[:1] == "f" and f[1:].isdigit() and int(f[1:]) >= 1]
  if (name not in VARIANTS or len(flight) > 1
      or ("dd" in flags and "sd" in flags)
      or any(f not in ("c", "nw", "nz", "k16", "dd", "sd", "qc", *flight) for f in flags)):
    raise ValueError(f"--variants: {token!r}: expected one of {list(VARIANTS)} with "
                     "optional suffixes +c (compute ablation), +nw (no copy waits), "
                     "+fN (N wgmma calls in flight), +nz (no zero word), +k16 "
                     "(16-column register operands), +qc (queries concatenated) and one of "
                     "+dd / +sd (dynamic / static descriptors)")
  dyn = True if "dd" in flags else False if "sd" in flags else None
  return (name, "c" in flags, "nw" in flags, int(flight[0][1:]) if flight else None,
          "nz" in flags, "k16" in flags, dyn, "qc" in flags)


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
  # (queries prepared as a pair, ``mosaic._QUERY_PARTS``, are flattened here: looped's
  # carry is one array)
  n_q = len(q) if isinstance(q, tuple) else 1
  launch = lambda *a: M._launch(a[:n_q] if n_q > 1 else a[0], *a[n_q:], scale=0.1,
                                config=config, ablation=None)
  flat = lambda q: tuple(q) if n_q > 1 else (q,)
  o, lse = jax.block_until_ready(jax.jit(launch)(*flat(q), pool, sl, bits))
  two = 2 * M.BLOCK_K * sl.shape[1]  # two tiles per split
  tiles2 = jax.block_until_ready(jax.jit(prep)(q_lat, q_rope, slots[:, :two], valid[:, :two]))
  timed = [("call", call, (q_lat, q_rope, pool, slots, valid)),
           ("prepare", prep, (q_lat, q_rope, slots, valid)),
           ("kernel", launch, (*flat(q), pool, sl, bits)),
           ("kernel, two tiles per split", launch, (*flat(tiles2[0]), pool, *tiles2[1:]))]
  if o.shape[1] > 1:
    timed.append(("merge", merge, (o, lse)))
  rows = []
  for part, f, args in timed:
    best, median = _time(f, *args)
    rows.append({"config": token, "batch": B, "part": part, "splits": int(o.shape[1]),
                 "us": best, "median_us": median})
    print(f"{token}:b{B}:{part:30s} {best:8.1f} us  median {median:8.1f}", flush=True)
  return rows


def _input_path(name: str) -> None:
  M._QUERY_PARTS = INPUT_PATHS[name]


def _restore() -> None:
  """Every kernel knob the probe sets back to the module's own."""
  M._tile_step, M._wait_groups = _TILE_STEP, _WAIT_GROUPS
  M._rows_tile_step, M._IN_FLIGHT, M._VOLATILE_BASE = _ROWS_TILE_STEP, _IN_FLIGHT, _VOLATILE
  M._FRAG_K, M._DYNAMIC_DESCRIPTORS, M._QUERY_PARTS = _FRAG_K, _DYNAMIC, _PARTS
  M._PROFILE, M._ISSUERS = None, _ISSUERS


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


def cupti(token: str, config, B: int, ks: list[int], S: int, paths: list[str],
          issuers: list[int]) -> list[dict]:
  """Every kernel of one call (each input path and count of issuing warps), of the
  kernel alone at each k, and of a device copy of the call's bytes (read and written),
  timed by CUPTI (``--cupti``)."""
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
  for path in paths:
    for n in issuers:
      _input_path(path)
      M._ISSUERS = n
      try:
        record("call", k_call, f"{path},{n} issuers", gpu_kernels(
            call, q_lat, q_rope, pool, slots[:, :k_call], valid[:, :k_call]))
      finally:
        _restore()
  prep = jax.jit(lambda ql, qr, sl, va: M._prepare(ql, qr, S, sl, va, config))
  launch = lambda q, *a: M._launch(q, *a, scale=0.1, config=config, ablation=None)
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
  M._PROFILE = (tiles + 8, folder)
  try:
    f = jax.jit(lambda *a: M.sparse_mla_attention_mosaic(*a, scale=0.1, config=config,
                                                         merge=False))
    jax.block_until_ready(f(*make_inputs(B, k, S)))
    jax.effects_barrier()
  finally:
    _restore()
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
  p.add_argument("--variants", default="full,full+nw,full+c", help="comma list")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--pool-rows", type=int, default=262144)
  p.add_argument("--parts", default=None,
                  help="batches (comma list): time the parts of a call instead")
  p.add_argument("--concat", action="store_true",
                  help="--parts with the row forms' queries concatenated (mosaic._QUERY_PARTS "
                       "off)")
  p.add_argument("--cupti", default=None,
                 help="batches (comma list): every kernel of a call timed by CUPTI instead "
                      "(input paths --paths, the kernel alone at each of --ks, a copy)")
  p.add_argument("--paths", default="parts,concatenated",
                 help=f"--cupti: input paths, comma list of {list(INPUT_PATHS)}")
  p.add_argument("--ks", default="2048", help="--cupti: selected entries, comma list")
  p.add_argument("--issuers", default=str(_ISSUERS),
                 help="--cupti: the producer's warps that issue row copies, comma list "
                      "(mosaic._ISSUERS: 1, 2 or 4)")
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
  paths = [t for t in args.paths.split(",") if t]
  if any(t not in INPUT_PATHS for t in paths):
    raise ValueError(f"--paths={args.paths!r}: expected a comma list of {list(INPUT_PATHS)}")
  ks = [int(x) for x in args.ks.split(",") if x]
  issuers = [int(x) for x in args.issuers.split(",") if x]
  if any(n not in (1, 2, 4) for n in issuers):
    raise ValueError(f"--issuers={args.issuers!r}: expected a comma list of 1, 2, 4")
  for flag, value in (("cupti", args.cupti), ("timeline", args.timeline)):
    for token, config in (configs if value else []):
      for b in [int(x) for x in value.split(",") if x]:
        rows += (cupti(token, config, b, ks, S, paths, issuers) if flag == "cupti" else
                 timeline(token, config, b, k, S, args.trace_dir))
  if args.cupti or args.timeline:
    variants = []
  if args.parts:
    M._QUERY_PARTS = _PARTS and not args.concat
    try:
      for token, config in configs:
        for b in [int(x) for x in args.parts.split(",") if x]:
          rows += parts(token, config, b, k, S)
    finally:
      _restore()
    variants = []
  inputs = make_inputs(B, k, S) if variants else None
  try:
    for token, config in configs:
      for name, compute, nowait, flight, nozero, k16, dyn, concat in variants:
        M._tile_step, M._rows_tile_step = _tile_step(name), _rows_tile_step(name)
        M._IN_FLIGHT = flight or _IN_FLIGHT
        M._VOLATILE_BASE = _VOLATILE and not nozero
        M._FRAG_K = 16 if k16 else _FRAG_K
        M._DYNAMIC_DESCRIPTORS = _DYNAMIC if dyn is None else dyn
        M._QUERY_PARTS = _PARTS and not concat
        M._wait_groups = (lambda pending: (lambda ctx: None)) if nowait else _WAIT_GROUPS
        f = lambda *a: M.sparse_mla_attention_mosaic(
            *a, scale=0.1, config=config, merge=False,
            ablation="compute" if compute else None)[0]
        best, median = _time(f, *inputs)
        label = (f"{token}:{name}" + ("+c" if compute else "") + ("+nw" if nowait else "")
                 + (f"+f{flight}" if flight else "") + ("+nz" if nozero else "")
                 + ("+k16" if k16 else "")
                 + ("" if dyn is None else "+dd" if dyn else "+sd")
                 + ("+qc" if concat else ""))
        rows.append({"config": token, "variant": name, "compute_ablation": compute,
                     "no_copy_waits": nowait, "in_flight": M._IN_FLIGHT,
                     "zero_word": M._VOLATILE_BASE, "operand_k": M._FRAG_K,
                     "dynamic_descriptors": M._DYNAMIC_DESCRIPTORS,
                     "query_parts": M._QUERY_PARTS, "us": best,
                     "median_us": median})
        print(f"{label:28s} {best:8.1f} us  median {median:8.1f}", flush=True)
  finally:
    _restore()
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({"benchmark": "mosaic_probe", "environment": environment(), "batch": B,
                 "k": k, "pool_rows": S, "rows": rows}, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
