"""One GPU: tokens/s, MFU and peak memory of `llmtrain train` in bf16.

    python benchmarks/gpu_train.py [--config configs/moe_100m.yaml] [--steps 30] [--name N]
                                   [--compile] [--timeout 240] [--out FILE.json] [a.b=c ...]

Runs the real trainer (DeepSpeed engine, ZeRO-1, fused AdamW) for `--steps` optimizer steps of
32 x 2048 tokens (8 per micro-batch; `train.global_batch_size=256` to run a config's own batch)
on the built-in corpus, drops the first `--warmup` steps (compilation, allocator growth) and
reports medians over the rest. MFU is against the GPU's dense bf16 peak
(llmtrain.train.metrics: 989 TFLOP/s for H100/H200) with the trainer's FLOPs per token (6 x
active matmul parameters + attention). Writes JSON to --out, else $OUT/gpu_train_<name>.json
when $OUT is set, else benchmarks/results/. Needs CUDA; exits 2 without it.

--profile profiles the last step inside the trainer (`train.profile_step`: GPU time by kernel
kind, top ops by GPU and host time) into the JSON's "step_profile", and leaves it out of the
medians.

--compile runs with train.compile=true (torch.compile of each block; the compilation falls in the
warm-up steps). Should that run fail before its first step, the benchmark reruns eager in the
time left, so a figure still comes back, and records why in "compile_error".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T_START = time.monotonic()  # before torch's import, which takes seconds on a fresh machine


def _default_out(name: str) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"gpu_train_{name}.json"
    return ROOT / "benchmarks" / "results" / f"gpu_train_{name}.json"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "moe_100m.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8, help="leading steps left out of the medians")
    ap.add_argument("--name", default="")
    # launch/gpu_check.sh's step limit, less a margin for writing the JSON after a timeout
    limit = float(os.environ.get("STEP_LIMIT", 0)) - 20
    ap.add_argument(
        "--timeout", type=float, default=limit if limit > 0 else 600,
        help="seconds from this script's start for the training run(s) (default: $STEP_LIMIT "
        "- 20, else 600)",
    )  # fmt: skip
    ap.add_argument("--out", default="")
    ap.add_argument("--compile", action="store_true", help="train.compile=true")
    ap.add_argument(
        "--profile", action="store_true",
        help="profile the last step (train.profile_step): its summary goes into the JSON, the "
        "step out of the medians",
    )  # fmt: skip
    ap.add_argument("--cpu", action="store_true", help="smoke-test this script on CPU (no figures)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()  # options may follow the a.b=c overrides (gpu_check.sh)
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("benchmarks/gpu_train.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    name = args.name or Path(args.config).stem
    out = Path(args.out) if args.out else _default_out(name)
    over = ["train.warmup_steps=5", "train.eval_every=100000", "train.save_final=false",
            "train.save_every=100000", "train.sample_tokens=0", "train.global_batch_size=32",
            "train.micro_batch_size=8", "train.seq_len=2048", "train.log_every=1",
            "train.dtype=bf16", "model.attn_backend=auto",
            # the last step's evaluation (not reported) would score 4 global batches eager:
            # 1,024 sequences at the 1B runs' 256 a step
            "train.eval_sequences=16",
            *([f"train.profile_step={args.steps}", "train.profile_trace=false"]
              if args.profile else []),
            *args.overrides]  # fmt: skip
    res: dict = {"name": name, "config": str(Path(args.config).name), "compile": args.compile}
    t0 = time.perf_counter()
    deadline = T_START + args.timeout
    rows, returncode, tail, prof, stats = _train(
        args, over, args.compile, deadline - time.monotonic()
    )
    left = deadline - time.monotonic()
    if args.compile and not rows and left > 30:
        res["compile_error"] = tail
        print("the compiled run failed before its first step; rerunning eager", flush=True)
        rows, returncode, _, prof, stats = _train(args, over, False, left)
        res["compile"] = False
    if prof:
        res["step_profile"] = prof
        print(prof[:20000], flush=True)
    modes = [o.split("=", 1)[1] for o in over if o.startswith("train.compile_mode=")]
    res["compile_mode"] = (modes[-1] if modes else "default") if res["compile"] else None
    if not res["compile"]:  # what ran: an eager fallback ran without the mode
        over = _without_mode(over)
    res["overrides"] = [f"train.max_steps={args.steps}", *over]
    if stats:
        res["compile_stats"] = stats
    res["sequences_per_step"] = int(  # the last override wins, as in the trainer
        [o for o in over if o.startswith("train.global_batch_size=")][-1].split("=")[1]
    )
    res["returncode"] = returncode
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    # a run cut short before them gives no figure, not a warm-up one; a profiled step is slower
    steady = [r for r in rows[args.warmup :] if not r.get("profiled")]
    res.update(
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (--cpu)",
        torch=torch.__version__,
        flash_attn=__import__("importlib").util.find_spec("flash_attn") is not None,
        steps_logged=len(rows),
        steady_steps=len(steady),
    )
    if rows:
        res.update(
            peak_memory_gib=max(r["memory_gib"] for r in rows),
            loss_first_last=[rows[0].get("loss"), rows[-1].get("loss")],
            losses=[r.get("loss") for r in rows],
        )
    if steady:
        res.update(
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
            tflops_per_gpu=statistics.median(r["tflops_per_device"] for r in steady),
            mfu=statistics.median(r["mfu"] for r in steady),
        )
    res.update(_predicted_memory(args, over, res.get("peak_memory_gib")))
    for k, v in res.items():
        if k not in ("overrides", "compile_error", "losses", "step_profile"):
            print(f"{k:>16}: {v}")
    # every step but the profiled last one logged: the figures stand; only its summary is lost
    # (a profile of 16 micro-batches can outlast the step's deadline)
    unprofiled = [r for r in rows if not r.get("profiled")]
    res["profile_cut"] = bool(args.profile and res["returncode"] != 0 and not prof
                              and len(unprofiled) >= args.steps - 1)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    if res["profile_cut"]:
        print("the profiled last step was cut short; the steady figures stand", flush=True)
    sys.exit(0 if (res["returncode"] == 0 or res["profile_cut"]) and steady else 1)


def _without_mode(over: list[str]) -> list[str]:
    """The overrides less train.compile_mode (refused without train.compile=true)."""
    return [o for o in over if not o.startswith("train.compile_mode=")]


def _predicted_memory(args, over: list[str], measured_gib) -> dict:
    """`llmtrain count`'s peak for this layout beside the measured one: the prediction less its
    runtime term, since torch.cuda.max_memory_allocated (what the trainer logs) counts tensors
    only, not the CUDA context. On CPU (--cpu) the prediction is for CUDA all the same."""
    from llmtrain.accounting import attention_kernel, memory_per_rank
    from llmtrain.config import load_config
    from llmtrain.model.attention import flash_attn_available

    over = _without_mode(over)  # a mode needs train.compile=true; memory does not depend on it
    try:
        cfg = load_config(args.config, over)
        t = cfg.train
        kernel = attention_kernel(cfg.model, "cuda", t.dtype)
        if kernel == "flash" and not flash_attn_available():
            kernel = "fused"  # SDPA's kernels: v stays at its own width (flash-attn pads it)
        mem = memory_per_rank(
            cfg.model, world_size=1, zero_stage=cfg.parallel.zero_stage, ep_size=1,
            dtype=t.dtype, micro_batch=t.micro_batch_size, seq_len=t.seq_len,
            activation_checkpointing=t.activation_checkpointing, device="cuda",
            attn_kernel=kernel,
        )  # fmt: skip
    except Exception as e:  # a figure to compare with, never a reason to lose the run's JSON
        return {"predicted_memory_error": repr(e)}
    gib = (mem["total"] - mem["runtime"]) / 2**30
    out = {"predicted_memory_gib": round(gib, 2), "predicted_attention_kernel": kernel,
           "predicted_parts_gib": {k: round(mem[k] / 2**30, 2) for k in (
               "weights", "master_weights", "gradients", "optimizer", "deepspeed_buffers",
               "activations")}}  # fmt: skip
    if not args.cpu and isinstance(measured_gib, (int, float)) and gib > 0:  # CPU: RSS
        out["measured_over_predicted"] = round(measured_gib / gib, 3)
    return out


def _train(
    args, over: list[str], compile: bool, timeout: float
) -> tuple[list, object, str, str, dict]:
    """One `llmtrain train` run; returns (step records, return code or "timeout", log tail,
    the profiled step's summary or "", the trainer's torch.compile statistics or {})."""
    run = Path(tempfile.mkdtemp(prefix="llmtrain-gpu-")) / "run"
    if not compile:  # an eager run (or the fallback of a failed compiled one) has no mode
        over = _without_mode(over)
    over = [f"train.max_steps={args.steps}", *over, f"train.compile={str(compile).lower()}"]
    cmd = [sys.executable, "-m", "llmtrain.cli", "train", args.config, "--run-dir", str(run), *over]
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    log = run.parent / "train.log"
    try:
        with log.open("w") as f:
            p = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(timeout, 1), stdout=f,
                               stderr=subprocess.STDOUT)  # fmt: skip
        returncode: object = p.returncode
    except subprocess.TimeoutExpired:
        returncode = "timeout"
    text = log.read_text(errors="replace") if log.exists() else ""
    print(text[-6000:], flush=True)  # the training log's end, into the check's log
    mfile = run / "metrics.jsonl"
    from llmtrain.train.metrics import read_records  # a line cut by the timeout is dropped

    rows = read_records(mfile) if mfile.exists() else []
    prof = "".join(f.read_text() for f in sorted((run / "profile").glob("step_*_rank0.txt")))
    shutil.rmtree(run.parent, ignore_errors=True)
    found = re.search(r"torch.compile on rank 0: (\{.*?\})", text)  # the trainer's last line
    stats = json.loads(found.group(1).replace("'", '"')) if found else {}
    return [r for r in rows if "tokens_per_s" in r], returncode, text[-3000:], prof, stats


if __name__ == "__main__":
    main()
