"""Report: what the Pallas kernels compile to on a Hopper GPU, on any machine.

``--kernel attention``: for each launch configuration (the attention benchmark's
``--configs`` tokens) and batch size, the sparse attention. ``--kernel resolve``: for
each batch size, device pool and launch form (``--fuse off,on``: four launches or one),
the PB-LRU resolve's kernels, at top-k ``--k``. Each kernel is lowered for CUDA, its
Triton IR compiled for ``sm_90a`` with the ``triton`` package
(``ula_jax.kernels.triton_ir.sm90_report``; no GPU needed), and the table shows what
decides its speed before it runs: shared memory and registers per program (so programs
per SM), spills, and its main loop: async copies, plain global loads, the copy-group
waits (how many groups a wait leaves in flight: 0 means every copy issued so far, the
next tile's included, is waited for before the step computes) and tensor-core
instructions.

    ula-jax bench kernel_report [--kernel attention] [--batch 64]
                                [--configs auto,h64k32w8n4] [--out FILE]
    ula-jax bench kernel_report --kernel resolve [--batch 64] [--pools 1M] [--fuse off,on]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ula_jax.bench.attention import parse_config
from ula_jax.bench.common import environment, parse_list, parse_sizes, write_json
from ula_jax.kernels.sparse_attention.pallas import (attention_cost,
                                                     sparse_mla_attention_pallas)
from ula_jax.kernels.triton_ir import TritonKernel, lowered_kernels, sm90_report

KERNEL = "ula_sparse_mla_attention"
KERNELS = ("attention", "resolve")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ula-jax bench kernel_report",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--kernel", choices=KERNELS, default="attention", help="which kernels")
  p.add_argument("--batch", default="64", help="decode batch sizes, comma list")
  p.add_argument("--heads", type=int, default=64)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--latent", type=int, default=512)
  p.add_argument("--rope", type=int, default=64)
  p.add_argument("--configs", default="auto",
                 help="attention: Pallas launch configurations, as in 'ula-jax bench "
                 "attention'")
  p.add_argument("--pools", default="1M", help="resolve: device pool slots, comma list")
  p.add_argument("--fuse", default="off,on",
                 help="resolve: four launches (off) or one (on), comma list")
  p.add_argument("--sms", type=int, default=132,
                 help="resolve: SMs of the GPU (the one launch's resident programs)")
  p.add_argument("--out", default="runs/bench/kernel_report.json", help="JSON output path")
  return p


def _row(triton_kernel: TritonKernel, /, **fields: Any) -> dict[str, Any]:
  """``fields``, then the kernel's ``KernelReport`` and the programs it fits per SM."""
  r = sm90_report(triton_kernel)
  return {**fields, "programs_per_sm": r.programs_per_sm(), **dataclasses.asdict(r)}


def report(B: int, H: int, k: int, Dl: int, Dr: int, token: str) -> dict[str, Any]:
  """One configuration's row: its launch and ``KernelReport`` fields."""
  config = parse_config(token)
  f = functools.partial(sparse_mla_attention_pallas, scale=0.1, config=config,
                        interpret=False)
  spec = jax.ShapeDtypeStruct
  kernels = lowered_kernels(f, spec((B, H, Dl), jnp.bfloat16), spec((B, H, Dr), jnp.bfloat16),
                            spec((2 * B * k, Dl + Dr), jnp.bfloat16), spec((B, k), jnp.int32),
                            spec((B, k), jnp.bool_))
  cost = attention_cost(B, H, k, Dl, Dr, jnp.bfloat16, jnp.bfloat16, config)
  return _row(kernels[KERNEL], batch=B, config=token, block_h=cost.block_h,
              splits=cost.splits, block_k=config.block_k)


def resolve_reports(B: int, k: int, pool: int, fuse: bool, num_sms: int = 132,
                    buckets: int | None = None) -> list[dict[str, Any]]:
  """Rows for every kernel of the Pallas PB-LRU resolve of one layer group: ``B``
  requests of top-k ``k`` over a ``pool``-slot device pool (the resolve benchmark's
  system) with ``buckets`` recent buckets (None: ``memory.pb_lru_buckets``'s default),
  four launches or one (with the programs a GPU of ``num_sms`` SMs keeps resident)."""
  from ula_jax.bench.resolve import Setup, build_system
  from ula_jax.config.schema import PB_LRU_BUCKETS
  from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG, ResolveConfig, resolve_group_pallas

  if buckets is None:
    buckets = PB_LRU_BUCKETS
  system = build_system(Setup(pool=pool, batch=B, k=k, buckets=buckets, steps_total=8),
                        "pb_lru")
  config = FUSED_CONFIG if fuse else ResolveConfig()  # what kernels.resolve launches
  # Lowered without the GPU: no device to count SMs on, so the count is given.
  programs = num_sms * config.resident_per_sm() if fuse else None
  f = functools.partial(resolve_group_pallas, system, config=config, interpret=False,
                        programs=programs)
  spec = jax.ShapeDtypeStruct
  kernels = lowered_kernels(f, jax.eval_shape(system.init_group_meta),
                            spec((B, k), jnp.int32), spec((B, k), jnp.bool_),
                            spec((B,), jnp.int32), spec((B,), jnp.bool_))
  label = f"pool {pool} {'fused' if fuse else 'staged'}"
  return [_row(kernel, batch=B, config=label, kernel=name) for name, kernel in kernels.items()]


def print_table(rows: list[dict]) -> None:
  from rich.console import Console
  from rich.table import Table

  t = Table(title=f"Pallas kernels compiled for sm_90a (Triton {rows[0]['triton_version']})"
            if rows else "Pallas kernels")
  for col in ("batch", "config", "launch", "smem KB", "regs", "spill B", "per SM",
              "loop", "spills", "LDGSTS", "LDG", "waits", "tensor-core ops"):
    t.add_column(col, justify="left" if col in ("config", "launch", "tensor-core ops")
                 else "right", no_wrap=True)
  for r in rows:
    mma = " ".join(f"{n.split('.')[0]}{n.split('.')[1]}:{c}"
                   for n, c in r["loop_mma"].items()) or "-"
    launch = (f"h{r['block_h']}k{r['block_k']}s{r['splits']}w{r['num_warps']}"
              f"n{r['num_stages']}" if "block_h" in r
              else f"{r['kernel']} w{r['num_warps']}")
    t.add_row(str(r["batch"]), r["config"], launch,
              f"{r['shared_bytes'] / 1024:.0f}", str(r["registers"]),
              str(r["spill_stores"]), str(r["programs_per_sm"]), str(r["loop_instructions"]),
              str(r["loop_spills"]), str(r["loop_async_copies"]), str(r["loop_loads"]),
              ",".join(map(str, r["loop_waits"])) or "-", mma)
  Console(width=max(Console().width, 150)).print(t)


def main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  if args.kernel == "attention":
    rows = [report(B, args.heads, args.k, args.latent, args.rope, token.strip())
            for B in parse_sizes(args.batch) for token in args.configs.split(",")
            if token.strip()]
  else:
    fuse = [x == "on" for x in parse_list(args.fuse, ("on", "off"), flag="--fuse")]
    rows = [row for B in parse_sizes(args.batch)
            for pool in parse_sizes(args.pools, flag="--pools", minimum=1, unit=" slot")
            for f in fuse for row in resolve_reports(B, args.k, pool, f, args.sms)]
  print_table(rows)
  write_json(args.out, {"benchmark": "kernel_report", "environment": environment(),
                        "rows": rows})
  return 0


__all__ = ["main", "report", "resolve_reports"]
