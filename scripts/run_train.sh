#!/usr/bin/env bash
# torchrun launcher (the project's torchrun wrapper, canon_titan.launch.torchrun). Environment:
#   CONFIG   TOML file (default train_configs/llama_debug.toml)
#   NGPU     processes per node (default 8; use 2 on a CPU machine)
#   NNODES   number of nodes (default 1); NODE_RANK this node's rank (default 0)
#   MASTER_ADDR / MASTER_PORT   rendezvous endpoint for multi-node (default localhost:29500)
#   LOG_RANK ranks whose output is shown (default 0)
# Extra arguments are overrides: scripts/run_train.sh --training.steps 100
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-train_configs/llama_debug.toml}
NGPU=${NGPU:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WORLD_SIZE=$((NGPU * NNODES))
"$PYTHON" -m canon_titan.cli config validate "$CONFIG" --world-size "$WORLD_SIZE" "$@" >/dev/null
unset WORLD_SIZE
if [ "$NNODES" -eq 1 ]; then
  RDZV=(--standalone)
else
  RDZV=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend c10d
        --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${RDZV_ID:-canon-titan}")
fi
# canon_titan.launch.torchrun is torchrun with the project's exit codes: 0, 2 (refused before training, one
# line), 3 (stopped: divergence, a failed save) and 75 (a stop signal: every rank saved the step it reached).
exec "$PYTHON" -m canon_titan.launch.torchrun "${RDZV[@]}" --nproc_per_node "$NGPU" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  -m canon_titan.train --config "$CONFIG" "$@"
