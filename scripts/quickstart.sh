#!/usr/bin/env bash
# Fresh machine -> the Canon vs no-Canon playground experiment: installs into .venv, then trains
# the llama and llama_canon debug models with identical budgets on a CPU-sized Depo (multi-hop
# successor task, generated on the fly: no data files, no network beyond the package index),
# 2 processes each (FSDP2; gloo on CPU), scores both with greedy generation and writes
# outputs/quickstart/results.md and accuracy.png. About 14 minutes on a 2-core CPU.
# Arguments go to scripts/playground.py (e.g. --tasks depo,mano for the full experiment).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-outputs/quickstart}
rm -rf "$OUT"
bash scripts/playground.sh --tasks depo --out "$OUT" "$@"
