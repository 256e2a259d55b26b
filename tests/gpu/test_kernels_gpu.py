"""MoE and loss pieces that take CUDA-only paths: the shared experts on a side stream, grouped
GEMM in bf16, the fused cross-entropy with GPU-sized chunks and a bf16 weight gradient, and a
training step on one GPU that never waits for the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llmtrain.config import load_config
from llmtrain.model import build_model
from llmtrain.model.loss import LMHead, _chunk_rows
from llmtrain.model.moe import MoE

DEV = "cuda"


def _grads(m, x):
    x = x.detach().requires_grad_(True)
    y, aux = m(x)
    (y.float().square().mean() + aux).backward()
    out = [y.detach().float(), x.grad.float()]
    out += [p.grad.float().clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad()
    return out


def test_shared_experts_side_stream_matches_serial(debug_cfg):
    cfg = dataclasses.replace(debug_cfg.model, hidden_size=256, moe_intermediate_size=128)
    torch.manual_seed(0)
    m = MoE(cfg).to(DEV)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    m.train()
    x = torch.randn(4, 512, cfg.hidden_size, device=DEV)
    serial = _grads(m, x)
    m.overlap_shared = lambda x_TD: x_TD.is_cuda  # as with expert parallelism
    overlapped = _grads(m, x)
    torch.cuda.synchronize()
    for a, b in zip(overlapped, serial):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_moe_on_cuda_matches_cpu_fp32(debug_cfg):
    """CUDA's own routing (a sort, not topk) and gather dispatch give the CPU path's outputs
    and gradients in fp32, group-limited routing included."""
    cfg = dataclasses.replace(
        debug_cfg.model, hidden_size=256, moe_intermediate_size=128, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, scoring_func="sigmoid",
    )  # fmt: skip
    torch.manual_seed(0)
    m = MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    m.train()
    x = torch.randn(2, 256, cfg.hidden_size)
    with torch.no_grad():  # no near-tie for device rounding (~1e-7 here) to flip a choice
        s = torch.sigmoid(x.view(-1, cfg.hidden_size) @ m.gate.weight.t()).sort(-1).values
        assert (s[:, 1:] - s[:, :-1]).min() > 1e-6
    ref = _grads(m, x)
    got = _grads(m.to(DEV), x.to(DEV))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_ce_bf16_gpu_chunks_match_reference(compiled):
    torch.manual_seed(0)
    v, d, n = 32000, 512, 8192
    assert _chunk_rows(v, torch.device(DEV)) < n  # several chunks
    head = LMHead(d, v).to(DEV, torch.bfloat16)
    head.compile_ce = compiled  # as train.compile sets it
    h = (torch.randn(n, d, device=DEV) * 0.5).bfloat16().requires_grad_(True)
    labels = torch.randint(0, v, (n,), device=DEV)
    labels[:100] = -100
    loss = head(h, labels)
    gh, gw = torch.autograd.grad(loss, [h, head.weight])
    h32, w32 = h.detach().float().requires_grad_(True), head.weight.detach().float()
    w32.requires_grad_(True)
    ref = F.cross_entropy(h32 @ w32.t(), labels, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, [h32, w32])
    assert abs(float(loss) - float(ref)) < 1e-2
    for a, b in ((gh, rh), (gw, rw)):
        err = (a.float() - b).abs().max() / b.abs().max()
        assert err < 2e-2, float(err)


@pytest.mark.parametrize("compiled", [False, True])
def test_one_gpu_training_step_never_syncs_the_host(compiled):
    """A bf16 forward + backward of moe_1b's layer shapes (2 layers, MTP, aux losses) raises on
    any synchronising CUDA call: dispatch, grouped GEMM, attention and the fused CE stay on the
    device, eager and as train.compile runs them (compiled blocks, fused GEMMs, compiled CE
    chunks). tests/test_model.py checks the eager model with FakeTensorMode on CPU."""
    over = ["model.num_layers=2", "model.mtp_depth=1", "model.router_z_loss_coef=1e-3"]
    cfg = load_config("configs/moe_1b.yaml", over).model
    model = build_model(cfg, device=DEV, dtype=torch.bfloat16).train()
    if compiled:
        from llmtrain.train.compile import compile_blocks

        compile_blocks(model, expert_parallel=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 1025), device=DEV)

    def step():
        out = model(ids[:, :-1], labels=ids[:, 1:], check_inputs=False)
        out.loss.backward()
        return out.loss.detach()

    step()  # warm-up: cuBLAS handles, workspaces, lazy kernel loading
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
