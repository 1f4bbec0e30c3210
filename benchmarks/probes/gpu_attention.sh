#!/usr/bin/env bash
# GPU sweep of the Pallas sparse MLA attention: ula_jax.bench.attention over batch sizes
# and launch configurations (ATTN_CONFIGS, ATTN_BATCH; further benchmark flags in
# ATTN_ARGS, e.g. "--impls pallas,mosaic"), then the kernel's GPU tests (SKIP_TESTS=1
# leaves them out).
# Run from the repository root on a CUDA machine:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_attention.sh
#
# Results under $OUT: bench_attention.json, junit_attention.xml, the logs. BUDGET_S
# (default 420) bounds the whole run.

set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_attention 420
ATTN_BATCH=${ATTN_BATCH:-1,8,32,64,128,256}
ATTN_CONFIGS=${ATTN_CONFIGS:-auto,h64k64w8p0,h64k32w8n4}
STEP_TAIL=${STEP_TAIL:-40}

step env 60 bash -c "nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv; \
  $PY -c 'import jax, jaxlib; print(\"jax\", jax.__version__, jaxlib.__version__, jax.devices())'"
step bench_attn 300 "$PY" -c "
import sys
from ula_jax.bench import attention
sys.exit(attention.main(sys.argv[1:]))" --out "$OUT/bench_attention.json" --reps 3 \
  --batch "$ATTN_BATCH" --configs "$ATTN_CONFIGS" --impls pallas ${ATTN_ARGS:-}
[ -n "${SKIP_TESTS:-}" ] || step tests_gpu 120 "$PY" -m pytest \
  tests/test_sparse_attention_pallas.py -m gpu -q -rf -p no:cacheprovider \
  --junitxml="$OUT/junit_attention.xml"
cp "$WORK"/*.log "$OUT"/ 2>/dev/null
print_steps
