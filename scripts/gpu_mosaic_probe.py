"""Where the Mosaic GPU sparse attention's time goes, part by part (Hopper GPU).

Times ``sparse_mla_attention_mosaic`` with parts of a tile step replaced, for each
launch form (``--configs``, the attention benchmark's Mosaic tokens) and variant
(``--variants``). The outputs of a variant other than ``full`` are not attention; each
variant keeps the data dependences of what it leaves in, so that nothing is optimised
away:

  full           the kernel as it is
  scores_only    scores (wgmma) and the online softmax, no output matmul
  no_softmax     scores and the output matmul, the probabilities are the raw scores
  outputs_only   softmax and output matmul over constant scores, no score matmul
  scores_nosoft  the score matmul alone

Suffixes: ``+c`` the benchmark's 'compute' ablation (the first tiles gathered once and
reused: no copies in flight), ``+nw`` no step waits for its copies to land (the
results are then wrong; the time says whether waiting, or issuing, is what costs).

    PYTHONPATH=. python scripts/gpu_mosaic_probe.py --configs auto,k32 \\
        --variants full,full+nw,full+c,scores_only+c --out probe.json

Prints one line per run (fastest and median of 5 x 20 calls, microseconds) and writes
them with the environment to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from ula_jax.bench.attention import parse_mosaic_config
from ula_jax.bench.common import best_and_median, environment, time_calls
from ula_jax.kernels.sparse_attention import mosaic as M

TIMING = dict(min_iters=20, max_iters=20, target_s=0.0, warmup=1)  # 20 calls
VARIANTS = ("full", "scores_only", "no_softmax", "outputs_only", "scores_nosoft")
_TILE_STEP, _WAIT_GROUPS = M._tile_step, M._wait_groups


def _tile_step(variant: str):
  """A replacement of ``mosaic._tile_step`` that does only part of a step."""

  def step(q_smem, stage, bits_smem, t, w, scale2, m, l, acc, block_k=M.BLOCK_K):
    if variant == "full":
      return _TILE_STEP(q_smem, stage, bits_smem, t, w, scale2, m, l, acc, block_k)
    if variant == "outputs_only":
      sc = plgpu.layout_cast(jnp.full((M.HEADS, block_k), 0.5, jnp.float32),
                             plgpu.Layout.WGMMA)
    else:
      sc = M._scores(q_smem, stage, block_k)
    if variant in ("no_softmax", "outputs_only", "scores_nosoft"):
      p, m = sc, m + sc.max(axis=1)
    else:
      m, l, acc, p = M._softmax_update(sc, m, l, acc)
    if variant in ("scores_only", "scores_nosoft"):
      return m, l, acc + jax.lax.broadcast_in_dim(p.sum(axis=1), acc.shape, [0])
    return m, l, M._outputs(p, stage, w, acc)

  return step


def _parse_variant(token: str) -> tuple[str, bool, bool]:
  name, *flags = token.split("+")
  if name not in VARIANTS or any(f not in ("c", "nw") for f in flags):
    raise ValueError(f"--variants: {token!r}: expected one of {list(VARIANTS)} with "
                     "optional suffixes +c (compute ablation) and +nw (no copy waits)")
  return name, "c" in flags, "nw" in flags


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", default="auto", help="Mosaic launch tokens, comma list")
  p.add_argument("--variants", default="full,full+nw,full+c", help="comma list")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--pool-rows", type=int, default=262144)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  configs = [(t, parse_mosaic_config(t)) for t in args.configs.split(",") if t]
  variants = [_parse_variant(t) for t in args.variants.split(",") if t]
  B, k, S = args.batch, args.k, args.pool_rows
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  inputs = (jax.random.normal(ks[0], (B, M.HEADS, M.LATENT), jnp.bfloat16),
            jax.random.normal(ks[1], (B, M.HEADS, M.ROPE), jnp.bfloat16),
            jax.random.normal(ks[2], (S, M.WIDTH), jnp.bfloat16),
            jax.random.randint(ks[3], (B, k), 0, S, jnp.int32), jnp.ones((B, k), bool))
  rows = []
  try:
    for token, config in configs:
      for name, compute, nowait in variants:
        M._tile_step = _tile_step(name)
        M._wait_groups = (lambda pending: (lambda ctx: None)) if nowait else _WAIT_GROUPS
        f = jax.jit(lambda *a: M.sparse_mla_attention_mosaic(
            *a, scale=0.1, config=config, merge=False,
            ablation="compute" if compute else None)[0]).lower(*inputs).compile()
        best, median = best_and_median(
            [time_calls(lambda _: f(*inputs), None, **TIMING)[0] * 1e6 for _ in range(5)])
        label = f"{token}:{name}" + ("+c" if compute else "") + ("+nw" if nowait else "")
        rows.append({"config": token, "variant": name, "compute_ablation": compute,
                     "no_copy_waits": nowait, "us": best, "median_us": median})
        print(f"{label:28s} {best:8.1f} us  median {median:8.1f}", flush=True)
  finally:
    M._tile_step, M._wait_groups = _TILE_STEP, _WAIT_GROUPS
  if args.out:
    with open(args.out, "w") as fh:
      json.dump({"benchmark": "mosaic_probe", "environment": environment(), "batch": B,
                 "k": k, "pool_rows": S, "rows": rows}, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
