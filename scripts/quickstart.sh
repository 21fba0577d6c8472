#!/usr/bin/env bash
# Fresh machine -> trained debug model: installs into .venv, then trains the debug Llama on the
# built-in corpus with 2 processes (FSDP2; gloo on CPU, NCCL on GPU), saving checkpoints, and
# checks that the loss fell. No network needed beyond the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-outputs/quickstart}
rm -rf "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/canon-titan train --config train_configs/llama_debug.toml --nproc "${NPROC:-2}" \
  --job.dump_folder "$OUT" "$@"
.venv/bin/python -m canon_titan.metrics "$OUT" --require-decrease
echo "[quickstart] checkpoints: $(ls -d "$OUT"/checkpoint/step-* | tr '\n' ' ')"
