"""One GPU: tokens/s and MFU of `llmtrain train` on the ~100M-active config in bf16 with
FlashAttention-class attention (flash-attn when installed, else PyTorch SDPA's flash kernel).

    python benchmarks/gpu_train.py [--steps 60] [--config configs/moe_100m.yaml] [a.b=c ...]

Needs CUDA; prints a table and writes JSON. Data: the embedded corpus (tokenized once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "moe_100m.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_train.json"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_train.py needs a CUDA GPU")
    run = Path(tempfile.mkdtemp(prefix="llmtrain-gpu-")) / "run"
    over = [f"train.max_steps={args.steps}", "train.warmup_steps=5", "train.eval_every=100000",
            "train.save_every=100000", "train.sample_tokens=0", "train.global_batch_size=32",
            "train.micro_batch_size=8", "train.seq_len=2048", "model.attn_backend=auto",
            *args.overrides]  # fmt: skip
    subprocess.run([sys.executable, "-m", "llmtrain.cli", "train", args.config, "--run-dir", str(run), *over],
                   check=True, cwd=ROOT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))  # fmt: skip
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][10:]
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "tflops": statistics.median(r["tflops_per_device"] for r in rows),
        "mfu": statistics.median(r["mfu"] for r in rows),
        "memory_gib": max(r["memory_gib"] for r in rows),
        "flash_attn": __import__("importlib").util.find_spec("flash_attn") is not None,
    }
    for k, v in res.items():
        print(f"{k:>14}: {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
