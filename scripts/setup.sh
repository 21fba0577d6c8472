#!/usr/bin/env bash
# Creates .venv and installs canon-titan into it (editable). Usage: scripts/setup.sh [EXTRAS]
#   EXTRAS: e.g. "dev" or "dev,eval". torch is installed first, pinned, so that a CPU machine
#   gets the CPU build; set TORCH_INDEX_URL (e.g. a CPU or CUDA wheel index) to choose where from.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "canon-titan needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
echo "[setup] installing torch (pinned) ..."
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${PIP[@]}" --index-url "$TORCH_INDEX_URL" torch
else
  "${PIP[@]}" torch
fi
EXTRAS=${1:-}
if [[ ",$EXTRAS," == *",gpu,"* ]]; then
  # canon-titan calls mamba-ssm's Triton SSD kernels only: install the package without compiling its CUDA
  # extensions (its switch; a plain install would build them with nvcc against this torch, or fail), from its
  # source with this venv's torch, before the extra asks for it (pip then keeps this install).
  echo "[setup] installing mamba-ssm (Triton kernels only) ..."
  "${PIP[@]}" setuptools wheel packaging
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "${PIP[@]}" --no-build-isolation --no-deps mamba-ssm
fi
echo "[setup] installing canon-titan${EXTRAS:+[$EXTRAS]} ..."
"${PIP[@]}" -e ".${EXTRAS:+[$EXTRAS]}"
.venv/bin/python -c 'import torch, torchtitan, canon_titan; print(f"[setup] torch {torch.__version__}, torchtitan {torchtitan.__version__}, cuda available: {torch.cuda.is_available()}")'
