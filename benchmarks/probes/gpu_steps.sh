# Sourced by the GPU scripts from the repository root: their common setup (gpu_setup), a
# budgeted step runner and its status table, and the config packages from carried wheels
# (config_wheels). step needs WORK (log folder), BUDGET_S and START (the script's
# $SECONDS at start), which gpu_setup sets.
# STEP_TAIL: lines of each step's log printed after it (default 25).

# gpu_setup NAME DEFAULT_BUDGET_S [outside]: ROOT (the repository root), OUT (default
# $ROOT/NAME_out), WORK=$OUT/work (created; with "outside", a fresh folder outside OUT,
# for scripts that pack their logs: at most 8 files come back from a device call), PY,
# BUDGET_S (default DEFAULT_BUDGET_S), START, FFI_BUILD (the command that installs the
# FFI custom call with its CUDA handlers for the H100/H200, sm_90, without build
# isolation: no network; more pip flags may follow it); the repository on PYTHONPATH, the
# GPU first, no up-front device memory (jax and CuPy may share the GPU), unbuffered Python
# output.
gpu_setup() {
  ROOT=$PWD
  OUT=${OUT:-$ROOT/${1}_out}
  mkdir -p "$OUT"
  if [ "${3:-}" = outside ]; then WORK=$(mktemp -d); else WORK=$OUT/work; fi
  mkdir -p "$WORK"
  PY=${PYTHON:-python3}
  BUDGET_S=${BUDGET_S:-$2}
  START=$SECONDS
  FFI_BUILD=(env ULA_JAX_FFI_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps
             --force-reinstall -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90 ./custom_calls)
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  export PYTHONUNBUFFERED=1
}

STATUS=()
# step NAME TIMEOUT_S CMD...: runs CMD with a timeout clipped to the remaining budget, logs
# to $WORK/NAME.log, records "NAME rc seconds" (rc 124: timed out; "skipped": no time) and
# returns CMD's exit status (1 when skipped).
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START) - 15))
  if ((left < 20)); then
    STATUS+=("$name skipped 0")
    return 1
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  STATUS+=("$name $rc $((SECONDS - t0))")
  tail -n "${STEP_TAIL:-25}" "$WORK/$name.log"
  return $rc
}

# print_steps: the table of every step's exit status and seconds.
print_steps() {
  echo "== steps (rc 0 = ok, 124 = timed out) =="
  printf '%-12s %8s %8s\n' step rc seconds
  local s
  for s in "${STATUS[@]}"; do
    # shellcheck disable=SC2086
    printf '%-12s %8s %8s\n' $s
  done
}

# tagged PREFIX ITEM [DEFAULT]: for ITEM of the form NAME@TAG, the value of the variable
# PREFIX_TAG (DEFAULT when it is unset or empty); DEFAULT for an ITEM without a tag.
tagged() {
  local item=$2 var
  if [ "${item%%@*}" = "$item" ]; then printf '%s' "${3:-}"; return; fi
  var="${1}_${item#*@}"
  printf '%s' "${!var:-${3:-}}"
}

# config_wheels: the config packages (pydantic, omegaconf), from the wheels carried in
# .whl/, when the machine lacks them (installed to /tmp/site, put on PYTHONPATH).
config_wheels() {
  if ! "$PY" -c "import pydantic, omegaconf" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}
