"""Sharded checkpoints at scale on CPU: per-rank peak RSS while training, saving and resuming,
and save / load wall time against bytes at several rank counts.

One run trains a few steps at the save layout (default 4 ranks, EP 4, ZeRO-2 on the 164M /
64-expert benchmark config) and saves; then each resume layout (default 4 ranks EP 4, 2 ranks
EP 2, 1 rank) starts fresh processes, restores that checkpoint, trains the same number of steps
and saves again. Each rank resets its peak-RSS counter (/proc/self/clear_refs) before a phase and
reads VmHWM after it, so every figure is that phase's own peak. Goal: save and resume peaks at
most 1.3x the training peak of the same rank. Prints a table, writes JSON. Run it alone:

    flock /tmp/llmtrain-heavy.lock .venv/bin/python benchmarks/checkpoint_io.py
    ... train.async_save=true      # stall: what training waits for (the copy), beside the save
    ... --save-layout 2,2,3 --resume-layouts 2,2,3 1,1,3      # ZeRO-3 + EP 2 (W,EP,ZERO)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5": reset VmHWM to the current RSS
        fh.write("5")


def child(args) -> None:
    """One rank of a run: build, [restore], train, save; phase peaks into OUT/rank{r}.json."""
    import torch
    import yaml

    from llmtrain.accounting import count
    from llmtrain.config import load_config
    from llmtrain.parallel import comm
    from llmtrain.parallel.engine import Engine, device_for, init_distributed, make_dispatcher
    from llmtrain.parallel.layout import make_layout
    from llmtrain.train import loop
    from llmtrain.train.checkpointing import Checkpointer

    torch.set_num_threads(1)
    cfg = load_config(args.config, args.overrides)
    layout = make_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world, local_rank = init_distributed(cfg.parallel.backend)
    run_dir = Path(args.run_dir)
    run = loop._load_data(cfg, run_dir, layout, rank, world, local_rank, device_for(local_rank))
    run.checkpointer = Checkpointer(run_dir, None, rank, keep_last=1)
    loop._build(run, Engine, make_dispatcher, None)
    rec = {"rank": rank, "world": world, "after_build": _status("VmRSS")}
    if args.resume:
        comm.barrier()
        _reset_peak()
        t0 = time.perf_counter()
        flops = count(cfg.model, seq_len=cfg.train.seq_len).flops_per_token
        loop._restore(run, Path(args.resume), flops)
        comm.barrier()
        rec["load_s"], rec["load_peak"] = time.perf_counter() - t0, _status("VmHWM")
    comm.barrier()
    _reset_peak()
    for step in range(run.start_step, run.start_step + args.steps):
        loop._step(run, step, set())
    rec["train_peak"] = _status("VmHWM")
    done = run.start_step + args.steps
    comm.barrier()
    _reset_peak()
    t0 = time.perf_counter()
    ck = run.checkpointer.save(done, {"step": done}, yaml.safe_dump(cfg.to_dict()), None,
                               asynchronous=cfg.train.async_save)  # fmt: skip
    rec["stall_s"] = time.perf_counter() - t0  # what training waits for (async: the copy)
    run.checkpointer.wait()
    rec["save_s"], rec["save_peak"] = time.perf_counter() - t0, _status("VmHWM")
    rec["checkpoint"] = str(ck)
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(rec))
    torch.distributed.destroy_process_group()


def launch(layout: tuple[int, int, int], args, run_dir: Path, resume: Path | None) -> list[dict]:
    w, ep, zero = layout
    out = Path(tempfile.mkdtemp(prefix="ckio-"))
    over = [f"parallel.ep_size={ep}", f"parallel.zero_stage={zero}", f"data.cache_dir={args.cache}",
            "train.tensorboard=false", *args.overrides]  # fmt: skip
    mod = ["--module", "benchmarks.checkpoint_io"] if w > 1 else ["-m", "benchmarks.checkpoint_io"]
    head = ([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(w),
             "--master_port", str(29500 + os.getpid() % 1000)] if w > 1 else [sys.executable])  # fmt: skip
    cmd = [*head, *mod, "--child", "--config", args.config, "--run-dir", str(run_dir),
           "--out-dir", str(out), "--steps", str(args.steps),
           *(["--resume", str(resume)] if resume else []), *over]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # fmt: skip
    env.pop("WORLD_SIZE", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"run {layout} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(w)]
    shutil.rmtree(out)
    return ranks


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="configs/bench_moe_150m.yaml")
    ap.add_argument("--save-layout", default="4,4,2", help="W,EP,ZERO of the run that saves first")
    ap.add_argument("--resume-layouts", nargs="+", default=["4,4,2", "2,2,2", "1,1,2"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "llmtrain-bench-cache"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_io.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--resume", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args, args.overrides = ap.parse_known_args()
    if args.child:
        child(args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # like the trainer: skip C++ static destructors that can abort a done rank

    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-ckio-"))
    layouts = [
        tuple(int(x) for x in s.split(",")) for s in [args.save_layout, *args.resume_layouts]
    ]
    results = []
    first = None
    for i, lay in enumerate(layouts):
        ranks = launch(lay, args, tmp / f"run{i}", first)
        ck = Path(ranks[0]["checkpoint"])
        first = first or ck
        results.append({"layout": dict(zip(("world", "ep", "zero"), lay)), "resumed": i > 0,
                        "bytes": _bytes(ck), "ranks": ranks})  # fmt: skip
    shutil.rmtree(tmp)  # the runs' checkpoints (GBs); a failed run exits above and keeps them

    gib = 2**30
    print(f"{'run':<22}{'rank':>5}{'train GiB':>11}{'save GiB':>10}{'save/tr':>9}{'load GiB':>10}"
          f"{'load/tr':>9}")  # fmt: skip
    for r in results:
        lay = r["layout"]
        name = f"{'resume' if r['resumed'] else 'train+save'} W{lay['world']} EP{lay['ep']} Z{lay['zero']}"
        for k in r["ranks"]:
            tr = k["train_peak"]
            load = k.get("load_peak")
            print(f"{name:<22}{k['rank']:>5}{tr / gib:>11.2f}{k['save_peak'] / gib:>10.2f}"
                  f"{k['save_peak'] / tr:>9.2f}"
                  + (f"{load / gib:>10.2f}{load / tr:>9.2f}" if load else f"{'-':>10}{'-':>9}"))  # fmt: skip
    print(f"\n{'ranks':>5}{'MB':>9}{'stall s':>9}{'save s':>9}{'save MB/s':>11}{'load s':>9}"
          f"{'load MB/s':>11}")  # fmt: skip
    for r in results:
        mb = r["bytes"] / 1e6
        save = max(k["save_s"] for k in r["ranks"])
        stall = max(k["stall_s"] for k in r["ranks"])
        load = max((k.get("load_s", 0) for k in r["ranks"]), default=0)
        lo = f"{load:>9.2f}{mb / load:>11.1f}" if load else f"{'-':>9}{'-':>11}"
        print(f"{r['layout']['world']:>5}{mb:>9.1f}{stall:>9.2f}{save:>9.2f}{mb / save:>11.1f}{lo}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": args.config, "steps": args.steps,
                                          "runs": results}, indent=1))  # fmt: skip
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
