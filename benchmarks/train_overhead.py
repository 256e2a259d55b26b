"""Trainer overhead: `llmtrain train` (data, metrics, DeepSpeed ZeRO-1) vs the bare model step.

Both at the same config (default the ~28M benchmark config: hidden 256, 4 layers, 16 experts
top-2, seq 256, batch 4), one process, fp32, fused AdamW; run one after the other in this run.
The bare step is forward + backward + optimizer on a fixed batch; the trainer's step time is
the median of its logged steps after warm-up. Prints a table, writes JSON.

    .venv/bin/python benchmarks/train_overhead.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bare_step_times(cfg, steps: int) -> list[float]:
    from llmtrain.model import build_model

    model = build_model(cfg.model, seed=cfg.train.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    b, t = cfg.train.micro_batch_size, cfg.train.seq_len
    accum = cfg.train.global_batch_size // b  # the trainer's step: every micro-batch of it
    ids = torch.randint(
        0, cfg.model.vocab_size, (accum, b, t + 1), generator=torch.Generator().manual_seed(0)
    )
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for mb in ids:
            (model(mb[:, :-1], labels=mb[:, 1:]).loss / accum).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench_28m.yaml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_overhead.json"))
    args = ap.parse_args()
    from llmtrain.config import load_config

    cfg = load_config(args.config)
    if cfg.train.dtype != "fp32":  # the bare step is the plain fp32 model's
        sys.exit(
            f"{args.config}: train.dtype={cfg.train.dtype}; this benchmark compares fp32 steps"
        )
    torch.set_num_threads(torch.get_num_threads())
    run = Path(tempfile.mkdtemp(prefix="llmtrain-overhead-")) / "run"
    over = [f"train.max_steps={args.steps}", "train.warmup_steps=1", "train.eval_every=100000",
            "train.save_every=100000", "train.sample_tokens=0", "train.log_every=1",
            "data.max_bytes=4000000"]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "llmtrain"), "train", args.config, "--run-dir", str(run), *over],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    wall = time.perf_counter() - t0
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run.parent, ignore_errors=True)  # its checkpoint: ~300 MB of /tmp per run
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    trainer = statistics.median(tokens / r["tokens_per_s"] for r in rows[3:])
    bare = statistics.median(bare_step_times(cfg, args.steps))
    overhead = trainer / bare - 1
    print(f"config {args.config}: {tokens} tokens/step, {torch.get_num_threads()} threads")
    print(f"{'':<10} {'step s':>8} {'tok/s':>8}")
    print(f"{'bare':<10} {bare:>8.3f} {tokens / bare:>8.0f}")
    mfu = statistics.median(r["mfu"] for r in rows[3:])
    print(f"{'trainer':<10} {trainer:>8.3f} {tokens / trainer:>8.0f}   MFU {mfu:.1%}")
    print(
        f"trainer overhead: {overhead:+.1%} of the bare step (target <= +10%); whole run {wall:.0f} s"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": args.config, "bare_step_s": bare, "trainer_step_s": trainer,
                                          "overhead": overhead, "tokens_per_step": tokens,
                                          "trainer_mfu": mfu}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
