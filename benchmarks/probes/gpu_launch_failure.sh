#!/usr/bin/env bash
# Where a decode step's "unspecified launch failure" comes from (run from anywhere):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_launch_failure.sh
#
# 1. whether compute-sanitizer runs a JAX program on this machine; 2. if it does, memcheck
# over a short GLM-5-geometry step probe (MC_REQUESTS requests of MC_PROMPT tokens,
# MC_OUTPUT new tokens, in MC_ROWS rows) with MC_ARGS; 3. the step probe
# (gpu_glm5_steps.py) with launches made synchronous and command buffers off, so a failing
# kernel is named where it fails. VARIANTS: NAME|ARGS items, ARGS (config overrides and
# probe options) joined by '+'. The default: scores by length with the decode radix
# select counted by the Pallas kernel (failed in 3 of 4 freshly compiled runs on an H200).
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_launch_failure "${TIME_LIMIT_S:-560}" outside
config_wheels
if step sanitizer_probe 90 compute-sanitizer --tool memcheck "$PY" -c \
    "import jax.numpy as jnp; print(int(jnp.arange(10).sum()))"; then
  n=${MC_REQUESTS:-4}; p=${MC_PROMPT:-34000}; o=${MC_OUTPUT:-4}
  mc_args=${MC_ARGS:-kernels.decode_scores=lengths+--decode-counts+pallas}
  # shellcheck disable=SC2086
  STEP_TAIL=60 step memcheck "${MC_LIMIT_S:-240}" compute-sanitizer --tool memcheck \
    --print-limit 30 "$PY" benchmarks/probes/gpu_glm5_steps.py --systems resident \
    --requests "$n" --prompt "$p" --output "$o" --json "$OUT/memcheck.json" \
    "engine.max_batch=${MC_ROWS:-8}" ${mc_args//+/ }
  # A sanitizer that dies can leave its program running, holding device memory (the
  # runs below then ran out of it): list what holds the GPU, stop what memcheck started.
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$WORK/gpu_apps.txt"
  pkill -9 -f "gpu_glm5_steps.py --systems resident --requests $n " || true
  sleep 3
fi
for v in ${VARIANTS:-lengths_pallas|kernels.decode_scores=lengths+--decode-counts+pallas}; do
  IFS='|' read -r name over <<< "$v"
  # shellcheck disable=SC2086
  CUDA_LAUNCH_BLOCKING=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=" STEP_TAIL=40 \
    step "sync_$name" "${RUN_LIMIT_S:-200}" $PY benchmarks/probes/gpu_glm5_steps.py \
    --systems resident --requests "${REQUESTS:-8}" --prompt "${PROMPT:-65536}" \
    --output "${OUTPUT:-24}" --json "$OUT/sync_$name.json" "engine.max_batch=${ROWS:-32}" \
    ${over//+/ }
done
print_steps | tee "$WORK/steps.txt"
tar czf "$OUT/logs.tgz" -C "$WORK" .
