#!/usr/bin/env bash
# The decode-speed ratios of issue "Decode at the device's speed" that one device call can
# measure (run from anywhere; config wheels in .whl/ when the machine lacks them):
#
#     OUT=/some/dir bash benchmarks/probes/gpu_decode_ratios.sh
#
# PARTS (default "small glm5 resolve fetch"), each a step within the budget:
#   small    ula-jax bench step_cost: an all-hit decode step, ula / resident, batch 32,
#            model small, top-k 256
#   glm5     the same at GLM-5 geometry (experiments/glm5_summarization, synthetic
#            prefill), batch GLM5_BATCH (default 64), GLM5_PROMPT-token prompts (8192);
#            GLM5_VARIANTS (default "base") runs it once per variant, NAME@TAG adding the
#            overrides in $VAR_TAG (e.g. VAR_spec="kernels.fast_path_mode=speculate") and
#            XLA_FLAGS from $XLA_TAG, --output from $OUTPUT_TAG (default batch + 24; with
#            engine.steps_per_dispatch=N at least (batch + 1) x N, e.g. OUTPUT_spd=280
#            for N = 4 at batch 64); GLM5_PROFILE=1 adds each run's per-step profile
#            (bench step_cost --profile)
#   batch1   the same at batch 1 with hisparse too (its all-hit step, not its misses);
#            BATCH1_VARIANTS as GLM5_VARIANTS
#            ROUNDS (default 1) is step_cost's --rounds for small, glm5 and batch1: that
#            many timed runs per system, the systems in turn, every engine kept (at
#            batch 64 and 8K prompts two 44.56 GiB pools do not fit one H200: with
#            ROUNDS > 1 use GLM5_PROMPT=4096)
#   resolve  ula-jax bench resolve: one layer group, batch 32 and 64, top-k 2048, 1M
#            slots, PB-LRU and exact LRU, Pallas in four launches and in one, profiled
#            (each kernel's device time in the JSON); once per PB-LRU ring size in
#            RESOLVE_BUCKETS (default "32", memory.pb_lru_buckets's default)
#   fetch    ula-jax bench fetch: 656-byte FP8 rows, 4K-64K rows, fetch and evict,
#            against a memcpy of the same bytes, a program a copy, then FETCH_COPIES
#            (default 8) copies a program, then those with the host rows in runs of
#            FETCH_RUN (default 4: entry_major's group of four layers); FETCH_FFI=1 first builds the FFI custom
#            calls (./custom_calls, CUDA handlers for sm_90) and measures them too;
#            FETCH_UNITS / FETCH_WARPS (comma lists) sweep the Pallas launch (16-byte
#            units per program, warps per program; the default launch is 1024 and 4,
#            list them to keep it in the sweep) in each of the three forms; FETCH_HOST_ROWS (space list of host
#            pool rows, default none) adds runs at 4K and 64K rows per pool size, rows
#            at random and in runs of FETCH_RUN, FETCH_COPIES copies a program: rows
#            scattered over a pinned pool as large as a serving run's (100 GiB is
#            163840000 rows) against the bench's small one; such pools are filled in
#            place and not checked (bench fetch --no-check); FETCH_FRESH=1 gives each
#            copy its own rows (--fresh-rows: no translation of a host page warm from
#            the copy before, as in a serving step; use FETCH_COPIES=16)
#   between  benchmarks/probes/gpu_fetch_between.py: the fetch and evict of 4K fresh
#            host rows in runs of 4, 100 GiB pool, among gathers of BETWEEN_GATHERS (default
#            "0,26K,104K") rows of a BETWEEN_DEVICE_ROWS-row device pool (default
#            65472000, 40 GiB), as a serving step's attention reads run between two
#            groups' fetches
#   serving  ula-jax bench serving at the throughput experiment's settings (GLM-5
#            geometry, 32K contexts, synthetic prefill and selections, Pallas fetch,
#            fused resolve), SERVING_SYSTEMS (default ula_dp) at SERVING_BATCHES (default
#            48), device budget SERVING_DEVICE (default 60GiB; 40GiB fits an H100), host
#            100GiB, each system's capacity point profiled (device ms per kernel kind a
#            step); SERVING_VARIANTS as GLM5_VARIANTS (XLA_TAG flags, VAR_TAG overrides)
# Results under $OUT: one JSON per part and logs.tgz; a short table last.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_decode_ratios "${TIME_LIMIT_S:-570}" outside
config_wheels
CLI="$PY -m ula_jax.cli.main"
wants() { [[ " ${PARTS:-small glm5 resolve fetch} " == *" $1 "* ]]; }
# The pinned-host cap a serving run sets (the RAM less the process's reserve), for the
# parts that pin host pools as large as a serving run's; a cap already given stays.
pin_like_serving() {
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-$(
    "$PY" -c 'from ula_jax.core.host_memory import *; print(default_pinned_limit_gib(host_ram()))')}"
}
if wants small; then
  STEP_TAIL=8 step small 150 $CLI bench step_cost --config experiments/quickstart/config.yaml \
    --systems resident,ula --batch 32 --prompt 1024 --output 64 --json "$OUT/step_small.json" \
    --rounds "${ROUNDS:-1}" mesh=dp1 mesh.platform=gpu model=small model.index_topk=256
