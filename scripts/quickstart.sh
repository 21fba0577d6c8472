#!/usr/bin/env bash
# Fresh machine -> the Canon vs no-Canon playground experiment: installs into .venv, then trains
# the llama and llama_canon debug models with identical budgets on a CPU-sized Depo (multi-hop
# successor task, generated on the fly: no data files, no network beyond the package index),
# side by side, one process each, scores both with greedy generation on held-out items and writes
# outputs/quickstart/results.md and accuracy.png: a sweep of two arms and one seed
# (train_configs/sweeps/quickstart.toml). About 7 minutes on an idle 2-core CPU: the two trainings
# assume two free cores, and the sweep says so when the machine is busy as it starts (README).
# It is also the guard of the README's headline: it exits 1 unless llama_canon beats llama on
# 1-hop queries by at least 40 points. Arguments go to canon-titan sweep (e.g. --jobs 1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-outputs/quickstart}
rm -rf "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/canon-titan sweep train_configs/sweeps/quickstart.toml --out "$OUT" \
    --check "llama_canon>llama:k=1:40" "$@"
