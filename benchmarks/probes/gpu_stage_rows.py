"""The copies of one layer's move (``Ula.move_layer``) over a plan list sized for the worst
case (B * k + B rows, B = 58 and 64, k = 2048) of which ``valid`` rows are moves, 656-byte
rows (the FP8 layout), on a GPU:

* stage (the victims set aside): an XLA gather of the whole list (before) against the
  Pallas launch that reads and writes only the valid rows, over the whole list's grid
  and with ``count`` (its programs past the valid prefix return at once);
* fetch from pinned host memory: the Pallas launch over the whole list and with count.

    PYTHONPATH=. python benchmarks/probes/gpu_stage_rows.py [OUT.json] [--quick]

Prints a table of median device-synchronised times (us) per call; the ceiling column is a
read and a write of the valid rows at the device's measured copy bandwidth. ``--quick``:
a CPU-sized smoke run (interpret mode).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.kernels.fetch.pallas import fetch_rows_pallas, stage_rows_pallas


def timed(f, *args, reps: int = 30) -> float:
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) * 1e6


def timed_into(f, dst, *args, reps: int = 30) -> tuple[float, jax.Array]:
  """Median us of ``dst = f(dst, *args)`` (dst donated and carried)."""
  ts = []
  for i in range(reps + 1):
    t0 = time.perf_counter()
    dst = jax.block_until_ready(f(dst, *args))
    if i:
      ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) * 1e6, dst


def main(argv: list[str]) -> None:
  quick = "--quick" in argv
  paths = [a for a in argv if not a.startswith("--")]
  S, W, k, batches = ((4096, 656, 64, (2,)) if quick else (2 << 20, 656, 2048, (58, 64)))
  H = S // 2
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.integers(0, 256, (S, W), dtype=np.uint8))
  host = pool[:H] if quick else jax.device_put(
      np.asarray(pool[:H]), jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                              memory_kind="pinned_host"))
  dev = jnp.zeros((H, W), jnp.uint8)
  xla = jax.jit(lambda p, i: p.at[jnp.clip(i, 0, S - 1)].get(mode="promise_in_bounds"))
  stage = jax.jit(stage_rows_pallas)
  stage_n = jax.jit(lambda p, i, n: stage_rows_pallas(p, i, count=n))
  fetch = jax.jit(lambda d, h, i, j: fetch_rows_pallas(h, i, d, j), donate_argnums=0)
  fetch_n = jax.jit(lambda d, h, i, j, n: fetch_rows_pallas(h, i, d, j, count=n),
                    donate_argnums=0)
  copy = jax.jit(lambda x: x + jnp.uint8(1))  # a read and a write of every byte
  big = jnp.zeros((1 << (16 if quick else 28),), jnp.uint8)
  bw = 2 * big.size / (timed(copy, big) * 1e-6)  # bytes/s, read + write
  rows = []
  for B in batches:
    M = B * k + B
    for valid in sorted({0, min(1000, M), min(4000, M), M}):
      idx = np.full((M,), -1, np.int32)
      idx[:valid] = rng.choice(H, valid, replace=False)
      n = jnp.int32(valid)
      for fn, args in ((stage, ()), (stage_n, (n,))):
        got = np.asarray(fn(pool, jnp.asarray(idx), *args))[:valid]
        assert (got == np.asarray(pool)[idx[:valid]]).all()
      idx_j = jnp.asarray(idx)
      d_idx = jnp.asarray(np.where(idx >= 0, np.arange(M) % H, -1).astype(np.int32))
      t_fetch, dev = timed_into(fetch, dev, host, idx_j, d_idx)
      t_fetch_n, dev = timed_into(fetch_n, dev, host, idx_j, d_idx, n)
      rows.append({"batch": B, "list": M, "valid": valid,
                   "stage_xla_us": timed(xla, pool, idx_j),
                   "stage_pallas_us": timed(stage, pool, idx_j),
                   "stage_count_us": timed(stage_n, pool, idx_j, n),
                   "fetch_us": t_fetch, "fetch_count_us": t_fetch_n,
                   "ceiling_us": 2 * valid * W / bw * 1e6})
  out = {"device": str(jax.devices()[0]), "jax": jax.__version__,
         "copy_bandwidth_GBps": bw / 1e9, "rows": rows}
  if paths:
    with open(paths[0], "w") as f:
      json.dump(out, f, indent=1)
  print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); us per call")
  cols = ["stage_xla_us", "stage_pallas_us", "stage_count_us", "fetch_us", "fetch_count_us",
          "ceiling_us"]
  print(f"{'B':>3} {'list':>7} {'valid':>7} " + " ".join(f"{c[:-3]:>14}" for c in cols))
  for r in rows:
    print(f"{r['batch']:>3} {r['list']:>7} {r['valid']:>7} "
          + " ".join(f"{r[c]:>14.1f}" for c in cols))


if __name__ == "__main__":
  main(sys.argv[1:])
