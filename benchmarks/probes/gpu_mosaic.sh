#!/usr/bin/env bash
# The Mosaic GPU sparse attention on a Hopper GPU, run from the repository root:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_mosaic.sh
#
# Steps: tests (tests/test_sparse_attention_mosaic.py -m gpu: every launch against the
# reference), ptxas (registers and spills of each launch at batch 64, k 2048, from
# MOSAIC_GPU_DUMP_PTXAS), bench (ula_jax.bench.attention at batch 64, 128 and 256: the
# Triton kernel and the Mosaic launches MOSAIC_CONFIGS, default auto,r232); MOSAIC_TESTS:
# a pytest -k expression choosing the tests (default: all). Results under $OUT:
# bench_mosaic.json and the logs; the last lines printed are the steps' table and the
# benchmark's rows.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_mosaic 540
CONFIGS=${MOSAIC_CONFIGS:-auto,r232}
step tests 150 "$PY" -m pytest -m gpu tests/test_sparse_attention_mosaic.py -q \
  -p no:cacheprovider -W ignore::DeprecationWarning -o addopts="" ${MOSAIC_TESTS:+-k "$MOSAIC_TESTS"}
MOSAIC_GPU_DUMP_PTXAS=1 step ptxas 120 "$PY" -c "
import sys, jax, jax.numpy as jnp
from ula_jax.bench.attention import parse_mosaic_config
from ula_jax.kernels.sparse_attention.mosaic import sparse_mla_attention_mosaic as f
z = jnp.zeros
for token in sys.argv[1].split(','):
  print('CONFIG', token, flush=True)
  g = jax.jit(lambda *a: f(*a, scale=0.1, config=parse_mosaic_config(token), merge=False))
  jax.block_until_ready(g(z((64, 64, 512), jnp.bfloat16), z((64, 64, 64), jnp.bfloat16),
                          z((300, 576), jnp.bfloat16), z((64, 2048), jnp.int32),
                          z((64, 2048), bool)))
  print('RAN', token, flush=True)" "$CONFIGS"
grep -E "CONFIG|RAN|registers|spill" "$WORK/ptxas.log"
step bench 240 "$PY" -c "
import sys
from ula_jax.bench import attention
sys.exit(attention.main(sys.argv[1:]))" --batch 64,128,256 --impls pallas,mosaic \
  --mosaic-configs "$CONFIGS" --reps 2 --out "$OUT/bench_mosaic.json"
print_steps
grep -E "│ +(64|128|256) │" "$WORK/bench.log" | cut -c1-150
