#!/usr/bin/env bash
# The measurements `kernels.*: auto` decides by, for the GPU this runs on, in one call, and
# the table with this GPU's rows merged into the shipped one:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_auto_table.sh
#
# PARTS (default "ffi attention fetch resolve"), each a step within the budget:
#   ffi        pip install ./custom_calls with the CUDA handlers (sm_90; no network), so
#              the fetch benchmark measures `ffi` beside `pallas`
#   attention  ula-jax bench attention, the production launches (`--configs auto
#              --mosaic-configs auto`): 64 heads, 512 + 64 bf16, top-k 2048, batch
#              1-64 (`xla`, `pallas`, `mosaic`) and 128-256 (`pallas`, `mosaic`)
#   fetch      ula-jax bench fetch, both row layouts (656-byte FP8, 1152-byte bf16),
#              64-64K rows a call, fetch and evict, `pallas` (and `ffi`), memcpy ceiling
#   resolve    ula-jax bench resolve, one layer group, batch 32 / 64 / 128, top-k 2048,
#              1M slots, PB-LRU and exact LRU, the four launches and the fused one, PB-LRU
#              rings of 32 (the default) and 4
# Then `ula-jax bench kernels_table --merge ula_jax/kernels/auto_table.json` over the
# JSON written here. Results under $OUT (8 files at most come back): attention.json,
# fetch.json, resolve_r32.json, resolve_r4.json, auto_table.json, summary.txt,
# logs.tgz. BUDGET_S (default 570) bounds the whole run.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_auto_table "${BUDGET_S:-570}" outside
config_wheels
CLI="$PY -m ula_jax.cli.main"
STEP_TAIL=12
wants() { [[ " ${PARTS:-ffi attention fetch resolve} " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,pci.link.gen.max,pci.link.width.max \
  --format=csv,noheader | tee "$WORK/gpu.txt"

impls=pallas
if wants ffi; then
  step build_ffi 200 "${FFI_BUILD[@]}" \
    && "$PY" -c "import ula_jax_ffi; assert ula_jax_ffi.has_cuda()" && impls=pallas,ffi
fi
if wants attention; then
  step attention_small 200 $CLI bench attention --batch 1,8,16,32,64 \
    --impls xla,pallas,mosaic --configs auto --mosaic-configs auto --reps 3 \
    --out "$OUT/attention.json"
  step attention_large 150 $CLI bench attention --batch 128,256 \
    --impls pallas,mosaic --configs auto --mosaic-configs auto --reps 3 \
    --out "$WORK/attention_large.json"
fi
if wants fetch; then
  step fetch 220 $CLI bench fetch --layouts fp8x656,bf16x576 \
    --entries 64,256,1K,4K,16K,64K --impls "$impls" --directions fetch,evict \
    --ceilings memcpy --reps 3 --out "$OUT/fetch.json"
fi
if wants resolve; then
  for r in 32 4; do
    step "resolve_r$r" 150 $CLI bench resolve --batch 32,64,128 --k 2048 --pools 1M \
      --policies pb_lru,lru --impls pallas --pallas-fuse off,on --buckets "$r" \
      --out "$OUT/resolve_r$r.json"
  done
fi

# The table: this GPU's rows, every other device's kept from the shipped one.
inputs=()
for f in "$OUT"/attention.json "$WORK"/attention_large.json "$OUT"/fetch.json \
  "$OUT"/resolve_r32.json "$OUT"/resolve_r4.json; do
  [ -f "$f" ] && inputs+=("$f")
done
if ((${#inputs[@]})); then
  STEP_TAIL=60 step table 60 $CLI bench kernels_table --merge ula_jax/kernels/auto_table.json \
    --out "$OUT/auto_table.json" "${inputs[@]}"
fi
# attention_large.json travels in logs.tgz (8 files at most come back).
print_steps | tee "$OUT/summary.txt"
tar -czf "$OUT/logs.tgz" -C "$WORK" .