fi
if wants glm5; then
  b=${GLM5_BATCH:-64}
  for item in ${GLM5_VARIANTS:-base}; do
    tag=${item#*@}; [ "$tag" = "$item" ] && tag=$item
    prof=(); [ "${GLM5_PROFILE:-0}" = 1 ] && prof=(--profile "$WORK/profile_$tag")
    # shellcheck disable=SC2046
    XLA_FLAGS="${XLA_FLAGS:-} $(tagged XLA "$item")" STEP_TAIL=16 step "glm5_$tag" 300 \
      $CLI bench step_cost \
      --config experiments/glm5_summarization/config.yaml --systems resident,ula \
      --batch "$b" --prompt "${GLM5_PROMPT:-8192}" --output "$(tagged OUTPUT "$item" $((b + 24)))" \
      --json "$OUT/step_glm5_$tag.json" --rounds "${ROUNDS:-1}" "${prof[@]}" \
      workload.prefill=synthetic \
      $(tagged VAR "$item")
    rm -rf "$WORK/profile_$tag"/*/plugins  # the traces are large; the JSON keeps the counts
  done
fi
if wants batch1; then
  for item in ${BATCH1_VARIANTS:-base}; do
    tag=${item#*@}; [ "$tag" = "$item" ] && tag=$item
    # shellcheck disable=SC2046
    XLA_FLAGS="${XLA_FLAGS:-} $(tagged XLA "$item")" STEP_TAIL=8 step "batch1_$tag" 240 \
      $CLI bench step_cost \
      --config experiments/glm5_summarization/config.yaml --systems resident,ula,hisparse \
      --batch 1 --prompt "${GLM5_PROMPT:-8192}" --output 48 \
      --json "$OUT/step_batch1_$tag.json" --rounds "${ROUNDS:-1}" workload.prefill=synthetic \
      $(tagged VAR "$item")
  done
fi
if wants resolve; then
  for r in ${RESOLVE_BUCKETS:-32}; do
    STEP_TAIL=14 step "resolve_r$r" 200 $CLI bench resolve --batch 32,64 --k 2048 \
      --pools 1M --policies pb_lru,lru --impls pallas --pallas-fuse off,on --buckets "$r" \
      --profile "$WORK/profile_resolve_r$r" --out "$OUT/resolve_r$r.json"
    rm -rf "$WORK/profile_resolve_r$r"  # the traces are large; the JSON keeps the kernels
  done
fi
if wants fetch; then
  impls=pallas
  if [ "${FETCH_FFI:-0}" = 1 ]; then
    step build_ffi 180 "${FFI_BUILD[@]}" && impls=pallas,ffi
  fi
  sweep=()
  [ -n "${FETCH_UNITS:-}" ] && sweep+=(--pallas-block-units "$FETCH_UNITS")
  [ -n "${FETCH_WARPS:-}" ] && sweep+=(--pallas-warps "$FETCH_WARPS")
  STEP_TAIL=30 step fetch 240 $CLI bench fetch --layouts fp8x656 --entries 4K,16K,64K \
    --impls "$impls" --directions fetch,evict --ceilings memcpy ${sweep[@]+"${sweep[@]}"} \
    --out "$OUT/fetch.json"
  # The kernels as a step runs them: FETCH_COPIES copies a program, no program launch
  # between copies; then with the host rows in runs of FETCH_RUN (memory.host_layout
  # entry_major: a group's layers of an entry side by side).
  STEP_TAIL=16 step fetch_copies 120 $CLI bench fetch --layouts fp8x656 --entries 4K,16K,64K \
    --impls "$impls" --directions fetch,evict --ceilings memcpy \
    --copies-per-call "${FETCH_COPIES:-8}" ${sweep[@]+"${sweep[@]}"} --out "$OUT/fetch_copies.json"
  STEP_TAIL=16 step fetch_runs 120 $CLI bench fetch --layouts fp8x656 --entries 4K,16K,64K \
    --impls "$impls" --directions fetch,evict --ceilings memcpy \
    --copies-per-call "${FETCH_COPIES:-8}" --host-run "${FETCH_RUN:-4}" \
    ${sweep[@]+"${sweep[@]}"} --out "$OUT/fetch_runs.json"
  # Host pools as large as a serving run's: filled in place, not mirrored (--no-check).
  [ -n "${FETCH_HOST_ROWS:-}" ] && pin_like_serving
  for h in ${FETCH_HOST_ROWS:-}; do
    for r in 1 "${FETCH_RUN:-4}"; do
      STEP_TAIL=10 step "fetch_host${h}_r$r" 150 $CLI bench fetch --layouts fp8x656 \
        --entries 4K,64K --impls pallas --directions fetch,evict --ceilings memcpy \
        --host-rows "$h" --host-run "$r" --copies-per-call "${FETCH_COPIES:-8}" \
        --no-check ${FETCH_FRESH:+--fresh-rows} --out "$OUT/fetch_host${h}_r$r.json"
    done
  done
fi
if wants between; then
  pin_like_serving
  STEP_TAIL=8 step between 240 "$PY" benchmarks/probes/gpu_fetch_between.py \
    --device-rows "${BETWEEN_DEVICE_ROWS:-65472000}" --gather-rows "${BETWEEN_GATHERS:-0,26K,104K}" \
    --out "$OUT/between.json"
fi
if wants serving; then
  for item in ${SERVING_VARIANTS:-base}; do
    tag=${item#*@}; [ "$tag" = "$item" ] && tag=$item
    # shellcheck disable=SC2046
    XLA_FLAGS="${XLA_FLAGS:-} $(tagged XLA "$item")" STEP_TAIL=24 step "serving_$tag" 300 \
      $CLI bench serving --systems "${SERVING_SYSTEMS:-ula_dp}" \
      --context 32768 --device-budget "${SERVING_DEVICE:-60GiB}" \
      --host-budget 100GiB --batches "${SERVING_BATCHES:-48}" --hisparse-buffer 4096 \
      --max-rows 64 --out "$WORK/serving_$tag" --profile "$WORK/profile_serving_$tag" \
      model=glm5_narrow mesh.platform=gpu engine.page_size=64 kernels.fetch=pallas \
      kernels.resolve=pallas_fused workload.selections=synthetic \
      workload.prefill=synthetic $(tagged VAR "$item")
    cp "$WORK/serving_$tag/serving.json" "$OUT/serving_$tag.json" 2>/dev/null
    rm -rf "$WORK/profile_serving_$tag"  # the traces are large; the JSON keeps the kernels
  done
fi
print_steps | tee "$WORK/steps.txt"
tar czf "$OUT/logs.tgz" -C "$WORK" .
