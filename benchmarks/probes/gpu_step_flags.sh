#!/usr/bin/env bash
# Where a GLM-5-geometry decode step's time goes under other XLA flags and decode-scoring
# modes, one process per variant (XLA reads its flags when the backend starts):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_step_flags.sh
#
# Each variant runs benchmarks/probes/gpu_glm5_steps.py (REQUESTS requests of PROMPT
# tokens in engine.max_batch=ROWS decode rows, OUTPUT new tokens, traced) for STEP_SYSTEMS
# (default resident). VARIANTS (default below): NAME|FLAGS|OVERRIDES items, FLAGS added to
# XLA_FLAGS (several joined by '+--'), OVERRIDES config overrides joined by '+'; EXTRA:
# overrides for every variant. Results: steps_NAME.json under $OUT, a table last (step and
# device-busy ms, operations, host waits, tokens equal to the first variant's).
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_step_flags "${TIME_LIMIT_S:-570}" outside
config_wheels
# base: the defaults (on one GPU: page scores, radix top-k counted in XLA); lengths:
# scores by length; sort: the top-k by lax.top_k. Each must decode base's tokens.
DEFAULT_VARIANTS="base|| lengths||kernels.decode_scores=lengths sort||kernels.decode_topk=sort"
BASE_FLAGS=${XLA_FLAGS:-}
for v in ${VARIANTS:-$DEFAULT_VARIANTS}; do
  IFS='|' read -r name flags over <<< "$v"
  all_flags="$BASE_FLAGS ${flags//+--/ --}"; all_flags=${all_flags# }; all_flags=${all_flags% }
  # shellcheck disable=SC2086
  XLA_FLAGS="$all_flags" STEP_TAIL=12 step "$name" "${RUN_LIMIT_S:-240}" \
    $PY benchmarks/probes/gpu_glm5_steps.py --systems "${STEP_SYSTEMS:-resident}" \
    --requests "${REQUESTS:-8}" --prompt "${PROMPT:-65536}" --output "${OUTPUT:-24}" \
    --json "$OUT/steps_$name.json" "engine.max_batch=${ROWS:-32}" ${EXTRA:-} ${over//+/ }
done
print_steps | tee "$WORK/steps.txt"
tar czf "$OUT/logs.tgz" -C "$WORK" .
$PY - "$OUT" <<'PY'
import glob, json, os, sys
rows, first = [], {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "steps_*.json")), key=os.path.getmtime):
  name = os.path.basename(f)[6:-5]
  for system, r in json.load(open(f))["systems"].items():
    if "error" in r:
      rows.append((name, system, "failed: " + r["error"][:60]))
      continue
    sha = r.get("tokens_sha256")
    same = first.setdefault(system, sha) == sha
    rows.append((name, system, f"{r['median_step_ms']:8.1f} "
                 f"{r['median_device_busy_ms']:8.1f} {r['median_device_ops']:6.0f} "
                 f"{r['median_host_waits']:6.0f} {str(same):>6}"))
print(f"{'variant':10} {'system':10} {'step ms':>8} {'busy ms':>8} {'ops':>6} {'waits':>6} {'=first':>6}")
for name, system, text in rows:
  print(f"{name:10} {system:10} {text}")
PY
