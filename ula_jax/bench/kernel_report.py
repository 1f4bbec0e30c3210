"""Report: what the Pallas sparse attention compiles to on a Hopper GPU, on any machine.

For each launch configuration (the attention benchmark's ``--configs`` tokens) and batch
size, the kernel is lowered for CUDA, its Triton IR compiled for ``sm_90a`` with the
``triton`` package (``ula_jax.kernels.triton_ir.sm90_report``; no GPU needed), and the
table shows what decides its speed before it runs: shared memory and registers per
program (so programs per SM), spills, and its main loop: async row copies, plain global
loads, the copy-group waits (how many groups a wait leaves in flight: 0 means every
copy issued so far, the next tile's included, is waited for before the step computes)
and tensor-core instructions.

    ula-jax bench kernel_report [--batch 64] [--configs auto,h64k32w8n4] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ula_jax.bench.attention import parse_config
from ula_jax.bench.common import environment, parse_sizes, write_json
from ula_jax.kernels.sparse_attention.pallas import sparse_mla_attention_pallas
from ula_jax.kernels.triton_ir import sm90_report, triton_kernels

KERNEL = "ula_sparse_mla_attention"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench kernel_report",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", default="64", help="decode batch sizes, comma list")
  p.add_argument("--heads", type=int, default=64)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--latent", type=int, default=512)
  p.add_argument("--rope", type=int, default=64)
  p.add_argument("--configs", default="auto",
                 help="Pallas launch configurations, as in 'ula-jax bench attention'")
  p.add_argument("--out", default="runs/bench/kernel_report.json", help="JSON output path")
  return p


def report(B: int, H: int, k: int, Dl: int, Dr: int, token: str) -> dict[str, Any]:
  """One configuration's row: its launch and ``KernelReport`` fields."""
  config = parse_config(token)
  f = functools.partial(sparse_mla_attention_pallas, scale=0.1, config=config,
                        interpret=False)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  text = jax.jit(f).trace(
      spec((B, H, Dl), jnp.bfloat16), spec((B, H, Dr), jnp.bfloat16),
      spec((2 * B * k, Dl + Dr), jnp.bfloat16), spec((B, k), jnp.int32),
      spec((B, k), jnp.bool_)).lower(lowering_platforms=("cuda",)).as_text()
  block_h, splits = config.launch(B, H, k, Dl, Dr, 2)
  r = sm90_report(triton_kernels(text)[KERNEL])
  return {"batch": B, "config": token, "block_h": block_h, "splits": splits,
          "block_k": config.block_k, "programs_per_sm": r.programs_per_sm(),
          **dataclasses.asdict(r)}


def print_table(rows: list[dict]) -> None:
  from rich.console import Console
  from rich.table import Table

  t = Table(title=f"{KERNEL} compiled for sm_90a (Triton {rows[0]['triton_version']})"
            if rows else KERNEL)
  for col in ("batch", "config", "launch", "smem KB", "regs", "spill B", "per SM",
              "loop", "spills", "LDGSTS", "LDG", "waits", "tensor-core ops"):
    t.add_column(col, justify="left" if col in ("config", "launch", "tensor-core ops")
                 else "right", no_wrap=True)
  for r in rows:
    mma = " ".join(f"{n.split('.')[0]}{n.split('.')[1]}:{c}"
                   for n, c in r["loop_mma"].items()) or "-"
    t.add_row(str(r["batch"]), r["config"],
              f"h{r['block_h']}k{r['block_k']}s{r['splits']}w{r['num_warps']}"
              f"n{r['num_stages']}", f"{r['shared_bytes'] / 1024:.0f}", str(r["registers"]),
              str(r["spill_stores"]), str(r["programs_per_sm"]), str(r["loop_instructions"]),
              str(r["loop_spills"]), str(r["loop_async_copies"]), str(r["loop_loads"]),
              ",".join(map(str, r["loop_waits"])) or "-", mma)
  Console(width=max(Console().width, 150)).print(t)


def main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  rows = [report(B, args.heads, args.k, args.latent, args.rope, token.strip())
          for B in parse_sizes(args.batch) for token in args.configs.split(",")
          if token.strip()]
  print_table(rows)
  write_json(args.out, {"benchmark": "kernel_report", "environment": environment(),
                        "rows": rows})
  return 0


__all__ = ["main", "report"]
