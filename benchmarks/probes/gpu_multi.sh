#!/usr/bin/env bash
# Runs on a host with several GPUs (run from the repository root; the config packages
# travel as wheels in .whl/ when the machine lacks them), in three parts that each fit
# one device call:
#
#     PART=a OUT=/some/dir bash benchmarks/probes/gpu_multi.sh     # exactness, TP link
#     PART=b OUT=/some/dir bash benchmarks/probes/gpu_multi.sh     # capacity and throughput
#     PART=c OUT=/some/dir bash benchmarks/probes/gpu_multi.sh     # one GPU: kernels, step cost
#
# Part a (every GPU of the host):
#   env          GPUs, their links (nvidia-smi topo -m), jax
#   exact_dp     greedy tokens of ula DP (dp = G, a device pool of ~1.5 x top-k per row:
#                most steps evict to the host pool) equal resident's (dp = G)
#   exact_tp     ula TP (tp = G, layout mod; device-only, and with a host pool) equal
#                resident's (tp = G, the latent replicated)
#   tp_link      ula_jax.bench.tp_link: TP miss delivery against the d2d copy bandwidth
# Part b: serving   ula_jax.bench.serving for $SERVING (default resident_tp, hisparse,
#                ula_dp, ula_tp; each point's result is kept as it comes)
# Part c (GPU 0):
#   ffi_build    the CUDA FFI handlers (in the background while the GPU works)
#   exact_kern   ula's tokens equal resident's with the Pallas fetch, resolve and attention
#                (the same attention kernel on both sides), and with the FFI fetch
#   cost_*       an all-hit decode step of ula against resident ($COST_VARIANTS, default
#                jnp and Pallas resolve, with and without the all-hit fast path, and the
#                fast path's conditionals inside CUDA graphs: *_cmdbuf; speculative
#                all-hit steps, no conditional: *_spec), each also traced
#                under the profiler (device operations, busy time, host waits per step)
#   probe        benchmarks/probes/gpu_decode_probe.py: a decode step's fixed cost and the pools
#                its compiled HLO copies, by host-pool size
# Results under $OUT (8 files at most): summary.txt (printed last), the benchmarks' JSON,
# serving.png, logs.tar.gz. BUDGET_S (default 560) bounds each part; RUN_PROBE=0 skips
# the probe, RUN_EXACT=0 exact_kern. PLATFORM=cpu runs the same steps at toy sizes on
# simulated CPU devices (a dry run).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
PART=${PART:-a}
OUT=${OUT:-$ROOT/gpu_multi_out}
WORK=${WORK:-/tmp/gpu_multi_work/$PART}  # logs; only chosen files go to $OUT
RUNS=${RUNS:-/tmp/gpu_multi_runs}
PROF=${PROF:-/tmp/gpu_multi_prof}  # profiler traces (large: not copied to $OUT)
mkdir -p "$OUT" "$WORK" "$RUNS"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
START=$SECONDS
PLATFORM=${PLATFORM:-gpu}
SERVING=${SERVING:-resident_tp,hisparse,ula_dp,ula_tp}  # the systems part b measures

# shellcheck source=benchmarks/probes/gpu_steps.sh
source "$ROOT/benchmarks/probes/gpu_steps.sh"
config_wheels
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
CLI="$PY -m ula_jax.cli.main"

if [ "$PLATFORM" = gpu ]; then
  G=$(nvidia-smi -L | wc -l)
  MODEL="model=small model.index_topk=64"
  SERVE="--context 8K --device-budget 64K --host-budget 128K --batches 1,4,16,32"
  SERVE_MODEL="model=small"
else  # a dry run on simulated CPU devices
  G=${G:-2}
  MODEL="model=tiny"
  SERVE="--context 512 --device-budget 1024 --host-budget 1024 --batches 2 --max-rows 16 --decode-steps 2"
  SERVE_MODEL="model=tiny"
fi
KOPTS="kernels.fetch=pallas kernels.resolve=pallas"  # the kernels bench serving runs with
BASE="experiments/quickstart/config.yaml mesh.platform=$PLATFORM $MODEL workload.num_requests=16"

STEP_TAIL=${STEP_TAIL:-12}

