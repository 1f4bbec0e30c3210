"""Benchmark: sparse MLA decode attention (one layer, one decode step).

Per batch size and implementation: the bytes a step must read (the k selected pool rows
of every request and the queries) per second, as a fraction of the memory traffic
(read + write) of a device-to-device copy of the same bytes measured in the same run.

Both sides run ``--loop`` times inside one jitted loop, each iteration depending on the
previous one, so the times are the GPU's (launch gaps included, as in a decode step
that runs every layer in one program) and not Python's dispatch. Every measurement is
repeated ``--reps`` times, interleaved; ``fraction`` compares the fastest repetitions,
``median frac`` the medians. ``max err`` is the largest difference from the jnp
reference. Each Pallas row also records its launch (head block, splits, programs), what it
moves and computes beyond the must-read bytes (split partials, re-gathered rows, FLOPs)
and the launch model's estimate, which is what explains a rate below the target.
``--impls mosaic`` adds the Mosaic GPU kernel (Hopper GPUs, 64 heads of 512 + 64
columns), ``--mosaic-configs`` its launches.

    ula-jax bench attention [--batch 1,8,32,64,128,256] [--heads 64] [--k 2048]
                            [--configs auto,h64k64w8,h32k64w8s1] [--impls xla,pallas,mosaic]
                            [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.bench import common
from ula_jax.bench.common import (add_timing_args, best_and_median, environment, fmt,
                                  parse_list, parse_sizes, time_calls, write_json)
from ula_jax.core import kv_layout as kv_layout_lib
from ula_jax.kernels.sparse_attention.pallas import (AttentionConfig, attention_cost,
                                                     bytes_read, sparse_mla_attention_pallas)
from ula_jax.kernels.sparse_attention.mosaic import (MosaicAttentionConfig,
                                                     sparse_mla_attention_mosaic)
from ula_jax.kernels.sparse_attention.reference import sparse_mla_attention_reference

IMPLS = ("xla", "pallas", "mosaic")  # mosaic: the Mosaic GPU kernel (Hopper GPUs)
DEFAULT_IMPLS = ("xla", "pallas")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
COPY = "device copy"  # impl label of the ceiling rows
_CONFIG_FIELDS = {"h": "block_h", "k": "block_k", "w": "num_warps", "s": "num_splits",
                  "n": "num_stages", "p": "preload_slots"}


@dataclasses.dataclass
class Row:
  batch: int
  impl: str
  bytes_read: int  # must-read bytes (the ceiling copies this many)
  seconds: float | None = None  # per step, fastest repetition
  median_seconds: float | None = None
  reps: int = 0
  read_gbps: float | None = None
  copy_gbps: float | None = None  # read + write traffic of the device copy
  fraction: float | None = None
  median_fraction: float | None = None
  tflops: float | None = None
  max_err: float | None = None
  # Pallas launch and extra traffic (attention_cost)
  block_h: int | None = None
  splits: int | None = None
  programs: int | None = None
  num_warps: int | None = None
  partial_bytes: int | None = None
  row_reads: int | None = None
  flops: int | None = None
  model_us: float | None = None  # the launch model's estimate (what the launch was chosen by)
  error: str | None = None


def _parse_tokens(token: str, config: type, fields: dict[str, str], *, flag: str,
                  example: str):
  """'auto' -> ``config()``; letters of ``fields``, each followed by a number (any
  subset, any order) -> ``config`` with those fields."""
  token = token.strip()
  if token == "auto":
    return config()
  parts = re.findall(r"([a-z])(\d+)", token)
  if not parts or "".join(f"{a}{b}" for a, b in parts) != token or any(
      a not in fields for a, _ in parts):
    letters = ", ".join(f"{a} ({name})" for a, name in fields.items())
    raise ValueError(f"{flag}: {token!r}: expected 'auto' or letters {letters} each "
                     f"followed by a number, e.g. {example}")
  bools = {f.name for f in dataclasses.fields(config) if f.type in (bool, "bool")}
  return config(**{fields[a]: (int(b) != 0 if fields[a] in bools else int(b))
                   for a, b in parts})


def parse_config(token: str) -> AttentionConfig:
  """'auto' -> AttentionConfig(); 'h64k32w8s2n3' -> block_h=64, block_k=32, num_warps=8,
  num_splits=2, num_stages=3 (any subset, any order)."""
  return _parse_tokens(token, AttentionConfig, _CONFIG_FIELDS, flag="--configs",
                       example="h64k64w8")


_MOSAIC_FIELDS = {"s": "num_splits", "r": "consumer_registers"}


def parse_mosaic_config(token: str) -> MosaicAttentionConfig:
  """'auto' -> MosaicAttentionConfig() (the launch ``kernels.attention='mosaic'`` runs);
  's2r232' -> num_splits=2, consumer_registers=232 (any subset, any order)."""
  return _parse_tokens(token, MosaicAttentionConfig, _MOSAIC_FIELDS,
                       flag="--mosaic-configs", example="s1r232")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench attention",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", default="1,8,32,64,128,256", help="decode batch sizes, comma list")
  p.add_argument("--heads", type=int, default=64, help="query heads on the device")
  p.add_argument("--k", type=int, default=2048, help="selected entries per request")
  p.add_argument("--latent", type=int, default=512, help="kv_lora_rank (Dl)")
  p.add_argument("--rope", type=int, default=64, help="rope dims (Dr)")
  p.add_argument("--pool-rows", type=int, default=None,
                 help="rows of the device pool (default: 2 x largest batch x k)")
  p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
  p.add_argument("--kv-layout", default="bf16", choices=kv_layout_lib.KINDS,
                 help="how the pool stores entries (model.kv_layout): 'fp8' rows of "
                 "Dl + 4 Dl/128 + 2 Dr bytes, read by 'xla' and 'pallas' ('mosaic' reads "
                 "bf16 rows only); --dtype is then the queries'")
  p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                 help=f"of {list(IMPLS)} ('mosaic' needs a Hopper GPU)")
  p.add_argument("--configs", default="auto",
                 help="Pallas configurations, comma list of 'auto' or e.g. h64k64w8s2n3 "
                      "(h block_h, k block_k, w num_warps, s num_splits, n num_stages, "
                      "p preload_slots)")
  p.add_argument("--mosaic-configs", default="auto",
                 help="Mosaic configurations, comma list of 'auto' or e.g. s1r232 (s "
                 "num_splits, r consumer_registers)")
  p.add_argument("--loop", type=int, default=16, help="steps per jitted loop")
  add_timing_args(p, max_iters=200, target_ms=100.0)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench/attention.json", help="JSON output path")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes and few iterations (smoke test, e.g. on CPU)")
  return p


def looped(fn: Callable[..., jax.Array], steps: int) -> Callable[..., jax.Array]:
  """``steps`` calls of ``fn(q_lat, q_rope, pool, slots, valid)`` in one jitted loop;
  returns the last output. Each call's queries carry a zero taken from the previous
  output, so XLA can neither hoist the calls out of the loop nor merge them."""

  def run(q_lat, q_rope, pool, slots, valid):
    def body(_, carry):
      q, _o = carry
      o = fn(q, q_rope, pool, slots, valid)
      # x * 0.0 is not folded for floats (NaN * 0 is NaN), and q keeps its value.
      return q.at[0, 0, 0].add((o[0, 0, 0] * 0).astype(q.dtype)), o

    o0 = jnp.zeros(q_lat.shape, jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (q_lat, o0))[1]

  return jax.jit(run)


def copy_loop(steps: int) -> Callable[[jax.Array], jax.Array]:
  """``steps`` passes over a donated uint32 buffer, each reading and writing every
  word once (XOR with the step number, which no pass can skip)."""

  def run(buf):
    return jax.lax.fori_loop(0, steps, lambda i, b: b ^ (i.astype(jnp.uint32) + 1), buf)

  return jax.jit(run, donate_argnums=0)


@dataclasses.dataclass
class _Measured:
  row: Row
  run: Callable[[], float]
  times: list[float] = dataclasses.field(default_factory=list)


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def run(args, checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Measures everything ``args`` asks for; ``checkpoint`` gets the partial result after
  every batch size (so a run cut short still leaves its measurements)."""
  batches = parse_sizes(args.batch)
  names = parse_list(args.impls, IMPLS, flag="--impls")
  configs = [(t.strip(), parse_config(t)) for t in args.configs.split(",") if t.strip()]
  if args.loop < 1 or args.reps < 1:
    raise ValueError(f"--loop={args.loop}, --reps={args.reps}: expected both >= 1")
  dtype = DTYPES[args.dtype]
  H, k, Dl, Dr = args.heads, args.k, args.latent, args.rope
  layout = args.kv_layout
  if layout != "bf16" and "mosaic" in names:
    raise ValueError(f"--impls={args.impls!r} with --kv-layout={layout!r}: 'mosaic' reads "
                     "bf16 rows only (use xla,pallas)")
  if layout == "fp8":
    kv_layout_lib.check_fp8_latent(Dl)
  S = args.pool_rows or max(2 * max(batches, default=1) * k, 1)
  scale = 1.0 / math.sqrt(Dl + Dr)
  steps = args.loop
  timing = dict(min_iters=args.min_iters, max_iters=args.max_iters,
                target_s=args.target_ms / 1e3, warmup=args.warmup)
  # Layout keyword only for fp8 rows: the bf16 calls stay as they were.
  by_layout = {} if layout == "bf16" else {"kv_layout": layout}
  reference = jax.jit(functools.partial(sparse_mla_attention_reference, scale=scale,
                                        **by_layout))
  impls: list[tuple[str, AttentionConfig | None, Any]] = []
  mosaic_configs = [(t.strip(), parse_mosaic_config(t))
                    for t in args.mosaic_configs.split(",") if t.strip()]
  kernels = {"pallas": (sparse_mla_attention_pallas, configs),
             "mosaic": (sparse_mla_attention_mosaic, mosaic_configs)}
  for name in names:
    if name == "xla":
      impls.append(("xla", None, looped(reference, steps)))
      continue
    kernel, launches = kernels[name]
    for token, cfg in launches:
      label = f"{name}[{token}]" if len(launches) > 1 else name
      fn = functools.partial(kernel, scale=scale, config=cfg, **by_layout)
      # The launch's cost model is the Triton kernel's (attention_cost).
      impls.append((label, cfg if name == "pallas" else None, looped(fn, steps)))
  copy = copy_loop(steps)

  # Inputs from numpy: eager jax.random calls would each compile a small program.
  rng = np.random.default_rng(args.seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
  pool = normal(S, Dl + Dr)
  if layout == "fp8":
    pool = kv_layout_lib.quantize(pool.astype(jnp.float32), Dl)
  rows: list[Row] = []

  def result() -> dict[str, Any]:
    return {"benchmark": "attention", "environment": environment(),
            "geometry": {"heads": H, "k": k, "latent": Dl, "rope": Dr, "pool_rows": S,
                         "dtype": args.dtype, "kv_layout": layout},
            "loop": steps, "reps": args.reps,
            "rows": [dataclasses.asdict(r) for r in rows]}

  for B in batches:
    q_lat, q_rope = normal(B, H, Dl), normal(B, H, Dr)
    slots = jnp.asarray(rng.integers(0, S, (B, k), dtype=np.int32))
    valid = jnp.asarray(np.ones((B, k), bool))
    args_b = (q_lat, q_rope, pool, slots, valid)
    nbytes = bytes_read(B, H, k, Dl, Dr, dtype, dtype, kv_layout=layout)
    measured: list[_Measured] = []

    copy_row = Row(B, COPY, nbytes)
    rows.append(copy_row)
    buf = {"x": jnp.zeros((max(nbytes // 4, 1),), jnp.uint32)}

    def copy_rep() -> float:
      t, buf["x"] = time_calls(copy, buf["x"], **timing)
      return t / steps

    measured.append(_Measured(copy_row, copy_rep))
    want = np.asarray(reference(*args_b))
    for label, cfg, fn in impls:
      row = Row(B, label, nbytes)
      rows.append(row)
      if cfg is not None:
        cost = attention_cost(B, H, k, Dl, Dr, dtype, dtype, cfg)
        row.block_h, row.splits, row.programs = cost.block_h, cost.splits, cost.programs
        row.num_warps, row.partial_bytes = cost.num_warps, cost.partial_bytes
        row.row_reads, row.flops, row.model_us = cost.row_reads, cost.flops, cost.model_us
      else:
        row.flops = 2 * B * H * k * (2 * Dl + Dr)
      try:
        out = np.asarray(fn(*args_b))  # compiles, and checks the result
        row.max_err = float(np.max(np.abs(out - want))) if want.size else 0.0
      except Exception as e:  # keep measuring the others; the table shows the error
        row.error = _error(e)
        continue

      def rep(fn=fn) -> float:
        t, _ = time_calls(lambda _: fn(*args_b), None, **timing)
        return t / steps

      measured.append(_Measured(row, rep))
    for r in range(args.reps):
      for m in measured:
        if m.row.error is None:
          try:
            m.times.append(m.run())
          except Exception as e:
            m.row.error = _error(e)
    for m in measured:
      m.row.seconds, m.row.median_seconds = best_and_median(m.times)
      m.row.reps = len(m.times)
    _rates([m.row for m in measured], copy_row)
    buf.clear()  # the copy's buffer freed before the next batch's
    if checkpoint is not None:
      checkpoint(result())
  return result()


def _rates(rows: list[Row], copy_row: Row) -> None:
  """Read rates, and their fractions of the copy's read + write traffic."""
  copy_best = copy_med = None
  if copy_row.seconds:
    copy_best = 2 * copy_row.bytes_read / copy_row.seconds / 1e9
    copy_med = 2 * copy_row.bytes_read / copy_row.median_seconds / 1e9
  for row in rows:
    if not row.seconds:
      continue
    row.read_gbps = row.bytes_read / row.seconds / 1e9
    row.copy_gbps = copy_best
    if row.flops:
      row.tflops = row.flops / row.seconds / 1e12
    if copy_best:
      row.fraction = row.read_gbps / copy_best
      row.median_fraction = row.bytes_read / row.median_seconds / 1e9 / copy_med


def print_table(result: dict) -> None:
  env, g = result["environment"], result["geometry"]
  cells = []
  for r in result["rows"]:
    us = None if r["seconds"] is None else r["seconds"] * 1e6
    launch = ("-" if r["block_h"] is None else
              f"h{r['block_h']} s{r['splits']} w{r['num_warps']} p{r['programs']}")
    extra = None if r["partial_bytes"] is None else r["partial_bytes"] / 1e6
    cells.append([str(r["batch"]), r["impl"], launch, fmt(r["bytes_read"] / 1e6, 1),
                  fmt(extra, 1), fmt(us, 1), fmt(r["model_us"], 1), fmt(r["read_gbps"], 1),
                  fmt(r["copy_gbps"], 1),
                  fmt(r["fraction"]), fmt(r["median_fraction"]), fmt(r["tflops"], 1),
                  "ERROR" if r["error"] else fmt(r["max_err"], 4)])
  common.print_table(
      f"sparse MLA decode attention on {env['device']} ({env['backend']}, jax {env['jax']}): "
      f"H={g['heads']} k={g['k']} Dl+Dr={g['latent']}+{g['rope']} {g['dtype']}"
      + (f" queries, {g['kv_layout']} rows" if g.get("kv_layout", "bf16") != "bf16" else "")
      + "; "
      f"{result['loop']} steps per loop, best of {result['reps']}",
      ("batch", "impl", "launch", "MB read", "MB partials", "us/step", "model us", "read GB/s",
       "copy GB/s (r+w)", "fraction", "median frac", "TFLOP/s", "max err"), cells,
      left=("impl", "launch"))
  for r in result["rows"]:
    if r["error"]:
      print(f"error: batch {r['batch']} {r['impl']}: {r['error']}")


def main(argv: list[str]) -> int:
  """Runs the attention benchmark; returns 0, or 1 when a measurement failed."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.quick:  # smaller defaults; explicit flags still win
    quick = dict(batch="1,3", heads=4, k=40, latent=32, rope=16, pool_rows=256, loop=2,
                 reps=2, min_iters=1, max_iters=2, target_ms=1.0, warmup=1)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  result = run(args, checkpoint=lambda partial: write_json(args.out, partial))
  print_table(result)
  path = write_json(args.out, result)
  print(f"wrote {path}")
  return 1 if any(r["error"] for r in result["rows"]) else 0
