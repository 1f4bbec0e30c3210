#!/usr/bin/env bash
# GPU check of the kernels (fetch/evict: Pallas + FFI custom calls; sparse MLA attention),
# run from the repository root on a CUDA machine, in one go:
#
#     OUT=/some/dir bash benchmarks/probes/gpu_kernels.sh
#
# Steps (each one runs even when an earlier one failed, and reports its status):
#   env          jax/GPU facts
#   build_ffi    pip install ./custom_calls with the CUDA handlers (no network needed)
#   ffi_import   the CUDA handlers load
#   tests_gpu    the GPU-marked tests of the kernel test files (Triton, CUDA handlers,
#                whole-pool-copy checks on the compiled HLO)
#   hlo          compiled HLO of every fetch/evict implementation with a pinned-host pool
#   cupy_probe   one cudaMemcpyAsync through CuPy; when it fails, the fetch benchmark
#                measures its ceiling with jax alone
#   bench_fetch  ula_jax.bench.fetch at full size (4K..64K entries first, both row layouts;
#                ceilings: jitted copy into a donated buffer and cudaMemcpyAsync, best of
#                3 interleaved repetitions; the JSON is rewritten after every entry count)
#   bench_attn   ula_jax.bench.attention (batch 1..64, 64 heads, k = 2048, a sweep of
#                Pallas launch configurations; 16 steps per jitted loop, best of 3)
#   tests_rest   the remaining tests of those files and of the benchmarks (interpret
#                twins, CPU handlers, the benchmarks' smoke runs on the GPU)
# Results under $OUT (8 files at most): summary.txt, bench_fetch.json, bench_attention.json,
# junit_gpu.xml, logs.tar.gz (every log and HLO dump). The last lines printed are the
# step table and the benchmark summary. BUDGET_S (default 480) bounds the whole run; every
# step's time limit is clipped to what is left of it.

set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup gpu_kernels 480
STEP_TAIL=15