# exact NAME "A overrides" "B overrides": two runs, their tokens compared.
exact_pair() {
  local name=$1 a=$2 b=$3
  # shellcheck disable=SC2086
  $CLI run $BASE $a --no-progress --out "$RUNS/${name}_ref" | grep -E "finished|tokens/s|peak" \
    && $CLI run $BASE $b --no-progress --out "$RUNS/$name" | grep -E "finished|tokens/s|hit|misses|xdev|distinct" \
    && { cmp_out=$($CLI compare "$RUNS/${name}_ref" "$RUNS/$name"); cmp_rc=$?;
         echo "$cmp_out" | tail -n 2; [ "$cmp_rc" -eq 0 ]; } \
    && echo "TOKENS EQUAL: $name" || { echo "TOKENS DIFFER (or failed): $name"; return 1; }
}
export -f exact_pair
export CLI BASE RUNS

serving() {  # serving NAME SYSTEMS [more args]
  local name=$1 systems=$2
  shift 2
  # shellcheck disable=SC2086
  $PY -m ula_jax.cli.main bench serving --systems "$systems" --devices "$G" $SERVE --out "$WORK/$name" \
    "$@" mesh.platform=$PLATFORM $SERVE_MODEL $KOPTS
}
export -f serving
export PY WORK PLATFORM SERVE SERVE_MODEL KOPTS G

if [ "$PART" = a ]; then
  step env 60 bash -c "nvidia-smi -L; nvidia-smi topo -m; $PY -c '
import jax; print(\"jax\", jax.__version__, jax.devices())'" || true
  step exact_dp 150 bash -c "exact_pair dp 'mesh.dp=$G mesh.tp=1 engine.max_batch=4' \
    'mesh.dp=$G mesh.tp=1 engine.max_batch=4 memory.system=ula memory.policy=pb_lru memory.device_pool=400 memory.host_pool=4096'"
  step exact_tp 200 bash -c "exact_pair tp 'mesh.dp=1 mesh.tp=$G engine.max_batch=8' \
    'mesh.dp=1 mesh.tp=$G engine.max_batch=8 memory.system=ula memory.layout=mod' && \
    exact_pair tp_host 'mesh.dp=1 mesh.tp=$G engine.max_batch=8' \
    'mesh.dp=1 mesh.tp=$G engine.max_batch=8 memory.system=ula memory.layout=mod memory.device_pool=1120 memory.host_pool=4096'"
  QUICK=""
  [ "$PLATFORM" = gpu ] || QUICK="--quick"
  step tp_link 90 $CLI bench tp_link --devices "$G" $QUICK --out "$OUT/tp_link.json"
elif [ "$PART" = b ]; then
  step serving "$BUDGET_S" bash -c "serving serving $SERVING"
  cp "$WORK/serving/serving.json" "$WORK/serving/serving.png" "$OUT/" 2>/dev/null
else
  if [ "$PLATFORM" = gpu ]; then
    (ULA_JAX_FFI_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps --force-reinstall \
      -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90 ./custom_calls >"$WORK/ffi_build.log" 2>&1;
     echo "rc $?" >>"$WORK/ffi_build.log") &
    SC="--batch 32 --prompt 1024 --output 64 model=small model.index_topk=256"
    PROBE="model=small --host 0,4096,131072"
  else
    SC="--batch 2 --prompt 64 --output 6 model=tiny"
    PROBE="model=tiny --host 0,1024 --device 1024 --steps 4"
  fi
  # The fast path's lax.cond per layer group, with and without conditionals captured in
  # CUDA graphs (cmdbuf), against the full resolve every step (nofast); each traced once
  # more under the profiler (device operations, busy time and host waits per step).
  CMDBUF="XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL"
  for name in ${COST_VARIANTS:-jnp jnp_nofast pallas pallas_nofast pallas_cmdbuf}; do
    envs=CUDA_VISIBLE_DEVICES=0
    case $name in
      jnp) set -- kernels.resolve=jnp ;;
      jnp_nofast) set -- kernels.resolve=jnp kernels.resolve_fast_path=false ;;
      jnp_cmdbuf) envs=$CMDBUF; set -- kernels.resolve=jnp ;;
      jnp_nocmdbuf) envs=XLA_FLAGS=--xla_gpu_enable_command_buffer=; set -- kernels.resolve=jnp ;;
      jnp_unpacked) set -- kernels.resolve=jnp engine.pack_state=false ;;
      jnp_spec) set -- kernels.resolve=jnp kernels.fast_path_mode=speculate ;;
      pallas_spec) set -- kernels.resolve=pallas kernels.fast_path_mode=speculate \
        kernels.resolve_fast_path=true ;;
      pallas) set -- kernels.resolve=pallas kernels.resolve_fast_path=true ;;
      pallas_nofast) set -- kernels.resolve=pallas kernels.resolve_fast_path=false ;;
      pallas_cmdbuf) envs=$CMDBUF; set -- kernels.resolve=pallas kernels.resolve_fast_path=true ;;
      *) echo "unknown step-cost variant $name"; continue ;;
    esac
    # shellcheck disable=SC2086
    step "cost_$name" 120 env CUDA_VISIBLE_DEVICES=0 $envs $CLI bench step_cost $SC \
      --json "$WORK/step_cost_$name.json" --profile "$PROF/$name" mesh.dp=1 mesh.tp=1 \
      mesh.platform=$PLATFORM "$@"
  done
  # shellcheck disable=SC2086
  [ "${RUN_PROBE:-1}" = 0 ] || step probe 150 env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/probes/gpu_decode_probe.py $PROBE \
    mesh.platform=$PLATFORM kernels.fetch=pallas kernels.resolve=pallas
  ONE="mesh.dp=1 mesh.tp=1 engine.max_batch=8"
  EVICT="memory.system=ula memory.device_pool=780 memory.host_pool=4096"
  wait  # the FFI build
  tail -n 3 "$WORK/ffi_build.log" 2>/dev/null
  # Attention is the model's, not the memory system's: both sides use the same kernel.
  [ "${RUN_EXACT:-1}" = 0 ] || step exact_kern 200 env CUDA_VISIBLE_DEVICES=0 bash -c "
    exact_pair k_pallas '$ONE kernels.attention=pallas' \
      '$ONE $EVICT kernels.fetch=pallas kernels.resolve=pallas kernels.attention=pallas' ;
    a=\$?; exact_pair k_ffi '$ONE' '$ONE $EVICT kernels.fetch=ffi' ; exit \$((a + \$?))"
