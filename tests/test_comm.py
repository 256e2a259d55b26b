"""Collectives get tensors on their group's device (checked under a declared non-CPU device).

Two gloo ranks (torch.multiprocessing) run expert-parallel dispatch and a short training run
(metrics, router-bias update, evaluation, checkpoint) inside `record_collectives`, which
fails on any collective that bypasses llmtrain.parallel.comm or gets a tensor off the group's
declared device.
"""

from __future__ import annotations

import ast
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmtrain.parallel import comm

from .comm_utils import CommDeviceError, record_collectives
from .conftest import ROOT
from .train_utils import free_port, run_then_exit


def _spawn(fn, *args, world: int = 2) -> None:
    port = free_port()
    mp.spawn(run_then_exit, args=(_entry, world, port, fn, args), nprocs=world, join=True)


def _entry(rank, world, port, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    fn(rank, world, *args)


def _gloo(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ---------------------------------------------------------------- dispatch


def _dispatch(rank, world, out_dir):
    from llmtrain.config import ModelConfig
    from llmtrain.model.moe import MoE
    from llmtrain.parallel.expert import ExpertParallelDispatcher

    _gloo(rank, world)
    try:
        cfg = ModelConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8,
                          num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                          moe_impl="grouped_mm")  # fmt: skip
        cfg.validate()
        group = dist.new_group(list(range(world)))
        full = MoE(cfg)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in full.parameters():
                p.normal_(0, 0.3)
        ep = MoE(cfg, ExpertParallelDispatcher(group, world, rank))
        el = cfg.n_routed_experts // world
        with torch.no_grad():
            for name, p in ep.named_parameters():
                src = full.get_parameter(name)
                p.copy_(src[rank * el : (rank + 1) * el] if "experts.w_" in name else src)
        x = torch.randn(2 + rank, 5, 32, generator=torch.Generator().manual_seed(rank))
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + rank))

        host_reads = []
        real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

        def step():
            xr = x.clone().requires_grad_(True)
            torch.Tensor.tolist = lambda t: host_reads.append("tolist") or real_tolist(t)
            torch.Tensor.item = lambda t: host_reads.append("item") or real_item(t)
            try:
                y, _ = ep(xr)
            finally:
                torch.Tensor.tolist, torch.Tensor.item = real_tolist, real_item
            (y * g).sum().backward()
            return y, xr.grad

        (y, gx), recs = record_collectives(step)
        xf = x.clone().requires_grad_(True)
        yf, _ = full(xf)
        (yf * g).sum().backward()
        torch.testing.assert_close(y, yf, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx, xf.grad, atol=1e-5, rtol=1e-5)
        # the expert gradient sums both ranks' tokens: compare with the two full-model grads
        wg = comm.all_reduce(full.experts.w_gate_up.grad)[rank * el : (rank + 1) * el]
        torch.testing.assert_close(ep.experts.w_gate_up.grad, wg, atol=1e-4, rtol=1e-4)
        assert host_reads == ["tolist"], host_reads  # the split sizes: one host sync per call
        if rank == 0:
            (out_dir / "dispatch.json").write_text(json.dumps([r.op for r in recs]))
    finally:
        dist.destroy_process_group()


def test_dispatch_hands_collectives_the_group_device(tmp_path):
    _spawn(_dispatch, tmp_path)
    ops = json.loads((tmp_path / "dispatch.json").read_text())
    # forward: counts + rows out + rows back; backward: the two reverse exchanges
    assert ops == ["all_to_all_single"] * 5, ops


def test_a_call_site_bypassing_comm_is_caught():
    """llmtrain code calling torch.distributed itself fails before the call is made."""
    site = {"__name__": "llmtrain.train.somewhere", "dist": dist, "torch": torch}
    code = compile("def save():\n    dist.all_reduce(torch.ones(1))\n", "somewhere.py", "exec")
    exec(code, site)
    with pytest.raises(CommDeviceError, match="calls torch.distributed.all_reduce directly"):
        record_collectives(site["save"])


# ---------------------------------------------------------------- a training run


def _train(rank, world, run_dir, cache, overrides):
    from llmtrain.config import load_config
    from llmtrain.train.loop import train

    cfg = load_config(ROOT / "configs" / "debug.yaml",
                      ["train.max_steps=2", "train.warmup_steps=1", "train.eval_every=2",
                       "train.eval_batches=1", "train.save_every=2", "train.sample_tokens=0",
                       "train.tensorboard=false", f"data.cache_dir={cache}", *overrides])  # fmt: skip
    final, recs = record_collectives(train, cfg, run_dir)
    if rank == 0:
        (run_dir / "records.json").write_text(json.dumps([[r.op, r.caller] for r in recs]))
        (run_dir / "final.json").write_text(json.dumps({"loss": final["loss"]}))


