#!/usr/bin/env bash
# torchrun launcher (the project's torchrun wrapper, canon_titan.launch.torchrun). Environment:
#   CONFIG   TOML file (default: this checkout's train_configs/llama_debug.toml)
#   NGPU     processes per node (default 8; use 2 on a CPU machine)
#   NNODES   number of nodes (default 1); with more, on every node: NODE_RANK (0 to NNODES-1; node 0 holds
#            global rank 0), MASTER_ADDR (node 0's address) and MASTER_PORT (a free port there, default 29500)
#   LOG_RANK ranks whose output is shown (default 0)
#   TRITON_CACHE_DIR  Triton's kernel cache (default: on this node's disk, under $TMPDIR or /tmp)
#   CANON_TITAN_TRITON_SEED  a shared pre-tuned Triton cache copied into it before the workers start
# Extra arguments are overrides: scripts/run_train.sh --training.steps 100
# Relative paths (CONFIG, the paths in the TOML and in overrides) are read from the current directory, as
# canon-titan train reads them. The wrapper checks the config for NNODES x NGPU processes before anything
# starts (one line and exit 2 on every node).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=${CONFIG:-$REPO/train_configs/llama_debug.toml}
NGPU=${NGPU:-8}
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3 )}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Node-local: on a shared home (Triton's default ~/.triton/cache) every rank writes the same files.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/canon-titan-triton-${USER:-$(id -u)}}
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
if [ "$NNODES" -eq 1 ]; then
  RDZV=(--standalone)
else
  if [ -z "${NODE_RANK:-}" ] || [ -z "${MASTER_ADDR:-}" ]; then
    echo "canon-titan: NNODES=$NNODES: set NODE_RANK (another on each node, 0 to $((NNODES - 1)); node 0 holds" \
         "global rank 0) and MASTER_ADDR (node 0's address) on every node" >&2
    exit 2
  fi
  # torchrun's static rendezvous honours the node rank: node N holds global ranks N*NGPU to N*NGPU+NGPU-1.
  RDZV=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
# canon_titan.launch.torchrun is torchrun with the project's exit codes: 0, 2 (refused before training, one
# line), 3 (stopped: divergence, a failed save) and 75 (a stop signal: every rank saved the step it reached,
# or none had trained). exec: a signal to this script reaches the wrapper itself.
exec "$PYTHON" -m canon_titan.launch.torchrun "${RDZV[@]}" --nproc_per_node "$NGPU" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  -m canon_titan.train --config "$CONFIG" "$@"
