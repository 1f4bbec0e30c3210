#!/usr/bin/env bash
# The papers' experiments (ula-jax experiment NAME) at gpu scale on one GPU, each in a
# time limit, their experiment directories packed into $OUT:
#
#     OUT=/some/dir EXPERIMENTS="latency policies" bash benchmarks/probes/gpu_experiments.sh
#
# EXPERIMENTS: names, run in order (default "latency policies"); NAME@TAG adds the
# parameter overrides in $ARGS_TAG, e.g. EXPERIMENTS="throughput@u throughput@h"
# ARGS_u="systems=[ula_dp]" ARGS_h="systems=[hisparse]" splits one experiment over
# runs that each fit a call. SCALE (default gpu), RUN_LIMIT_S (each run's limit, default
# 540; a run stopped by it writes no directory), TIME_LIMIT_S (the whole script's,
# default 570), LOG_LEVEL (ula-jax --log-level, default info: capacities and each serving
# point's engine steps in the logs as they happen). Under $OUT: NAME[_TAG].tgz
# (figure.png, table.md, results.json, params.yaml) and logs.tgz (each run's output,
# steps.txt): at most seven runs per call, since 8 files come back from a device call.
# A throughput run unpacked into the working
# tree (e.g. results/experiments/throughput-gpu-a/) travels with the next call, where
# ARGS_x="reuse=[results/experiments/throughput-gpu-a]" takes its systems as measured:
# one experiment over several calls.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_experiments "${TIME_LIMIT_S:-570}" outside
config_wheels
CLI="$PY -m ula_jax.cli.main"
DIRS=${EXPERIMENT_DIRS:-/tmp/gpu_experiments}
mkdir -p "$DIRS"
for item in ${EXPERIMENTS:-latency policies}; do
  name=${item%%@*}; run=${item/@/_}
  rm -rf "${DIRS:?}/$run"
  # shellcheck disable=SC2046,SC2086
  STEP_TAIL=20 step "$run" "${RUN_LIMIT_S:-540}" $CLI --log-level "${LOG_LEVEL:-info}" \
    experiment "$name" \
    --scale "${SCALE:-gpu}" --no-progress --out "$DIRS/$run" $(tagged ARGS "$item")
  [ -d "$DIRS/$run" ] && tar czf "$OUT/$run.tgz" -C "$DIRS" "$run"
done
print_steps | tee "$WORK/steps.txt"
tar czf "$OUT/logs.tgz" -C "$WORK" .
