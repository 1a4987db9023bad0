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
#   PYTHON [python from .venv if present, else python3]
# The config is checked first (`$RECIPE --check`), so a bad config or a job that cannot fit in
# memory fails with one line before torchrun starts any rank. A SIGTERM sent to this script
# goes to the training ranks, which save a final checkpoint and exit 0; the script then exits 0.
# (torchrun itself, when it gets a SIGTERM, stops its workers the same way but exits 1.)
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RECIPE=${RECIPE:-recipes/train.py}
if [[ -z "${TORCHRUN:-}" ]]; then
  if [[ -x .venv/bin/torchrun ]]; then TORCHRUN=.venv/bin/torchrun; else TORCHRUN=torchrun; fi
fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# (An elastic NNODES=MIN:MAX is checked at MAX nodes.)
RANK=0 WORLD_SIZE=$((NPROC * ${NNODES##*:})) LOCAL_WORLD_SIZE=$NPROC "$PYTHON" "$RECIPE" --check "$@" >/dev/null
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
# In the background so that this shell can take SIGTERM meanwhile. (Background commands start
# with SIGINT ignored; torchrun installs its own handler before it starts the ranks.)
"$TORCHRUN" --nnodes="$NNODES" --nproc_per_node="$NPROC" "${rendezvous[@]}" \
  --max-restarts="$MAX_RESTARTS" "$RECIPE" "$@" &
agent=$!

# SIGTERM goes to the ranks (torchrun's children), not to torchrun: they agree to stop at the
# next step boundary, save, and exit 0, so torchrun exits 0 too. Before the ranks exist, and
# for SIGINT, the signal goes to torchrun.
forward() {
  local workers=""
  if [[ "$1" == TERM ]]; then workers=$(cat /proc/"$agent"/task/*/children 2>/dev/null || true); fi
  # shellcheck disable=SC2086
  if [[ -n "$workers" ]]; then kill -TERM $workers 2>/dev/null || true; else kill "-$1" "$agent" 2>/dev/null || true; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
status=0
while true; do
  wait "$agent" && status=0 || status=$?
  kill -0 "$agent" 2>/dev/null || break  # wait returned for a trapped signal: torchrun still runs
done
exit "$status"
