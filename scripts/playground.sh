#!/usr/bin/env bash
# Canon vs no-Canon on the synthetic playground, sized for a CPU: trains the llama and
# llama_canon debug models with identical budgets on Depo and Mano (train_configs/playground/),
# side by side, one process each (NPROC=2 for two each), scores both on held-out test sets with
# greedy generation, and writes outputs/playground/results.md, results.json and accuracy.png
# (scripts/playground.py runs them as a canon-titan sweep). Arguments go to scripts/playground.py:
# --tasks depo,mano,brevo,lano,capo  --steps N  --jobs N  --count N (test items per group)
# --check GROUP:POINTS  --out DIR. Finished runs under --out are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python scripts/playground.py --nproc "${NPROC:-1}" "$@"
