"""Document masking without a dense mask: DocumentMask's kernels against the dense reference."""

from __future__ import annotations

import pytest
import torch

from llmtrain.data.loader import document_mask
from llmtrain.model import build_model
from llmtrain.model.attention import (
    DocumentMask,
    _flex,
    attention,
    document_backend,
    reference_attention,
    sdpa_kernel_name,
)


def _qkv(b=2, h=3, t=40, e=24, v=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, vv = (torch.randn(b, h, t, d, generator=g) for d in (e, e, v))
    return q, k, vv


def _docs(b=2, t=40, eos=0, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (b, t), generator=g)
    ids[ids % 7 == 0] = eos  # several documents per row, some of one token
    ids[1, -1] = eos
    return ids


def test_document_mask_dense_equals_loader_mask():
    ids = _docs()
    dm = DocumentMask.from_eos(ids, 0)
    assert torch.equal(dm.dense(), document_mask(ids, 0))
    assert dm.shape == (2, 1, 40, 40)


@pytest.mark.parametrize("backend", ["sdpa", "reference", "auto"])
def test_document_masked_attention_equals_dense_reference(backend):
    q, k, v = _qkv()
    q.requires_grad_(True)
    dm = DocumentMask.from_eos(_docs(), 0)
    ref = reference_attention(q, k, v, 0.2, dm.dense())
    out = attention(q, k, v, 0.2, backend, dm)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), q)
    (g_out,) = torch.autograd.grad(out.square().sum(), q)
    torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)


def test_sdpa_kernel_name_reports_the_dispatchers_choice(caplog):
    """MLA's v is narrower than q/k, which SDPA's flash kernels refuse: on CPU torch falls back
    to its math kernel, and the log says so (on CUDA it names cuDNN or the efficient kernel)."""
    q, k, v = _qkv()
    assert sdpa_kernel_name(q, k, v) == "math"
    assert sdpa_kernel_name(q, k, torch.randn(2, 3, 40, 24)) == "flash_attention"
    import llmtrain.model.attention as A

    A._logged.discard("sdpa kernel")
    with caplog.at_level("INFO", logger="llmtrain.model.attention"):
        with torch.no_grad():  # evaluation-like calls may take other kernels: not logged
            attention(q, k, v, 0.2, "auto")
        assert "sdpa kernel" not in caplog.text
        attention(q.requires_grad_(), k, v, 0.2, "auto")  # a training call is
    assert "sdpa kernel (math: q (2, 3, 40, 24), v (2, 3, 40, 16)" in caplog.text


def test_cpu_picks_dense_fallback():
    q, _, _ = _qkv()
    assert document_backend("auto", q) == "sdpa"  # FlexAttention has no CPU backward (2.13)


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention warns it is slow
def test_flex_block_mask_forward_equals_dense_on_cpu():
    """The FlexAttention path (what CUDA runs, compiled) in eager mode, forward only on CPU."""
    q, k, v = _qkv(t=64)
    dm = DocumentMask.from_eos(_docs(t=64), 0)
    with torch.no_grad():
        out = _flex(q, k, v, 0.2, dm, compiled=False)
    torch.testing.assert_close(
        out, reference_attention(q, k, v, 0.2, dm.dense()), atol=1e-5, rtol=1e-5
    )


