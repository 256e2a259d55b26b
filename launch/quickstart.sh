#!/usr/bin/env bash
# CPU quickstart from nothing: set up .venv, then train the debug MoE model (MLA + DeepSeekMoE)
# on the embedded corpus (this Python's standard library sources) on CPU, with a progress line,
# validation loss against the data's unigram entropy, a checkpoint and a generated sample; then
# export it to the Hugging Face layout and check it against stock transformers.
#   launch/quickstart.sh [a.b=c ...]      (re-running starts the run over)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
bin="${LLMTRAIN_VENV:-$root/.venv}/bin"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" TOKENIZERS_PARALLELISM=false
run="${LLMTRAIN_RUN_DIR:-$root/runs/quickstart}"
"$bin/llmtrain" count configs/debug.yaml | sed -n 1,4p  # sed reads it all: no closed pipe
"$bin/llmtrain" train configs/debug.yaml --run-dir "$run" --overwrite train.max_steps=1200 "$@"
"$bin/llmtrain" export "$run" --out "$run/hf" --dtype fp32 --overwrite
echo "run directory: $run (metrics.jsonl, tensorboard/, checkpoints/, sample.txt, hf/ for transformers)"
