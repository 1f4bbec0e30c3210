#!/usr/bin/env bash
# Real scale on one GPU (run from anywhere; config wheels in .whl/ when the machine lacks
# them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_real_scale.sh
#
#   hlo        the compiled decode step copies no pool (tests/test_decode_hlo.py, stacked
#              pools, Pallas fetch)
#   compile    ula-jax bench compile: decode step and prefill chunk at 8, 32, 78 layers of
#              model small, resident and ula
#   glm5 x2    GLM-5 geometry (glm5_narrow, 78 layers, top-k 2048), ula with the Mosaic
#              attention and Pallas fetch / fused resolve, a short workload run twice
#              into a fresh compilation cache: the first run's summary says how long its
#              decode step took to compile, the second must compile nothing
# Results under $OUT: bench_compile_small.json, glm5_first.json, glm5_second.json,
# steps.txt (printed last).
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_real_scale "${TIME_LIMIT_S:-560}"
config_wheels
CLI="$PY -m ula_jax.cli.main"
step hlo 100 "$PY" -m pytest -m gpu tests/test_decode_hlo.py -k pallas -o addopts= \
  -p no:cacheprovider -q
step compile 200 $CLI bench compile --layers 8,32,78 --json "$OUT/bench_compile_small.json" \
  model=small mesh.platform=gpu mesh.dp=1 memory.host_pool=4096 kernels.fetch=pallas \
  kernels.resolve=pallas_fused
CACHE=$(mktemp -d)
GLM5="experiments/glm5_summarization/config.yaml workload.num_requests=2
      workload.length_scale=0.005 workload.output_scale=0.02 engine.max_batch=2
      engine.prefill_chunk=512 memory.device_pool=65536 memory.host_pool=65536
      kernels.attention=mosaic kernels.fetch=pallas kernels.resolve=pallas_fused
      experiment.plots=false engine.compilation_cache_dir=$CACHE"
for run in first second; do
  # shellcheck disable=SC2086
  step "glm5_$run" 170 $CLI run $GLM5 --no-progress --out "$WORK/glm5_$run"
  "$PY" -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; \
json.dump({k: s[k] for k in ('compilation', 'wall_time_s', 'finished', 'generated_tokens')}, \
open(sys.argv[2], 'w'), indent=1); print(json.dumps(s['compilation']))" \
    "$WORK/glm5_$run/summary.json" "$OUT/glm5_$run.json"
done
print_steps | tee "$OUT/steps.txt"