def test_varlen_cu_seqlens_cover_the_documents():
    """What flash-attn's varlen kernel computes from cu_seqlens (one causal attention per
    document of the flattened batch), emulated per document, equals the dense reference."""
    b, h, t = 2, 3, 40
    q, k, v = _qkv(b, h, t)
    dm = DocumentMask.from_eos(_docs(b, t), 0)
    cu, longest = dm.varlen()
    lens = (cu[1:] - cu[:-1]).tolist()
    assert cu[0] == 0 and cu[-1] == b * t and max(lens) == longest and min(lens) >= 1

    def flat(x):
        return x.transpose(1, 2).reshape(b * t, h, x.shape[-1])

    fq, fk, fv = flat(q), flat(k), flat(v)
    out = torch.empty(b * t, h, v.shape[-1])
    for a, z in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[a:z] = torch.nn.functional.scaled_dot_product_attention(
            fq[a:z].transpose(0, 1), fk[a:z].transpose(0, 1), fv[a:z].transpose(0, 1),
            is_causal=True, scale=0.2,
        ).transpose(0, 1)  # fmt: skip
    got = out.reshape(b, t, h, -1).transpose(1, 2)
    torch.testing.assert_close(
        got, reference_attention(q, k, v, 0.2, dm.dense()), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "activation-checkpointing"])
def test_model_with_document_mask_equals_dense_mask(debug_cfg, ckpt):
    model = build_model(debug_cfg.model, seed=0)
    model.gradient_checkpointing = ckpt
    model.train()
    ids = _docs(2, 48, eos=3)
    labels = torch.roll(ids, -1, 1)
    losses, grads = [], []
    for mask in (document_mask(ids, 3), DocumentMask.from_eos(ids, 3)):
        model.zero_grad()
        out = model(ids, labels=labels, attention_mask=mask)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append(model.model.layers[0].self_attn.kv_b_proj.weight.grad.clone())
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("v_dim", [6, 8, 12])
def test_one_head_dim_padding_leaves_attention_unchanged(v_dim):
    """flash-attn takes one head dim: padding v up to q·k's, or q and k up to a larger v (a
    v_head_dim above qk_nope + qk_rope), gives the same output once cut back to v's dim."""
    import torch.nn.functional as F

    from llmtrain.model.attention import one_head_dim, reference_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    v = torch.randn(2, 3, 5, v_dim, generator=g)
    qq, kk, vv = one_head_dim(q, k, v)
    assert qq.shape[-1] == kk.shape[-1] == vv.shape[-1] == max(8, v_dim)
    got = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=0.3)[..., :v_dim]
    want = reference_attention(q, k, v, 0.3, torch.ones(5, 5, dtype=torch.bool).tril())
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)


def test_flex_probe_inside_a_checkpointed_block_leaves_backward_and_the_rng_alone(monkeypatch):
    """On CUDA the first FlexAttention call of a shape is probed (a forward + backward on random
    inputs), inside the first block: with activation checkpointing that block is checkpointed,
    and the probe's saved tensors, counted in its forward but not in its recompute (which skips
    the probe), failed the first backward with a CheckpointError; its random draws moved the
    run's generator. CPU stand-in (FlexAttention has no CPU backward): a dense differentiable
    kernel in its place, the probe enabled for CPU."""
    import llmtrain.model.attention as A
    import llmtrain.model.transformer as TR
    from llmtrain.config import load_config

    def dense_flex(q, k, v, scale, mask, compiled):
        return reference_attention(q, k, v, scale, mask.dense()).to(q.dtype)

    monkeypatch.setattr(A, "_flex", dense_flex)
    monkeypatch.setattr(A, "FLEX_PROBED_ON", {"cpu"})
    monkeypatch.setattr(A, "_flex_failed", [])
    for mod in (A, TR):
        monkeypatch.setattr(mod, "document_backend", lambda backend, q: "flex")
    cfg = load_config("configs/debug.yaml").model
    ids = _docs(t=64, eos=3)
    losses = []
    for ckpt in (False, True):
        monkeypatch.setattr(A, "_flex_probed", set())
        model = build_model(cfg, seed=0).train()
        model.gradient_checkpointing = ckpt
        state = torch.get_rng_state()
        out = model(ids, labels=ids.roll(-1, 1), attention_mask=DocumentMask.from_eos(ids, 3))
        out.loss.backward()
        assert A._flex_probed and not A._flex_failed, A._flex_failed
        assert torch.equal(torch.get_rng_state(), state)
        losses.append(out.loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
