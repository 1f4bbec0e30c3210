#!/usr/bin/env bash
# Where a GLM-5-geometry decode step's weight reads go, in one device call (run from
# anywhere; config wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_weights.sh
#
# 1. the layer stack of 78 layers at 64 rows, products read in place
#    (benchmarks/probes/gpu_layer_weights.py --projections pallas): its time against
#    reading the weights once, its compiled HLO and its device operations by HLO op
#    (what the remaining copies are);
# 2. the all-hit GLM-5 decode step, resident and ula (bench step_cost, batch 32);
# 3. every product of a layer under each launch config in SM_CONFIGS (block of K, of N,
#    warps, stages, programs[, cap on the K splits' float32 partial sums])
#    (benchmarks/probes/gpu_stacked_matmul.py --shapes model).
# PARTS (default "layers step sweep") picks among 1-3 (each fits one device call on
# its own; all three may not). FETCH=1 runs first the judged fetch ratios
# (gpu_decode_ratios.sh PARTS=fetch, its own folder under $OUT/ratios); FETCH=auto (the
# default) runs them only on an H200, the card the issue judges them on. Results under
# $OUT: JSONs, logs.tgz.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_weights "${TIME_LIMIT_S:-560}" outside
config_wheels
wants() { [[ " ${PARTS:-layers step sweep} " == *" $1 "* ]]; }
FETCH=${FETCH:-auto}
if [ "$FETCH" = auto ]; then
  FETCH=0
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && FETCH=1
fi
if [ "$FETCH" = 1 ]; then
  STEP_TAIL=40 step ratios 200 env OUT="$OUT/ratios" PARTS=fetch TIME_LIMIT_S=190 \
    bash benchmarks/probes/gpu_decode_ratios.sh
fi
wants layers && STEP_TAIL=4 step layers 200 "$PY" benchmarks/probes/gpu_layer_weights.py --tag pallas78 \
  --layers 78 --rows 64 --projections pallas --json "$OUT/lw78_pallas.json" \
  --hlo "$WORK/hlo_lw78_pallas.txt" --ops "$WORK/lw78_ops.json"
# The all-hit GLM-5 decode step (resident and ula, batch 32, 4K prompts), as the
# projections' earlier measurement ran it (RESULTS.md, "GLM-5 geometry on one GPU").
wants step && STEP_TAIL=10 step step 220 "$PY" -m ula_jax.cli.main bench step_cost \
  --config experiments/glm5_summarization/config.yaml --systems resident,ula --batch 32 \
  --prompt 4096 --output 56 --json "$OUT/step_pallas.json" workload.prefill=synthetic \
  kernels.projections=pallas
wants sweep && STEP_TAIL=20 step sweep 400 "$PY" benchmarks/probes/gpu_stacked_matmul.py --shapes model \
  --layers 16 --rows 64 --reps 3 --json "$OUT/sm_sweep.json" \
  --configs "${SM_CONFIGS:-64,128,4,3,264;64,128,4,3,264,0.25;64,128,4,3,264,1;128,128,4,3,264;64,128,8,4,264;64,256,8,3,264;64,128,4,3,132;64,32,4,4,264,0;64,32,4,4,264}"
tar -czf "$OUT/logs.tgz" -C "$WORK" .
print_steps
