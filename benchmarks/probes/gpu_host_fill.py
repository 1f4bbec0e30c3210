"""How fast a zero-filled ``pinned_host`` pool is created, two ways, on one GPU.

``device``: ``memory.base.device_zeros`` (a jitted fill computed by host compute, what the
memory systems' ``init_state`` uses today); ``numpy``: ``jax.device_put`` of a lazily
zeroed numpy array (``np.zeros`` maps the zero page: no RAM is touched until written)
straight into the pinned sharding. Each made array is checked (memory kind, all zeros on
a sampled slice). The first array of a size pins a new region of the allocator (the next
power of two, up to the engine's cap), so a size's first method also pays the pinning:
``--methods device --gib 100`` times what a 100 GiB host pool costs an engine.

    python benchmarks/probes/gpu_host_fill.py --gib 4,16 [--methods device] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core.host_memory import HOST_LIMIT_ENV, default_pinned_limit_gib, host_ram
from ula_jax.memory.base import device_zeros, memory_kind_of

W = 576  # one bf16 MLA entry


def _numpy_zeros(mesh, shape, dtype):
  sharding = NamedSharding(mesh, P("dp"), memory_kind="pinned_host")
  return jax.device_put(np.zeros(shape, dtype), sharding)


def main() -> None:
  # The pinned-host cap the engine sets (``mesh.configure_platform``), read when the
  # backend starts: without it pools above 64 GiB fail.
  ram = host_ram()
  if ram and HOST_LIMIT_ENV not in os.environ:
    os.environ[HOST_LIMIT_ENV] = str(default_pinned_limit_gib(ram))
  ap = argparse.ArgumentParser()
  ap.add_argument("--gib", default="4,16")
  ap.add_argument("--methods", default="numpy,device",
                  help="comma-separated: numpy, device (numpy copies at about 1.4 GB/s)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  mesh = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
  rows_per_gib = (1 << 30) // (W * 2)
  out = []
  for gib in [int(g) for g in args.gib.split(",")]:
    shape = (1, gib * rows_per_gib, W)
    for how in args.methods.split(","):
      t0 = time.perf_counter()
      x = (_numpy_zeros(mesh, shape, jnp.bfloat16) if how == "numpy"
           else device_zeros(mesh, shape, jnp.bfloat16, "pinned_host"))
      jax.block_until_ready(x)
      dt = time.perf_counter() - t0
      sample = np.asarray(jax.device_put(x[:, -4096:], NamedSharding(mesh, P("dp"))))
      kind = memory_kind_of(x)
      ok = kind == "pinned_host" and not sample.any()
      row = {"method": how, "gib": gib, "seconds": dt, "gb_per_s": gib * 2**30 / dt / 1e9,
             "memory_kind": kind, "checked": bool(ok)}
      out.append(row)
      print(json.dumps(row), flush=True)
      del x, sample
  print(f"{'method':<8}{'GiB':>5}{'s':>8}{'GB/s':>8}  ok")
  for r in out:
    print(f"{r['method']:<8}{r['gib']:>5}{r['seconds']:>8.2f}{r['gb_per_s']:>8.2f}  {r['checked']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
