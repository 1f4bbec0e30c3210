#!/usr/bin/env bash
# Trained against random weights, side by side (run from anywhere; config wheels in .whl/
# when the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_selection_traces.sh
#
# The trained small model (experiments/train_small: 4 layers, one indexer per layer,
# top-k 2048) and the same model with random weights (model.checkpoint=null) serve the
# four held-out prompts (4K-16K tokens) with NEW_TOKENS generated each (default 512),
# recording their selections (engine.record_trace) on the GPU. Then, on this machine's
# CPU (8 simulated devices), for each trace:
#   stats_<m>.json     ula-jax trace stats: overlap of consecutive steps, reuse distances,
#                      exact-LRU misses of a per-request buffer of k / 2k / 4k, the shared
#                      pool under pb_lru and lru at the buffers' memory
#   replay_<m>.json    ula-jax run workload.kind=trace at equal device memory (the
#                      per-request 2k buffers' slots, 4 x 4097 per group): hisparse with
#                      a k and a 2k buffer, ula DP (pb_lru, a host tier for the rest), ula
#                      TP over 2 ranks (mod layout; its smallest pool with a host tier:
#                      a local buffer of 4 x 2049 and 8196 owner slots per rank)
# MODELS (default "trained random") picks the models; CHECKPOINT (default the committed
# model) names the trained model's checkpoint, e.g. CHECKPOINT=runs/train_small_conc/model.
# steps.txt is printed last; summary.txt holds the side-by-side table.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_selection_traces "${TIME_LIMIT_S:-420}"
config_wheels
CLI="$PY -m ula_jax.cli.main"
NEW_TOKENS=${NEW_TOKENS:-512}
"$PY" - "$WORK/requests.jsonl" "$NEW_TOKENS" <<'EOF'
import json, sys
with open("experiments/train_small/requests.jsonl") as f, open(sys.argv[1], "w") as g:
  for line in f:
    rec = json.loads(line)
    rec["max_new_tokens"] = int(sys.argv[2])
    g.write(json.dumps(rec) + "\n")
EOF
SERVE="experiments/train_small/config.yaml workload.path=$WORK/requests.jsonl
       engine.max_batch=4 engine.record_trace=true experiment.plots=false"
MODELS=${MODELS:-trained random}
TRAINED=()
[ -n "${CHECKPOINT:-}" ] && TRAINED=("model.checkpoint=$CHECKPOINT")
if [[ " $MODELS " == *" trained "* ]]; then
  # shellcheck disable=SC2086
  step trained 200 $CLI run $SERVE ${TRAINED[@]+"${TRAINED[@]}"} --no-progress --out "$WORK/trained"
fi
if [[ " $MODELS " == *" random "* ]]; then
  # shellcheck disable=SC2086
  step random 200 $CLI run $SERVE model.checkpoint=null --no-progress --out "$WORK/random"
fi

export JAX_PLATFORMS=cpu
export XLA_FLAGS="--xla_force_host_platform_device_count=8"
REPLAY="experiments/train_small/config.yaml mesh.platform=cpu workload.kind=trace
        engine.max_batch=4 experiment.plots=false engine.record_trace=false"
SLOTS=$((4 * 4097))
for m in trained random; do
  [ -d "$WORK/$m" ] || continue
  step "stats_$m" 120 $CLI trace stats "$WORK/$m" --json "$OUT/stats_$m.json"
  # shellcheck disable=SC2086
  step "hs_k_$m" 60 $CLI run $REPLAY workload.trace="$WORK/$m" memory=hisparse \
    memory.hisparse.device_buffer_size=2048 memory.hisparse.host_to_device_ratio=16 --no-progress --out "$WORK/hs_k_$m"
  # shellcheck disable=SC2086
  step "hs_2k_$m" 60 $CLI run $REPLAY workload.trace="$WORK/$m" memory=hisparse \
    memory.hisparse.device_buffer_size=4096 memory.hisparse.host_to_device_ratio=8 --no-progress --out "$WORK/hs_2k_$m"
  # shellcheck disable=SC2086
  step "ula_dp_$m" 60 $CLI run $REPLAY workload.trace="$WORK/$m" memory=ula_pb_lru \
    memory.device_pool=$SLOTS memory.host_pool=131072 --no-progress --out "$WORK/ula_dp_$m"
  # shellcheck disable=SC2086
  step "ula_tp_$m" 120 $CLI run $REPLAY workload.trace="$WORK/$m" memory=ula_pb_lru \
    mesh.tp=2 workload.trace_replay=system memory.device_pool=16392 \
    memory.host_pool=131072 --no-progress --out "$WORK/ula_tp_$m"
done
"$PY" - "$WORK" "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
KEYS = ("hit_rate", "total_hits", "total_misses", "total_evictions", "decode_steps",
        "total_host_fetches", "total_xdev_rows")
table = {}
for m in ("trained", "random"):
  row = {}
  for name in ("hs_k", "hs_2k", "ula_dp", "ula_tp"):
    f = work / f"{name}_{m}" / "summary.json"
    if f.is_file():
      s = json.loads(f.read_text())["summary"]
      row[name] = {k: s.get(k) for k in KEYS}
  table[m] = row
  st = out / f"stats_{m}.json"
  if st.is_file():
    stats = json.loads(st.read_text())
    row["stats"] = {k: v for k, v in stats.items() if k not in ("per_group", "by_context")}
(out / "replay.json").write_text(json.dumps(table, indent=1))
for m, row in table.items():
  print(m, json.dumps(row.get("stats"))[:1500])
  for name in ("hs_k", "hs_2k", "ula_dp", "ula_tp"):
    print(f"  {name:8s}", row.get(name))
EOF
print_steps | tee "$OUT/steps.txt"
