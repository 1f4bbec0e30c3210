#!/usr/bin/env bash
# End-to-end checks of the engine on one GPU (run from the repository root, with the
# config dependencies carried as wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_engine.sh
#
#   exact     greedy tokens of ula (small device pool, most steps evict; pb_lru and lru),
#             hisparse and far_tier equal resident's (ula-jax compare)
#   mosaic    greedy tokens of ula and hisparse equal resident's with kernels.attention=mosaic
#             (the small model widened to the Mosaic kernel's 64 heads of 512 + 64)
#   stepcost  a decode step whose selections all hit, ula vs resident, same batch
# STEPS: a comma list of these (default all). Results under $OUT: exact.txt,
# exact_mosaic.txt, step_cost.json, summary.txt (printed last).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_engine_out}
mkdir -p "$OUT"
RUNS=${RUNS:-/tmp/gpu_engine_runs}
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
config_wheels
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
CLI="$PY -m ula_jax.cli.main"
BASE="experiments/quickstart/config.yaml mesh=dp1 mesh.platform=gpu model=small
      model.index_topk=64 workload.num_requests=16 engine.max_batch=8"
STEPS=${STEPS:-exact,mosaic,stepcost}
wants() { [[ ",$STEPS," == *",$1,"* ]]; }
touch "$OUT/exact.txt" "$OUT/exact_mosaic.txt" "$OUT/step_cost.txt"
wants exact && {
  echo "== exactness on $($PY -c 'import jax; print(jax.devices()[0].device_kind, jax.__version__)')"
  $CLI run $BASE --no-progress --out "$RUNS/resident" | tail -n 25
  $CLI run $BASE --no-progress --out "$RUNS/resident2" > /dev/null
  $CLI compare "$RUNS/resident" "$RUNS/resident2" > /dev/null \
    && echo "TOKENS EQUAL: resident run twice" || echo "TOKENS DIFFER: resident run twice"
  for sys in "ula memory.policy=pb_lru memory.device_pool=780 memory.host_pool=4096" \
             "ula memory.policy=lru memory.device_pool=780 memory.host_pool=4096" \
             "hisparse memory.hisparse.device_buffer_size=64 memory.hisparse.host_to_device_ratio=8" \
             "far_tier memory.far_tier.mode=on_demand"; do
    name=$(echo "$sys" | tr ' =.' '___' | cut -c1-40)
    # shellcheck disable=SC2086
    $CLI run $BASE memory.system=$sys --no-progress --out "$RUNS/$name" \
      | grep -E "hit|finished|tokens/s"
    $CLI compare "$RUNS/resident" "$RUNS/$name" && echo "TOKENS EQUAL: $sys" \
      || echo "TOKENS DIFFER: $sys"
  done
} 2>&1 | tee "$OUT/exact.txt"
WIDE="model.num_heads=64 model.kv_lora_rank=512 model.qk_rope_head_dim=64
      kernels.attention=mosaic"
wants mosaic && {
  echo "== exactness with kernels.attention=mosaic (64 heads, 512 + 64)"
  # shellcheck disable=SC2086
  $CLI run $BASE $WIDE --no-progress --out "$RUNS/resident_mosaic" | grep -E "finished|tokens/s"
  for sys in "ula memory.policy=pb_lru memory.device_pool=780 memory.host_pool=4096" \
             "hisparse memory.hisparse.device_buffer_size=64 memory.hisparse.host_to_device_ratio=8"; do
    name=mosaic_$(echo "$sys" | tr ' =.' '___' | cut -c1-40)
    # shellcheck disable=SC2086
    $CLI run $BASE $WIDE memory.system=$sys --no-progress --out "$RUNS/$name" \
      | grep -E "hit|finished|tokens/s"
    $CLI compare "$RUNS/resident_mosaic" "$RUNS/$name" && echo "TOKENS EQUAL: mosaic, $sys" \
      || echo "TOKENS DIFFER: mosaic, $sys"
  done
} 2>&1 | tee "$OUT/exact_mosaic.txt"
wants stepcost && $PY -c "
import sys
from ula_jax.bench import step_cost
sys.exit(step_cost.main(sys.argv[1:]))" --config experiments/quickstart/config.yaml \
  --batch 32 --prompt 1024 --output 64 --json "$OUT/step_cost.json" \
  mesh=dp1 mesh.platform=gpu model=small model.index_topk=256 2>&1 | tee "$OUT/step_cost.txt"
rm -rf "$RUNS/resident2"
for d in "$RUNS"/*/; do rm -f "$d/metrics.jsonl" "$d/config.yaml" "$d/requests.jsonl"; done
{ grep -hE "TOKENS" "$OUT/exact.txt" "$OUT/exact_mosaic.txt"; tail -n 8 "$OUT/step_cost.txt"; } \
  | tee "$OUT/summary.txt"
