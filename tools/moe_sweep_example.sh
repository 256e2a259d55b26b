#!/usr/bin/env bash
# MoE scaling on CPU at tiny scale: plan runs of the debug MoE family with E in {1, 4, 16} experts
# at two fixed active sizes and two compute budgets, train them on the embedded corpus, collect
# the final losses and fit the joint law of Ludziejewski et al. (2025) with bootstrap intervals.
# gamma and zeta (how E bends the N and D exponents) are held at the published values: 12 runs
# cannot identify them. Prints the predicted loss against E at the runs' median size and tokens.
#   tools/moe_sweep_example.sh [OUT_DIR]     (default runs/moe_sweep_example; finished runs kept)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/runs/moe_sweep_example}"
bin="${LLMTRAIN_VENV:-$root/.venv}/bin"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" TOKENIZERS_PARALLELISM=false
start=$(date +%s)
[ -f "$out/manifest.json" ] || "$bin/llmtrain" scaling sweep plan --budgets 3e11 1e12 \
  --family "$root/configs/families/debug_moe_family.yaml" --out "$out" \
  --experts 1 4 16 --active 5e4 1.5e5
"$bin/llmtrain" scaling sweep run "$out"
"$bin/llmtrain" scaling sweep collect "$out"
"$bin/llmtrain" scaling fit "$out/results.csv" --law moe-joint --fix gamma zeta --bootstrap 200 \
  --plot "$out/loss_vs_experts.png" --out "$out/fit.json"
echo "MoE sweep end to end: $(( $(date +%s) - start )) s"
