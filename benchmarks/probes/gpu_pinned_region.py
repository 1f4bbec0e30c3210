"""Pinned host pools on 2 MiB pages (``core.pinned_region``) against XLA's own, on one GPU.

For each size: seconds to a zero-filled ``pinned_host`` array both ways (each in the same
process, the region first so XLA's allocator has not pinned anything yet), then on the
region's array: memory kind and pointer, zeros on a sampled slice, the Pallas evict
writing rows into it under donation (the output must keep the region's pointer, and the
rows must read back), the Pallas fetch reading them, and the region given back once no
array points into it.

    python benchmarks/probes/gpu_pinned_region.py --gib 1,32 [--xla] [--json OUT.json]

``--breakdown G`` first times a G GiB region's two parts apart - mapping and zeroing by
16 threads, registering - and the same mapping faulted by ``MADV_POPULATE_WRITE`` in 16
threads instead of written.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ula_jax.core import pinned_region
from ula_jax.kernels.fetch import evict_rows, fetch_rows
from ula_jax.memory.base import device_zeros

W = 576


def _breakdown(gib: int, dev) -> list[dict]:
  out = []
  for how in ("memset", "populate"):
    nbytes = gib << 30
    t0 = time.perf_counter()
    if how == "memset":
      r = pinned_region._map(nbytes, 16)
    else:  # the same mapping, pages faulted by the kernel without a write
      pr, libc = pinned_region, pinned_region._libc()
      length = nbytes + pr._HUGE
      base = libc.mmap(None, length, pr._PROT_RW, pr._MAP_PRIVATE_ANON, -1, 0)
      addr = -(-base // pr._HUGE) * pr._HUGE
      libc.madvise(addr, length - (addr - base), pr._MADV_HUGEPAGE)
      chunk = nbytes // 16
      with concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda s: libc.madvise(addr + s, chunk, 23),  # POPULATE_WRITE
                              range(0, nbytes, chunk)))
      r = pinned_region._Region(base, length, addr, nbytes)
    t1 = time.perf_counter()
    pinned_region._register(r, dev)
    t2 = time.perf_counter()
    huge = [int(line.split()[1]) for line in open("/proc/meminfo")
            if line.startswith("AnonHugePages")][0] << 10
    pinned_region._free(r)
    row = {"breakdown": how, "gib": gib, "map_and_fault_s": t1 - t0, "register_s": t2 - t1,
           "anon_huge_gib": huge / 2**30}
    if how == "populate":
      row["madvise_codes"] = sorted(set(codes))
    print(json.dumps(row), flush=True)
    out.append(row)
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--gib", default="1,32")
  ap.add_argument("--xla", action="store_true", help="also time XLA's allocator per size")
  ap.add_argument("--breakdown", type=int, default=0, help="GiB; 0: skip")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  dev = jax.devices()[0]
  print("available:", pinned_region.available(dev), dev.device_kind, flush=True)
  mesh = jax.make_mesh((1,), ("dp",), devices=[dev])
  out = _breakdown(args.breakdown, dev) if args.breakdown else []
  for gib in [int(g) for g in args.gib.split(",")]:
    rows = (gib << 30) // (W * 2)
    row = {"gib": gib}
    t0 = time.perf_counter()
    x = pinned_region.zeros(dev, (rows, W), jnp.bfloat16)
    jax.block_until_ready(x)
    row["region_s"] = time.perf_counter() - t0
    row["region_gb_s"] = (gib << 30) / row["region_s"] / 1e9
    ptr = x.addressable_shards[0].data.unsafe_buffer_pointer()
    row["memory_kind"] = x.sharding.memory_kind
    dev_sh = NamedSharding(mesh, P(), memory_kind="device")
    row["zeros"] = not np.asarray(jax.device_put(x[-4096:], dev_sh)).any()
    # Evict 4096 device rows into it under donation, then fetch them back.
    n = 4096
    rng = np.random.default_rng(0)
    src = jax.device_put(rng.standard_normal((n, W), np.float32).astype(jnp.bfloat16), dev_sh)
    host_idx = jax.device_put(rng.choice(rows, n, replace=False).astype(np.int32), dev_sh)
    dev_idx = jax.device_put(np.arange(n, dtype=np.int32), dev_sh)
    host_sh = NamedSharding(mesh, P(), memory_kind="pinned_host")
    evict = jax.jit(functools.partial(evict_rows, impl="pallas"), donate_argnums=(2,),
                    out_shardings=host_sh)
    y = evict(src, dev_idx, x, host_idx)
    jax.block_until_ready(y)
    row["donated_in_place"] = y.addressable_shards[0].data.unsafe_buffer_pointer() == ptr
    row["x_deleted"] = x.is_deleted()
    back = jax.jit(functools.partial(fetch_rows, impl="pallas"), donate_argnums=(2,))(
        y, host_idx, jnp.zeros((n, W), jnp.bfloat16, device=dev_sh), dev_idx)
    row["rows_back"] = bool(np.array_equal(np.asarray(back), np.asarray(src)))
    # A second evict on the output: still in place?
    y2 = evict(src, dev_idx, y, host_idx)
    jax.block_until_ready(y2)
    row["second_in_place"] = y2.addressable_shards[0].data.unsafe_buffer_pointer() == ptr
    row["held_gib_before"] = pinned_region.held_bytes() / 2**30
    del x, y, y2, back
    row["released_gib"] = pinned_region.release_unused() / 2**30
    row["held_gib_after"] = pinned_region.held_bytes() / 2**30
    if args.xla:
      t0 = time.perf_counter()
      z = device_zeros(mesh, (1, rows, W), jnp.bfloat16, "pinned_host")
      jax.block_until_ready(z)
      row["xla_s"] = time.perf_counter() - t0
      row["xla_gb_s"] = (gib << 30) / row["xla_s"] / 1e9
      del z
    out.append(row)
    print(json.dumps(row), flush=True)
  print(f"{'GiB':>5}{'region s':>10}{'GB/s':>7}{'xla s':>8}{'GB/s':>7}  checks")
  for r in out:
    if "region_s" in r:
      checks = all(r[k] for k in ("zeros", "donated_in_place", "x_deleted", "rows_back",
                                  "second_in_place")) and r["held_gib_after"] == 0
      print(f"{r['gib']:>5}{r['region_s']:>10.2f}{r['region_gb_s']:>7.1f}"
            f"{r.get('xla_s', float('nan')):>8.2f}{r.get('xla_gb_s', float('nan')):>7.1f}"
            f"  {'ok' if checks else 'FAILED'}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
