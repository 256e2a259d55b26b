#!/usr/bin/env bash
# One-GPU check of llmtrain, in under 8 minutes: set-up, tests/gpu, and the training benchmark
# (tokens/s, MFU against the GPU's dense bf16 peak, peak memory) for configs/moe_100m.yaml and
# configs/moe_1b.yaml, and a kernel profile of the 1B model's step. Every step has a timeout and
# the whole run a budget; a summary table is printed at the end and everything is written under
# $OUT (default ./gpu_check_out).
#
#   bash launch/gpu_check.sh --prepare-wheels   # on a machine WITH a package registry: puts
#                                               # DeepSpeed and its missing deps into .whl/
#   bash launch/gpu_check.sh                    # on the GPU machine (offline is fine)
#
# The GPU machine is expected to hold python3 with a CUDA torch (no DeepSpeed, no flash-attn).
# Set-up installs .whl/*.whl (carried with the repo) into /tmp/llmtrain-site, else tries pip
# (for machines that reach a registry). flash-attn is optional: its tests skip without it.
# Device tool: run(command="bash launch/gpu_check.sh", timeout_s=560, carry=[".whl"]) after
# --prepare-wheels here; files come back from $OUT (6 files).
# Environment: OUT, PYTHON (default python3), GPU_CHECK_BUDGET (seconds, default 480),
# BENCH_STEPS (default 30), GPU_CHECK_SKIP (step names to leave out on a rerun, e.g.
# "bench_moe_1b bench_moe_100m"; steps: setup prepare_data bench_moe_1b bench_moe_100m tests_gpu
# profile_moe_1b; a rerun usually lands on a fresh machine, so keep setup and prepare_data).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS="hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions"
DS_VERSION=0.19.8
export PY WHEELS DS_VERSION

