"""Run under the deepspeed launcher by tests/test_robust.py: a non-finite gradient (finite loss) at
each ZeRO stage and dtype is skipped with weights and Adam moments unchanged, and a checkpoint of
non-finite state is refused. Writes a JSON verdict (rank 0) to argv[1]."""

import json
import os
import sys
from pathlib import Path

import torch

os.environ["LLMTRAIN_FAULT_GRAD_STEPS"] = "3"

from llmtrain.config import load_config  # noqa: E402
from llmtrain.model import build_model  # noqa: E402
from llmtrain.parallel.engine import Engine, init_distributed  # noqa: E402
from llmtrain.parallel.layout import make_layout  # noqa: E402
from llmtrain.train import faults, health  # noqa: E402
from llmtrain.train.checkpointing import Checkpointer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def snapshot(engine, model):
    """This rank's fp32 master fragments and both Adam moments (what a checkpoint writes)."""
    engine.prepare_optimizer_state()
    out = {}
    for name, p in model.named_parameters():
        frag = engine.local_fragment(p)
        if frag is not None:
            for key, v in frag[1].items():
                out[f"{name}::{key}"] = v.detach().clone()
    return out


def all_ranks(items: list) -> list:
    got = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(got, items)
    return sorted({x for part in got for x in part})


def run(dtype: str, zero: int, rank: int, world: int, out_dir: Path) -> dict:
    cfg = load_config(ROOT / "configs" / "debug.yaml",
                      [f"train.dtype={dtype}", f"parallel.zero_stage={zero}", "train.seq_len=32"])  # fmt: skip
    layout = make_layout(cfg, world)
    model = build_model(cfg.model, seed=1)
    engine = Engine(model, cfg, layout)
    fault = faults.GradFault(model, rank)
    gen = torch.Generator().manual_seed(100 + rank)
    res = {"norms": [], "ok": []}
    before = None
    for step in range(4):
        fault.arm(step + 1)  # steps are numbered from 1, as the trainer's
        if step == 2:
            before = snapshot(engine, model)
        x = torch.randint(0, cfg.model.vocab_size, (layout.micro_batch, 33), generator=gen)
        for _ in range(layout.grad_accum):
            out = engine(x[:, :-1], labels=x[:, 1:])
            engine.backward(out.loss)
            engine.step()
        res["loss_finite_" + str(step)] = bool(torch.isfinite(out.loss).item())
        norm = engine.grad_norm()
        res["norms"].append(norm)
        res["ok"].append(health.step_ok(float(out.loss.detach()), norm))
        if step == 2:
            after = snapshot(engine, model)
            res["changed_by_bad_step"] = all_ranks(
                [k for k in before if not torch.equal(before[k], after[k])]
            )
    res["changed_after"] = len(
        all_ranks([k for k, v in snapshot(engine, model).items() if not torch.equal(before[k], v)])
    )
    if zero == 2:  # poison one weight: the save must refuse and keep nothing
        for p in model.parameters():
            frag = engine.local_fragment(p)
            if frag is not None:
                with torch.no_grad():
                    frag[1]["fp32"].fill_(float("nan"))
                break
        run_dir = out_dir / f"run-{dtype}"
        writer = Checkpointer(run_dir, model, rank, keep_last=2)
        writer.engine = engine
        try:
            writer.save(5, {"step": 5}, "", None)
            res["nonfinite_save"] = "saved"
        except health.NonFiniteCheckpointError as e:
            res["nonfinite_save"] = str(e)
        torch.distributed.barrier()
        res["ckpt_files"] = sorted(p.name for p in (run_dir / "checkpoints").glob("*"))
    return res


def main() -> None:
    out = Path(sys.argv[-1])  # the launcher puts --local_rank=N first
    rank, world, _ = init_distributed("gloo")
    results = {}
    for dtype in os.environ.get("LLMTRAIN_TEST_DTYPES", "fp32,bf16").split(","):
        for zero in (1, 2, 3):
            results[f"{dtype}-zero{zero}"] = run(dtype, zero, rank, world, out.parent)
    if rank == 0:
        out.write_text(json.dumps(results))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    # Leave like the training CLI does: gloo / DeepSpeed C++ threads can abort a finished process
    # at interpreter exit ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
