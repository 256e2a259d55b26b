#!/usr/bin/env bash
# One-GPU check of llmtrain, in under 8 minutes: set-up, tests/gpu, and the training benchmark
# (tokens/s, MFU against the GPU's dense bf16 peak, peak memory) for configs/moe_1b.yaml and
# configs/moe_100m.yaml with train.compile=true (the 1B run with a profile of one trainer step:
# GPU time by kernel kind, how busy the GPU was), configs/moe_1b_wide.yaml (the same parameters at
# width 2048), the 1B one again with CUDA graphs (train.compile_mode=reduce-overhead: what the
# host's launch overhead costs), and the step's kernels timed one by one at the 1B shapes (the
# device's matmul and copy ceilings, every weight matmul, the attention kernels: which one
# attn_backend should take, and the MFU bound that those kernels leave). Every step
# has a timeout and the whole run a budget; a summary table is printed at the end and
# everything is written under $OUT (default ./gpu_check_out).
#
#   bash launch/gpu_check.sh --prepare-wheels   # on a machine WITH a package registry: puts
#                                               # DeepSpeed and its missing deps into .whl/
#   bash launch/gpu_check.sh                    # on the GPU machine (offline is fine)
#
# The GPU machine is expected to hold python3 with a CUDA torch (no DeepSpeed, no flash-attn).
# Set-up installs what the image lacks from .whl/ (carried with the repo; unzipped where the image
# has no pip) into $GPU_CHECK_SITE (default /tmp/llmtrain-site), else tries pip (for machines that
# reach a registry). flash-attn is optional: its tests skip without it.
# Device tool: run(command="bash launch/gpu_check.sh", timeout_s=560, carry=[".whl"]) after
# --prepare-wheels here; files come back from $OUT (8 files, as many as the device tool returns).
# A session has 15 device minutes, a machine's start included: after a full first run about 5
# are left, so the rerun (a fresh machine) gets GPU_CHECK_BUDGET=180 and GPU_CHECK_SKIP naming
# the benchmark and test steps that passed (set-up and data run again), with timeout_s=240.
# Environment: OUT, PYTHON (default python3), GPU_CHECK_BUDGET (seconds, default 480),
# BENCH_STEPS (default 20; the 1B runs: BENCH_STEPS_1B, default 8, at BENCH_GBS_1B sequences a
# step, default 256 as in configs/moe_1b.yaml, and BENCH_MICRO_1B a micro-batch, default 16 as
# there), GPU_CHECK_SKIP (step names to leave out on a
# rerun, e.g. "bench_moe_1b bench_moe_100m"; steps: setup prepare_data bench_moe_1b tests_gpu
# tests_gpu_train bench_moe_100m bench_moe_1b_wide bench_moe_1b_graphs kernels; a rerun usually lands
# on a fresh machine, so keep setup and prepare_data). GPU_CHECK_CPU_SMOKE=1 runs every step here on CPU with the debug config and a
# few steps, to check this script itself (tests/test_gpu_check.py); its figures mean nothing.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
# What llmtrain, DeepSpeed and pytest import that a bare CUDA-torch image may lack, pinned to the
# versions tested here (pydantic and pydantic-core must match). Set-up installs only the missing.
WHEELS="hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 PyYAML==6.0.4 numpy==2.4.6 tokenizers==0.23.3
tqdm==4.70.1 packaging==26.4 psutil==7.2.2 einops==0.8.2 msgpack==1.2.4 pytest==9.2.0
iniconfig==2.3.1 pluggy==1.7.0 Pygments==2.21.0"
DS_VERSION=0.19.8
export PY WHEELS DS_VERSION

