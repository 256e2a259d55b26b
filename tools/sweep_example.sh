#!/usr/bin/env bash
# End to end on CPU at tiny scale: plan an IsoFLOP sweep of the debug family (3 budgets, up to 5
# sizes each: 12 runs, enough for Approach 3), train every run, collect final losses, fit, plot.
#   tools/sweep_example.sh [OUT_DIR]        (default runs/sweep_example; finished runs are kept)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/runs/sweep_example}"
bin="${LLMTRAIN_VENV:-$root/.venv}/bin"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" TOKENIZERS_PARALLELISM=false
start=$(date +%s)
[ -f "$out/manifest.json" ] || "$bin/llmtrain" scaling sweep plan --budgets 3e11 1e12 3e12 \
  --family "$root/configs/families/debug_family.yaml" --out "$out" --sizes 5 --spread 8 --center-factor 0.5
"$bin/llmtrain" scaling sweep run "$out"
"$bin/llmtrain" scaling sweep collect "$out"
"$bin/llmtrain" scaling fit "$out/results.csv" --approach all --bootstrap 200 --plot "$out/fit.png" --out "$out/fit.json"
echo "sweep end to end: $(( $(date +%s) - start )) s"
