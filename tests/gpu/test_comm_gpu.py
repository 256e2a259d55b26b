"""The comm helpers' contract under a real NCCL group (a world of one): results come back on
the caller's device whatever it is, values intact. NCCL rejects CPU tensors, so a helper that
skipped the move to the group's device fails here, not silently as under gloo. (The CPU suite's
strict checker, tests/comm_utils.py, emulates this; here NCCL itself is the check, and
test_resume_gpu.py runs training, saves and resumes over it.)"""

from __future__ import annotations

import os

import torch


def _contract(rank: int, port: int) -> None:
    import torch.distributed as dist

    from llmtrain.parallel import comm

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert comm.comm_device() == torch.device("cuda", 0)
        for dev in ("cpu", "cuda"):
            x = torch.arange(6, dtype=torch.float32, device=dev).view(3, 2)
            y = comm.all_reduce(x.clone())
            assert y.device.type == dev and torch.equal(y, x)
            (g,) = comm.all_gather(x)
            assert g.device.type == dev and torch.equal(g, x)
            z = comm.all_to_all_single(x, [3], [3])
            assert z.device.type == dev and torch.equal(z, x)
            w = comm.broadcast(x.clone(), src=0)
            assert w.device.type == dev and torch.equal(w, x)
            assert comm.broadcast_object({"k": dev}) == {"k": dev}
            b16 = comm.all_reduce(x.bfloat16())
            assert b16.dtype == torch.bfloat16 and b16.device.type == dev
        comm.barrier()
    finally:
        dist.destroy_process_group()


def test_comm_contract_under_nccl():
    from tests.train_utils import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    p = ctx.Process(target=_contract, args=(0, free_port()))
    p.start()
    p.join(120)
    assert p.exitcode == 0
