"""How fast Hopper's ``wgmma`` runs per SM, by operand source and N (Hopper GPU).

One program per SM, one or two warpgroups, each issuing ``--calls`` ``wgmma`` calls of
M 64, K 64 (four ``HGMMA.64xNx16`` instructions each) on one accumulator, with the A
operand in registers (``rs``: a WGMMA-layout array, as the Mosaic kernel's rows) or in
shared memory (``ss``, as the Triton kernel's queries), and B ([K, N], bf16, read
transposed like the Mosaic kernel's queries) in shared memory; ``--in-flight`` calls left
in flight before the next is issued. Prints, per (source, N, warpgroups), microseconds and
the cycles per instruction per SM at the clock given (``--clock-ghz``), against the N / 2
cycles that the tensor cores' peak (2,048 bf16 multiply-adds per cycle per SM: 989
TFLOP/s over 132 SMs at 1.83 GHz) would take, and writes them to ``--out``.

    PYTHONPATH=. python benchmarks/probes/gpu_wgmma_rate.py --n 32,64,128,256 --out wgmma.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ula_jax.bench.common import best_and_median, environment, time_calls

SMS = 132


def rate_kernel(source: str, n: int, warpgroups: int, calls: int, in_flight: int):
  """A function of B [N, 64] bf16 -> [SMS, warpgroups, 64, N] float32 accumulators."""
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(a_ref, b_ref, o_ref, a_smem, b_smem, bar):
    sm, wg = jax.lax.axis_index("sm"), jax.lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(b_ref, b_smem, bar)
      plgpu.copy_gmem_to_smem(a_ref, a_smem, bar)

    plgpu.barrier_wait(bar)
    bt = plgpu.transpose_ref(b_smem, (1, 0))  # [64 (K), N]
    if source == "rs":
      a = plgpu.layout_cast(jnp.full((64, 64), 0.001, jnp.bfloat16), plgpu.Layout.WGMMA)
    else:
      a = a_smem

    def run(acc_ref):
      def step(i, carry):
        plgpu.wgmma(acc_ref, a, bt)
        plgpu.wgmma_wait(in_flight)
        return carry

      jax.lax.fori_loop(0, calls, step, 0)
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    acc = pl.run_scoped(run, plgpu.ACC((64, n), jnp.float32))
    o_ref[sm, wg] = acc

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((SMS, warpgroups, 64, n), jnp.float32),
      scratch_types=[plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiled),
                     plgpu.SMEM((n, 64), jnp.bfloat16, transforms=tiled),
                     plgpu.Barrier(num_arrivals=2)],
      grid=(SMS,), grid_names=("sm",), num_threads=warpgroups, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--n", default="32,64,128,256", help="wgmma N values, comma list")
  p.add_argument("--sources", default="rs,ss", help="A operand: rs (registers), ss (smem)")
  p.add_argument("--warpgroups", default="1,2", help="warpgroups per SM, comma list")
  p.add_argument("--calls", type=int, default=4096)
  p.add_argument("--in-flight", type=int, default=1)
  p.add_argument("--clock-ghz", type=float, default=1.98)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rows = []
  a = jnp.full((64, 64), 0.001, jnp.bfloat16)
  for source in args.sources.split(","):
    for n in (int(x) for x in args.n.split(",")):
      b = jnp.full((n, 64), 0.001, jnp.bfloat16)
      for wgs in (int(x) for x in args.warpgroups.split(",")):
        f = jax.jit(rate_kernel(source, n, wgs, args.calls, args.in_flight))
        out = jax.block_until_ready(f(a, b))
        expect = args.calls * 64 * 0.001 * 0.001
        ok = bool(abs(float(out[0, 0, 0, 0]) - expect) < 0.05 * expect)
        best, median = best_and_median(
            [time_calls(lambda _: f(a, b), None, min_iters=5, max_iters=5, target_s=0.0,
                        warmup=1)[0] * 1e6 for _ in range(3)])
        instr = args.calls * 4 * wgs  # HGMMA instructions per SM
        cycles = best * 1e-6 * args.clock_ghz * 1e9 / instr
        peak = 64 * n * 16 / 2048
        rows.append({"source": source, "n": n, "warpgroups": wgs, "us": best,
                     "median_us": median, "cycles_per_instr": cycles,
                     "peak_cycles_per_instr": peak, "result_ok": ok})
        print(f"{source} N={n:3d} wg={wgs}: {best:8.1f} us  {cycles:6.1f} cycles/instr "
              f"(peak {peak:5.1f})  {'ok' if ok else 'WRONG'}", flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({"benchmark": "wgmma_rate", "environment": environment(), "calls": args.calls,
                 "in_flight": args.in_flight, "clock_ghz": args.clock_ghz, "rows": rows},
                fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
