#!/usr/bin/env bash
# The layer stack's weight reads under each XLA setting and form
# (benchmarks/probes/gpu_layer_weights.py), one process a variant:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_layer_weights.sh
#
# LW_LAYERS (default 16), LW_ROWS (default 64). Results under $OUT: a JSON a variant,
# logs.tgz (the logs and the base program's HLO); a short table last.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_layer_weights "${TIME_LIMIT_S:-540}" outside
config_wheels
L=${LW_LAYERS:-16}; R=${LW_ROWS:-64}
run_variant() {  # TAG FORM FLAGS
  XLA_FLAGS="$3" step "lw_$1" 150 "$PY" benchmarks/probes/gpu_layer_weights.py --tag "$1" \
    --form "$2" --layers "$L" --rows "$R" --json "$OUT/lw_$1.json" \
    ${LW_HLO:+--hlo "$WORK/hlo_$1.txt"}
}
LW_HLO=1 run_variant base scan ""
run_variant unrolled unrolled ""
run_variant dsf scan "--xla_gpu_enable_dynamic_slice_fusion=true"
run_variant nolt scan "--xla_gpu_enable_cublaslt=false"
run_variant dsf_nolt scan "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_cublaslt=false"
run_variant nocmdbuf scan "--xla_gpu_enable_command_buffer="
tar -czf "$OUT/logs.tgz" -C "$WORK" .
grep -h " ms" "$WORK"/lw_*.log 2>/dev/null || true
print_steps
