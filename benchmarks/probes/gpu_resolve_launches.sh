#!/usr/bin/env bash
# The Pallas resolve's kernels, launch by launch: batch 64, 1M slots, PB-LRU, one launch
# (FUSED_CONFIG, --pallas-fuse on) and four (the defaults), in the benchmark's device loop
# and as straight-line code (segments of 32, 16, 8 and 4 resolves), under the profiler;
# each launch's time and the device's idle time before it (Row.launches). Run from the repository root on a CUDA machine:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_resolve_launches.sh
#
# LAUNCH_RUNS="NAME ARGS..." lines replace the default runs (e.g. "while32_flush --loop while
# --steps 32 --flush-mb 128": the cache cleared between resolves; BENCH_LIMIT: seconds per run,
# default 200). Results under $OUT:
# launches.json (every run's benchmark result, by run name: while32_fuse_on, ...); printed
# last, per run and kernel: its median / min / max per launch, its median after an idle
# device and after back-to-back work, the first launches, and the profiled resolves'
# misses.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_resolve_launches 540
bench() {
  step "$1" "${BENCH_LIMIT:-200}" "$PY" -c "
import sys
from ula_jax.bench import resolve
sys.exit(resolve.main(sys.argv[1:]))" --impls pallas --pools 1M --batch 64 --policies pb_lru \
    --profile "/tmp/prof_$1" --out "$OUT/launches_$1.json" "${@:2}"
}
if [ -n "${LAUNCH_RUNS:-}" ]; then
  # LAUNCH_RUNS: one run per line, "NAME ARGS..." (ARGS: more flags of bench resolve)
  while read -r name args; do
    # shellcheck disable=SC2086
    [ -n "$name" ] && bench "$name" $args
  done <<<"$LAUNCH_RUNS"
else
  for fuse in on off; do
    bench "while32_fuse_$fuse" --pallas-fuse $fuse --loop while --steps 32
    for n in 32 16 8 4; do
      bench "unrolled${n}_fuse_$fuse" --pallas-fuse $fuse --loop unrolled --steps $n
    done
  done
fi
# One file back: every run's rows.
"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, sys
runs = {os.path.basename(p)[9:-5]: json.load(open(p))
        for p in sorted(glob.glob(os.path.join(sys.argv[1], "launches_*.json")))}
json.dump(runs, open(os.path.join(sys.argv[1], "launches.json"), "w"), indent=1)
for p in glob.glob(os.path.join(sys.argv[1], "launches_*.json")):
  os.remove(p)
PYEOF
print_steps
"$PY" - "$OUT"/launches.json <<'PYEOF'
import json, statistics as st, sys
for path, r in json.load(open(sys.argv[1])).items():
  for x in r["rows"]:
    if x.get("error"):
      print(path, x["impl"], "ERROR", x["error"])
    for name, d in (x.get("launches") or {}).items():
      us, idle = d["us"], d["idle_before_us"]
      after_idle = [u for u, i in zip(us, idle) if i is not None and i > 5]
      packed = [u for u, i in zip(us, idle) if i is not None and i <= 1]
      med = lambda v: f"{st.median(v):.1f} (n {len(v)})" if v else "-"
      print(f"{path:22s} {x['impl']:18s} {name} median {st.median(us):.1f} min {min(us):.1f} "
            f"max {max(us):.1f} | after idle > 5 us: {med(after_idle)} | idle <= 1 us: "
            f"{med(packed)} | before: {d['before']}")
      print("   first launches:", [round(u, 1) for u in us[:12]])
    p = x.get("profiled") or {}
    print(f"   profiled: {p.get('resolves')} resolves, misses {p.get('misses', 0):.0f}, "
          f"kernels {x.get('kernel_us') or 0:.1f} us, device {x.get('device_us') or 0:.1f} us")
PYEOF
