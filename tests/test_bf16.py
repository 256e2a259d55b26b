"""bf16 training through the path training takes (DeepSpeed's engine, which casts the model).

Checked at ZeRO 1/2/3 on 1 and 2 gloo ranks (DeepSpeed's bf16 runs on CPU): routing reads fp32
weights equal to the optimizer's fp32 master copy, the router bias and load counters stay fp32,
master weights and Adam moments are fp32, gradients are accumulated and reduced in fp32; and a
bf16 run's loss tracks the fp32 run's.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "configs" / "debug.yaml"

# Measured (test_bf16_loss_tracks_fp32: debug config, 30 steps of 8 x 32 tokens, 4 micro-batches,
# ZeRO-1, 1 rank, lr 3e-3, loss 6.95 -> 5.95): |loss_bf16 - loss_fp32| was at most 0.0061 over
# the first 10 steps and 0.0117 on average over the last 10 (0.2% of the loss). Bounds, ~3x:
# (DeepSpeed's BF16_Optimizer accumulating wrongly, see engine.deepspeed_config, gave 0.051 / 0.10)
EARLY_ATOL = 0.02  # max over steps 1-10
LATE_MEAN_ATOL = 0.035  # mean over steps 21-30


def _setup(rank: int, world: int, port: int, device: str = "cpu") -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR=device,
    )  # fmt: skip
    torch.set_num_threads(1)


def _batches(vocab: int, step: int, n: int, t: int) -> torch.Tensor:
    """Learnable sequences (arithmetic progressions mod vocab), the same on every run."""
    g = torch.Generator().manual_seed(1000 + step)
    a = torch.randint(0, vocab, (n, 1), generator=g)
    b = torch.randint(1, 3, (n, 1), generator=g)
    return (a + b * torch.arange(t + 1)) % vocab


def _engine(dtype: str, stage: int, world: int, ep: int, overrides=(), device: str = "cpu"):
    """Model + Engine as the trainer builds them; `device` "cuda" runs NCCL (tests/gpu)."""
    from llmtrain.config import load_config
    from llmtrain.model import build_model
    from llmtrain.parallel.engine import Engine, device_for, init_distributed, make_dispatcher
    from llmtrain.parallel.layout import make_layout

    cfg = load_config(
        CFG,
        [f"train.dtype={dtype}", f"parallel.zero_stage={stage}", f"parallel.ep_size={ep}",
         "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=32",
         "model.bias_update_speed=0.001", *overrides],
    )  # fmt: skip
    layout = make_layout(cfg, world)
    init_distributed("nccl" if device == "cuda" else "gloo")
    dev = device_for(int(os.environ["LOCAL_RANK"])) if device == "cuda" else torch.device("cpu")
    model = build_model(cfg.model, device=dev, seed=0, dispatcher=make_dispatcher(layout))
    return cfg, layout, model, Engine(model, cfg, layout)


def _train_steps(cfg, layout, model, eng, steps: int, rank: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    dev = next(model.parameters()).device
    for step in range(steps):
        eng.set_lr(3e-3)
        data = _batches(cfg.model.vocab_size, step, layout.global_batch, cfg.train.seq_len)
        mine = data.view(layout.world_size, -1, data.shape[1])[rank].to(dev)
        total = torch.zeros((), device=dev)
        for mb in mine.split(layout.micro_batch):
            out = eng(mb[:, :-1], labels=mb[:, 1:], check_inputs=False)
            eng.backward(out.loss)
            eng.step()
            total += out.lm_loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (layout.grad_accum * layout.world_size))
        loads = model.expert_loads().float()
        dist.all_reduce(loads)
        model.update_router_biases(loads)
    return losses


def _reference_grad_norm(cfg, layout) -> float:
    """Norm of step 0's gradient (mean over every rank's micro-batches), plain fp32 torch."""
    from llmtrain.model import build_model

    ref = build_model(cfg.model, seed=0)  # the same weights at any layout
    ref.train()
    data = _batches(cfg.model.vocab_size, 0, layout.global_batch, cfg.train.seq_len)
    n = layout.global_batch // layout.micro_batch
    for mb in data.split(layout.micro_batch):
        (ref(mb[:, :-1], labels=mb[:, 1:], check_inputs=False).loss / n).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))


def _dtype_worker(rank: int, world: int, port: int, stage: int, ep: int, out: str) -> None:
    _setup(rank, world, port)
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
    )

    cfg, layout, model, eng = _engine("bf16", stage, world, ep)
    res: dict = {"data_types": [str(d) for d in eng.engine.get_data_types()]}
    res["comm"] = str(eng.engine.communication_data_type)
    res["ref_norm"] = _reference_grad_norm(cfg, layout)
    _train_steps(cfg, layout, model, eng, 1, rank)
    res["norm"] = eng.grad_norm()  # of the gradient accumulated over the step's micro-batches
    # gradients as accumulated over micro-batches, read at the boundary before the step
    x = _batches(cfg.model.vocab_size, 99, layout.micro_batch, cfg.train.seq_len)
    res["bf16_grads_alive"] = 0
    for _ in range(layout.grad_accum):
        eng.backward(eng(x[:, :-1], labels=x[:, 1:], check_inputs=False).loss)
        res["bf16_grads_alive"] += sum(p.grad.numel() for p in model.parameters()
                                       if p.grad is not None and p.grad.dtype != torch.float32)  # fmt: skip
        if eng.engine.is_gradient_accumulation_boundary():
            g = safe_get_full_grad(model.moe_layers()[0].gate.weight)
            res["grad_dtype"] = str(g.dtype)
        eng.step()
    gate0 = model.moe_layers()[0].gate
    res["param_dtype"] = str(gate0.weight.dtype)  # the engine's compute copy: bf16
    res["routing"] = []
    for m in model.moe_layers():
        w = m.gate.routing_weight()
        master = safe_get_full_fp32_param(m.gate.weight)
        res["routing"].append(
            {
                "weight": str(w.dtype),
                "equals_master": bool(torch.equal(w.detach(), master.to(w.device))),
                "master_not_bf16": bool((master.bfloat16().float() != master).any()),
                "bias": str(m.gate.e_score_correction_bias.dtype),
                "counts": [str(m.last_counts.dtype), str(m.load_since_update.dtype)],
            }
        )
    eng.relink_optimizer_state()
    res["masters"] = sorted(
        {str(safe_get_full_fp32_param(p).dtype) for p in model.parameters()}
        | {str(safe_get_full_optimizer_state(p, "exp_avg").dtype) for p in model.parameters()}
    )
    # a gamma step at |bias| >= 0.5 survives (bf16 spacing there is 2**-8 = 0.0039)
    m = model.moe_layers()[0]
    m.gate.e_score_correction_bias.fill_(0.75)
    load = torch.arange(cfg.model.n_routed_experts, dtype=torch.float32)
    m.update_bias(load)
    step = m.gate.e_score_correction_bias - 0.75
    res["bias_step"] = [float(step.min()), float(step.max())]
    # the routers' full fp32 copies each rank keeps (what `llmtrain count` adds in bf16)
    res["router_fp32_bytes"] = sum(
        m.gate.fp32_weight.nbytes for m in model.moe_layers() if m.gate.fp32_weight is not None
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    import torch.distributed as dist

    dist.destroy_process_group()


def _loss_worker(
    rank: int, world: int, port: int, dtype: str, steps: int, out: str, device: str = "cpu"
) -> None:
    _setup(rank, world, port, device)
    cfg, layout, model, eng = _engine(dtype, 1, world, 1, device=device)
    losses = _train_steps(cfg, layout, model, eng, steps, rank)
    if rank == 0:
        Path(out, f"{dtype}.json").write_text(json.dumps(losses))
    import torch.distributed as dist

    dist.destroy_process_group()


def _sync_worker(rank: int, world: int, port: int, out: str, device: str = "cpu") -> None:
    """Counts device synchronisations inside the micro-batches that are not a step's last
    (forward, backward, engine.step) after the first step (DeepSpeed's timer started at its
    global step 2); on CUDA any implicit sync in them raises."""
    _setup(rank, world, port, device)
    from deepspeed.accelerator import get_accelerator

    cfg, layout, model, eng = _engine("bf16", 1, world, 1, device=device)
    acc, calls, inside = get_accelerator(), [], [False]
    real = acc.synchronize
    acc.synchronize = lambda *a, **k: (calls.append(inside[0]), real(*a, **k))[1]
    dev = next(model.parameters()).device
    for step in range(4):
        eng.set_lr(1e-3)
        data = _batches(cfg.model.vocab_size, step, layout.global_batch, cfg.train.seq_len)
        for i, mb in enumerate(data.to(dev).split(layout.micro_batch)):
            inside[0] = i < layout.grad_accum - 1 and step >= 1  # step 0: warm-up
            if inside[0] and device == "cuda":  # implicit syncs too (.item(), D2H copies)
                torch.cuda.set_sync_debug_mode("error")
            res = eng(mb[:, :-1], labels=mb[:, 1:], check_inputs=False)
            eng.backward(res.loss)
            eng.step()
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            inside[0] = False
    Path(out, "syncs.json").write_text(json.dumps({"inside": sum(calls), "all": len(calls)}))


def _accum_worker(rank: int, world: int, port: int, ours: bool, out: str) -> None:
    """bf16 ZeRO-1 steps with our one-pass gradient accumulation and without all-reduce over
    one rank (`ours`), or with DeepSpeed's own methods for both."""
    _setup(rank, world, port)
    cfg, layout, model, eng = _engine("bf16", 1, world, 1)
    res = {"installed": "_update_hp_grad" in vars(eng.optimizer),
           "allreduce": eng.engine.enable_backward_allreduce}  # fmt: skip
    if not ours:
        del eng.optimizer._update_hp_grad  # back to the class's method
        eng.engine.enable_backward_allreduce = True
    res["losses"] = _train_steps(cfg, layout, model, eng, 3, rank)
    res["norm"] = eng.grad_norm()
    from deepspeed.utils import safe_get_full_fp32_param

    w = torch.cat([safe_get_full_fp32_param(p).flatten() for p in model.parameters()])
    res["weights"] = w.double().sum().item(), w.abs().double().sum().item()
    Path(out, f"{'ours' if ours else 'deepspeed'}.json").write_text(json.dumps(res))


