#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv, torch==2.13.0 (CPU)
# first so nothing pulls a CUDA build, then this package with its test tools.
# Usage: launch/setup.sh            (re-running does nothing when all is in place)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LLMTRAIN_VENV:-$root/.venv}"
stamp="$venv/.llmtrain-setup"
want="$(sha1sum "$root/pyproject.toml" "$root/launch/setup.sh" | sha1sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# 1. torch pinned first, the CPU build: PyPI's torch for Linux is the CUDA one (several GB of
#    nvidia-* packages). A wheel on disk (pip's find-links) is taken without the network; else
#    the CPU build from PyTorch's index; LLMTRAIN_TORCH_INDEX picks another index (a CUDA one on
#    a GPU machine). Then its dependencies, with numpy in the same step: torch imported before
#    numpy exists warns "Failed to initialize NumPy".
torch_spec="torch==${LLMTRAIN_TORCH:-2.13.0}"
if [ -n "${LLMTRAIN_TORCH_INDEX:-}" ]; then
  "${pip[@]}" --no-deps --index-url "$LLMTRAIN_TORCH_INDEX" "$torch_spec"
elif ! "${pip[@]}" --no-deps --no-index "$torch_spec" 2>/dev/null; then
  "${pip[@]}" --no-deps --index-url https://download.pytorch.org/whl/cpu "$torch_spec"
fi
"${pip[@]}" "$torch_spec" numpy
# 2. the package and its tools, with torch held where it is.
echo "torch==$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')" > "$venv/torch-pin.txt"
"${pip[@]}" -c "$venv/torch-pin.txt" -e "$root[dev,train,eval]" "transformers==5.24.0"
"$venv/bin/python" -m llmtrain.parallel.ops --build  # 3. DeepSpeed's CPU ops now, not mid-run
echo "$want" > "$stamp"
