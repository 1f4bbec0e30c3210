#!/usr/bin/env bash
# Sparse prefill on one GPU (run from the repository root; config wheels in .whl/ when
# the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_prefill.sh
#
#   prefill      ula-jax bench prefill: one PROMPT-token prompt (default 64K) at GLM-5
#                geometry (glm5_narrow: 78 layers, top-k 2048, 20 index groups) in chunks
#                of CHUNK (default 4096), kernels.attention=mosaic kernels.indexer=pallas:
#                prompt tokens/s, every chunk's seconds, and the last chunk's parts
#                (selection, scores, radix top-k, attention, the rest) against their FLOP
#                and byte ceilings, with the Pallas scores launches (INDEXER_CONFIGS) and
#                the radix bits per pass (RADIX_BITS) swept
#   tests        the GPU twins of tests/test_sparse_prefill.py (Pallas scores and counting
#                passes, radix top-k against lax.top_k, the Triton and Mosaic attention of
#                many rows against the reference)
#   xla_indexer  the last chunk's parts with kernels.indexer=xla (scores in column tiles,
#                counting passes in XLA)
#   pallas_attn  the last chunk's parts with kernels.attention=pallas (Triton)
# STEPS: a comma list of these (default all, in this order). TIME_LIMIT_S bounds the
# whole script (default 570). Results under $OUT: prefill.json, prefill_xla_indexer.json,
# prefill_pallas_attn.json, steps.txt (printed last); logs under $OUT/work.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_prefill "${TIME_LIMIT_S:-570}"
config_wheels
STEP_TAIL=${STEP_TAIL:-40}
CLI="$PY -m ula_jax.cli.main"
PROMPT=${PROMPT:-64K}
CHUNK=${CHUNK:-4096}
STEPS=${STEPS:-prefill,tests,xla_indexer,pallas_attn}
wants() { [[ ",$STEPS," == *",$1,"* ]]; }
BENCH="bench prefill --config experiments/glm5_summarization/config.yaml --prompt $PROMPT
       --chunk $CHUNK --radix-bits ${RADIX_BITS:-2,4}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
# shellcheck disable=SC2086
wants prefill && step prefill 330 $CLI $BENCH --json "$OUT/prefill.json" \
  --indexer-configs "${INDEXER_CONFIGS:-n64t256w8s3,n64t128w4s3,n128t128w8s3,n64t256w8s2}" \
  kernels.attention=mosaic kernels.indexer=pallas
wants tests && step tests 150 "$PY" -m pytest -m gpu tests/test_sparse_prefill.py \
  -o addopts= -p no:cacheprovider -q
# shellcheck disable=SC2086
wants xla_indexer && step xla_indexer 100 $CLI $BENCH --no-prompt \
  --json "$OUT/prefill_xla_indexer.json" kernels.attention=mosaic kernels.indexer=xla
# shellcheck disable=SC2086
wants pallas_attn && step pallas_attn 100 $CLI $BENCH --no-prompt \
  --json "$OUT/prefill_pallas_attn.json" kernels.attention=pallas kernels.indexer=pallas
print_steps | tee "$OUT/steps.txt"
