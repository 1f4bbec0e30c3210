#!/usr/bin/env bash
# The default training run on one GPU, in a fixed time budget, resumable:
#
#     OUT=/some/dir bash experiments/train_small/train_gpu.sh
#
# Trains experiments/train_small/train.yaml into runs/train_small (extra arguments are
# overrides, e.g. train.sparse_steps=400; CONFIG and RUN name another training file and
# run directory: CONFIG=experiments/train_small/train_mtp.yaml RUN=runs/train_small_mtp
# trains the committed model's MTP block). A run stopped by the budget (TIME_LIMIT_S,
# default 540: SIGTERM, a checkpoint at the step boundary) is resumed by running the
# script again on the same machine. Then packs the run directory without its optimizer
# checkpoints into $OUT: run.tgz.part-* (15 MB pieces; `cat run.tgz.part-* | tar xz`
# gives model/, requests.jsonl, metrics.jsonl, eval.jsonl, config.yaml), summary.json,
# curves.png and train.log.
set -u
cd "$(dirname "$0")/../.."
# shellcheck source=benchmarks/probes/gpu_steps.sh
source benchmarks/probes/gpu_steps.sh
gpu_setup train_small "${TIME_LIMIT_S:-540}"
unset XLA_PYTHON_CLIENT_PREALLOCATE  # training takes the GPU to itself
export JAX_PLATFORMS=cuda
config_wheels
CONFIG=${CONFIG:-experiments/train_small/train.yaml}
RUN=${RUN:-runs/train_small}
# An image whose standard library ships without .py sources: train on the installed
# packages' sources instead (summary.json's corpus.root says which).
EXTRA=()
if [ "$("$PY" -c 'import pathlib, sysconfig
print(sum(1 for _ in pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))')" -lt 100 ]; then
  EXTRA=("data.root=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')")
  echo "the standard library has no .py sources here: ${EXTRA[0]}"
fi
if [ -f "$RUN/config.yaml" ]; then
  WHERE=(--resume "$RUN")
else
  WHERE=(--out "$RUN")
fi
if ! grep -qs '"status": "finished"' "$RUN/summary.json"; then
  timeout --kill-after=60 "$((BUDGET_S - 20))" "$PY" -m ula_jax.cli.main train \
    "$CONFIG" ${EXTRA[@]+"${EXTRA[@]}"} "$@" --no-progress "${WHERE[@]}" \
    2>&1 | tee "$OUT/train.log"
  echo "train exit status ${PIPESTATUS[0]}" | tee -a "$OUT/train.log"
fi
cp "$RUN/summary.json" "$RUN/curves.png" "$OUT/" 2>/dev/null
tar -C "$RUN" --exclude=checkpoints -czf - . | split -b 15m - "$OUT/run.tgz.part-"
ls -l "$OUT"
