"""Training step (forward + backward + AdamW) of our model vs transformers' DeepseekV3ForCausalLM.

Same config, same weights, same batch, same optimizer, in the same run; each model is timed in
its own child process (so peak memory is its own) and the runs alternate to spread machine
noise. Two comparisons:

- training step (the headline): each model through its own loss path, as its users train it.
  Ours: `model(x, labels=y).lm_loss` (fused, chunked head + cross-entropy). transformers:
  `model(input_ids=x, labels=x).loss` (its ForCausalLMLoss: fp32 logits, shift, cross-entropy).
- body only: both models' `.logits`, then the same `cross_entropy(logits.float(), y)` outside,
  so the difference is the decoder itself (attention, MoE), not the loss head.

Prints both tables and ratios and writes JSON with tokens/s, ratios, achieved GFLOP/s, MFU
against a 1024³ matmul measured in this run, and peak memory.

    .venv/bin/python benchmarks/model_step.py [--config configs/bench_28m.yaml] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def vm_hwm_bytes() -> int:
    """This process image's own peak RSS (VmHWM). Not ru_maxrss: a spawned child's starts at its
    parent's peak (the kernel carries the pre-exec maxrss over exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def matmul_ceiling(dtype=torch.float32, n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _loss(kind: str, path: str, model, x, y, vocab: int) -> torch.Tensor:
    """One forward to the scalar loss. `path`: "loss" = the model's own labels= path, "body" =
    plain logits + the same outside cross-entropy for both models."""
    if path == "loss":
        if kind == "ours":
            return model(x, labels=y).lm_loss  # fused head + cross-entropy
        return model(input_ids=x, labels=x).loss  # transformers shifts labels itself
    logits = model(x).logits if kind == "ours" else model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))


def _child(kind: str, path: str, hf_dir: str, batch: int, seq: int, steps: int, threads: int,
           q) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if kind == "ours":
        import llmtrain

        model = llmtrain.from_pretrained(hf_dir).train()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    vocab = model.config.vocab_size if kind == "hf" else model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    base = rss_bytes()
    times, losses = [], []
    for i in range(steps + 2):
        t = time.perf_counter()
        loss = _loss(kind, path, model, x, y, vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t
        if i >= 2:  # two warm-up steps
            times.append(dt)
        losses.append(loss.item())
    peak = vm_hwm_bytes()
    q.put({"kind": kind, "times": times, "losses": losses, "peak_rss": peak, "base_rss": base})


def run_child(kind, path, hf_dir, batch, seq, steps, threads):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(kind, path, hf_dir, batch, seq, steps, threads, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench_28m.yaml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per model")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "model_step.json"))
    args = ap.parse_args()

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from llmtrain.accounting import count
    from llmtrain.config import load_config
    from llmtrain.hf import hf_config_from_model

    cfg = load_config(args.config)
    mc, batch, seq = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    hf_cfg = hf_config_from_model(mc)
    hf_cfg.pop("architectures"), hf_cfg.pop("model_type")
    torch.manual_seed(0)
    hf_model = DeepseekV3ForCausalLM(DeepseekV3Config(**hf_cfg))
    tmp = tempfile.mkdtemp(prefix="llmtrain-bench-")
    hf_model.save_pretrained(tmp)
    del hf_model

    torch.set_num_threads(args.threads)
    ceiling = matmul_ceiling()
    flops_tok = count(mc, seq_len=seq).flops_per_token
    variants = [("ours", "loss"), ("hf", "loss"), ("ours", "body"), ("hf", "body")]
    runs: dict[tuple, list] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for kind, path in variants:
            runs[kind, path].append(
                run_child(kind, path, tmp, batch, seq, args.steps, args.threads)
            )
    ceiling = max(ceiling, matmul_ceiling())
    shutil.rmtree(tmp, ignore_errors=True)  # the HF checkpoint both sides loaded

    rows = {}
    for (kind, path), rs in runs.items():
        step = statistics.median(t for r in rs for t in r["times"])
        tok_s = batch * seq / step
        rows[f"{kind}_{path}"] = {
            "step_s": step,
            "tokens_per_s": tok_s,
            "gflops": tok_s * flops_tok / 1e9,
            "mfu": tok_s * flops_tok / ceiling,
            "peak_rss_mib": max(r["peak_rss"] for r in rs) / 2**20,
            "step_mem_mib": max(r["peak_rss"] - r["base_rss"] for r in rs) / 2**20,
            "first_loss": rs[0]["losses"][0],
            "median_step_per_round": [statistics.median(r["times"]) for r in rs],
        }

    def ratio(path: str, key: str = "tokens_per_s") -> float:
        return rows[f"ours_{path}"][key] / rows[f"hf_{path}"][key]

    print(f"config {args.config}: batch {batch} x seq {seq}, {count(mc).total_params / 1e6:.1f}M params, "
          f"{flops_tok / 1e6:.1f} MFLOP/token, {args.threads} threads")  # fmt: skip
    print(f"fp32 matmul ceiling (1024^3, same run): {ceiling / 1e9:.1f} GFLOP/s")
    print("loss path: ours = labels= (fused head + CE); hf = labels= (ForCausalLMLoss); "
          "body: .logits + the same cross_entropy for both")  # fmt: skip
    print(
        f"{'variant':<10} {'step s':>8} {'tok/s':>9} {'GFLOP/s':>9} {'MFU':>6} {'peak MiB':>9} {'step MiB':>9} {'loss0':>8}"
    )
    for k, r in rows.items():
        print(f"{k:<10} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} {r['gflops']:>9.1f} {r['mfu']:>6.1%} "
              f"{r['peak_rss_mib']:>9.0f} {r['step_mem_mib']:>9.0f} {r['first_loss']:>8.4f}")  # fmt: skip
        print(
            f"  median step per round: {', '.join(f'{t:.3f}' for t in r['median_step_per_round'])}"
        )
    print(f"training-step speed ratio ours/hf (each its own labels= loss): {ratio('loss'):.2f}x   "
          f"peak-memory ratio: {ratio('loss', 'peak_rss_mib'):.2f}")  # fmt: skip
    print(f"body-only speed ratio ours/hf (logits + the same cross-entropy): {ratio('body'):.2f}x   "
          f"peak-memory ratio: {ratio('body', 'peak_rss_mib'):.2f}")  # fmt: skip
    out = {
        "config": args.config,
        "batch": batch,
        "seq_len": seq,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "matmul_ceiling_gflops": ceiling / 1e9,
        "flops_per_token": flops_tok,
        "results": rows,
        "speed_ratio": ratio("loss"),
        "peak_memory_ratio": ratio("loss", "peak_rss_mib"),
        "body_speed_ratio": ratio("body"),
        "body_peak_memory_ratio": ratio("body", "peak_rss_mib"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
