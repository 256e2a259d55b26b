"""Attention kernels on CUDA against the fp32 reference: SDPA, flash-attn (when installed),
flash-attn varlen and FlexAttention for document masks, at MLA's head dims (192 / 128)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.model import build_model
from llmtrain.model.attention import (
    DocumentMask,
    _flex,
    _flex_failed,
    attention,
    document_backend,
    reference_attention,
    sdpa_kernel_name,
)

DEV = "cuda"
B, H, T, E, V = 2, 16, 1024, 192, 128
SCALE = E**-0.5
ATOL = 2e-2  # bf16 inputs, fp32 reference: |error| ~ a few bf16 ulps of O(1) outputs


def _qkv(dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(B, H, T, d, device=DEV, generator=g, dtype=dtype) for d in (E, E, V)]


def _docs(eos=0, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randint(1, 200, (B, T), device=DEV, generator=g)
    ids[ids % 97 == 0] = eos  # ~10 documents per row, of varied lengths
    return DocumentMask.from_eos(ids, eos)


def _ref(q, k, v, mask=None):
    m = mask if mask is not None else torch.ones(T, T, device=DEV, dtype=torch.bool).tril()
    return reference_attention(q.float(), k.float(), v.float(), SCALE, m)


def _grads(fn, q, k, v):
    """Output and input gradients of <out, g> for a fixed O(1) g: gradients of O(1) too, so
    that the tolerances below mean something (a mean over 4M outputs gives ~1e-6)."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    g = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(7))
    (out.float() * g).sum().backward()
    return out.detach().float(), [x.grad.float() for x in (q, k, v)]


def _close_grads(got, want):
    for x, y in zip(got, want):
        err = float((x - y).abs().max() / y.abs().max())
        assert err < ATOL and float(y.abs().max()) > 1e-2, err


def test_sdpa_matches_reference_bf16():
    """What training runs without flash-attn: SDPA at MLA's 192 / 128 head dims (on Hopper with
    a recent cuDNN the dispatcher picks cuDNN's kernel; the failure names the kernel), forward
    and backward against the fp32 reference."""
    q, k, v = _qkv()
    kernel = sdpa_kernel_name(q, k, v)
    out, grads = _grads(lambda *x: attention(*x, SCALE, "sdpa"), q, k, v)
    ref, ref_grads = _grads(_ref, q, k, v)
    assert (out - ref).abs().max() < ATOL, kernel
    _close_grads(grads, ref_grads)


def test_flash_attn_matches_sdpa():
    pytest.importorskip("flash_attn")
    q, k, v = _qkv()
    a, ga = _grads(lambda *x: attention(*x, SCALE, "flash"), q, k, v)
    b, gb = _grads(lambda *x: attention(*x, SCALE, "sdpa"), q, k, v)
    assert (a - b).abs().max() < ATOL
    _close_grads(ga, gb)


def test_flash_varlen_document_mask_matches_dense():
    pytest.importorskip("flash_attn")
    q, k, v = _qkv()
    dm = _docs()
    out = attention(q, k, v, SCALE, "flash", dm)
    assert (out.float() - _ref(q, k, v, dm.dense())).abs().max() < ATOL


def test_flex_document_mask_matches_dense_forward_and_backward():
    q, k, v = _qkv()
    dm = _docs()
    a, ga = _grads(lambda *x: _flex(*x, SCALE, dm, compiled=True), q, k, v)
    b, gb = _grads(lambda *x: attention(*x, SCALE, "sdpa", dm.dense()), q, k, v)
    assert (a - _ref(q, k, v, dm.dense())).abs().max() < ATOL
    _close_grads(ga, gb)


def test_auto_uses_a_sparse_kernel_for_documents():
    q, k, v = _qkv()
    assert document_backend("auto", q) in ("flash_varlen", "flex")
    attention(q, k, v, SCALE, "auto", _docs())
    assert not _flex_failed, _flex_failed


def test_model_bf16_document_mask_equals_dense_on_gpu(debug_cfg):
    model = build_model(debug_cfg.model, device=DEV)
    ids = torch.randint(1, debug_cfg.model.vocab_size, (2, 128), device=DEV)
    ids[:, 40] = 3
    ids[1, 90] = 3
    labels = torch.roll(ids, -1, 1)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # q, k fp32 (rope), v bf16: mixed
        a = model(ids, labels=labels, attention_mask=DocumentMask.from_eos(ids, 3)).loss
        b = model(ids, labels=labels, attention_mask=DocumentMask.from_eos(ids, 3).dense()).loss
    assert abs(float(a) - float(b)) < 1e-2 * abs(float(b))
    a.backward()  # the sparse kernel's backward under autocast
    assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