def _one_rank_worker(rank: int, world: int, port: int, stage: int, out: str) -> None:
    _setup(rank, world, port)
    cfg, layout, model, eng = _engine("bf16", stage, world, 1)
    losses = _train_steps(cfg, layout, model, eng, 3, rank)
    res = {"losses": losses, "norm": eng.grad_norm(),
           "allreduce": eng.engine.enable_backward_allreduce}  # fmt: skip
    Path(out, f"stage{stage}.json").write_text(json.dumps(res))


def _router_init_worker(rank: int, world: int, port: int, stage: int, hf_dir: str, out: str):
    """The routers' fp32 masters and routing copies as the trainer builds them (bf16), from the
    seed and from train.init_from."""
    _setup(rank, world, port)
    from deepspeed.utils import safe_get_full_fp32_param

    from llmtrain.config import load_config
    from llmtrain.parallel.engine import init_distributed
    from llmtrain.parallel.layout import make_layout
    from llmtrain.train.loop import build_model_and_engine

    cfg = load_config(CFG, ["train.dtype=bf16", f"parallel.zero_stage={stage}"])
    init_distributed("gloo")
    res = {}
    for how, init_from in (("seed", None), ("init_from", hf_dir)):
        model, _ = build_model_and_engine(cfg, make_layout(cfg, world), torch.device("cpu"),
                                          init_from=init_from)  # fmt: skip
        res[how] = [(safe_get_full_fp32_param(m.gate.weight).clone(), m.gate.fp32_weight.clone())
                    for m in model.moe_layers()]  # fmt: skip
    torch.save(res, Path(out, f"stage{stage}.pt"))


