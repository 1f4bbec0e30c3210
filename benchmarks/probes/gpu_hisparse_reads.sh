#!/usr/bin/env bash
# Where hisparse's device rows part from their host rows on a GPU, and what changes it:
# gpu_scatter_drop.py (does a scatter masked by one out-of-range index lose real updates,
# with and without deterministic ops; `scatter`), then gpu_write_through.py --check-reads (4 requests of 65,536 tokens, GLM-5 geometry, a
# 2048-entry buffer so slots are reused from the second decode step on) as is, with XLA's
# command buffers (CUDA graphs) off, with XLA's deterministic-scatter rewrite off
# (--xla_gpu_enable_scatter_determinism_expander=false: scatters with repeated or dropped
# indices then run as loops), with deterministic ops off altogether, and with a scatter
# that does not declare its indices unique. Run from anywhere:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_hisparse_reads.sh
#
# VARIANTS (default "scatter base"; also noexpander, nograph, nondet, plain), OUTPUT (decode steps, default 6), EXTRA
# (overrides for every run, e.g. "--prompt 512 model=tiny mesh.platform=cpu"), TIME_LIMIT_S
# (the script's, default 570). Results: VARIANT.json per variant, logs.tgz.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_hisparse_reads "${TIME_LIMIT_S:-570}" outside
config_wheels
PROBE=(benchmarks/probes/gpu_write_through.py --check-reads --output "${OUTPUT:-6}"
       memory.hisparse.device_buffer_size=2048)
# shellcheck disable=SC2206
PROBE+=(${EXTRA:-})
flagged() {  # flagged FLAGS VARIANT: the probe with FLAGS added to XLA_FLAGS
  XLA_FLAGS="${XLA_FLAGS:-} $1" step "$2" 200 "$PY" "${PROBE[@]}" --json "$OUT/$2.json"
}
for v in ${VARIANTS:-scatter base}; do
  case $v in
    scatter) step "$v" 120 bash -c "$PY benchmarks/probes/gpu_scatter_drop.py && \
               $PY benchmarks/probes/gpu_scatter_drop.py --deterministic" ;;
    base) step "$v" 200 "$PY" "${PROBE[@]}" --json "$OUT/$v.json" ;;
    noexpander) flagged --xla_gpu_enable_scatter_determinism_expander=false "$v" ;;
    nograph) flagged --xla_gpu_enable_command_buffer= "$v" ;;
    nondet) flagged --xla_gpu_deterministic_ops=false "$v" ;;
    plain) step "$v" 200 "$PY" "${PROBE[@]}" --plain-scatter --json "$OUT/$v.json" ;;
    *) echo "unknown variant $v (scatter, base, noexpander, nograph, nondet, plain)"; exit 2 ;;
  esac
done
print_steps | tee "$WORK/steps.txt"
tar czf "$OUT/logs.tgz" -C "$WORK" .