step env 60 bash -c "nvidia-smi; $PY -c '
import jax, jaxlib
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"backend\", jax.default_backend())
for d in jax.devices():
  print(d, d.device_kind, getattr(d, \"core_count\", \"?\"), \"SMs\", [m.kind for m in d.addressable_memories()])
'; $PY -m pip list 2>/dev/null | grep -i -E 'jax|triton|nanobind|scikit|pytest|rich|flax|numpy|cupy'; nvcc --version; cmake --version"

# The CUDA handlers, built for the H100/H200 (sm_90) without build isolation: no network.
step build_ffi 180 "${FFI_BUILD[@]}" -v
step ffi_import 60 "$PY" -c "
import ula_jax_ffi
print('platforms', ula_jax_ffi.platforms(), 'cuda import error', ula_jax_ffi.CUDA_IMPORT_ERROR)
assert ula_jax_ffi.has_cuda()"

# pytest and rich may be missing on the GPU machine: install them from carried wheels.
if ! "$PY" -c "import pytest" 2>/dev/null && [ -d "$ROOT/.whl" ]; then
  step wheels 120 "$PY" -m pip install --no-index --find-links "$ROOT/.whl" pytest rich
fi

KERNEL_TESTS="tests/test_fetch.py tests/test_ffi.py tests/test_sparse_attention_pallas.py tests/test_decode_scores.py"
step tests_gpu 180 "$PY" -m pytest -m gpu $KERNEL_TESTS -v -rA -p no:cacheprovider \
  --junitxml="$OUT/junit_gpu.xml"

step hlo 60 "$PY" - "$WORK" <<'EOF'
"""Compiled HLO of fetch/evict with a pinned-host pool, per implementation."""
import functools, pathlib, sys, traceback
import jax, jax.numpy as jnp
from ula_jax.kernels.fetch import evict_rows, fetch_rows
from ula_jax.kernels.fetch.hlo import host_parameter_shapes, pool_materializations

work = pathlib.Path(sys.argv[1])
dev0 = jax.devices()[0]
put = lambda x, kind: jax.device_put(x, jax.sharding.SingleDeviceSharding(dev0, memory_kind=kind))
Sh, Sd, N, W = 4099, 61, 9, 576
host = put(jnp.zeros((Sh, W), jnp.bfloat16), "pinned_host")
dev = put(jnp.zeros((Sd, W), jnp.bfloat16), "device")
idx = put(jnp.zeros((N,), jnp.int32), "device")
for impl in ("xla", "pallas", "ffi"):
  for direction, fn, args in (("fetch", fetch_rows, (host, idx, dev, idx)),
                              ("evict", evict_rows, (dev, idx, host, idx))):
    try:
      text = jax.jit(functools.partial(fn, impl=impl), donate_argnums=2).lower(
          *args).compile().as_text()
      (work / f"hlo_{direction}_{impl}.txt").write_text(text)
      copies = pool_materializations(text, (Sh, W))
      print(f"{direction:5s} {impl:6s} host params {host_parameter_shapes(text)} "
            f"pool-sized buffers {len(copies)}")
      for line in copies:
        print("    ", line[:200])
    except Exception:
      print(f"{direction:5s} {impl:6s} FAILED")
      traceback.print_exc()
EOF

CEILINGS=jax
if step cupy_probe 60 "$PY" -c "
import numpy as np, cupy
n = 1 << 24
host = cupy.cuda.alloc_pinned_memory(n)
dev = cupy.cuda.alloc(n)
s = cupy.cuda.Stream(non_blocking=True)
rt = cupy.cuda.runtime
for kind in (rt.memcpyHostToDevice, rt.memcpyDeviceToHost):
  src, dst = (host.ptr, dev.ptr) if kind == rt.memcpyHostToDevice else (dev.ptr, host.ptr)
  rt.memcpyAsync(dst, src, n, kind, s.ptr)
s.synchronize()
print('cupy', cupy.__version__, 'memcpy ok')"; then
  CEILINGS=jax,memcpy
fi

step bench_fetch 170 "$PY" -c "
import sys
from ula_jax.bench import fetch
sys.exit(fetch.main(sys.argv[1:]))" --out "$OUT/bench_fetch.json" --ceilings "$CEILINGS" \
  --entries 4K,16K,64K,1K,256,64 --reps 3 --target-ms 60 \
  --pallas-block-units 1024,4096 --pallas-warps 4

step bench_attn 170 "$PY" -c "
import sys
from ula_jax.bench import attention
sys.exit(attention.main(sys.argv[1:]))" --out "$OUT/bench_attention.json" --reps 3 \
  --target-ms 60 --loop 16 \
  --configs auto,h64k64w8,h64k32w8,h64k32w8n3,h64k64w8s1,h32k64w8,h32k64w8s1,h32k32w4,h16k64w4,h16k32w4

step tests_rest 150 "$PY" -m pytest -m "not gpu" $KERNEL_TESTS \
  tests/test_sparse_attention_reference.py tests/test_bench.py -q -rf -p no:cacheprovider

{
  print_steps
  echo "total $((SECONDS - START)) s of BUDGET_S=$BUDGET_S"
  echo
  echo "tests_gpu:  $(grep -E " (passed|failed|error)" "$WORK/tests_gpu.log" | tail -n 1)"
  grep -E "^FAILED|^ERROR" "$WORK/tests_gpu.log" | head -n 20
  echo "tests_rest: $(grep -E " (passed|failed|error)" "$WORK/tests_rest.log" 2>/dev/null | tail -n 1)"
  grep -E "^FAILED|^ERROR" "$WORK/tests_rest.log" 2>/dev/null | head -n 20
  grep -h "^error:\|^skipped" "$WORK/bench_fetch.log" "$WORK/bench_attn.log" 2>/dev/null | head -n 20
  echo
  "$PY" -m ula_jax.bench.summary "$OUT/bench_fetch.json" "$OUT/bench_attention.json" 2>&1
} >"$OUT/summary.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" work && rm -rf "$WORK"
echo
cat "$OUT/summary.txt"