fi

if ls "$WORK"/step_cost_*.json >/dev/null 2>&1; then
  ($PY - "$WORK" "$OUT/step_cost.json" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
out = {p.stem.removeprefix("step_cost_"): json.loads(p.read_text())
       for p in sorted(work.glob("step_cost_*.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=2))
for name, r in out.items():
  for s, row in r["systems"].items():
    print(f"step_cost {name:13s} {s:9s} {row['median_step_s'] * 1e3:8.3f} ms  ratio "
          f"{row['ratio_to_resident']:.3f}  misses {row['misses']}  equal {row['tokens_equal_resident']}")
    if "profile" in row:
      q = row["profile"]
      print(f"step_prof {name:13s} {s:9s} wall {q['wall_us'] / 1e3:7.3f} ms  busy "
            f"{q['device_busy_us'] / 1e3:7.3f} ms  ops {q['device_ops']:6.0f}  memcpy "
            f"{q['memcpy']:4.0f}  host waits {q['host_waits']:4.0f}")
EOF
  ) >"$WORK/step_cost_summary.log" 2>&1
  cat "$WORK/step_cost_summary.log"
fi

tar -czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null  # the traces stay in $PROF
{
  print_steps
  echo "total $((SECONDS - START)) s of BUDGET_S=$BUDGET_S (part $PART, $G devices, $PLATFORM)"
  grep -h -E "TOKENS" "$WORK"/*.log 2>/dev/null
  grep -h -E "^step_(cost|prof)" "$WORK"/*.log 2>/dev/null
  [ -f "$WORK/probe.log" ] && tail -n 6 "$WORK/probe.log"
  [ -f "$WORK/serving.log" ] && grep -E "^  [a-z_]+ +batch" "$WORK/serving.log"
  [ -f "$WORK/tp_link.log" ] && grep -E "│" "$WORK/tp_link.log" | tail -n 16
} | tee "$OUT/summary.txt"
