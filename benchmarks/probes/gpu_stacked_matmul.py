"""Whether a decode product can read a layer's weights in place of the stacked array: a
loop over the layers of ``x @ w[l]`` (``w``: [L, K, N] stacked weights, ``l`` the loop's
index, a device scalar) as XLA compiles it (a dynamic slice, which it copies out before
the product) against a Pallas kernel that loads ``w[l]``'s blocks itself
(``kernels.stacked_matmul``: grid over blocks of N and splits of K, float32 partial sums
added after), each set against
reading the weights once at the device's copy rate (measured in the same process).

Shapes: the large products of a ``glm5_narrow`` layer at ``--rows`` decode rows (the
query up-projection 2048 x 16384, the output projection 16384 x 1024, the value
up-projection as one 512 x 16384 product, the indexer's query 2048 x 4096).

    PYTHONPATH=. python benchmarks/probes/gpu_stacked_matmul.py --json out.json \\
        [--layers 16] [--rows 64] [--bk 64 --bn 128 --warps 4 --stages 3 --programs 264]

``--quick``: a CPU-sized smoke run (interpret mode, small shapes; no ceiling).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.bench.common import (best_and_median, device_copy_rate, environment,
                                   time_calls)
from ula_jax.kernels.stacked_matmul.pallas import (StackedMatmulConfig, splits_for,
                                                   stacked_matmul_pallas)

F32 = jnp.float32
SHAPES = {"w_uq": (2048, 16384), "w_o": (16384, 1024), "w_uv": (512, 16384),
          "idx_q": (2048, 4096)}
QUICK_SHAPES = {"a": (128, 256), "b": (512, 64)}


def layer_loop(product):
  """A loop over the layers: each step's product of the carried rows and layer l's
  weights (its first K columns fed back, so the steps run in order)."""
  def run(x, w):
    L = w.shape[0]

    def step(l, xc):
      y = product(xc, w, l)
      K = xc.shape[1]
      return (y[:, :K] if y.shape[1] >= K else jnp.tile(y, (1, K // y.shape[1] + 1))[:, :K]
              ).astype(xc.dtype)
    return jax.lax.fori_loop(0, L, step, x)
  return run


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--json", default="stacked_matmul.json")
  p.add_argument("--bk", type=int, default=64)
  p.add_argument("--bn", type=int, default=128)
  p.add_argument("--warps", type=int, default=4)
  p.add_argument("--stages", type=int, default=3)
  p.add_argument("--programs", type=int, default=264, help="K splits give about this many")
  p.add_argument("--quick", action="store_true")
  args = p.parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  interpret = not gpu
  shapes = QUICK_SHAPES if args.quick else SHAPES
  bk, bn = (32, 64) if args.quick else (args.bk, args.bn)
  programs = 4 if args.quick else args.programs

  rate = device_copy_rate(2**30) if gpu else None  # read + write traffic
  rows = []
  key = jax.random.key(0)
  for name, (K, N) in shapes.items():
    kx, kw, key = jax.random.split(key, 3)
    x = jax.random.normal(kx, (args.rows, K), F32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (args.layers, K, N), F32) / np.sqrt(K)).astype(jnp.bfloat16)
    config = StackedMatmulConfig(block_k=bk, block_n=bn, num_warps=args.warps,
                                 num_stages=args.stages, programs=programs)
    splits = splits_for(K, N, bk, bn, programs)
    kern = lambda xc, w, l: stacked_matmul_pallas(xc, w, l, config=config,
                                                  interpret=interpret)
    xla = lambda xc, w, l: jnp.dot(xc, w[l], preferred_element_type=F32)
    # One product: the kernel against XLA's.
    got = jax.jit(kern)(x, w, jnp.int32(args.layers - 1))
    want = jax.jit(xla)(x, w, jnp.int32(args.layers - 1))
    err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30))
    wbytes = w.size * w.dtype.itemsize
    for impl, prod in (("xla", xla), ("pallas", kern)):
      f = jax.jit(layer_loop(prod))
      times = []
      state = x
      for _ in range(args.reps):
        t, state = time_calls(lambda s: f(s, w), state, min_iters=2, max_iters=200,
                              target_s=0.2, warmup=1)
        times.append(t)
      best, median = best_and_median(times)
      ceiling = wbytes / rate if rate else None
      rows.append({"weight": name, "K": K, "N": N, "layers": args.layers, "rows": args.rows,
                   "impl": impl, "splits": splits if impl == "pallas" else None,
                   "config": {"bk": bk, "bn": bn, "warps": args.warps,
                              "stages": args.stages} if impl == "pallas" else None,
                   "loop_s": best, "loop_median_s": median, "weight_bytes": wbytes,
                   "read_once_s": ceiling,
                   "fraction_of_read_once": ceiling / best if ceiling else None,
                   "max_rel_err": err})
      r = rows[-1]
      print(f"{name:>6} {K:6d}x{N:<6d} {impl:>6}  {best * 1e3:8.3f} ms"
            + (f"  read-once {ceiling * 1e3:7.3f} ms  fraction {ceiling / best:5.2f}"
               if ceiling else "") + f"  rel err {err:.1e}")
  doc = {"probe": "stacked_matmul", "environment": environment(), "rows": rows}
  with open(args.json, "w") as f:
    json.dump(doc, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
