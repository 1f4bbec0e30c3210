#!/usr/bin/env bash
# The Triton sparse attention over FP8 rows (model.kv_layout: fp8) on one GPU, run from
# the repository root (config wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_fp8_attention.sh
#
# Steps: tests (tests/test_sparse_attention_pallas.py -m gpu -k fp8: the kernel through
# Triton against the reference), bench (ula-jax bench attention --kv-layout fp8 --impls
# xla,pallas at BATCHES, default 1,8,32,64, and the Triton kernel over bf16 rows at the
# same batches), step_xla / step_pallas (a `resident` decode step at GLM-5 geometry with
# FP8 entries, batch STEP_BATCH (default 8), 4K prompts, synthetic prefill and
# selections, with kernels.attention xla and then pallas). Results under $OUT:
# attn_fp8.json, attn_bf16.json, step_xla.json, step_pallas.json and the logs; the
# last lines printed are the steps' table and the measured rows. BUDGET_S (default 540)
# bounds the whole run.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_fp8_attention 540
config_wheels
CLI="$PY -m ula_jax.cli.main"
BATCHES=${BATCHES:-1,8,32,64}
step tests 150 "$PY" -m pytest -m gpu tests/test_sparse_attention_pallas.py -k fp8 -q \
  -p no:cacheprovider -W ignore::DeprecationWarning -o addopts=""
step bench 150 $CLI bench attention --kv-layout fp8 --impls xla,pallas --batch "$BATCHES" \
  --reps 3 --out "$OUT/attn_fp8.json"
step bench_bf16 90 $CLI bench attention --impls pallas --batch "$BATCHES" --reps 3 \
  --out "$OUT/attn_bf16.json"
for impl in xla pallas; do
  step "step_$impl" 150 $CLI bench step_cost --config experiments/glm5_summarization/config.yaml \
    --systems resident --batch "${STEP_BATCH:-8}" --prompt 4096 --output 24 \
    --json "$OUT/step_$impl.json" workload.prefill=synthetic workload.selections=synthetic \
    model.kv_layout=fp8 "kernels.attention=$impl" memory.device_pool=16GiB
done
print_steps
"$PY" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
for name in ("attn_fp8", "attn_bf16"):
  path = os.path.join(out, f"{name}.json")
  if os.path.exists(path):
    for r in json.load(open(path))["rows"]:
      us = None if r["seconds"] is None else round(r["seconds"] * 1e6, 1)
      print(name, r["batch"], r["impl"], us, "us; fraction", r.get("fraction"), "max err",
            r.get("max_err"), r.get("error") or "")
for impl in ("xla", "pallas"):
  path = os.path.join(out, f"step_{impl}.json")
  if os.path.exists(path):
    r = json.load(open(path))["systems"]["resident"]
    print(f"decode step, fp8 rows, attention {impl}: {r['median_step_s'] * 1e3:.2f} ms")
PY
