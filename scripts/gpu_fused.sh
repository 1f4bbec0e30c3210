#!/usr/bin/env bash
# GPU check and benchmark of the Pallas resolve's launches (one fused launch vs four),
# run from the repository root on a CUDA machine:
#
#     OUT=/some/dir bash scripts/gpu_fused.sh
#
# Steps: the GPU tests of tests/test_resolve_kernel.py (the fused launch array for
# array against the jnp resolve, full size and with few programs); the resolve benchmark
# at 1M slots, batch 64/32/128, PB-LRU and exact LRU, one launch and four, with the
# device operations of a resolve (--profile); the same at batch 64 with acquire-release
# atomics; batch 64 and 32 as straight-line code (--loop unrolled, as in a decode step).
# JSON under $OUT; the last lines printed are one line per row.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_fused_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu} XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
bench() { timeout "$1" "$PY" -c "
import sys
from ula_jax.bench import resolve
sys.exit(resolve.main(sys.argv[1:]))" --impls pallas --pools 1M "${@:2}" >>"$OUT/bench.log" 2>&1
  echo "bench ${*:2}: rc $?"; }

timeout 300 "$PY" -m pytest -m gpu tests/test_resolve_kernel.py -q -p no:cacheprovider \
  >"$OUT/tests_gpu.log" 2>&1; echo "tests_gpu: rc $?"; tail -n 3 "$OUT/tests_gpu.log"
bench 200 --batch 64,32,128 --policies pb_lru,lru --pallas-fuse on,off \
  --profile /tmp/prof_a --out "$OUT/bench_fused.json"
bench 120 --batch 64 --policies pb_lru --pallas-fuse on,off --pallas-relaxed off \
  --profile /tmp/prof_b --out "$OUT/bench_acq_rel.json"
bench 200 --batch 64,32 --policies pb_lru,lru --loop unrolled \
  --profile /tmp/prof_c --out "$OUT/bench_unrolled.json"
"$PY" - "$OUT"/bench_*.json <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
  try:
    r = json.load(open(path))
  except Exception as e:
    print(path, "unreadable", e); continue
  loop = r["stream"]["loop"]
  for x in r["rows"]:
    top = ", ".join(f"{n[:22]} {us:.1f}" for n, _, us in (x.get("kernels") or [])[:3])
    us = x["us"] and round(x["us"], 1)
    dev = x.get("device_us") and round(x["device_us"], 1)
    print(f"{loop:8s} b{x['batch']:<4d} {x['policy']:6s} {x['impl']:24s} wall {us} "
          f"device {dev} | {top} {x['error'] or ''}")
PYEOF