def _flatten_worker(rank: int, world: int, port: int, ep: int, bucket: int, out: str) -> None:
    """The largest copy DeepSpeed's gradient all-reduce flattens in one bf16 ZeRO-1 step, with
    its all-reduce bucket of `bucket` elements."""
    _setup(rank, world, port)
    from torch._utils import _flatten_dense_tensors

    cfg, layout, model, eng = _engine("bf16", 1, world, ep)
    copies = [0]

    def flatten(ts):
        flat = _flatten_dense_tensors(ts)
        if flat.data_ptr() != ts[0].data_ptr():  # a new tensor, not a view of the one
            copies.append(flat.numel() * flat.element_size())
        return flat

    ds = eng.engine
    ds.flatten, allreduce = flatten, ds.allreduce_gradients
    ds.allreduce_gradients = lambda bucket_size=bucket: allreduce(bucket_size=bucket_size)
    _train_steps(cfg, layout, model, eng, 1, rank)
    res = {"optimizer": type(ds.optimizer).__name__, "peak": max(copies)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def _bucket_worker(rank: int, world: int, port: int, stage: int, offload: bool, out: str):
    """The reduce buckets bf16 ZeRO-1/2 allocate (torch.empty: whole on a GPU's allocator, on CPU
    only the pages touched) in one step."""
    _setup(rank, world, port)
    cfg, layout, model, eng = _engine("bf16", stage, world, 1,
                                      [f"train.offload_optimizer={str(offload).lower()}"])  # fmt: skip
    opt, res = eng.engine.optimizer, {"bytes": 0, "dtypes": []}
    setup = opt.setup_buckets

    def setup_buckets():  # what a backward holds (released after each micro-batch's step)
        setup()
        bufs = [b for bucket in opt.ipg_buckets.values() for b in bucket.buffer]
        res["bytes"] = max(res["bytes"], sum(b.numel() * b.element_size() for b in bufs))
        res["dtypes"] = sorted({*res["dtypes"], *(str(b.dtype) for b in bufs)})

    opt.setup_buckets = setup_buckets
    _train_steps(cfg, layout, model, eng, 1, rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


def _spawn(fn, world: int, *args) -> None:
    from tests.train_utils import free_port, run_then_exit

    port = free_port()
    if world == 1:  # in a child all the same: the process group and DeepSpeed state stay out
        ctx = torch.multiprocessing.get_context("spawn")
        p = ctx.Process(target=run_then_exit, args=(0, fn, 1, port, *args))
        p.start()
        p.join(300)
        assert p.exitcode == 0, f"worker failed ({p.exitcode})"
        return
    torch.multiprocessing.start_processes(
        run_then_exit, args=(fn, world, port, *args), nprocs=world, join=True, start_method="spawn"
    )


@pytest.fixture(autouse=True)
def _importable_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize(
    "world,stage,ep",
    [(1, 1, 1), (2, 2, 2), pytest.param(2, 3, 1, marks=pytest.mark.slow),
     pytest.param(2, 1, 2, marks=pytest.mark.slow)],
    ids=["1rank-zero1", "2ranks-zero2-ep2", "2ranks-zero3", "2ranks-zero1-ep2"],
)  # fmt: skip
def test_bf16_engine_keeps_routing_and_accumulation_fp32(tmp_path, world, stage, ep):
    pytest.importorskip("deepspeed")
    from llmtrain.accounting import _router_numel
    from llmtrain.config import load_config

    _spawn(_dtype_worker, world, stage, ep, str(tmp_path))
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["data_types"] == ["torch.bfloat16", "torch.float32"]
        assert res["comm"] == "torch.float32"
        assert res["grad_dtype"] == "torch.float32"
        assert res["param_dtype"] == "torch.bfloat16"  # what DeepSpeed does to every parameter
        for layer in res["routing"]:
            assert layer["weight"] == "torch.float32"
            assert layer["equals_master"] and layer["master_not_bf16"]
            assert layer["bias"] == "torch.float32"
            assert layer["counts"] == ["torch.float32", "torch.float32"]
        assert res["masters"] == ["torch.float32"]
        assert res["router_fp32_bytes"] == 4 * _router_numel(load_config(CFG).model)
        if stage == 1:  # ZeRO-1's fp32 accumulator takes each bf16 gradient and frees it, as
            # `llmtrain count` assumes (no bf16 gradients beside the fp32 ones)
            assert res["bf16_grads_alive"] == 0
        # accumulated over 4 micro-batches per rank: bf16 compute noise only (a wrong
        # accumulation, as DeepSpeed's BF16_Optimizer without immediate_grad_update, is > +100%)
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=0.03)
        assert res["bias_step"] == pytest.approx([-1e-3, 1e-3], abs=1e-6)


@pytest.mark.slow  # two 2-rank launches
@pytest.mark.parametrize("ep", [1, 2])
def test_bf16_zero1_gradient_allreduce_copies_what_count_predicts(tmp_path, ep):
    """bf16 ZeRO-1 over several ranks runs DeepSpeed's BF16_Optimizer, whose fp32 gradient
    buffers the engine all-reduces in buckets: a bucket of one buffer in place, one of several
    through a new flat copy. `llmtrain count`'s deepspeed_buffers is that copy, at DeepSpeed's
    500M-element bucket and at one smaller than the largest buffer."""
    pytest.importorskip("deepspeed")
    from llmtrain.accounting import (
        DS_ALLREDUCE_BUCKET,
        _fallback_flatten_peak,
        _param_split,
        memory_per_rank,
    )
    from llmtrain.config import load_config

    c = load_config(CFG).model
    split = _param_split(c, 2, ep)
    small = int(max(max(g) for g in split.group_sizes if g)) - 1
    for bucket in (DS_ALLREDUCE_BUCKET, small):
        _spawn(_flatten_worker, 2, ep, bucket, str(tmp_path))
        got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert {g["optimizer"] for g in got} == {"BF16_Optimizer"}
        pred = 4 * max(_fallback_flatten_peak(g, bucket) for g in split.group_sizes)
        assert [g["peak"] for g in got] == [pred, pred], (bucket, got, pred)
        if bucket == DS_ALLREDUCE_BUCKET:
            assert memory_per_rank(c, 2, 1, ep, "bf16")["deepspeed_buffers"] == pred > 0


@pytest.mark.slow  # a 2-rank launch each (the offloaded one: DeepSpeed's CPU Adam)
@pytest.mark.parametrize("stage,offload,dtype", [(2, False, "torch.bfloat16"),
                                                 (1, True, "torch.float32")])  # fmt: skip
def test_bf16_reduce_bucket_is_allocated_whole_as_count_says_on_cuda(tmp_path, stage, offload,
                                                                     dtype):  # fmt: skip
    """ZeRO-1/2 allocate the reduce bucket at reduce_bucket_size whatever the rank holds: in
    bf16 at ZeRO-2, in fp32 at an offloaded ZeRO-1 (DeepSpeed's ZeRO optimizer accumulating in
    fp32, not BF16_Optimizer). A GPU's allocator reserves all of it, which `count --device cuda`
    adds (on CPU untouched pages cost nothing: the bucket counts what a rank holds)."""
    pytest.importorskip("deepspeed")
    from llmtrain.accounting import DS_REDUCE_BUCKET, _param_split, memory_per_rank
    from llmtrain.config import load_config

    _spawn(_bucket_worker, 2, stage, offload, str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and got[0]["dtypes"] == [dtype], got
    nbytes = torch.empty(0, dtype=getattr(torch, dtype.split(".")[1])).element_size()
    assert got[0]["bytes"] == nbytes * DS_REDUCE_BUCKET
    c = load_config(CFG).model
    s = _param_split(c, 2, 1)
    flat = 2 * min(s.largest_group_part, s.held)
    cuda, cpu = (memory_per_rank(c, 2, stage, 1, "bf16", device=d, offload_optimizer=offload)
                 ["deepspeed_buffers"] for d in ("cuda", "cpu"))  # fmt: skip
    staging = 2 * s.part if offload else 0  # ZeRO-Offload's bf16 copy of the partition (host)
    assert cuda == got[0]["bytes"] + flat and cpu == nbytes * s.held + flat + staging


@pytest.mark.slow
def test_bf16_loss_tracks_fp32(tmp_path):
    """Same data, same init: bf16 (ZeRO-1) tracks fp32 within EARLY_ATOL / LATE_MEAN_ATOL."""
    pytest.importorskip("deepspeed")
    steps = 30
    for dtype in ("fp32", "bf16"):
        _spawn(_loss_worker, 1, dtype, steps, str(tmp_path))
    f32 = json.loads((tmp_path / "fp32.json").read_text())
    b16 = json.loads((tmp_path / "bf16.json").read_text())
    assert f32[-1] < f32[0] - 0.5  # it learns, so the comparison means something
    diff = [abs(a - b) for a, b in zip(f32, b16)]
    assert max(diff[:10]) < EARLY_ATOL, f"bf16 - fp32 loss per step: {diff}"
    assert sum(diff[-10:]) / 10 < LATE_MEAN_ATOL, f"bf16 - fp32 loss per step: {diff}"


def test_bf16_zero3_routers_start_from_exact_fp32_weights(tmp_path):
    """ZeRO-3 builds every weight in bf16 (zero.Init): its routers' fp32 masters and routing
    copies are still the seed's fp32 draw (as ZeRO-1 builds them, in fp32) and, from
    train.init_from, the file's fp32 values, not their bf16 rounding."""
    pytest.importorskip("deepspeed")
    from .hf_utils import DEBUG_HF, make_hf_model

    hf = make_hf_model(seed=3, **DEBUG_HF)
    hf.save_pretrained(tmp_path / "hf")
    want = [w.float() for n, w in hf.state_dict().items() if n.endswith("mlp.gate.weight")]
    for stage in (1, 3):
        _spawn(_router_init_worker, 1, stage, str(tmp_path / "hf"), str(tmp_path))
    z1, z3 = (torch.load(tmp_path / f"stage{s}.pt") for s in (1, 3))
    for how, ref in (("seed", [m for m, _ in z1["seed"]]), ("init_from", want)):
        assert len(z3[how]) == len(ref) == 2
        for (master, routing), r in zip(z3[how], ref):
            assert (r.bfloat16().float() != r).any()  # not bf16 values: the rounding would show
            assert torch.equal(master, r) and torch.equal(routing, r), how
    for (master, _), r in zip(z1["init_from"], want):
        assert torch.equal(master, r)


@pytest.mark.slow
def test_bf16_zero1_kill_and_resume_is_exact(tmp_path):
    """The trainer in bf16 (BF16_Optimizer, fp32 routers from the master copy) resumes
    bit-exactly on CPU: master weights, moments and the routers' fp32 weights are restored."""
    from tests.train_utils import kill_when_step, metrics, run_train

    over = ["train.max_steps=8", "train.warmup_steps=2", "train.sample_tokens=0",
            "train.eval_every=4", "train.save_every=4", "train.tensorboard=false",
            "train.dtype=bf16", "data.doc_mask=true", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    run_train(tmp_path / "a", 1, over)
    kill_when_step(tmp_path / "b", 1, over, step=6)
    run_train(tmp_path / "b", 1, [*over, "resume=auto"])
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_engine_micro_batches_never_synchronise_the_device(tmp_path):
    """DeepSpeed's throughput timer (on by default) synchronised the device at every forward
    and engine.step(): the GPU drained twice a micro-batch. Off in our config, no micro-batch
    but a step's last one synchronises."""
    pytest.importorskip("deepspeed")
    _spawn(_sync_worker, 1, str(tmp_path))
    res = json.loads((tmp_path / "syncs.json").read_text())
    assert res["inside"] == 0, res


def test_one_pass_accumulation_is_deepspeeds_to_the_bit(tmp_path):
    """Engine.accumulate_in_place (bf16 gradients added into the fp32 accumulator without a
    temporary copy) and no all-reduce over one rank leave losses, norms and master weights
    exactly as DeepSpeed's own methods do."""
    pytest.importorskip("deepspeed")
    for ours in (True, False):
        _spawn(_accum_worker, 1, ours, str(tmp_path))
    a = json.loads((tmp_path / "ours.json").read_text())
    b = json.loads((tmp_path / "deepspeed.json").read_text())
    assert a["installed"] and not a["allreduce"]
    assert a["losses"][-1] < a["losses"][0]
    assert (a["losses"], a["norm"], a["weights"]) == (b["losses"], b["norm"], b["weights"])


@pytest.mark.parametrize("stage", [2, 3], ids=lambda s: f"zero{s}")
def test_one_rank_partitioning_stages_keep_their_reduction(tmp_path, stage):
    """On one rank the reduction is skipped only for optimizers whose reduction is a plain
    all-reduce: ZeRO-2/3 partition their gradients in that call (skipped, ZeRO-3's step failed
    with a KeyError)."""
    pytest.importorskip("deepspeed")
    _spawn(_one_rank_worker, 1, stage, str(tmp_path))
    res = json.loads((tmp_path / f"stage{stage}.json").read_text())
    assert res["allreduce"] and all(map(math.isfinite, [*res["losses"], res["norm"]])), res
    assert res["losses"][-1] < res["losses"][0], res
