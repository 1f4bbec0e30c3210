"""One Mosaic GPU sparse attention launch to profile with Nsight Compute (Hopper GPU).

Runs the kernel (``mosaic.sparse_mla_attention_probe``) three times at batch 64, k 2048
(the benchmark's shape) with a launch token and one of ``gpu_mosaic_probe``'s tile-step
variants, so that

    ncu -k regex:mosaic --launch-skip 2 --launch-count 1 --set full -o rows \\
        python3 benchmarks/probes/gpu_mosaic_ncu.py auto full compute

profiles the third (compiled, warm) launch; ``benchmarks/probes/ncu_summary.py`` reads the
report's CSV pages. Arguments: TOKEN VARIANT [ABLATION] (ablation: compute or gather).
"""

from __future__ import annotations

import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_mosaic_probe as probe  # noqa: E402
from ula_jax.bench.attention import parse_mosaic_config  # noqa: E402
from ula_jax.kernels.sparse_attention import mosaic as M  # noqa: E402


def main(argv: list[str]) -> int:
  if len(argv) not in (2, 3):
    raise SystemExit(__doc__)
  token, variant = argv[:2]
  ablation = argv[2] if len(argv) == 3 else None
  name = probe._parse_variant(variant)[0]
  inputs = probe.make_inputs(64, 2048, 262144)
  config = parse_mosaic_config(token)
  f = jax.jit(lambda *a: M.sparse_mla_attention_probe(
      *a, scale=0.1, config=config, tile_step=probe.tile_step(name), ablation=ablation)[0])
  for _ in range(3):
    jax.block_until_ready(f(*inputs))
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
