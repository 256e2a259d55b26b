"""Per-rank peak memory while training, predicted (`llmtrain count`) beside measured.

Runs a few real training steps of configs/bench_moe_150m.yaml (164M total, 64 experts) with the
trainer: one process, or W ranks under the deepspeed launcher on CPU (gloo), as tests do. The
rank processes are measured from outside: a sampler reads VmRSS of every rank process from
/proc/<pid>/status every 20 ms until the first checkpoint directory appears (the trainer saves at
the last step; saving is not training), and VmHWM (the kernel's peak) at the end. The prediction
is `memory_per_rank` for the same layout, micro-batch and sequence length.

    flock /tmp/llmtrain-heavy.lock .venv/bin/python benchmarks/memory_per_rank.py
    ... --layouts 1:2:1 2:2:2 4:2:4 2:1:1 2:3:1 --steps 3     # world:zero:ep
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VENV_BIN = Path(sys.executable).parent
MiB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM in bytes (empty when the process is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _rank_of(pid: int) -> int | None:
    """The RANK of a training process (launcher children carry it; a lone process has none)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if not any(b"llmtrain" in c for c in cmd) or any(b"deepspeed" in c for c in cmd[:3]):
            return None
        env = dict(
            kv.split(b"=", 1)
            for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in kv
        )
        return int(env.get(b"RANK", b"0"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None


def measure(
    world: int,
    zero: int,
    ep: int,
    steps: int,
    extra: list[str],
    config: str = "configs/bench_moe_150m.yaml",
) -> dict:
    """Train `steps` steps; per-rank peak VmRSS before the save starts, and VmHWM."""
    run_dir = Path(tempfile.mkdtemp(prefix="llmtrain-mem-")) / "run"
    overrides = [f"parallel.zero_stage={zero}", f"parallel.ep_size={ep}", f"train.max_steps={steps}",
                 "train.warmup_steps=1", "train.save_every=100000", "train.eval_batches=1",
                 "train.tensorboard=false", *extra]  # fmt: skip
    args = [config, "--run-dir", str(run_dir), *overrides]
    if world == 1:
        cmd = [str(VENV_BIN / "llmtrain"), "train", *args]
    else:
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(world), "--master_port",
               str(_free_port()), "--module", "llmtrain.train", *args]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))  # fmt: skip
    env.pop("WORLD_SIZE", None)
    log = run_dir.parent / "log.txt"
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    ranks: dict[int, int] = {}  # pid -> rank
    train_peak: dict[int, int] = {}
    hwm: dict[int, int] = {}
    saving = False
    while p.poll() is None:
        for pid in _descendants(p.pid):
            if pid not in ranks:
                r = _rank_of(pid)
                if r is not None:
                    ranks[pid] = r
        saving = saving or (run_dir / "checkpoints").exists()
        for pid, r in ranks.items():
            s = _status(pid)
            if not s:
                continue
            hwm[r] = max(hwm.get(r, 0), s["VmHWM"])
            if not saving:
                train_peak[r] = max(train_peak.get(r, 0), s["VmRSS"])
        time.sleep(0.02)
    if p.returncode != 0:
        raise RuntimeError(
            f"training failed ({p.returncode}); see {log}:\n{log.read_text()[-3000:]}"
        )
    return {"train_peak": train_peak, "hwm": hwm, "wall_s": time.time() - t0, "log": str(log)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layouts", nargs="+", default=["1:2:1", "2:2:2", "4:2:4"],
                    help="world:zero_stage:ep_size")  # fmt: skip
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="extra a.b=c overrides for every run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_per_rank.json"))
    args = ap.parse_args()

    from llmtrain.accounting import memory_per_rank
    from llmtrain.config import load_config
    from llmtrain.parallel.layout import make_layout

    rows = []
    for spec in args.layouts:
        world, zero, ep = map(int, spec.split(":"))
        cfg = load_config(ROOT / "configs" / "bench_moe_150m.yaml",
                          [f"parallel.zero_stage={zero}", f"parallel.ep_size={ep}", *args.overrides])  # fmt: skip
        lay = make_layout(cfg, world)
        t = cfg.train
        pred = memory_per_rank(
            cfg.model, world, zero, ep, dtype=t.dtype, micro_batch=lay.micro_batch,
            seq_len=t.seq_len, activation_checkpointing=t.activation_checkpointing,
            offload_optimizer=t.offload_optimizer, device="cpu",
        )  # fmt: skip
        m = measure(world, zero, ep, args.steps, args.overrides)
        meas = max(m["train_peak"].values())
        rows.append({
            "layout": f"W={world} ZeRO-{zero} EP={ep}", "world_size": world, "zero_stage": zero,
            "ep_size": ep, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
            "predicted_bytes": pred["total"], "predicted": pred,
            "measured_train_peak_bytes": meas,
            "measured_train_peak_per_rank": m["train_peak"], "vmhwm_per_rank": m["hwm"],
            "ratio": meas / pred["total"], "wall_s": m["wall_s"],
        })  # fmt: skip
        print(f"{rows[-1]['layout']}: predicted {pred['total'] / MiB:.0f} MiB, measured "
              f"{meas / MiB:.0f} MiB ({m['wall_s']:.0f} s)", flush=True)  # fmt: skip

    print(f"\n{'layout':<22} {'predicted':>10} {'measured':>10} {'ratio':>6}   (MiB per rank)")
    for r in rows:
        print(f"{r['layout']:<22} {r['predicted_bytes'] / MiB:>10.0f} "
              f"{r['measured_train_peak_bytes'] / MiB:>10.0f} {r['ratio']:>6.2f}")  # fmt: skip
    keys = ["weights", "master_weights", "gradients", "optimizer", "deepspeed_buffers",
            "activations", "runtime"]  # fmt: skip
    print("\nprediction breakdown (MiB):", " ".join(f"{k}" for k in keys))
    for r in rows:
        print(f"{r['layout']:<22}", " ".join(f"{r['predicted'][k] / MiB:.0f}" for k in keys))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": "configs/bench_moe_150m.yaml", "steps": args.steps,
                               "rows": rows}, indent=2))  # fmt: skip
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
