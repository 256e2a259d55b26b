"""What every rank reads before it loads a byte: the checkpoint's metadata, format 1 (one DCP
chunk per tensor per rank) against format 2 (packed parts plus a memory-mapped index).

No ranks are started: the save planner's local plans are made for every rank of a ZeRO-3
layout of a real config's parameters (built on the meta device, routed experts split by
expert parallelism), and the coordinator's global plan is computed as `dcp.save` would. Per
format and world size it measures what the coordinator gathers (the pickled local plans), the
`.metadata` file (pickled with the storage records the file writer adds: bytes, unpickle
time and the memory the unpickled object holds, measured in a fresh process), what a load
gathers on the coordinator (one rank's pickled load plan x ranks; "(reads)": what it gathered
while the plans carried every tensor read), and for format 2 the index
file and one rank's lookup of all its pieces. Prints a table, writes JSON:

    .venv/bin/python benchmarks/checkpoint_metadata.py                      # DeepSeek-V3
    .venv/bin/python benchmarks/checkpoint_metadata.py --worlds 8 64 --v1-max-world 64 \\
        --config configs/moe_1b.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _tensors(config: str) -> list[tuple[str, int, int | None]]:
    """(name, numel, experts or None) of every parameter, plus the replicated router biases."""
    from llmtrain.config import load_config
    from llmtrain.model.moe import Experts
    from llmtrain.model.transformer import build_model

    cfg = load_config(config, [])
    model = build_model(cfg.model, device="meta")
    out = []
    for name, p in model.named_parameters():
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        out.append((name, p.numel(), p.shape[0] if isinstance(mod, Experts) else None))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            out.append((name, b.numel(), -1))
    return out, cfg.parallel.ep_size


def _rank_pieces(tensors, world: int, ep: int, rank: int):
    """ZeRO-3 pieces of `rank`: dense weights split over all ranks, experts over the ranks
    of their expert-parallel slot, biases whole on every rank; weights with both moments."""
    from llmtrain.checkpoint.format import MOMENTS, Piece, model_key, moment_key

    pieces = []
    for name, n, experts in tensors:
        if experts == -1:
            pieces.append(Piece(model_key(name), n, 0, n))
            continue
        if experts is None:
            lo, span, ranks, at = 0, n, world, rank
        else:  # this rank's experts, then ZeRO-3 over the world/ep ranks holding the same ones
            per = n // experts * (experts // ep)
            lo, span, ranks, at = (rank % ep) * per, per, world // ep, rank // ep
        s = -(-span // ranks)
        a, b = min(span, at * s), min(span, (at + 1) * s)
        if b > a:
            for key in (model_key(name), *(moment_key(m, name) for m in MOMENTS)):
                pieces.append(Piece(key, n, lo + a, b - a))
    return pieces


def _measure(path: Path) -> dict:
    """In a fresh process: unpickle the metadata; time and the RSS it adds."""
    code = (
        "import pickle,sys,time,resource\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1])*4096\n"
        "import torch.distributed.checkpoint\n"
        "r0=rss(); t=time.perf_counter(); m=pickle.load(open(sys.argv[1],'rb'))\n"
        "print(time.perf_counter()-t, rss()-r0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    return {"load_s": float(out[0]), "load_rss_bytes": int(out[1])}


def one(tensors, ep: int, world: int, pack: bool, work: Path) -> dict:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from llmtrain.checkpoint.format import PackIndex, PieceLoadPlanner, PieceSavePlanner

    t0 = time.perf_counter()
    planners, plans = [], []
    for r in range(world):
        pl = PieceSavePlanner(_rank_pieces(tensors, world, ep, r), {f"rng/{r}": b""},
                              out=work, pack=pack)  # fmt: skip
        pl.set_up_planner({}, None, r == 0)
        plans.append(pl.create_local_plan())
        planners.append(pl)
    gathered = sum(len(pickle.dumps(p)) for p in plans)
    t1 = time.perf_counter()
    final, md = planners[0].create_global_plan(plans)
    plan_s = time.perf_counter() - t1
    n_chunks = sum(len(getattr(m, "chunks", ())) for m in md.state_dict_metadata.values())
    # what FileSystemWriter.finish adds before pickling: where each written item lies
    at = 0
    md.storage_data = {}
    for r, pl in enumerate(final):
        for item in pl.items:
            n = item.tensor_data.chunk.sizes[0] * 4 if item.tensor_data is not None else 8
            md.storage_data[item.index] = _StorageInfo(f"__{r}_0.distcp", at, n)
            at += n
    # one rank's load plan, which DCP gathers from every rank on the coordinator
    lp = PieceLoadPlanner(_rank_pieces(tensors, world, ep, world // 2), [f"rng/{world // 2}"],
                          PackIndex(work) if pack else None)  # fmt: skip
    lp.set_up_planner({}, md, False)
    local = lp.create_local_plan()
    load_gathered = len(pickle.dumps(local)) * world
    # before the reads stayed local, DCP gathered all of them (one ReadItem per piece read)
    load_gathered_before = len(pickle.dumps(lp.finish_plan(local))) * world
    mfile = work / "metadata.pkl"
    mfile.write_bytes(pickle.dumps(md))
    row = {
        "format": 2 if pack else 1,
        "world": world,
        "pieces": sum(len(p.pieces) for p in planners),
        "chunks": n_chunks,
        "gathered_bytes": gathered,
        "plan_s": plan_s,
        "load_gathered_bytes_est": load_gathered,
        "load_gathered_before_bytes_est": load_gathered_before,
        "metadata_bytes": mfile.stat().st_size,
        **_measure(mfile),
    }
    del planners, plans, md
    if pack:
        row["index_bytes"] = (work / "pack_index.npy").stat().st_size
        mine = _rank_pieces(tensors, world, ep, world // 2)
        t = time.perf_counter()
        idx = PackIndex(work)
        lp = PieceLoadPlanner(mine, pack=idx)
        n = sum(len(idx.read_items(p, i)[0]) for i, p in enumerate(lp.pieces))
        row["rank_lookup_s"] = time.perf_counter() - t
        row["rank_reads"] = n
    row["total_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="configs/deepseek_v3.yaml")
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--ep", type=int, help="expert-parallel size (default: the config's)")
    ap.add_argument("--v1-max-world", type=int, default=256,
                    help="format 1 only up to this world (its metadata grows as tensors x ranks)")  # fmt: skip
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_metadata.json")
    )
    args = ap.parse_args()
    tensors, cfg_ep = _tensors(args.config)
    rows = []
    for world in args.worlds:
        ep = math.gcd(args.ep or cfg_ep, world)
        for pack in (False, True):
            if not pack and world > args.v1_max_world:
                continue
            with tempfile.TemporaryDirectory() as d:
                rows.append({"ep": ep, **one(tensors, ep, world, pack, Path(d))})
            print(json.dumps(rows[-1]), file=sys.stderr)
    head = f"{'fmt':>3} {'world':>5} {'ep':>3} {'chunks':>9} {'metadata':>10} {'load s':>7} " \
           f"{'load RSS':>10} {'save gath.':>10} {'load gath.':>10} {'(reads)':>10} {'plan s':>7} {'index':>9} " \
           f"{'rank lookup s':>13}"  # fmt: skip
    print(f"{args.config}: ZeRO-3 layout, {len(tensors)} tensors (+2 moments each)")
    print(head)
    for r in rows:
        print(f"{r['format']:>3} {r['world']:>5} {r['ep']:>3} {r['chunks']:>9} "
              f"{r['metadata_bytes'] / 1e6:>8.1f}MB {r['load_s']:>7.2f} "
              f"{r['load_rss_bytes'] / 1e6:>8.0f}MB {r['gathered_bytes'] / 1e6:>8.1f}MB "
              f"{r['load_gathered_bytes_est'] / 1e6:>8.1f}MB "
              f"{r['load_gathered_before_bytes_est'] / 1e6:>8.1f}MB "
              f"{r['plan_s']:>7.2f} "
              f"{(str(round(r['index_bytes'] / 1e6, 1)) + 'MB') if 'index_bytes' in r else '-':>9} "
              f"{r.get('rank_lookup_s', float('nan')):>13.3f}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
