"""The decode products that read a layer's weights in place, one launch config against
another: a loop over the layers of ``x @ w[l]`` (``w``: stacked weights, ``l`` the loop's
index, a device scalar) as XLA compiles it (a dynamic slice, which it copies out before
the product) and as ``kernels.stacked_matmul``'s Pallas kernel runs it under each launch
config given (block of K, block of N, warps, pipeline stages, the grid size its K splits
aim for), each set against reading the weights once at the device's copy rate
(measured in the same process).

Shapes (``--shapes model``): every product of a ``glm5_narrow`` layer and group at
``--rows`` decode rows, batched as the model runs them (``models.transformer.IN_PLACE``:
MLA's down-projections, the query up-projection, the key up-projection per head with its
weights stored [N, K], the value up-projection per head, the output projection, the
experts' three, the shared expert's, a dense layer's MLP, the indexer's three).
``--shapes legacy``: the four plain products of the first version.

    PYTHONPATH=. python benchmarks/probes/gpu_stacked_matmul.py --json out.json \\
        [--layers 16] [--rows 64] [--shapes model|legacy] \\
        [--configs "64,128,4,3,264;128,128,8,4,132"]

Results are rounded to bfloat16 (``out_dtype``), as the model takes them. ``--quick``: a
CPU-sized smoke run (interpret mode, small shapes; no ceiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ula_jax.bench.common import (best_and_median, device_copy_rate, environment,
                                   time_calls)
from ula_jax.kernels.stacked_matmul.pallas import (StackedMatmulConfig, blocks, padded_rows,
                                                   splits_for, stacked_matmul_pallas)
from ula_jax.kernels.stacked_matmul.reference import stacked_matmul_reference

F32, BF16 = jnp.float32, jnp.bfloat16
# name: (batch B, K, N, rows shared by the batch, weights stored [N, K])
MODEL_SHAPES = {
    "w_uq": (1, 2048, 16384, True, False),
    "w_uk": (64, 192, 512, False, True),
    "w_uv": (64, 512, 256, False, False),
    "w_o": (1, 16384, 1024, True, False),
    "e_gate": (8, 1024, 256, True, False),
    "e_down": (8, 256, 1024, False, False),
    "w_dq": (1, 1024, 2048, True, False),
    "w_dkv": (1, 1024, 512, True, False),
    "w_kr": (1, 1024, 64, True, False),
    "sh_gate": (1, 1024, 256, True, False),
    "sh_down": (1, 256, 1024, True, False),
    "mlp_gate": (1, 1024, 2048, True, False),
    "mlp_down": (1, 2048, 1024, True, False),
    "idx_q": (1, 2048, 4096, True, False),
    "idx_k": (1, 1024, 128, True, False),
    "idx_w": (1, 1024, 32, True, False),
}
LEGACY_SHAPES = {"w_uq": (1, 2048, 16384, True, False), "w_o": (1, 16384, 1024, True, False),
                 "w_uv": (1, 512, 16384, True, False), "idx_q": (1, 2048, 4096, True, False)}
QUICK_SHAPES = {"a": (1, 128, 256, True, False), "b": (2, 64, 64, False, True)}
DEFAULT_CONFIGS = "64,128,4,3,264"


def parse_configs(text: str) -> list[StackedMatmulConfig]:
  """``"bk,bn,warps,stages,programs[,max_partials];..."`` -> configs."""
  out = []
  for part in filter(None, (p.strip() for p in text.split(";"))):
    fields = part.split(",")
    bk, bn, warps, stages, programs = (int(v) for v in fields[:5])
    out.append(StackedMatmulConfig(block_k=bk, block_n=bn, num_warps=warps,
                                   num_stages=stages, programs=programs,
                                   max_partials=float(fields[5]) if len(fields) > 5 else None))
  return out


def tag(c: StackedMatmulConfig) -> str:
  return (f"{c.block_k},{c.block_n},{c.num_warps},{c.num_stages},{c.programs}"
          + (f",{c.max_partials:g}" if c.max_partials is not None else ""))


def layer_loop(product, x_shape):
  """A loop over the layers: each step's product of the carried rows and layer l's
  weights, its first elements fed back as the next rows (so the steps run in order)."""
  size = int(np.prod(x_shape))

  def run(x, w):
    def step(l, xc):
      flat = product(xc, w, l).reshape(-1)
      flat = flat[:size] if flat.size >= size else jnp.tile(flat, size // flat.size + 1)[:size]
      return flat.reshape(x_shape).astype(xc.dtype)
    return jax.lax.fori_loop(0, w.shape[0], step, x)
  return run


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--rows", type=int, default=64)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--json", default="stacked_matmul.json")
  p.add_argument("--shapes", choices=("model", "legacy"), default="model")
  p.add_argument("--configs", default=DEFAULT_CONFIGS,
                 help="Pallas launch configs, 'bk,bn,warps,stages,programs' separated by ';'")
  p.add_argument("--quick", action="store_true")
  args = p.parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  interpret = not gpu
  shapes = QUICK_SHAPES if args.quick else (MODEL_SHAPES if args.shapes == "model"
                                            else LEGACY_SHAPES)
  configs = ([StackedMatmulConfig(block_k=32, block_n=64, programs=4)] if args.quick
             else parse_configs(args.configs))

  rate = device_copy_rate(2**30) if gpu else None  # read + write traffic
  rows = []
  key = jax.random.key(0)
  for name, (B, K, N, shared, transposed) in shapes.items():
    kx, kw, key = jax.random.split(key, 3)
    x = jax.random.normal(kx, (1 if shared else B, args.rows, K), F32).astype(BF16)
    wshape = (args.layers, B, N, K) if transposed else (args.layers, B, K, N)
    w = (jax.random.normal(kw, wshape, F32) / np.sqrt(K)).astype(BF16)
    wbytes = w.size * w.dtype.itemsize
    ceiling = wbytes / rate if rate else None
    xla = lambda xc, w, l: stacked_matmul_reference(xc, w, l, transposed=transposed
                                                    ).astype(BF16)
    want = jax.jit(xla)(x, w, jnp.int32(args.layers - 1)).astype(F32)
    variants = [("xla", None, xla)]
    for c in configs:
      variants.append(("pallas", c, lambda xc, w, l, c=c: stacked_matmul_pallas(
          xc, w, l, transposed=transposed, out_dtype=BF16, config=c, interpret=interpret)))
    for impl, c, prod in variants:
      err = failure = None
      bk, bn = blocks(K, N, c) if c else (None, None)
      splits = (splits_for(K, B * N, bk, bn, c.programs, rows=padded_rows(args.rows),
                           max_partials=c.max_partials) if c and bk and bn else None)
      try:
        if c is not None:
          got = jax.jit(prod)(x, w, jnp.int32(args.layers - 1)).astype(F32)
          err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30))
        f = jax.jit(layer_loop(prod, x.shape))
        times, state = [], x
        for _ in range(args.reps):
          t, state = time_calls(lambda s: f(s, w), state, min_iters=2, max_iters=200,
                                target_s=0.2, warmup=1)
          times.append(t)
      except Exception as e:  # a launch the GPU cannot run (e.g. too much shared memory)
        failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        print(f"{name:>8} {impl} {c}: failed: {failure}")
        rows.append({"weight": name, "B": B, "K": K, "N": N, "impl": impl,
                     "config": dataclasses.asdict(c) if c else None, "splits": splits,
                     "failed": failure})
        continue
      best, median = best_and_median(times)
      rows.append({"weight": name, "B": B, "K": K, "N": N, "shared_rows": shared,
                   "transposed": transposed, "layers": args.layers, "rows": args.rows,
                   "impl": impl, "splits": splits,
                   "config": None if c is None else dataclasses.asdict(c),
                   "loop_s": best, "loop_median_s": median, "weight_bytes": wbytes,
                   "us_per_product": best / args.layers * 1e6,
                   "read_once_s": ceiling,
                   "fraction_of_read_once": ceiling / best if ceiling else None,
                   "max_rel_err": err})
      label = "xla" if c is None else f"{tag(c)} s{splits}"
      print(f"{name:>8} {B:3d}x{K:5d}x{N:<5d} {label:>24}  {best / args.layers * 1e6:8.2f} us"
            + (f"  fraction {ceiling / best:5.2f}" if ceiling else "")
            + (f"  rel err {err:.1e}" if err is not None else ""))
    write(args.json, rows)  # after each shape: a run cut short keeps what it measured
  # Per shape, the fastest config.
  print("== fastest per shape (us a product; fraction of reading the weights once)")
  for name in shapes:
    mine = [r for r in rows if r["weight"] == name and "failed" not in r]
    xr = next((r for r in mine if r["impl"] == "xla"), None)
    ran = [r for r in mine if r["impl"] == "pallas"]
    if xr is None or not ran:
      print(f"{name:>8}  no measurement")
      continue
    best = min(ran, key=lambda r: r["loop_s"])
    c = StackedMatmulConfig(**best["config"])
    print(f"{name:>8}  xla {xr['us_per_product']:8.2f}  pallas {best['us_per_product']:8.2f}"
          f"  ({tag(c)} s{best['splits']})"
          + (f"  fraction {best['fraction_of_read_once']:5.2f}"
             if best["fraction_of_read_once"] else ""))
  write(args.json, rows)
  return 0


def write(path: str, rows: list[dict]) -> None:
  with open(path, "w") as f:
    json.dump({"probe": "stacked_matmul", "environment": environment(), "rows": rows}, f,
              indent=1)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
