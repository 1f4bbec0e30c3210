"""Benchmark: sparse MLA decode attention (one layer, one decode step).

Per batch size and implementation: the bytes a step must read (the k selected pool rows
of every request, the queries and the slot lists) per second, as a fraction of the
memory traffic (read + write) of a device-to-device copy of the same bytes measured in
the same run. ``max err`` is the largest difference from the jnp reference.

    ula-jax bench attention [--batch 1,8,32,64] [--heads 64] [--k 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.bench import common
from ula_jax.bench.common import (environment, fmt, parse_list, parse_sizes, time_calls,
                                  write_json)
from ula_jax.kernels.sparse_attention.pallas import (AttentionConfig, bytes_read,
                                                     sparse_mla_attention_pallas)
from ula_jax.kernels.sparse_attention.reference import sparse_mla_attention_reference

IMPLS = ("xla", "pallas")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass
class Row:
  batch: int
  impl: str
  bytes_read: int
  seconds: float | None = None
  read_gbps: float | None = None
  copy_gbps: float | None = None  # read + write traffic of the device copy
  fraction: float | None = None
  max_err: float | None = None
  error: str | None = None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench attention",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", default="1,8,32,64", help="decode batch sizes, comma list")
  p.add_argument("--heads", type=int, default=64, help="query heads on the device")
  p.add_argument("--k", type=int, default=2048, help="selected entries per request")
  p.add_argument("--latent", type=int, default=512, help="kv_lora_rank (Dl)")
  p.add_argument("--rope", type=int, default=64, help="rope dims (Dr)")
  p.add_argument("--pool-rows", type=int, default=None,
                 help="rows of the device pool (default: 2 x largest batch x k)")
  p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
  p.add_argument("--impls", default=",".join(IMPLS), help=f"of {list(IMPLS)}")
  p.add_argument("--block-h", default="auto", help="Pallas sweep: heads per program")
  p.add_argument("--block-k", default="32", help="Pallas sweep: rows per loop step")
  p.add_argument("--splits", default="auto", help="Pallas sweep: k splits per row")
  p.add_argument("--warps", default="auto", help="Pallas sweep: warps per program")
  p.add_argument("--min-iters", type=int, default=5)
  p.add_argument("--max-iters", type=int, default=500)
  p.add_argument("--target-ms", type=float, default=200.0)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs/bench/attention.json", help="JSON output path")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes and few iterations (smoke test, e.g. on CPU)")
  return p


def _sweep(text: str) -> list[int | None]:
  return [None] if text.strip() == "auto" else parse_sizes(text)


def _configs(args) -> list[tuple[str, AttentionConfig]]:
  grid = list(itertools.product(_sweep(args.block_h), _sweep(args.block_k),
                                _sweep(args.splits), _sweep(args.warps)))
  out = []
  for bh, bk, ns, nw in grid:
    cfg = AttentionConfig(block_h=bh, block_k=bk or 32, num_splits=ns, num_warps=nw)
    label = "pallas" if len(grid) == 1 else (
        f"pallas[h{bh or 'a'},k{bk},s{ns or 'a'},w{nw or 'a'}]")
    out.append((label, cfg))
  return out


def run(args, checkpoint: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Measures everything ``args`` asks for; ``checkpoint`` gets the partial result after
  every batch size (so a run cut short still leaves its measurements)."""
  batches = parse_sizes(args.batch)
  names = parse_list(args.impls, IMPLS, flag="--impls")
  dtype = DTYPES[args.dtype]
  H, k, Dl, Dr = args.heads, args.k, args.latent, args.rope
  S = args.pool_rows or max(2 * max(batches, default=1) * k, 1)
  scale = 1.0 / math.sqrt(Dl + Dr)
  timing = dict(min_iters=args.min_iters, max_iters=args.max_iters,
                target_s=args.target_ms / 1e3, warmup=args.warmup)
  reference = jax.jit(functools.partial(sparse_mla_attention_reference, scale=scale))
  impls: list[tuple[str, Any]] = []
  for name in names:
    if name == "xla":
      impls.append(("xla", reference))
    else:
      for label, cfg in _configs(args):
        impls.append((label, jax.jit(functools.partial(
            sparse_mla_attention_pallas, scale=scale, config=cfg))))

  # Inputs from numpy: eager jax.random calls would each compile a small program.
  rng = np.random.default_rng(args.seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
  pool = normal(S, Dl + Dr)
  copy = jax.jit(lambda x: x ^ jnp.uint32(1))  # streams every byte in and out once
  rows: list[Row] = []

  def result() -> dict[str, Any]:
    return {"benchmark": "attention", "environment": environment(),
            "geometry": {"heads": H, "k": k, "latent": Dl, "rope": Dr, "pool_rows": S,
                         "dtype": args.dtype},
            "rows": [dataclasses.asdict(r) for r in rows]}

  for B in batches:
    q_lat, q_rope = normal(B, H, Dl), normal(B, H, Dr)
    slots = jnp.asarray(rng.integers(0, S, (B, k), dtype=np.int32))
    valid = jnp.asarray(np.ones((B, k), bool))
    args_b = (q_lat, q_rope, pool, slots, valid)
    nbytes = bytes_read(B, H, k, Dl, Dr, dtype, dtype)
    buf = jnp.asarray(np.zeros((max(nbytes // 4, 1),), np.uint32))
    t_copy, _ = time_calls(copy, buf, **timing)
    copy_gbps = 2 * buf.size * 4 / t_copy / 1e9
    want = np.asarray(reference(*args_b))
    for label, fn in impls:
      row = Row(B, label, nbytes, copy_gbps=copy_gbps)
      rows.append(row)
      try:
        t, out = time_calls(lambda _: fn(*args_b), None, **timing)
        row.seconds = t
        row.read_gbps = nbytes / t / 1e9
        row.fraction = row.read_gbps / copy_gbps
        row.max_err = float(np.max(np.abs(np.asarray(out) - want))) if want.size else 0.0
      except Exception as e:  # keep measuring the others; the table shows the error
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if checkpoint is not None:
      checkpoint(result())
  return result()


def print_table(result: dict) -> None:
  env, g = result["environment"], result["geometry"]
  cells = []
  for r in result["rows"]:
    us = None if r["seconds"] is None else r["seconds"] * 1e6
    cells.append([str(r["batch"]), r["impl"], fmt(r["bytes_read"] / 1e6, 1), fmt(us, 1),
                  fmt(r["read_gbps"], 1), fmt(r["copy_gbps"], 1), fmt(r["fraction"]),
                  "ERROR" if r["error"] else fmt(r["max_err"], 4)])
  common.print_table(
      f"sparse MLA decode attention on {env['device']} ({env['backend']}, jax {env['jax']}): "
      f"H={g['heads']} k={g['k']} Dl+Dr={g['latent']}+{g['rope']} {g['dtype']}",
      ("batch", "impl", "MB read", "us/step", "read GB/s", "copy GB/s (r+w)", "fraction",
       "max err"), cells, left=("impl",))
  for r in result["rows"]:
    if r["error"]:
      print(f"error: batch {r['batch']} {r['impl']}: {r['error']}")


def main(argv: list[str]) -> int:
  """Runs the attention benchmark; returns 0, or 1 when a measurement failed."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.quick:  # smaller defaults; explicit flags still win
    quick = dict(batch="1,3", heads=4, k=40, latent=32, rope=16, pool_rows=256, min_iters=1,
                 max_iters=2, target_ms=1.0, warmup=1)
    for name, value in quick.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, value)
  result = run(args, checkpoint=lambda partial: write_json(args.out, partial))
  print_table(result)
  path = write_json(args.out, result)
  print(f"wrote {path}")
  return 1 if any(r["error"] for r in result["rows"]) else 0
