#!/usr/bin/env bash
# The summarisation experiments at full size on one GPU, one run per memory system
# (run from anywhere; config wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir SYSTEMS="ula_pb_lru hisparse" bash benchmarks/probes/gpu_glm5_run.sh
#
# CONFIG (default experiments/glm5_summarization/config.yaml), SYSTEMS (memory presets,
# run in order), EXTRA (overrides for every run), RUN_LIMIT_S (each run's time limit,
# default 480: the experiment's 8-minute target; a run stopped by it writes its run
# directory with what it finished), TIME_LIMIT_S (the whole script's, default 570).
# Results under $OUT: SYSTEM.json (the run's summary), SYSTEM.log (its output),
# steps.txt (printed last).
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_glm5_run "${TIME_LIMIT_S:-570}"
config_wheels
CLI="$PY -m ula_jax.cli.main"
CONFIG=${CONFIG:-experiments/glm5_summarization/config.yaml}
RUNS=${RUNS_DIR:-/tmp/glm5_runs}
mkdir -p "$RUNS"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
free -g | tee -a "$OUT/gpu.txt"
for sys in ${SYSTEMS:-ula_pb_lru hisparse resident}; do
  # shellcheck disable=SC2086
  STEP_TAIL=30 step "$sys" "${RUN_LIMIT_S:-480}" $CLI run "$CONFIG" "memory=$sys" ${EXTRA:-} \
    --no-progress --out "$RUNS/$sys"
  cp "$WORK/$sys.log" "$OUT/$sys.log"
  [ -f "$RUNS/$sys/summary.json" ] && cp "$RUNS/$sys/summary.json" "$OUT/$sys.json"
  for f in "$RUNS/$sys"/*.png "$RUNS/$sys"/*.csv; do [ -f "$f" ] && cp "$f" "$OUT/${sys}_$(basename "$f")"; done
done
print_steps | tee "$OUT/steps.txt"
