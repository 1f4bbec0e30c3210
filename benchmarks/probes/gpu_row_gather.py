"""How fast Hopper's tensor memory accelerator gathers pool rows by slot (Hopper GPU).

The sparse attention must read ``B x k`` rows of 1152 bytes (576 bf16) at random slots.
The Mosaic kernel's first forms issued those reads as 16-byte ``cp.async`` copies from
the threads that then compute, and the issue stalled them
(``docs/kernels/sparse_attention.md``). This measures what leaves the threads free, and
what the kernel now does: TMA copies, issued by one thread each and tracked by a
barrier's transaction count, in a program per (request, k split) like the attention's,
with a ring of two 64-row tiles and nothing computed:

  row      one TMA copy per row: the pool viewed as [3 S, 192], a (3, 192) box
  chunks   nine TMA copies of 128 bytes per row (the boxes a 128-byte-swizzled tile for
           ``wgmma`` would need, one per 64 columns)

Beside them, in the same run: the attention benchmark's device copy of the same bytes
(``bench.attention.copy_loop``: the ceiling the attention target is a fraction of, bytes
read per second against the copy's read + write traffic).

    PYTHONPATH=. python benchmarks/probes/gpu_row_gather.py --modes row,chunks --issuers 1,2,4 \\
        --out gather.json

``--issuers``: warpgroups per program that issue the copies (each from one thread):
whether a tile's 576 small copies are bound by one thread's issue rate.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ula_jax.bench.attention import copy_loop
from ula_jax.bench.common import best_and_median, environment, time_calls

WIDTH, TILE = 576, 64
MODES = ("row", "chunks")


def tma_gather(pool, slots, *, mode: str, splits: int, issuers: int = 1):
  """Gathers ``pool[slots]`` tile by tile into shared memory (and discards it);
  returns each program's last tile's first row, so the copies cannot be dropped.
  ``issuers``: warpgroups per program, each issuing the copies of every
  ``issuers``-th row of a tile from one of its threads (1, 2 or 4)."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: expected one of {list(MODES)}")
  if issuers not in (1, 2, 4):
    raise ValueError(f"issuers={issuers!r}: expected 1, 2 or 4 warpgroups")
  S, B, k = pool.shape[0], slots.shape[0], slots.shape[1]
  tiles = k // splits // TILE
  if tiles < 2 or k % (splits * TILE * 2):
    raise ValueError(f"k={k}: expected a multiple of {2 * splits * TILE}")
  slots = slots.reshape(B, splits, tiles, TILE)
  if mode == "row":
    src, box, copies = pool.reshape(S * 3, WIDTH // 3), (3, WIDTH // 3), TILE
  else:
    src, box, copies = pool, (WIDTH // 64, 64), TILE * WIDTH // 64

  def body(src_ref, slots_ref, out_ref, buf, slots_smem, bars, in_bar):
    b, sp = jax.lax.axis_index("b"), jax.lax.axis_index("split")
    wg = jax.lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(slots_ref.at[b, sp], slots_smem, in_bar)

    plgpu.barrier_wait(in_bar)

    def issue(t, s: int):
      def row(i, carry):
        r = i * issuers + wg
        slot = slots_smem[t, r]
        if mode == "row":
          plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(slot * 3, 3)], buf.at[s, r], bars.at[s])
        else:
          for c in range(WIDTH // 64):
            plgpu.copy_gmem_to_smem(src_ref.at[slot, pl.ds(64 * c, 64)], buf.at[s, r, c],
                                    bars.at[s])
        return carry

      jax.lax.fori_loop(0, TILE // issuers, row, 0)

    issue(0, 0)

    def pair(jj, carry):
      for s in range(2):
        t = 2 * jj + s
        pl.when(t + 1 < tiles)(lambda: issue(t + 1, 1 - s))
        plgpu.barrier_wait(bars.at[s])
      return carry

    jax.lax.fori_loop(0, tiles // 2, pair, 0)

    @pl.when(wg == 0)
    def _():
      plgpu.copy_smem_to_gmem(buf.at[1, 0], out_ref.at[b, sp])
      plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((B, splits) + box, pool.dtype),
      scratch_types=[plgpu.SMEM((2, TILE) + box, pool.dtype),
                     plgpu.SMEM((tiles, TILE), jnp.int32),
                     plgpu.Barrier(num_arrivals=copies, num_barriers=2),
                     plgpu.Barrier(num_arrivals=1)],
      grid=(splits, B), grid_names=("split", "b"), num_threads=issuers, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane))
  return kernel(src, slots)


def _best(step, state, reps: int = 5) -> float:
  """Fastest of ``reps`` measurements (``bench.common.time_calls``) of 20 calls of
  ``state = step(state)``: seconds per call."""
  times = []
  for _ in range(reps):
    t, state = time_calls(step, state, min_iters=20, max_iters=20, target_s=0.0, warmup=1)
    times.append(t)
  return best_and_median(times)[0]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--modes", default="row,chunks")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--splits", type=int, default=2)
  p.add_argument("--issuers", default="1", help="warpgroups issuing copies, comma list "
                 "of 1, 2, 4")
  p.add_argument("--pool-rows", type=int, default=262144)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  B, k, S = args.batch, args.k, args.pool_rows
  key = jax.random.split(jax.random.PRNGKey(0), 2)
  pool = jax.random.normal(key[0], (S, WIDTH), jnp.bfloat16)
  slots = jax.random.randint(key[1], (B, k), 0, S, jnp.int32)
  nbytes = B * k * WIDTH * 2
  passes = 16  # the attention benchmark's ceiling: passes over a donated buffer
  copy_s = _best(copy_loop(passes), jnp.zeros((nbytes // 4,), jnp.uint32)) / passes
  copy_gbps = 2 * nbytes / copy_s / 1e9  # read + write traffic
  rows = [{"mode": "device copy", "us": copy_s * 1e6, "read_gbps": nbytes / copy_s / 1e9,
           "fraction": 0.5}]
  runs = [(m, int(n)) for m in args.modes.split(",") if m
          for n in args.issuers.split(",") if n]
  for mode, issuers in runs:
    f = jax.jit(lambda pl_, sl, mode=mode, n=issuers: tma_gather(
        pl_, sl, mode=mode, splits=args.splits, issuers=n))
    got = f(pool, slots)  # the last tile's first row of every program
    want = pool[slots.reshape(B, args.splits, -1)[:, :, -TILE]]  # last tile, row 0
    exact = bool(jnp.array_equal(got.reshape(want.shape), want))
    s = _best(lambda _: f(pool, slots), None)
    rows.append({"mode": mode, "issuers": issuers, "us": s * 1e6, "read_gbps": nbytes / s / 1e9,
                 "fraction": nbytes / s / 1e9 / copy_gbps, "exact": exact})
  for r in rows:
    print(f"{r['mode']:12s} {r.get('issuers', '-')!s:>3} {r['us']:8.1f} us  {r['read_gbps']:7.1f} GB/s read  "
          f"fraction {r['fraction']:.3f}  {'exact' if r.get('exact', True) else 'WRONG'}")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({"benchmark": "row_gather", "environment": environment(), "batch": B,
                 "k": k, "splits": args.splits, "pool_rows": S, "bytes": nbytes,
                 "rows": rows}, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
