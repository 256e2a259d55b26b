"""LM head fused with cross-entropy, computed in chunks of tokens.

Shape legend: N tokens, D hidden, V vocabulary, C tokens per chunk.

Why: the [N, V] logits, their log-softmax and its gradient are the largest tensors of a step
at small width (3 × 131 MB for 1,024 tokens × 32k vocab) and the log-softmax passes cost more
than the head's matmul. Computing loss and the gradients of (hidden, head weight) chunk by chunk
in the forward keeps one [C, V] block alive and reads it once; backward only scales the saved
gradients. The FLOPs are those of the plain head (one matmul forward, two backward).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _chunk_rows(v: int, device: torch.device | None = None, n: int = 0) -> int:
    """Tokens per chunk. CPU: ~16 MB of fp32 logits (cache-sized; tuned on CPU). CUDA: ~256 MB,
    a multiple of 128 rows: few launches and GEMMs large enough to fill the GPU. Given the
    token count `n` (a multiple of 128), CUDA chunks divide it evenly where a size up to 1.25x
    that one allows: a ragged last chunk runs the eager path (8 passes over its fp32 logits,
    not 2). At 16,384 tokens and vocab 102,400 the 640-row chunks left a ragged one; 512-row
    chunks do not (vocab 32,000: 2,048 rows, which divide it already)."""
    if device is not None and device.type == "cuda":
        cap = max(128, (1 << 26) // v // 128 * 128)
        if n and n % 128 == 0:
            if n <= cap:
                return n  # one full chunk (the compiled path), not one ragged
            lo = -(-n // (cap + cap // 4))  # fewest chunks of at most 1.25 x cap rows
            for k in range(lo, 2 * lo + 1):
                if n % (128 * k) == 0:
                    return n // k
        return cap
    return max(32, (1 << 22) // v)


def _ce_chunk(z_CV, tgt_C, val_C, inv, out_dtype: torch.dtype):
    """One chunk's summed loss and d(mean loss)/dz = (softmax(z) - onehot(target)) · valid / n.

    One function so that torch.compile makes its passes over the [C, V] block two kernels (a
    row reduction, then the gradient written once in the matmul's dtype); eager, the same maths
    is ~8 passes over fp32 logits (`_FusedLinearCE` runs it in place instead)."""
    z_CV = z_CV.float()
    lse_C = torch.logsumexp(z_CV, dim=-1)
    loss = ((lse_C - z_CV.gather(1, tgt_C[:, None]).squeeze(1)) * val_C).sum()
    hot_CV = torch.arange(z_CV.shape[1], device=z_CV.device)[None, :] == tgt_C[:, None]
    g_CV = (torch.exp(z_CV - lse_C[:, None]) - hot_CV.float()) * (val_C.float() * inv)[:, None]
    return loss, g_CV.to(out_dtype)


@functools.cache
def _compiled_ce_chunk():
    return torch.compile(_ce_chunk, dynamic=False, fullgraph=True)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk: int, need_w_grad: bool, fused: bool = False):
        n = h_ND.shape[0]
        valid_N = labels_N != -100
        n_valid = valid_N.sum().clamp(min=1)
        grad_h = torch.empty_like(h_ND)
        grad_w = (
            torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
            if need_w_grad
            else None
        )
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        inv = 1.0 / n_valid.float()
        for s in range(0, n, chunk):
            h_CD, lab_C, val_C = (
                h_ND[s : s + chunk],
                labels_N[s : s + chunk],
                valid_N[s : s + chunk],
            )
            tgt_C = lab_C.clamp(min=0)
            if fused and h_CD.shape[0] == chunk:  # compiled: two kernels over the logits
                # (full chunks only: one graph per run; a ragged last chunk, whose length
                # changes with N, runs eager, as fullgraph=True fails at the recompile limit)
                part, g_CV = _compiled_ce_chunk()(h_CD @ w_VD.t(), tgt_C, val_C, inv, h_ND.dtype)
                total += part
            else:
                z_CV = (h_CD @ w_VD.t()).float()
                lse_C = torch.logsumexp(z_CV, dim=-1)
                total += ((lse_C - z_CV.gather(1, tgt_C[:, None]).squeeze(1)) * val_C).sum()
                # d(sum loss)/dz = softmax(z) - onehot(target), on valid rows only
                g_CV = z_CV.sub_(lse_C[:, None]).exp_()
                g_CV[torch.arange(g_CV.shape[0], device=g_CV.device), tgt_C] -= 1.0
                g_CV.mul_((val_C.float() * inv)[:, None])
                g_CV = g_CV.to(h_ND.dtype)
            grad_h[s : s + chunk] = g_CV @ w_VD
            if grad_w is not None:
                # tensor cores: each chunk's product rounded to bf16 once, summed over chunks in
                # fp32, the total cast to the weight's dtype in backward all the same
                if h_CD.is_cuda and h_CD.dtype != torch.float32:
                    grad_w.add_(g_CV.t() @ h_CD)
                else:
                    grad_w.addmm_(g_CV.t().float(), h_CD.float())
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.need_w_grad = need_w_grad
        ctx.w_dtype = w_VD.dtype
        return total * inv

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        gw = (grad_w * g).to(ctx.w_dtype) if ctx.need_w_grad else None
        return grad_h * g.to(grad_h.dtype), gw, None, None, None, None


class LMHead(nn.Linear):
    """The output projection; given labels it returns the mean cross-entropy without logits.

    Being the module that owns the weight matters under ZeRO-3: its forward hooks gather it.
    `compile_ce` (set by `train.compile`): on CUDA, each chunk's softmax and gradient run as
    compiled kernels (`_ce_chunk`).
    """

    def __init__(self, hidden: int, vocab: int):
        super().__init__(hidden, vocab, bias=False)
        self.compile_ce = False

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        h_ND = h.reshape(-1, h.shape[-1])
        labels_N = labels.reshape(-1)
        if torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad):
            return _FusedLinearCE.apply(
                h_ND,
                self.weight,
                labels_N,
                _chunk_rows(self.out_features, h.device, h_ND.shape[0]),
                self.weight.requires_grad,
                self.compile_ce and h.is_cuda,
            )
        return chunked_cross_entropy(h_ND, self.weight, labels_N)


@torch.no_grad()
def chunked_cross_entropy(
    h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor
) -> torch.Tensor:
    """Mean CE over labels != -100 without keeping [N, V] logits (evaluation)."""
    chunk = _chunk_rows(w_VD.shape[0], h_ND.device, h_ND.shape[0])
    valid_N = labels_N != -100
    total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
    for s in range(0, h_ND.shape[0], chunk):
        z = (h_ND[s : s + chunk] @ w_VD.t()).float()
        lab = labels_N[s : s + chunk]
        ce = torch.logsumexp(z, -1) - z.gather(1, lab.clamp(min=0)[:, None]).squeeze(1)
        total += (ce * valid_N[s : s + chunk]).sum()
    return total / valid_N.sum().clamp(min=1)
