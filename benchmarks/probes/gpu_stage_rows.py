"""The victims' staging of one layer's move (``Ula.move_layer``), old and new, on a GPU:
an XLA gather of the whole plan list against the Pallas launch that touches only its
valid prefix. Rows of 656 bytes (the FP8 layout), a list of B * k + B rows (B = 58 and
64, k = 2048) of which ``valid`` are victims, a device pool of 2M rows.

    PYTHONPATH=. python benchmarks/probes/gpu_stage_rows.py [OUT.json]

Prints a table of median device-synchronised times (us) per call; the ceiling column is
a read and a write of the valid rows at the device's measured copy bandwidth.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.kernels.fetch.pallas import stage_rows_pallas


def timed(f, *args, reps: int = 30) -> float:
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts)) * 1e6


def main() -> None:
  S, W = 2 << 20, 656
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.integers(0, 256, (S, W), dtype=np.uint8))
  xla = jax.jit(lambda p, i: p.at[jnp.clip(i, 0, S - 1)].get(mode="promise_in_bounds"))
  pallas = jax.jit(stage_rows_pallas)
  copy = jax.jit(lambda x: x + jnp.uint8(1))  # a read and a write of every byte
  big = jnp.zeros((1 << 28,), jnp.uint8)
  bw = 2 * big.size / (timed(copy, big) * 1e-6)  # bytes/s, read + write
  rows = []
  for B in (58, 64):
    M = B * 2048 + B
    for valid in (0, 1000, 4000, M):
      idx = np.full((M,), -1, np.int32)
      idx[:valid] = rng.choice(S, valid, replace=False)
      idx = jnp.asarray(idx)
      got = np.asarray(pallas(pool, idx))[:valid]
      assert (got == np.asarray(pool)[np.asarray(idx)[:valid]]).all()
      t_x, t_p = timed(xla, pool, idx), timed(pallas, pool, idx)
      ceil = 2 * valid * W / bw * 1e6
      rows.append({"batch": B, "list": M, "valid": valid, "xla_us": t_x, "pallas_us": t_p,
                   "ceiling_us": ceil})
  out = {"device": str(jax.devices()[0]), "jax": jax.__version__,
         "copy_bandwidth_GBps": bw / 1e9, "rows": rows}
  if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
  print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
  print(f"{'B':>3} {'list':>7} {'valid':>7} {'xla us':>9} {'pallas us':>10} {'ceiling us':>11}")
  for r in rows:
    print(f"{r['batch']:>3} {r['list']:>7} {r['valid']:>7} {r['xla_us']:>9.1f} "
          f"{r['pallas_us']:>10.1f} {r['ceiling_us']:>11.1f}")


if __name__ == "__main__":
  main()
