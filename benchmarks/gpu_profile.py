"""One GPU: where a training step's time goes (model forward + backward in bf16, no optimizer).

    python benchmarks/gpu_profile.py [--config configs/moe_1b.yaml] [--micro 8] [--seq 2048]
                                     [--compile]

Builds the model as DeepSpeed's bf16 engine would hold it (bf16 parameters, fp32 routing state),
runs warm-up steps, then profiles a few with torch.profiler and prints the top CUDA kernels /
ops (of the compiled blocks with --compile, as train.compile=true runs them), the step time, the achieved TFLOP/s against the config's FLOPs per token, and how much of
the step the GPU sat idle (host-bound). Writes the table to --out (default
$OUT/gpu_profile_<config>.txt when $OUT is set). Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "moe_1b.yaml"))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    ap.add_argument("--cpu", action="store_true", help="smoke-test this script on CPU (no figures)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmtrain.accounting import count
    from llmtrain.config import load_config
    from llmtrain.model import build_model

    if not torch.cuda.is_available() and not args.cpu:
        print("benchmarks/gpu_profile.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    dev = "cpu" if args.cpu else "cuda"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    cfg = load_config(args.config, args.overrides)
    model = build_model(cfg.model, device=dev)
    for m in model.moe_layers():  # what the engine holds: bf16 params, fp32 master router
        m.gate.set_fp32_weight(m.gate.weight.detach().clone())
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.train()
    if args.compile:
        from llmtrain.train.compile import compile_blocks

        compile_blocks(model, expert_parallel=False)
    v = cfg.model.vocab_size
    ids = torch.randint(0, v, (args.micro, args.seq + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        out = model(x, labels=y, check_inputs=False)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dt = (time.perf_counter() - t) / args.steps
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    tokens = args.micro * args.seq
    flops = count(cfg.model, seq_len=args.seq).flops_per_token * tokens
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
    lines = [
        f"config {Path(args.config).name} ({'compiled' if args.compile else 'eager'}): "
        f"{tokens} tokens/micro-batch, fwd+bwd {dt * 1e3:.1f} ms, "
        f"{tokens / dt:,.0f} tokens/s, {flops / dt / 1e12:.0f} TFLOP/s "
        f"({flops / dt / 989e12:.1%} of 989), GPU busy {gpu_us / 1e6 / dt:.0%} of the step, "
        f"peak memory {peak_gib:.1f} GiB",
        events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60),
    ]
    text = "\n".join(lines)
    print(text)
    out = args.out or (
        str(Path(os.environ["OUT"]) / f"gpu_profile_{Path(args.config).stem}.txt")
        if os.environ.get("OUT")
        else ""
    )
    if out:
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