if [[ "${1:-}" == "--prepare-wheels" ]]; then
  mkdir -p .whl && rm -f .whl/*.whl
  for pyv in 3.11 3.12; do  # binary wheels for either Python the image may have (x86_64)
    plat=(--only-binary=:all: --python-version "$pyv" --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
    # shellcheck disable=SC2086
    $PY -m pip download -q --no-deps "${plat[@]}" -d .whl $WHEELS || exit 1
  done
  $PY -m pip wheel -q --no-deps -w .whl "deepspeed==$DS_VERSION" || exit 1  # pure Python
  ls -la .whl && du -sh .whl
  echo "now run on the GPU machine with .whl carried: bash launch/gpu_check.sh"
  exit 0
fi

OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
BUDGET=${GPU_CHECK_BUDGET:-480}
STEPS=${BENCH_STEPS:-20}
T0=$(date +%s)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export LLMTRAIN_CACHE=${LLMTRAIN_CACHE:-/tmp/llmtrain-cache} DS_ACCELERATOR=cuda
export SITE=${GPU_CHECK_SITE:-/tmp/llmtrain-site}  # where set-up installs what the image lacks
export LLMTRAIN_TRACEBACK=1  # a bug's traceback in the log, not only its one line
SMOKE=${GPU_CHECK_CPU_SMOKE:-0}
export SMOKE
# what the benchmarks run: the real configs, or (CPU smoke) the debug one for a few short steps
CFG_1B=configs/moe_1b.yaml CFG_100M=configs/moe_100m.yaml CFG_WIDE=configs/moe_1b_wide.yaml
COMPILE=(--compile) SMALL=() PSMALL=()
WARMUP=6  # leading benchmark steps left out of the medians (compilation, allocator growth)
GBS_1B=${BENCH_GBS_1B:-256} STEPS_1B=${BENCH_STEPS_1B:-8} WARMUP_1B=3  # the 1B runs' batch
MICRO_1B=${BENCH_MICRO_1B:-16}
STEPS_1B_WIDE=6 STEPS_1B_GRAPHS=5 WARMUP_SHORT=2
GRAPHS=(--compile train.compile_mode=reduce-overhead)
export CFG_1B
if [[ $SMOKE == 1 ]]; then
  export DS_ACCELERATOR=cpu
  CFG_1B=configs/debug.yaml CFG_100M=configs/debug.yaml CFG_WIDE=configs/debug.yaml COMPILE=()
  STEPS=3 WARMUP=1
  STEPS_1B=3 WARMUP_1B=0 GBS_1B=8 MICRO_1B=4  # no warm-up: the last step is profiled, 2 left
  STEPS_1B_WIDE=3 STEPS_1B_GRAPHS=3 WARMUP_SHORT=0
  GRAPHS=(--warmup "$WARMUP_1B")  # an option after the overrides, as on a GPU
  SMALL=(--cpu train.seq_len=64 train.global_batch_size=8 train.micro_batch_size=4)
  PSMALL=(--cpu --micro 2 --seq 64 --steps 1)
fi
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
  elif ((limit < ${MIN:-10})); then  # MIN=...: below that, a clipped run could not finish
    rc=no-time  # not run for want of budget: the check is incomplete, so it fails ...
    [[ -n ${OPTIONAL:-} ]] && rc=no-time-optional  # ... unless the step is a diagnostic
    echo "=== $name: skipped, ${limit}s of budget left (needs ${MIN:-10}s)" | tee -a "$LOG"
  else
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    export STEP_LIMIT=$limit  # the benchmarks stop themselves before this, to write their JSON
    # SIG=INT for pytest: interrupted, it still writes its junit XML (TERM would lose it)
    if declare -F "$1" >/dev/null; then  # a function of this script: run it in a bash child
      timeout -s "${SIG:-TERM}" --kill-after=15 "$limit" bash -c "$(declare -f); $*" 2>&1 |
        tee -a "$LOG" | tail -n 40
    else
      timeout -s "${SIG:-TERM}" --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
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
import os, platform, shutil, sys, sysconfig, torch
print("python", sys.version.split()[0], platform.machine(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "cpus", os.cpu_count())
# Triton (torch.compile, FlexAttention) builds its launcher with a C compiler and Python.h
inc = os.path.join(sysconfig.get_paths()["include"], "Python.h")
print("cc", shutil.which("gcc") or shutil.which("cc"), "Python.h", os.path.exists(inc))
assert torch.cuda.is_available() or os.environ["SMOKE"] == "1", "torch sees no CUDA device"
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
  [[ $? -eq 0 ]] || return 1
  # the wheels whose module is missing (or, for DeepSpeed, another version than the tested one)
  local need
  need=$($PY - <<'EOF'
import importlib.metadata as md, importlib.util, os
mods = {"hjson": "hjson", "pydantic": "pydantic", "pydantic-core": "pydantic_core",
        "annotated-types": "annotated_types", "typing-inspection": "typing_inspection",
        "typing-extensions": "typing_extensions", "PyYAML": "yaml", "numpy": "numpy",
        "tokenizers": "tokenizers", "tqdm": "tqdm", "packaging": "packaging", "psutil": "psutil",
        "einops": "einops", "msgpack": "msgpack", "pytest": "pytest", "iniconfig": "iniconfig",
        "pluggy": "pluggy", "Pygments": "pygments"}
wheels = os.environ["WHEELS"].split()
# DeepSpeed's config stack must be the tested versions (pydantic and its core must match each
# other; an image's pydantic v1 or older typing_extensions would break it): ours shadow the image's
exact = {"hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
         "typing-extensions"}
def present(w):
    name, version = w.split("==")
    if importlib.util.find_spec(mods[name]) is None:
        return False
    try:
        return name not in exact or md.version(name) == version
    except md.PackageNotFoundError:
        return False
need = [w for w in wheels if not present(w)]
try:
    ok = md.version("deepspeed") == os.environ["DS_VERSION"]
except md.PackageNotFoundError:
    ok = False
print(" ".join(need + ([] if ok else ["deepspeed==" + os.environ["DS_VERSION"]])))
EOF
)
  echo "to install into $SITE: ${need:-nothing}"
  if [[ -n $need ]]; then
    if ls .whl/*.whl >/dev/null 2>&1 && ! $PY -m pip --version >/dev/null 2>&1; then
      unpack_wheels $need || return 1  # an image without pip: a wheel is a zip file
    elif ls .whl/*.whl >/dev/null 2>&1; then
      # shellcheck disable=SC2086
      $PY -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" $need || return 1
    else
      # shellcheck disable=SC2086
      timeout 120 $PY -m pip install -q --target "$SITE" --no-deps $need || return 1
    fi
  fi
  $PY - <<'EOF'
import importlib.util, deepspeed, torch, yaml, numpy, tokenizers, pytest
import llmtrain.cli, llmtrain.train.loop  # everything the steps import at start
print("deepspeed", deepspeed.__version__, "accelerator", deepspeed.get_accelerator().device_name())
print("flash_attn", importlib.util.find_spec("flash_attn") is not None)
print("flex_attention", importlib.util.find_spec("torch.nn.attention.flex_attention") is not None)
EOF
}

unpack_wheels() {  # NAME==VERSION...: unzip the matching .whl/ files for this Python
  $PY - "$@" <<'EOF'
import glob, os, re, sys, zipfile
tag = "cp%d%d" % sys.version_info[:2]
for spec in sys.argv[1:]:
    name, version = spec.split("==")
    norm = re.sub(r"[-_.]+", "_", name).lower()
    files = [f for f in glob.glob(f".whl/*-{version}-*.whl")
             if re.sub(r"[-_.]+", "_", os.path.basename(f).split("-")[0]).lower() == norm]
    ok = [f for f in files if f"-{tag}-" in f or "-abi3-" in f or "-none-any" in f]
    if not ok:
        sys.exit(f"no wheel of {spec} for {tag} in .whl/ (run --prepare-wheels for this Python)")
    zipfile.ZipFile(ok[0]).extractall(os.environ["SITE"])
    print("unpacked", os.path.basename(ok[0]))
EOF
}

prepare() {  # tokenize the built-in corpus once for the tests (debug) and benchmarks (32k vocab)
  # through the CLI, not `python - <<EOF`: the tokenizer's worker processes are spawned, and a
  # spawned child re-imports its parent's main script, which stdin is not (they die; it hangs)
  # the data section is part of the cache key: debug as tests/gpu run it, the benchmarks' config
  $PY -m llmtrain.cli data prepare configs/debug.yaml data.doc_mask=true || return 1
  $PY -m llmtrain.cli data prepare "$CFG_1B"
}

# before the image's site-packages; set-up puts there only what the image lacks (and DeepSpeed
# 0.19.8 should the image hold another version)
export PYTHONPATH=$PYTHONPATH:$SITE
# Order, most wanted first, as one run is likely all a session's device minutes allow (a fresh
# machine's start counts): the MFU figure (compiled: should compilation fail, gpu_train.py
# reruns eager and says so), the 1B run with CUDA graphs (whether the host's kernel launches
# hold the GPU back; loss curves compared), then correctness in two steps (-v: each result is
# logged as it finishes, should the step run out of time): the kernel tests, then the training
# ones (bf16 vs fp32, NCCL save/resume); then the 100M figure, the wide 1B figure, and last the
# kernels timed one by one (they bound the MFU and decide attn_backend; measured in session 19
# at micro-batch 8, so the least wanted now).
# The bare model's kernel profile (benchmarks/gpu_profile.py) is left to manual runs:
# the trainer step's profile says as much, and 8 files come back. A step with less budget
# left than it needs to finish is skipped, not run; a rerun skips the steps that passed.
step setup 120 setup
step prepare_data 120 prepare
# the 1B runs at the config's own batch (256 x 2048 tokens, 16 micro-batches of 16 a step), as
# its training would: the optimizer step is then 1/16 of the step's work, not 1/4 (the
# benchmark's default of 32 sequences in micro-batches of 8); 8 such steps are 3.2x the tokens
# of 20 small ones (the wide and CUDA-graph runs take 6 and 5, 2 of them warm-up, and compile
# afresh: limits of 120 and 150 s).
# The compiled run's last
# step is profiled inside the trainer (DeepSpeed engine, optimizer, data: what the bare-model
# profile leaves out), out of the medians; its summary lands in the JSON
MIN=100 step bench_moe_1b 200 $PY benchmarks/gpu_train.py --config $CFG_1B "${COMPILE[@]}" \
  --profile --steps "$STEPS_1B" --warmup "$WARMUP_1B" --name moe_1b --out "$OUT/gpu_train_moe_1b.json" \
  "${SMALL[@]}" "train.global_batch_size=$GBS_1B" "train.micro_batch_size=$MICRO_1B"
# CUDA graphs right after: the goal's likeliest route, while Inductor's cache is warm (the
# mode still compiles its own graphs: ~150 s with start-up, never measured before)
MIN=90 step bench_moe_1b_graphs 150 $PY benchmarks/gpu_train.py --config $CFG_1B \
  --steps "$STEPS_1B_GRAPHS" --warmup "$WARMUP_SHORT" --name moe_1b_graphs \
  --out "$OUT/gpu_train_moe_1b_graphs.json" "${SMALL[@]}" "train.global_batch_size=$GBS_1B" \
  "train.micro_batch_size=$MICRO_1B" "${GRAPHS[@]}"
SIG=INT MIN=30 step tests_gpu 120 $PY -m pytest -v -rA -p no:cacheprovider \
  --junitxml="$OUT/tests_gpu.xml" tests/gpu/test_kernels_gpu.py tests/gpu/test_comm_gpu.py \
  tests/gpu/test_attention_gpu.py
SIG=INT MIN=60 step tests_gpu_train 200 $PY -m pytest -v -rA -p no:cacheprovider \
  --junitxml="$OUT/tests_gpu_train.xml" tests/gpu/test_bf16_gpu.py tests/gpu/test_resume_gpu.py
MIN=70 step bench_moe_100m 110 $PY benchmarks/gpu_train.py --config $CFG_100M "${COMPILE[@]}" \
  --steps "$STEPS" --warmup "$WARMUP" --name moe_100m --out "$OUT/gpu_train_moe_100m.json" \
  "${SMALL[@]}"
MIN=80 step bench_moe_1b_wide 120 $PY benchmarks/gpu_train.py --config $CFG_WIDE "${COMPILE[@]}" \
  --steps "$STEPS_1B_WIDE" --warmup "$WARMUP_SHORT" --name moe_1b_wide \
  --out "$OUT/gpu_train_moe_1b_wide.json" "${SMALL[@]}" "train.global_batch_size=$GBS_1B" \
  "train.micro_batch_size=$MICRO_1B"
# (optional: should the budget not reach it, the check still passes and says so; up to 120 s,
# clipped to the budget left: the FlexAttention rows start only with 60 s to spare)
OPTIONAL=1 MIN=25 step kernels 120 $PY benchmarks/gpu_profile.py --config $CFG_1B --kernels \
  --micro "$MICRO_1B" --out "$OUT/gpu_kernels_moe_1b.txt" "${PSMALL[@]}"

echo
echo "================ gpu_check summary ($(($(date +%s) - T0))s of ${BUDGET}s budget) ================"
printf "%-20s %-8s %6s\n" step rc seconds
fail=0 passed=()
for i in "${!NAMES[@]}"; do
  printf "%-20s %-8s %6s\n" "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
  # skip: GPU_CHECK_SKIP; no-time-optional: a diagnostic step the budget did not reach
  [[ "${RCS[$i]}" =~ ^(0|skip|no-time-optional)$ ]] || fail=1
  # what a rerun may leave out: set-up and data run again (a rerun gets a fresh machine)
  [[ "${NAMES[$i]}" != setup && "${NAMES[$i]}" != prepare_data ]] &&
    [[ "${RCS[$i]}" == "0" || "${RCS[$i]}" == "skip" ]] && passed+=("${NAMES[$i]}")
done
$PY - "$OUT" <<'EOF' || true
import json, re, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
a = out / "gpu_kernels_moe_1b.txt"
bound = None
if a.exists():
    text = a.read_text().rstrip()
    print("\n" + text)
    m = re.search(r"MFU <= ([\d.e+-]+)%", text)
    bound = float(m.group(1)) / 100 if m else None
def cases(x):  # a step killed while writing leaves a cut file: said, and the rest printed
    try:
        return list(ET.parse(x).getroot().iter("testcase"))
    except ET.ParseError as e:
        print(f"  {x.name} is unreadable ({e}): its step was cut short")
        return []
xs = [x for x in (out / "tests_gpu.xml", out / "tests_gpu_train.xml") if x.exists()]
if xs:
    print("\ntests/gpu:")
    for tc in (tc for x in xs for tc in cases(x)):
        state = "passed"
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                state = f"{kind}: {(el.get('message') or '')[:90]}"
        print(f"  {tc.get('name'):<58} {state}")
rows = []
for f in sorted(out.glob("gpu_train_*.json")):
    try:
        rows.append(json.loads(f.read_text()))
    except ValueError as e:
        print(f"{f.name} is unreadable ({e}): its run was cut short")
if rows:
    # loss at the first and last step: the two 1B runs see the same data and seed
    print(f"\n{'run':<14} {'compile':>15} {'seq/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'peak GiB':>9} {'rc':>7}  loss first -> last")
    for r in rows:
        tok, tf, mfu, mem = (r.get(k) for k in ("tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib"))
        fmt = lambda v, s: s.format(v) if isinstance(v, (int, float)) else "-"
        first, last = (r.get("loss_first_last") or [None, None])[:2]
        print(f"{r['name']:<14} {str(r.get('compile_mode') or r.get('compile')):>15} {str(r.get('sequences_per_step', '-')):>8} {fmt(tok, '{:>10.0f}')} {fmt(tf, '{:>8.1f}')} "
              f"{fmt(mfu, '{:>6.1%}')} {fmt(mem, '{:>9.1f}')} {str(r.get('returncode')):>7}  "
              f"{fmt(first, '{:.4f}')} -> {fmt(last, '{:.4f}')}")
        if r.get("predicted_memory_gib"):  # llmtrain count's peak, less the CUDA context
            print(f"  peak memory predicted {r['predicted_memory_gib']:.2f} GiB, measured/predicted "
                  f"{r.get('measured_over_predicted', '-')}")
        cs = r.get("compile_stats") or {}
        if cs:  # graph breaks split blocks; CUDA-graph skips run a graph mode without graphs
            print(f"  torch.compile: {cs.get('graphs')} graphs, {cs.get('graph_breaks')} breaks, "
                  f"{cs.get('cudagraph_skips')} CUDA-graph skips")
        if r.get("compile_error"):
            print(f"  compile failed, ran eager: {r['compile_error'].strip().splitlines()[-1][:120]}")
    by = {r["name"]: r for r in rows}
    sp = by.get("moe_1b", {}).get("step_profile")
    if sp:  # where a whole trainer step's time goes, next to the bare model's forward + backward
        print("moe_1b trainer step profile: " + "\n  ".join(sp.splitlines()[:2]))
    c, e = by.get("moe_1b", {}), by.get("moe_1b_graphs", {})
    if bound and isinstance(c.get("mfu"), (int, float)):  # how far the step is from its kernels
        print(f"moe_1b MFU {100 * c['mfu']:.3g}% against the kernels' bound {100 * bound:.3g}%: "
              f"{c['mfu'] / bound:.0%} of it (the rest: kernels other than matmul and attention, "
              f"gaps, the optimizer)")
    a, b = c.get("losses") or [], e.get("losses") or []
    if c.get("compile_error") or e.get("compile_error"):
        print("moe_1b compiled vs CUDA graphs: no comparison, a compiled run fell back to eager")
    elif a and b:  # the same data, seed and kernels: replayed graphs should train alike
        d = max(abs(x - y) for x, y in zip(a, b))
        print(f"moe_1b compiled vs CUDA graphs: max |loss difference| {d:.4f} over "
              f"{min(len(a), len(b))} steps")
EOF
echo "log: $LOG"
if ((fail)); then  # after fixing what failed: run only the rest, within the device time left
  echo "rerun the rest: GPU_CHECK_BUDGET=180 GPU_CHECK_SKIP=\"${passed[*]}\" bash launch/gpu_check.sh"
fi
exit $fail
