#!/usr/bin/env bash
# Where the GLM-5 decode step's compile time goes, on one GPU (run from the repository
# root; config wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_compile_profile.sh
#
# ula-jax bench compile of the decode step only, GLM-5 geometry (glm5_narrow, 78 layers,
# top-k 2048), batch 2, context 2048, one process per variant:
#   full        ula, Mosaic attention, Pallas fetch, fused Pallas resolve (what a GLM-5 run
#               compiles)
#   xla_attn    the same with XLA attention
#   xla_all     ula with XLA attention, XLA fetch, jnp resolve
#   no_tune     xla_all with XLA's autotuning off
#   resident    resident with the Mosaic attention
#   proj_xla    full with kernels.projections=xla (the layers' products sliced, no
#               stacked-matmul kernels: what those kernels add to the compile)
# Results: compile_<variant>.json under $OUT, steps.txt printed last.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_compile_profile "${TIME_LIMIT_S:-560}"
config_wheels
CLI="$PY -m ula_jax.cli.main"
BASE="--config experiments/glm5_summarization/config.yaml --layers 78 --steps decode
      --batch 2 --context 2048 memory.device_pool=65536 memory.host_pool=65536"
variant() {  # variant NAME SYSTEM ATTENTION FETCH RESOLVE [XLA_FLAGS]
  local name=$1
  # shellcheck disable=SC2086
  XLA_FLAGS="${6:-${XLA_FLAGS:-}}" step "$name" 150 $CLI bench compile $BASE --systems "$2" \
    --json "$OUT/compile_$name.json" kernels.attention="$3" kernels.fetch="$4" \
    kernels.resolve="$5" ${EXTRA:-}
}
for v in ${VARIANTS:-full xla_attn xla_all no_tune resident}; do
  case $v in
    full) variant full ula mosaic pallas pallas_fused ;;
    xla_attn) variant xla_attn ula xla pallas pallas_fused ;;
    xla_all) variant xla_all ula xla xla jnp ;;
    no_tune) variant no_tune ula xla xla jnp --xla_gpu_autotune_level=0 ;;
    resident) variant resident resident mosaic xla jnp ;;
    proj_xla) EXTRA=kernels.projections=xla variant proj_xla ula mosaic pallas pallas_fused ;;
  esac
done
print_steps | tee "$OUT/steps.txt"
