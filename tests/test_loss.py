import pytest
import torch
import torch.nn.functional as F

from llmtrain.model.loss import LMHead, chunked_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_head_ce_matches_plain_loss_and_grads(dtype, monkeypatch):
    monkeypatch.setattr(
        "llmtrain.model.loss._chunk_rows", lambda v, device=None, n=0: 7
    )  # ragged chunks
    torch.manual_seed(0)
    head = LMHead(16, 50).to(dtype)
    h = torch.randn(3, 10, 16, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (3, 10))
    labels[0, :4] = -100
    loss = head(h, labels)
    ref = F.cross_entropy(head(h).reshape(-1, 50).float(), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss.to(ref.dtype), ref)
    g1 = torch.autograd.grad(loss * 3.0, [h, head.weight])
    g2 = torch.autograd.grad(ref * 3.0, [h, head.weight])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b.to(a.dtype))
    with torch.no_grad():
        torch.testing.assert_close(head(h, labels), ref)
    torch.testing.assert_close(
        chunked_cross_entropy(h.reshape(-1, 16), head.weight, labels.reshape(-1)), ref.detach()
    )


def test_chunk_size_by_device():
    from llmtrain.model.loss import _chunk_rows

    cpu = _chunk_rows(32000, torch.device("cpu"))
    gpu = _chunk_rows(32000, torch.device("cuda", 0))  # no GPU needed: only the device type
    assert cpu == _chunk_rows(32000) == (1 << 22) // 32000  # CPU keeps its tuned size
    assert gpu % 128 == 0 and gpu >= 8 * cpu
    assert _chunk_rows(10**7, torch.device("cuda")) == 128  # never below one tile of rows
    cuda = torch.device("cuda")
    # given the token count, CUDA chunks divide it (no ragged, eager last chunk), <= 1.25 x
    for v, n in [(32000, 16384), (32000, 32768), (129280, 16384), (102400, 8192), (50257, 4096)]:
        rows = _chunk_rows(v, cuda, n)
        assert n % rows == 0 and rows % 128 == 0, (v, n, rows)
        assert _chunk_rows(v, cuda) // 2 < rows <= 1.25 * _chunk_rows(v, cuda), (v, n, rows)
    assert _chunk_rows(32000, cuda, 16384) == 2048
    assert _chunk_rows(102400, cuda, 16384) == 512  # 640 rows left a ragged chunk
    assert _chunk_rows(32000, cuda, 1000) == _chunk_rows(32000, cuda)  # not a multiple of 128
    assert _chunk_rows(32000, cuda, 1024) == 1024  # fewer tokens than a chunk: one full chunk
    assert _chunk_rows(32000, torch.device("cpu"), 16384) == cpu  # CPU: unchanged


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_chunk_function_matches_in_place_path(compiled, monkeypatch):
    """`_ce_chunk` (what `train.compile` runs per chunk on CUDA) gives the in-place path's loss
    and gradients; compiled here on CPU by inductor, eager when not."""
    from llmtrain.model import loss as L

    if not compiled:
        monkeypatch.setattr(L, "_compiled_ce_chunk", lambda: L._ce_chunk)
    torch.manual_seed(0)
    w = torch.randn(50, 16, requires_grad=True)
    h = torch.randn(30, 16, requires_grad=True)
    labels = torch.randint(0, 50, (30,))
    labels[:4] = -100
    out = []
    for fused in (False, True):
        loss = L._FusedLinearCE.apply(h, w, labels, 8, True, fused)
        out.append((loss, *torch.autograd.grad(loss * 2.0, [h, w])))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ragged last chunks of 9 lengths (past torch.compile's recompile limit of 8, where a
    # fullgraph function raises): only full chunks take the compiled function
    for n in range(17, 26):
        L._FusedLinearCE.apply(h[:n], w, labels[:n], 8, True, True).backward()
