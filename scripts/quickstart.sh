#!/usr/bin/env bash
# Fresh machine -> the Canon vs no-Canon playground experiment: installs into .venv, then trains
# the llama and llama_canon debug models with identical budgets on a CPU-sized Depo (multi-hop
# successor task, generated on the fly: no data files, no network beyond the package index),
# side by side, one process each, scores both with greedy generation on held-out items and writes
# outputs/quickstart/results.md and accuracy.png. About 7 minutes on an idle 2-core CPU (README).
# It is also the guard of the README's headline: it exits 1 unless llama_canon beats llama on
# 1-hop queries by at least 40 points. Arguments go to scripts/playground.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-outputs/quickstart}
rm -rf "$OUT"
bash scripts/playground.sh --tasks depo --check k=1:40 --out "$OUT" "$@"