if [[ "${1:-}" == "--prepare-wheels" ]]; then
  mkdir -p .whl && rm -f .whl/*.whl
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps "${plat[@]}" -d .whl $WHEELS || exit 1
  $PY -m pip wheel -q --no-deps -w .whl "deepspeed==$DS_VERSION" || exit 1  # pure Python
  ls -la .whl
  echo "now run on the GPU machine with .whl carried: bash launch/gpu_check.sh"
  exit 0
fi

OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
BUDGET=${GPU_CHECK_BUDGET:-480}
STEPS=${BENCH_STEPS:-30}
T0=$(date +%s)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export LLMTRAIN_CACHE=${LLMTRAIN_CACHE:-/tmp/llmtrain-cache} DS_ACCELERATOR=cuda
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/llmtrain-inductor}
NAMES=() RCS=() SECS=()

# step NAME LIMIT_S CMD...: run with min(LIMIT, what is left of the budget) seconds; log it.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - T0)))
  ((left < limit)) && limit=$left
  local s rc
  s=$(date +%s)
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    rc=skip
    echo "=== $name: skipped (GPU_CHECK_SKIP)" | tee -a "$LOG"
  elif ((limit < 10)); then
    rc=skip
    echo "=== $name: skipped, budget spent" | tee -a "$LOG"
  else
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    if declare -F "$1" >/dev/null; then  # a function of this script: run it in a bash child
      timeout --kill-after=15 "$limit" bash -c "$(declare -f "$1"); $*" 2>&1 | tee -a "$LOG" | tail -n 40
    else
      timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
    fi
    rc=${PIPESTATUS[0]}
    ((rc == 124 || rc == 137)) && rc="timeout"
  fi
  NAMES+=("$name") RCS+=("$rc") SECS+=($(($(date +%s) - s)))
  echo "=== $name: rc=$rc in $(($(date +%s) - s))s" | tee -a "$LOG"
}

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  $PY - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
  [[ $? -eq 0 ]] || return 1
  if ! $PY -c "import deepspeed" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/llmtrain-site .whl/*.whl || return 1
    else
      # shellcheck disable=SC2086
      timeout 120 $PY -m pip install -q --target /tmp/llmtrain-site --no-deps \
        "deepspeed==$DS_VERSION" $WHEELS || return 1
    fi
  fi
  $PY - <<'EOF'
import importlib.util, deepspeed, torch
print("deepspeed", deepspeed.__version__, "accelerator", deepspeed.get_accelerator().device_name())
print("flash_attn", importlib.util.find_spec("flash_attn") is not None)
print("flex_attention", importlib.util.find_spec("torch.nn.attention.flex_attention") is not None)
EOF
}

prepare() {  # tokenize the built-in corpus once for the tests (debug) and benchmarks (32k vocab)
  $PY - <<'EOF'
import time
from llmtrain.config import load_config
from llmtrain.data.prepare import prepare_data
# the data section is part of the cache key: debug as tests/gpu run it, the 32k one as the benchmarks
for path, over in (("configs/debug.yaml", ["data.doc_mask=true"]), ("configs/moe_1b.yaml", [])):
    t = time.time()
    c = load_config(path, over)
    print(path, prepare_data(c.data, c.model.vocab_size), f"{time.time() - t:.0f}s", flush=True)
EOF
}

if [[ -d /tmp/llmtrain-site ]] || ! $PY -c "import deepspeed" 2>/dev/null; then
  export PYTHONPATH=$PYTHONPATH:/tmp/llmtrain-site  # after the image's own packages
fi
# Order: the MFU figures first, then correctness (-v: each result is logged as it finishes, should
# the step run out of time), then the profile.
step setup 120 setup
step prepare_data 120 prepare
step bench_moe_1b 130 $PY benchmarks/gpu_train.py --config configs/moe_1b.yaml \
  --steps "$STEPS" --name moe_1b --timeout 120 --out "$OUT/gpu_train_moe_1b.json"
step bench_moe_100m 90 $PY benchmarks/gpu_train.py --config configs/moe_100m.yaml \
  --steps "$STEPS" --name moe_100m --timeout 80 --out "$OUT/gpu_train_moe_100m.json"
step tests_gpu 270 $PY -m pytest tests/gpu -v -rA -p no:cacheprovider --junitxml="$OUT/tests_gpu.xml"
step profile_moe_1b 60 $PY benchmarks/gpu_profile.py --config configs/moe_1b.yaml \
  --out "$OUT/gpu_profile_moe_1b.txt"

echo
echo "================ gpu_check summary ($(($(date +%s) - T0))s of ${BUDGET}s budget) ================"
printf "%-16s %-8s %6s\n" step rc seconds
fail=0
for i in "${!NAMES[@]}"; do
  printf "%-16s %-8s %6s\n" "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
  [[ "${RCS[$i]}" == "0" || "${RCS[$i]}" == "skip" ]] || fail=1
done
$PY - "$OUT" <<'EOF' || true
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
x = out / "tests_gpu.xml"
if x.exists():
    print("\ntests/gpu:")
    for tc in ET.parse(x).getroot().iter("testcase"):
        state = "passed"
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                state = f"{kind}: {(el.get('message') or '')[:90]}"
        print(f"  {tc.get('name'):<58} {state}")
rows = []
for f in sorted(out.glob("gpu_train_*.json")):
    r = json.loads(f.read_text())
    rows.append(r)
if rows:
    print(f"\n{'config':<10} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'rc':>7}")
    for r in rows:
        tok, tf, mfu, mem = (r.get(k) for k in ("tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib"))
        fmt = lambda v, s: s.format(v) if isinstance(v, (int, float)) else "-"
        print(f"{r['name']:<10} {fmt(tok, '{:>10.0f}')} {fmt(tf, '{:>8.1f}')} "
              f"{fmt(mfu, '{:>6.1%}')} {fmt(mem, '{:>9.1f}')} {str(r.get('returncode')):>7}")
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
EOF
echo "log: $LOG"
exit $fail
