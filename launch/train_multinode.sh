#!/usr/bin/env bash
# Multi-node training with the deepspeed launcher.
#
#   With ssh between nodes (run once, on the first node):
#     launch/train_multinode.sh HOSTFILE CONFIG --run-dir DIR [a.b=c ...]
#   Without ssh (schedulers; run once per node, NODE_RANK 0..N-1, MASTER_ADDR = first node):
#     NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/train_multinode.sh HOSTFILE CONFIG --run-dir DIR ...
# The run directory must be on a filesystem every node sees (every rank writes its checkpoint pieces).
set -euo pipefail
# SIGUSR1 (SLURM's --signal=USR1@SECONDS warning, sent to every process of the step) is for the
# ranks: they save and stop at the next step boundary. Ignored here and so in the launcher this
# script becomes (its default action would end the launcher, and the step with it); each rank
# sets its own handler.
trap '' USR1
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
hostfile="$1"; shift
bin="${LLMTRAIN_VENV:-$root/.venv}/bin"
"$bin/llmtrain" hostfile "$hostfile" >/dev/null   # a bad line stops here, with its number
port="${MASTER_PORT:-29500}"
if [ -n "${NODE_RANK:-}" ]; then
  # This node's launcher itself (what `deepspeed --no_ssh` runs as its child), not the `deepspeed`
  # command: that one dies at once on SIGTERM (it handles signals only for pdsh launches), and a
  # scheduler that sees its task exit (slurmstepd) SIGKILLs the rest of the step, ranks mid-save.
  # deepspeed.launcher.launch stays until its ranks exit (SIGTERM to them, up to 30 s each).
  world_info="$("$bin/python" -m llmtrain.parallel.hostfile --world-info "$hostfile" "$NODE_RANK")"
  exec "$bin/python" -u -m deepspeed.launcher.launch --world_info="$world_info" \
    --master_addr="${MASTER_ADDR:?set MASTER_ADDR to the first node}" --master_port="$port" \
    --node_rank="$NODE_RANK" --module llmtrain.train "$@"
fi
# Over ssh DeepSpeed forwards only PYTHON*/NCCL*/UCX*/MV2*/MLFLOW* variables: llmtrain's own
# (LLMTRAIN_CACHE: where `llmtrain data prepare` put the data) and DS_ACCELERATOR go through its
# env file (DS_ENV_FILE), with the lines of the env files it would have read (~/NAME, ./NAME).
name="${DS_ENV_FILE:-.deepspeed_env}"
envfile="$(mktemp "${TMPDIR:-/tmp}/llmtrain-ds-env.XXXXXX")"
{ for f in "$HOME/$name" "./$name" "$name"; do [ -f "$f" ] && cat "$f"; done
  env | grep -E '^(LLMTRAIN_[A-Z_]*|DS_ACCELERATOR|TORCH_EXTENSIONS_DIR)='
} | awk 'NF && !seen[$0]++' > "$envfile" || true
export DS_ENV_FILE="$envfile"
exec "$bin/deepspeed" --hostfile "$hostfile" --master_port "$port" --module llmtrain.train "$@"
