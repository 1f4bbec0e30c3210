#!/usr/bin/env bash
# GPU check and benchmark of the Pallas resolve's launch forms (four launches,
# kernels.resolve=pallas, against one, kernels.resolve=pallas_fused with FUSED_CONFIG),
# run from the repository root on a CUDA machine, with the config dependencies carried as
# wheels in .whl/ when the machine lacks them:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_fused.sh
#
# Steps:
#   tests     the GPU tests of tests/test_resolve_kernel.py (both launches array for
#             array against the jnp resolve, full size, the fused launch with few programs)
#   bench     ula_jax.bench.resolve at 1M slots, batch 64/32/128, PB-LRU and exact LRU,
#             four launches and one (--pallas-fuse off,on), with each resolve's device
#             operations (--profile)
#   unrolled  batch 64 as straight-line code (--loop unrolled, as a decode step runs its
#             groups' resolves)
#   exact     greedy tokens of ula (small device pool, most steps evict) with
#             kernels.resolve=pallas and =pallas_fused equal resident's (ula-jax compare)
# Results under $OUT: tests.log, bench_fused.json, bench_unrolled.json, exact.txt; the
# last lines printed are one line per benchmark row and the token comparisons.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_fused_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
config_wheels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu} XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
bench() { timeout "$1" "$PY" -c "
import sys
from ula_jax.bench import resolve
sys.exit(resolve.main(sys.argv[1:]))" --impls pallas --pools 1M "${@:2}" >>"$OUT/bench.log" 2>&1
  echo "bench ${*:2}: rc $?"; }

timeout 300 "$PY" -m pytest -m gpu tests/test_resolve_kernel.py -p no:cacheprovider \
  >"$OUT/tests.log" 2>&1; echo "tests: rc $?: $(grep -E " (passed|failed)" "$OUT/tests.log" \
  | tail -n 1)"
bench 240 --batch 64,32,128 --policies pb_lru,lru --pallas-fuse off,on \
  --profile /tmp/prof_fused --out "$OUT/bench_fused.json"
bench 120 --batch 64 --policies pb_lru --pallas-fuse off,on --loop unrolled \
  --profile /tmp/prof_unrolled --out "$OUT/bench_unrolled.json"

RUNS=/tmp/gpu_fused_runs
CLI="$PY -m ula_jax.cli.main"
BASE="experiments/quickstart/config.yaml mesh=dp1 mesh.platform=gpu model=small
      model.index_topk=64 workload.num_requests=16 engine.max_batch=8"
ULA="memory.system=ula memory.policy=pb_lru memory.device_pool=780 memory.host_pool=4096
     kernels.fetch=pallas"
{
  # shellcheck disable=SC2086
  timeout 150 $CLI run $BASE --no-progress --out "$RUNS/resident" | grep -E "finished|tokens/s"
  for resolve in pallas pallas_fused; do
    # shellcheck disable=SC2086
    timeout 150 $CLI run $BASE $ULA kernels.resolve=$resolve --no-progress \
      --out "$RUNS/$resolve" | grep -E "hit|finished|tokens/s"
    $CLI compare "$RUNS/resident" "$RUNS/$resolve" >/dev/null \
      && echo "TOKENS EQUAL: ula kernels.resolve=$resolve" \
      || echo "TOKENS DIFFER: ula kernels.resolve=$resolve"
  done
} >"$OUT/exact.txt" 2>&1

"$PY" - "$OUT"/bench_fused.json "$OUT"/bench_unrolled.json <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
  try:
    r = json.load(open(path))
  except Exception as e:
    print(path, "unreadable", e)
    continue
  loop = r["stream"]["loop"]
  for x in r["rows"]:
    top = ", ".join(f"{n[:20]} {us:.1f}" for n, _, us in (x.get("kernels") or [])[:4])
    us = x["us"] and round(x["us"], 1)
    dev, own = (x.get(k) and round(x[k], 1) for k in ("device_us", "kernel_us"))
    print(f"{loop:8s} b{x['batch']:<4d} {x['policy']:6s} {x['impl']:14s} wall {us} "
          f"device {dev} kernels {own} | {top} {x['error'] or ''}")
  for t in r["targets"]:
    print(f"target {t['target']} b{t['batch']} {t['impl']}: {t['value']:.2f} "
          f"{t.get('measure', '')} {'met' if t['met'] else 'MISSED'}")
PYEOF
grep -E "TOKENS|hit" "$OUT/exact.txt"
