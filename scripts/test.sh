#!/usr/bin/env bash
# Installs canon-titan[dev,eval] into .venv and runs the test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not slow" to skip the multi-process training tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,eval
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -ra "$@"
