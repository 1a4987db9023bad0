#!/usr/bin/env bash
# Launch recipes/train.py with torchrun. Arguments are Hydra overrides, passed through:
#   scripts/train.sh training.steps=100 parallel=hsdp
# Environment (defaults in brackets):
#   NPROC [2]          ranks per node
#   NNODES [1]         nodes; >1 uses torchrun's c10d rendezvous at RDZV_ENDPOINT
#   RDZV_ENDPOINT [127.0.0.1:29400]  host:port of the rendezvous (the same on every node)
#   RDZV_ID [hyper_parallel]         job id shared by the nodes of one job
#   MAX_RESTARTS [0]   restart the whole job this many times after a rank fails; the
#                      restarted job resumes from the latest checkpoint by itself
#   RECIPE [recipes/train.py]
#   TORCHRUN [torchrun from .venv if present, else from PATH]
#   DRY_RUN            set: print the torchrun command line instead of running it
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RECIPE=${RECIPE:-recipes/train.py}
if [[ -z "${TORCHRUN:-}" ]]; then
  if [[ -x .venv/bin/torchrun ]]; then TORCHRUN=.venv/bin/torchrun; else TORCHRUN=torchrun; fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ "$NNODES" == 1 && -z "${RDZV_ENDPOINT:-}" ]]; then
  rendezvous=(--standalone)
else
  rendezvous=(--rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT:-127.0.0.1:29400}"
              --rdzv_id="${RDZV_ID:-hyper_parallel}")
fi

if [[ -n "${DRY_RUN:-}" ]]; then  # print the command line (one line, shell-quoted) instead
  printf '%q ' "$TORCHRUN" --nnodes="$NNODES" --nproc_per_node="$NPROC" "${rendezvous[@]}" \
    --max-restarts="$MAX_RESTARTS" "$RECIPE" "$@"; echo; exit 0
fi
exec "$TORCHRUN" --nnodes="$NNODES" --nproc_per_node="$NPROC" "${rendezvous[@]}" \
  --max-restarts="$MAX_RESTARTS" "$RECIPE" "$@"
