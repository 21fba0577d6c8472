#!/usr/bin/env bash
# Installs canon-titan[dev,eval] into .venv and runs the test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not slow" to skip the multi-process training tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,eval
# mamba-ssm's Triton SSD kernels, for the kernel-backend tests (they run in Triton's interpreter):
# MAMBA_SKIP_CUDA_BUILD is the package's switch to install its Python files without compiling its
# CUDA extensions, which need a GPU toolchain (see tests/triton_interpreter.py for how it is imported).
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE .venv/bin/python -m pip install --quiet --disable-pip-version-check \
  --no-build-isolation --no-deps -c constraints.txt mamba-ssm
# transformers 4.47.1 (the PhysicsLM4 release's version) with the tokenizers and hub client it needs, in a
# folder of its own: tests load exports in it (PYTHONPATH=.venv/transformers4) as well as in transformers 5.
[ -f .venv/transformers4/transformers/__init__.py ] || .venv/bin/python -m pip install --quiet \
  --disable-pip-version-check --no-deps --target .venv/transformers4 transformers==4.47.1 "tokenizers>=0.21,<0.22" \
  "huggingface-hub>=0.24,<1.0"
# Triton 3.6.0, the offline GPU kit's, in a folder of its own: tests compile the Canon kernels for sm_90 with it
# as well as with the pinned Triton (PYTHONPATH=.venv/triton36; its wheel bundles ptxas, so no GPU is needed).
[ -f .venv/triton36/triton/__init__.py ] || .venv/bin/python -m pip install --quiet --disable-pip-version-check \
  --no-deps --target .venv/triton36 triton==3.6.0
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The tests run in parallel worker processes (pytest-xdist), one per core, at most 4 by default (TEST_WORKERS
# sets the number; 0 runs them in this process). Most tests keep one core busy, so on the 2-core CI machine two
# workers keep both busy. Work stealing evens out the long multi-process tests. "-n 0" after it wins.
WORKERS=${TEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")}
exec .venv/bin/python -m pytest -ra --durations=30 -n "$WORKERS" --dist worksteal "$@"