@pytest.mark.slow  # ~25 s each: data preparation and DeepSpeed start-up on two ranks
@pytest.mark.parametrize("stage", [2, 3], ids=lambda s: f"zero{s}")
def test_training_run_hands_collectives_the_group_device(tmp_path, stage):
    """Dispatch, the loss/stat reduction, the router-bias load reduction, evaluation and the
    checkpoint of an EP-2 run, all under a declared non-CPU communication device."""
    run = tmp_path / "run"
    over = [f"parallel.zero_stage={stage}", "parallel.ep_size=2"]
    _spawn(_train, run, str(tmp_path / "cache"), over)
    recs = json.loads((run / "records.json").read_text())
    callers = {c for _, c in recs}
    assert "llmtrain.train.loop._step" in callers  # stats + expert loads (bias update)
    assert {"llmtrain.train.checkpointing.save", "llmtrain.train.checkpointing.resolve"} <= callers
    assert "llmtrain.train.loop.evaluate" in callers
    assert {"llmtrain.parallel.expert.forward", "llmtrain.parallel.expert.backward"} <= callers
    assert json.loads((run / "final.json").read_text())["loss"] > 0


# ---------------------------------------------------------------- static check


def test_no_module_calls_torch_distributed_collectives_directly():
    """Belt and braces for paths the runs above do not take."""
    from .comm_utils import COLLECTIVES

    bad = []
    for f in (ROOT / "llmtrain").rglob("*.py"):
        if f.name == "comm.py" and f.parent.name == "parallel":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in COLLECTIVES
                and isinstance(node.value, ast.Name)
                and node.value.id == "dist"
            ):
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno} dist.{node.attr}")
    assert not bad, bad


def test_recorder_rejects_a_tensor_off_the_declared_device():
    """The recorder itself: comm skipping its move to the group's device is caught."""

    def run():
        comm._to = lambda t, d: t  # comm 'forgets' to move (restored by the recorder)
        comm.all_reduce(torch.ones(2))

    with pytest.raises(CommDeviceError, match="not on the group's device"):
        record_collectives(run)


# ---------------------------------------------------------------- shared-memory workspace


def _shm_names(rank, world, out_dir):
    import deepspeed

    from llmtrain.parallel.engine import SHM_DIR, release_shm_names, shm_buffer_name

    os.environ["LOCAL_SIZE"] = str(world)  # what the deepspeed launcher sets on one node
    deepspeed.init_distributed(dist_backend="gloo")
    mine = os.path.join(SHM_DIR, shm_buffer_name(rank))
    created = os.path.exists(mine)  # DeepSpeed's op made it and would leave it behind
    release_shm_names()
    t = torch.full((8,), float(rank + 1))
    deepspeed.comm.inference_all_reduce(t)  # the op's shm path, on mappings whose names are gone
    (out_dir / f"{rank}.json").write_text(
        json.dumps({"created": created, "left": os.path.exists(mine), "sum": t.tolist()})
    )
    dist.destroy_process_group()


@pytest.mark.slow  # ~20 s: DeepSpeed start-up on two ranks
def test_deepspeed_shm_workspace_is_unlinked_after_init(tmp_path):
    """DeepSpeed's CPU shm op leaves a 64 MiB /dev/shm workspace per rank forever (tmpfs is RAM:
    a test suite of launches filled 20 GiB). init_distributed unlinks the names once all ranks
    have mapped them; the all-reduce still runs through the mappings."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    _spawn(_shm_names, tmp_path)
    for rank in range(2):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        assert r["created"], "DeepSpeed created no shm workspace: the test checks nothing"
        assert not r["left"]
        assert r["sum"] == [3.0] * 8


def test_a_group_of_one_gives_back_the_variables_it_set(monkeypatch):
    """`llmtrain train` / `eval --sharded` in a Python process: the launcher variables made for
    a group of one go at shutdown, and a user's own (MASTER_ADDR here) come back as they were."""
    from llmtrain.parallel.engine import init_distributed, shutdown_distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert init_distributed("gloo") == (0, 1, 0)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["WORLD_SIZE"] == "1"
    shutdown_distributed()
    assert os.environ["MASTER_ADDR"] == "10.1.2.3"
    assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"} & set(os.environ)
