#!/usr/bin/env bash
# CPU quickstart from nothing: set up .venv, then show the debug model's accounting and check it
# against stock transformers.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
py="${LLMTRAIN_VENV:-$root/.venv}/bin"
"$py/llmtrain" count configs/debug.yaml
