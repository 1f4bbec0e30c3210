#!/usr/bin/env bash
# GPU check of the Pallas resolve (ula_jax/memory/ula/resolve) and its benchmark, run from
# the repository root on a CUDA machine:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_resolve.sh
#
# Steps (each one runs even when an earlier one failed, and reports its status):
#   env          jax/GPU facts
#   tests_gpu    the GPU-marked tests of tests/test_resolve_kernel.py (Triton kernels
#                against the jnp resolve, array for array; full size: batch 64, k 2048)
#   launches     the kernels each implementation's compiled resolve runs (HLO op counts:
#                jnp, pallas, pallas_fused)
#   bench        ula_jax.bench.resolve at full size: batch 1..128, k 2048, device pools
#                of 64K and 1M slots, PB-LRU and exact LRU, jnp and Pallas (the JSON is
#                rewritten after every row)
#   sweep        Pallas block sizes of the four launches at batch 64, 1M pool, PB-LRU and
#                exact LRU
#   tests_rest   the interpret-mode twins and the other tests of the two test files
# Results under $OUT: summary.txt, bench_resolve.json, bench_resolve_sweep.json,
# junit_resolve_gpu.xml, logs.tar.gz (every log and HLO dump). The last lines printed are
# the step table and the benchmark's short table with the targets. BUDGET_S (default
# 570) bounds the whole run. No config package is needed (no pydantic/omegaconf).

set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_resolve 570
STEP_TAIL=25

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c '
import jax, jaxlib
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"backend\", jax.default_backend())
print(jax.devices())
'; $PY -m pip list 2>/dev/null | grep -i -E 'jax|triton|pytest|rich|flax|numpy'"

# pytest and rich may be missing on the GPU machine: install them from carried wheels.
if ! "$PY" -c "import pytest" 2>/dev/null && [ -d "$ROOT/.whl" ]; then
  step wheels 120 "$PY" -m pip install --no-index --find-links "$ROOT/.whl" pytest rich
fi

step tests_gpu 150 "$PY" -m pytest -m gpu tests/test_resolve_kernel.py -v -rA \
  -p no:cacheprovider --junitxml="$OUT/junit_resolve_gpu.xml"

step launches 60 "$PY" - "$WORK" <<'EOF'
"""Kernels in the compiled resolve of one group (batch 64, k 2048, 1M-slot pool)."""
import collections, functools, pathlib, re, sys, traceback
import jax, jax.numpy as jnp
from ula_jax.bench.resolve import Setup, build_system
from ula_jax.memory.ula.resolve import resolve_group

work = pathlib.Path(sys.argv[1])
setup = Setup(pool=1 << 20, batch=64, k=2048, buckets=4, steps_total=1)
skip = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all"}
for policy in ("pb_lru", "lru"):
  system = build_system(setup, policy)
  meta = jax.eval_shape(system.init_group_meta)
  args = (meta, jax.ShapeDtypeStruct((64, 2048), jnp.int32),
          jax.ShapeDtypeStruct((64, 2048), jnp.bool_), jax.ShapeDtypeStruct((64,), jnp.int32),
          jax.ShapeDtypeStruct((64,), jnp.bool_))
  for impl in ("jnp", "pallas", "pallas_fused"):
    try:
      fn = jax.jit(functools.partial(resolve_group, system, impl=impl), donate_argnums=0)
      text = fn.lower(*args).compile().as_text()
      (work / f"hlo_resolve_{policy}_{impl}.txt").write_text(text)
      entry = text[text.index("ENTRY"):]
      entry = entry[:entry.index("\n}")]
      ops = collections.Counter(m for m in re.findall(r"= [^ ]+ ([a-z\-]+)\(", entry)
                                if m not in skip)
      print(f"{policy:6s} {impl:12s} entry ops {sum(ops.values()):3d}: {dict(ops.most_common())}")
    except Exception:
      print(f"{policy:6s} {impl:12s} FAILED")
      traceback.print_exc()
EOF

# The rows the targets name first (1M pool, batch 64 and 32), so a run cut short by the
# budget still has them.
step bench 300 "$PY" -c "
import sys
from ula_jax.bench import resolve
sys.exit(resolve.main(sys.argv[1:]))" --out "$OUT/bench_resolve.json" --pools 1M,64K \
  --batch 64,32,128,8,1

step sweep 120 "$PY" -c "
import sys
from ula_jax.bench import resolve
sys.exit(resolve.main(sys.argv[1:]))" --out "$OUT/bench_resolve_sweep.json" --batch 64 \
  --pools 1M --policies pb_lru,lru --impls pallas --pallas-block-elems 128,256,1024 \
  --pallas-block-place 16,32,256 --pallas-warps 4 --segments 2

step tests_rest 100 "$PY" -m pytest -m "not gpu" tests/test_resolve_kernel.py \
  tests/test_bench_resolve.py -q -rf -p no:cacheprovider

{
  print_steps
  echo
  grep -E " (passed|failed|skipped|error)" "$WORK/tests_gpu.log" | tail -n 1
  grep -E "^FAILED|^ERROR" "$WORK/tests_gpu.log" | head -n 20
  grep -E "entry ops|FAILED" "$WORK/launches.log"
  echo
  "$PY" - "$OUT/bench_resolve.json" "$OUT/bench_resolve_sweep.json" <<'EOF' 2>&1
import json, pathlib, sys
from ula_jax.bench import resolve
for path in sys.argv[1:]:
  p = pathlib.Path(path)
  if not p.exists():
    print(f"{path}: missing")
    continue
  result = json.loads(p.read_text())
  if "sweep" in p.name:
    for r in result["rows"]:
      print(f"sweep batch {r['batch']} {r['impl']}: {r['us'] and round(r['us'], 1)} us "
            f"{r['error'] or ''}")
    continue
  for r in result["rows"]:
    if r["error"] and not r["error"].startswith("skipped"):
      print(f"error: pool {r['pool']} batch {r['batch']} {r['policy']} {r['impl']}: "
            f"{r['error']}")
  resolve.print_summary(result)
EOF
} >"$OUT/summary.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" work && rm -rf "$WORK"
cat "$OUT/summary.txt"
