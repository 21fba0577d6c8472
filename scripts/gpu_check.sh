#!/usr/bin/env bash
# One command for a lent GPU: correctness and every benchmark of record, within 9 minutes, into
# OUTDIR/gpu_check.md, gpu_check.json and gpu_check.log (see scripts/benchmarks/gpu_check.py for the steps).
#   scripts/gpu_check.sh OUTDIR                    # on the GPU machine (offline: the kit is installed first)
#   scripts/gpu_check.sh OUTDIR --only float8_rowwise,linear_trainer   # a second command for skipped steps
#   scripts/gpu_check.sh OUTDIR --tiny             # CPU, toy sizes in Triton's interpreter: checks the script
# GPU_CHECK_SECONDS (default 540) is the whole command's time, the kit's install included; scripts/gpu_lease.sh
# runs it across two device calls.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR [--tiny] [--only STEP,...]}
shift
started=$SECONDS
[[ ${GPU_CHECK_SECONDS:-540} =~ ^[0-9]+$ ]] || {
  echo "gpu_check: GPU_CHECK_SECONDS must be whole seconds, got '${GPU_CHECK_SECONDS}'" >&2; exit 2; }
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torchtitan' 2>/dev/null; then
  PY=.venv/bin/python
else
  # The offline GPU machine: its image lacks torchtitan, fla, mamba-ssm ...; the kit (../shared/gpu,
  # carried along as .gpu/) installs them from wheels, with no network.
  KIT=$( [ -f .gpu/setup.sh ] && echo .gpu || echo ../shared/gpu )
  [ -f "$KIT/setup.sh" ] || { echo "gpu_check: no .venv and no offline kit (.gpu/setup.sh or ../shared/gpu)" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$KIT/setup.sh"
  PY=python3
fi
# On a GPU every Triton autotuner keeps its results in Triton's cache (fla's and the Canon forward's do anyway),
# which gpu_check.py brings back as OUTDIR/triton_autotune.json and restores from scripts/benchmarks/gpu_check_tuned.json.
case " $* " in *" --tiny "*) export TRITON_INTERPRET=1 OMP_NUM_THREADS=1 ;; *) export TRITON_CACHE_AUTOTUNING=1 ;; esac
export WANDB_MODE=offline PYTHONUNBUFFERED=1
exec "$PY" scripts/benchmarks/gpu_check.py "$OUT" --budget $((${GPU_CHECK_SECONDS:-540} - (SECONDS - started) - 15)) "$@"
