#!/usr/bin/env bash
# Multi-node training with the deepspeed launcher.
#
#   With ssh between nodes (run once, on the first node):
#     launch/train_multinode.sh HOSTFILE CONFIG --run-dir DIR [a.b=c ...]
#   Without ssh (schedulers; run once per node, NODE_RANK 0..N-1, MASTER_ADDR = first node):
#     NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/train_multinode.sh HOSTFILE CONFIG --run-dir DIR ...
# The run directory must be on a filesystem every node sees (every rank writes its checkpoint pieces).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
hostfile="$1"; shift
bin="${LLMTRAIN_VENV:-$root/.venv}/bin"
"$bin/llmtrain" hostfile "$hostfile" >/dev/null   # a bad line stops here, with its number
port="${MASTER_PORT:-29500}"
if [ -n "${NODE_RANK:-}" ]; then
  exec "$bin/deepspeed" --hostfile "$hostfile" --no_ssh --node_rank "$NODE_RANK" \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first node}" --master_port "$port" \
    --module llmtrain.train "$@"
fi
exec "$bin/deepspeed" --hostfile "$hostfile" --master_port "$port" --module llmtrain.train "$@"
