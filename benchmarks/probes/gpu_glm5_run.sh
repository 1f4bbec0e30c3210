#!/usr/bin/env bash
# The summarisation experiments at full size on one GPU, one run per memory system
# (run from anywhere; config wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir SYSTEMS="ula_pb_lru hisparse" bash benchmarks/probes/gpu_glm5_run.sh
#
# CONFIG (default experiments/glm5_summarization/config.yaml), SYSTEMS (memory presets,
# run in order; PRESET@TAG runs PRESET with the overrides in $EXTRA_TAG as well, e.g.
# SYSTEMS="resident resident@d ula_pb_lru@d" EXTRA_d="engine.record_digests=true"; and
# with $CONFIG_TAG set, that config file instead of CONFIG, e.g.
# SYSTEMS="resident@v ula_pb_lru@v" CONFIG_v=experiments/dsv32_summarization/config.yaml),
# EXTRA (overrides for every run), RUN_LIMIT_S (each run's time limit,
# default 480: the experiment's 8-minute target; a run stopped by it writes its run
# directory with what it finished), TIME_LIMIT_S (the whole script's, default 570),
# SWEEP=1 (one process serves all the systems: ula-jax sweep, below).
# Results under $OUT (8 files at most come back): SYSTEM.json (the run's summary),
# SYSTEM_digests.npz (with engine.record_digests=true), compare_FIRST_SYSTEM.txt (tokens,
# and digests where both runs have them, against the first system), logs.tgz (each
# run's output and plots, gpu.txt, steps.txt; left_behind.txt names digests that did
# not fit in the eight files).
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
# At most 8 files come back from $OUT: step logs, plots and machine facts go into WORK,
# outside it, and travel as logs.tgz.
gpu_setup gpu_glm5_run "${TIME_LIMIT_S:-570}" outside
config_wheels
CLI="$PY -m ula_jax.cli.main"
CONFIG=${CONFIG:-experiments/glm5_summarization/config.yaml}
# A fresh folder per call unless RUNS_DIR names one (a warm machine keeps /tmp between
# calls, and the CLI will not overwrite a run directory).
RUNS=${RUNS_DIR:-$(mktemp -d /tmp/glm5_runs.XXXXXX)}
mkdir -p "$RUNS"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$WORK/gpu.txt"
free -g | tee -a "$WORK/gpu.txt"
# collect SYS DIR: a run directory's summary and digests into $OUT, plots and tables into WORK.
collect() {
  [ -f "$2/summary.json" ] && cp "$2/summary.json" "$OUT/$1.json"
  [ -f "$2/digests.npz" ] && cp "$2/digests.npz" "$OUT/${1}_digests.npz"
  for f in "$2"/*.png "$2"/*.csv; do [ -f "$f" ] && cp "$f" "$WORK/${1}_$(basename "$f")"; done
}
if [ -n "${SWEEP:-}" ]; then
  # One process serves every system in turn (ula-jax sweep): the backend starts once (with
  # memory.host_alloc=xla, XLA's pinned host region made for the first host pool is
  # reused by the next ones; regions of 2 MiB pages are made per pool in seconds). The
  # systems share the first item's tag (its CONFIG_TAG and EXTRA_TAG); RUN_LIMIT_S is
  # the whole sweep's limit.
  # shellcheck disable=SC2206
  sweep_items=(${SYSTEMS:-ula_pb_lru hisparse resident})
  presets=$(printf '%s,' "${sweep_items[@]%%@*}")
  tag=${sweep_items[0]}
  # One config for all: a later item with a tag of its own would be served with the
  # first item's overrides, so it is refused.
  for item in "${sweep_items[@]}"; do
    if [ "${item#*@}" != "${tag#*@}" ] && [[ "$item" == *@* || "$tag" == *@* ]]; then
      echo "error: SWEEP=1 serves every system with the first item's tag ('$tag'); '$item'" \
        "has another: give them the same tag, or leave SWEEP unset" >&2
      exit 2
    fi
  done
  # shellcheck disable=SC2046,SC2086
  STEP_TAIL=40 step sweep "${RUN_LIMIT_S:-480}" $CLI sweep "$(tagged CONFIG "$tag" "$CONFIG")" \
    "memory=${presets%,}" ${EXTRA:-} $(tagged EXTRA "$tag") --no-progress --out "$RUNS/sweep"
  for i in "${!sweep_items[@]}"; do
    sys=${sweep_items[$i]/@/_}
    printf -v dir '%s/sweep/%03d-memory=%s' "$RUNS" "$i" "${sweep_items[$i]%%@*}"
    [ -d "$dir" ] && ln -sfn "$dir" "$RUNS/$sys" && collect "$sys" "$dir"
  done
  [ -f "$RUNS/sweep/sweep.csv" ] && cp "$RUNS/sweep/sweep.csv" "$WORK/sweep.csv"
else
  for item in ${SYSTEMS:-ula_pb_lru hisparse resident}; do
    preset=${item%%@*}; sys=${item/@/_}
    # shellcheck disable=SC2046,SC2086
    STEP_TAIL=30 step "$sys" "${RUN_LIMIT_S:-480}" $CLI run "$(tagged CONFIG "$item" "$CONFIG")" \
      "memory=$preset" ${EXTRA:-} $(tagged EXTRA "$item") --no-progress --out "$RUNS/$sys"
    collect "$sys" "$RUNS/$sys"
  done
fi
# Tokens request by request: every later system against the first (a stopped run's
# requests compared over the tokens both have).
items=${SYSTEMS:-ula_pb_lru hisparse resident}
set -- ${items//@/_}
first=$1; shift
for sys in "$@"; do
  [ -d "$RUNS/$first" ] && [ -d "$RUNS/$sys" ] && $CLI compare "$RUNS/$first" "$RUNS/$sys" \
    > "$OUT/compare_${first}_${sys}.txt" 2>&1; tail -n 1 "$OUT/compare_${first}_${sys}.txt" 2>/dev/null
done
# At most 8 files come back, logs.tgz one of them: the digests of later systems, already
# compared above against the first system's, stay on the machine when they would not fit
# (the compare files hold what they showed); the first system's always come back.
while [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 7 ]; do
  extra=$(find "$OUT" -maxdepth 1 -name '*_digests.npz' ! -name "${first}_digests.npz" | sort | tail -n 1)
  [ -n "$extra" ] || break
  echo "not brought back (compared here): $(basename "$extra")" | tee -a "$WORK/left_behind.txt"
  rm -f "$extra"
done
print_steps | tee "$WORK/steps.txt"
tar czf "$OUT/logs.tgz" -C "$WORK" .
