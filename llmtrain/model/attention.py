"""Multi-head latent attention (MLA) and the attention kernels behind it.

Shape legend: B batch, T query length, S key length (cache + new), D hidden, H heads,
N qk_nope_head_dim, P qk_rope_head_dim, E = N + P (qk head dim), V v_head_dim,
Q q_lora_rank, R kv_lora_rank.

Training/prefill expands the latent into per-head K/V and calls a fused kernel. Cached decoding
works in the latent space ("absorbed" form): q_nope is pushed through W_UK and the output through
W_UV, so the cache holds only R + P values per token per layer.

Document masking (packed sequences, attention inside each document) is described by document
ids (`DocumentMask`), not by a dense [B, 1, T, T] mask, so that a kernel can skip the masked
blocks: flash-attn's variable-length kernel (one causal sequence per document, cu_seqlens) or
FlexAttention with a block mask, on CUDA. A dense mask into SDPA is only the fallback (CPU, where
FlexAttention has no backward in torch 2.13, or neither kernel available).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.config import ModelConfig
from llmtrain.model.layers import RMSNorm, apply_rope, softmax_scale

logger = logging.getLogger(__name__)


_FLASH_OK: bool | None = None  # a plain global: compiled code reads it as a constant


def flash_attn_available() -> bool:
    """flash-attn importable here, with CUDA. Imported, not only found: a wheel built for
    another torch (an ABI mismatch, common) fails at import, and must mean "use SDPA", not a
    crash at the first forward. `compile_blocks` asks before compiling, so no trace imports."""
    global _FLASH_OK
    if _FLASH_OK is None:
        _FLASH_OK = False
        if importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available():
            try:
                from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401

                _FLASH_OK = True
            except Exception as e:  # ImportError, OSError (undefined symbol), RuntimeError ...
                logger.warning("flash-attn is installed but does not import (%s: %s); using "
                               "SDPA", type(e).__name__, e)  # fmt: skip
    return _FLASH_OK


_logged: set[str] = set()


def _log_choice(name: str, why: str) -> None:
    if torch.compiler.is_compiling():  # a log call would split the compiled graph in two
        return
    if name not in _logged:
        _logged.add(name)
        logger.info("attention backend: %s (%s)", name, why)


def resolve_backend(requested: str, q: torch.Tensor) -> str:
    """Pick the kernel at run time; flash-attn only on CUDA in half precision when installed."""
    if requested == "flash":
        if not (flash_attn_available() and q.is_cuda):
            raise RuntimeError(
                "attn_backend='flash' needs CUDA and the flash-attn package "
                "(pip install 'llmtrain[gpu]'); use 'auto' or 'sdpa' elsewhere"
            )
        return "flash"
    if requested == "auto":
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
            _log_choice("flash", "CUDA, half precision, flash-attn installed")
            return "flash"
        _log_choice("sdpa", f"device={q.device.type}, dtype={q.dtype}")
        return "sdpa"
    _log_choice(requested, "requested in config")
    return requested


def sdpa_kernel_name(q_BHTE, k_BHSE, v_BHSV, mask: torch.Tensor | None = None) -> str:
    """The kernel torch's SDPA dispatcher picks for these inputs (causal when `mask` is None):
    cuDNN, flash or efficient on CUDA, math as the fallback. MLA's q/k and v head dims differ,
    which rules out SDPA's flash kernel, so which one runs instead is worth a line in the log."""
    try:
        from torch.nn.attention import SDPBackend

        causal = mask is None and q_BHTE.shape[-2] == k_BHSE.shape[-2]
        i = torch._fused_sdp_choice(q_BHTE, k_BHSE, v_BHSV, attn_mask=mask, is_causal=causal)
        return SDPBackend(i).name.lower()
    except Exception as e:  # a private API: say why rather than fail a training step
        return f"unknown ({type(e).__name__})"


class DocumentMask:
    """Causal attention restricted to documents: `doc_BT[b, i]` is the document of token i.

    Ids must be non-decreasing along each row (packed documents). Each derived form (dense mask,
    cu_seqlens, FlexAttention block mask) is built once and shared by every layer of a forward.
    """

    def __init__(self, doc_BT: torch.Tensor):
        self.doc_BT = doc_BT
        self._dense: torch.Tensor | None = None
        self._varlen: tuple[torch.Tensor, int] | None = None
        self._block = None
        self._prefixes: dict[int, DocumentMask] = {}

    def prefix(self, n: int) -> DocumentMask:
        """The mask of each row's first n tokens (an MTP depth's positions), built once."""
        if n == self.doc_BT.shape[1]:
            return self
        if n not in self._prefixes:
            self._prefixes[n] = DocumentMask(self.doc_BT[:, :n])
        return self._prefixes[n]

    @classmethod
    def from_eos(cls, input_ids_BT: torch.Tensor, eos_id: int) -> DocumentMask:
        """Split after each EOS: the EOS belongs to the document it ends."""
        eos = (input_ids_BT == eos_id).long()
        return cls(torch.cumsum(eos, dim=1) - eos)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, t = self.doc_BT.shape
        return (b, 1, t, t)

    def dense(self) -> torch.Tensor:
        """[B, 1, T, T] boolean "may attend" mask (the fallback, and the reference)."""
        if self._dense is None:
            d = self.doc_BT
            t = d.shape[1]
            causal_TT = torch.ones(t, t, dtype=torch.bool, device=d.device).tril()
            self._dense = ((d[:, :, None] == d[:, None, :]) & causal_TT).unsqueeze(1)
        return self._dense

    def prepare(self, kind: str) -> DocumentMask:
        """Build the form the `kind` kernel reads (`document_backend`) now, before the layers:
        outside any compiled block, so compiled code only reads it (a form built inside would
        change the guards after the first layer), and a host sync (varlen) happens here once."""
        if kind == "flash_varlen":
            self.varlen()
        elif kind == "flex":
            self.block_mask()
        else:
            self.dense()
        return self

    def varlen(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens int32 [n_docs + 1] over the flattened B·T tokens, longest document).

        Two host syncs per forward (the document starts' count in `nonzero`, the longest
        length), made once in `prepare` before the layers; documents never span two rows.
        """
        if self._varlen is None:
            d = self.doc_BT
            start_BT = torch.ones_like(d, dtype=torch.bool)
            start_BT[:, 1:] = d[:, 1:] != d[:, :-1]
            starts = start_BT.reshape(-1).nonzero().squeeze(1)
            cu = torch.cat([starts, starts.new_tensor([d.numel()])]).to(torch.int32)
            self._varlen = (cu, int((cu[1:] - cu[:-1]).max()))
        return self._varlen

    def block_mask(self, heads: int | None = None):
        """FlexAttention BlockMask (causal within documents); blocks wholly masked are skipped."""
        if self._block is None:
            from torch.nn.attention.flex_attention import create_block_mask

            doc = self.doc_BT

            def mask_mod(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

            b, t = doc.shape
            self._block = create_block_mask(mask_mod, b, None, t, t, device=doc.device)
        return self._block


def mask_prefix(mask, n: int):
    """`mask` (None, DocumentMask or boolean [B, 1, T, T]) restricted to the first n positions."""
    if mask is None:
        return None
    if isinstance(mask, DocumentMask):
        return mask.prefix(n)
    return mask[..., :n, :n]


def check_mask(mask, shape_BT: torch.Size | tuple[int, int]) -> None:
    """Refuse masks that would broadcast silently: an HF-style [B, T] padding mask of batch 1
    broadcast over [B, 1, T, S] would let every query see every key, the future included."""
    if mask is None or isinstance(mask, DocumentMask):
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"attention_mask {got} must be a boolean [B, 1, T, S] 'may attend' mask (causality "
            "included) or a DocumentMask; an HF-style [B, T] padding mask is not read: combine "
            "it with causal_mask(T, S) as pad_BS[:, None, None, :] & causal_TS"
        )
    if mask.dtype != torch.bool:  # SDPA would add a 0/1 float mask to the scores: no masking
        raise ValueError(
            f"attention_mask must be boolean (True: may attend), not {mask.dtype}: a float mask "
            "would be added to the scores (the future unmasked); pass mask.bool()"
        )
    b, t = shape_BT
    if mask.shape[0] not in (1, b) or mask.shape[2] != t:
        raise ValueError(
            f"attention_mask {tuple(mask.shape)} does not fit input_ids [{b}, {t}]: it must be "
            f"[{b} or 1, 1, {t}, S]"
        )


def _dense(mask) -> torch.Tensor | None:
    return mask.dense() if isinstance(mask, DocumentMask) else mask


@functools.cache
def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def one_head_dim(q_BHTE, k_BHSE, v_BHSV):
    """flash-attn wants one head dim for q, k and v: v zero-padded up to q·k's (the padded
    output columns are dropped after), or q and k up to v's (zeros add nothing to q·kᵀ; the
    softmax scale is passed explicitly, so it stays that of the true dim)."""
    e, v = q_BHTE.shape[-1], v_BHSV.shape[-1]
    if v < e:
        return q_BHTE, k_BHSE, F.pad(v_BHSV, (0, e - v))
    if v > e:
        return F.pad(q_BHTE, (0, v - e)), F.pad(k_BHSE, (0, v - e)), v_BHSV
    return q_BHTE, k_BHSE, v_BHSV


@torch.compiler.disable  # eager even inside a compiled block: cu_seqlens' length and the
# longest document change every batch, and a graph specialised on them would recompile each step
def _flash_varlen(q_BHTE, k_BHSE, v_BHSV, scale: float, mask: DocumentMask) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # optional, CUDA only

    b, h, t, _ = q_BHTE.shape
    v = v_BHSV.shape[-1]
    q_BHTE, k_BHSE, vv = one_head_dim(q_BHTE, k_BHSE, v_BHSV)
    cu, longest = mask.varlen()

    def flat(x_BHTX):  # [B·T, H, X]: the documents laid end to end
        return x_BHTX.transpose(1, 2).reshape(b * t, h, x_BHTX.shape[-1])

    out_NHE = flash_attn_varlen_func(
        flat(q_BHTE), flat(k_BHSE), flat(vv), cu, cu, longest, longest,
        softmax_scale=scale, causal=True,
    )  # fmt: skip
    return out_NHE[..., :v].reshape(b, t, h, v).transpose(1, 2)


def _flex(q_BHTE, k_BHSE, v_BHSV, scale: float, mask: DocumentMask, compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    return fn(q_BHTE, k_BHSE, v_BHSV, block_mask=mask.block_mask(), scale=scale)


_flex_failed: list[str] = []  # why FlexAttention was given up (then dense SDPA is used)
_flex_probed: set[tuple] = set()
FLEX_PROBED_ON = {"cuda"}  # device types whose FlexAttention is probed first (compiled there)


def _flex_works(
    q_BHTE: torch.Tensor, v_BHSV: torch.Tensor, mask: DocumentMask, scale: float
) -> bool:
    """Compile and run FlexAttention forward + backward once, at these shapes, dtype, scale and
    with this mask, before training relies on it: its backward compiles lazily, inside
    `loss.backward()`, where a failure could not fall back any more. Probing at the real shapes
    means the real call reuses what the probe compiled."""
    if _flex_failed:
        return False
    if torch.compiler.is_compiling():  # inside a compiled block: compiled with it, no fallback
        return True
    key = (tuple(q_BHTE.shape), tuple(v_BHSV.shape), q_BHTE.dtype, q_BHTE.device, scale)
    if key in _flex_probed or q_BHTE.device.type not in FLEX_PROBED_ON:
        return True
    _flex_probed.add(key)
    dev = q_BHTE.device
    # identity saved-tensor hooks: inside a checkpointed block (activation checkpointing) the
    # checkpoint would pack the probe's saved tensors too, counting them in its forward but not
    # in its recompute (which skips the probe): a CheckpointError in backward. fork_rng: the
    # probe's random inputs leave the run's generator where it was (a resume draws the same)
    keep = torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    try:
        with torch.enable_grad(), keep, torch.random.fork_rng([dev] if dev.type == "cuda" else []):
            q, k, v = (
                torch.randn(x.shape, device=dev, dtype=x.dtype, requires_grad=True)
                for x in (q_BHTE, q_BHTE, v_BHSV)
            )
            _flex(q, k, v, scale, mask, compiled=q_BHTE.is_cuda).float().sum().backward()
    except Exception as e:  # an unsupported shape or compiler: run on, densely
        _flex_failed.append(repr(e))
        logger.warning(
            "FlexAttention failed (%r); document masking falls back to SDPA with a dense mask", e
        )
        return False
    return True


def document_backend(backend: str, q: torch.Tensor) -> str:
    """The kernel for a DocumentMask: varlen flash-attn, FlexAttention (CUDA), else dense SDPA."""
    if backend == "flash":
        return "flash_varlen"
    if backend == "auto" and q.is_cuda:
        if q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
            return "flash_varlen"
        if flex_available():
            return "flex"
    if backend == "flex":
        return "flex"
    return "reference" if backend == "reference" else "sdpa"


def reference_attention(
    q_BHTE: torch.Tensor,
    k_BHSE: torch.Tensor,
    v_BHSV: torch.Tensor,
    scale: float,
    mask_TS: torch.Tensor | None,
) -> torch.Tensor:
    """Plain softmax(QKᵀ·scale + mask)·V in fp32; mask is boolean (True = may attend)."""
    s = _atleast_fp32(torch.matmul(q_BHTE, k_BHSE.transpose(-1, -2))) * scale
    p = torch.softmax(s, dim=-1) if mask_TS is None else masked_softmax(s, mask_TS)
    return torch.matmul(p.to(v_BHSV.dtype), v_BHSV)


def masked_softmax(s: torch.Tensor, may_attend: torch.Tensor) -> torch.Tensor:
    """softmax over the keys a query may attend; a query that may attend none (a left pad's
    row) gets zeros, as SDPA gives, not NaN: p·V of the next layer's real queries would be
    0·NaN = NaN at that key, and the NaN would reach every token of the sequence."""
    p = torch.softmax(s.masked_fill(~may_attend, float("-inf")), dim=-1)
    return p.masked_fill(~may_attend.any(dim=-1, keepdim=True), 0.0)


def _atleast_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype.itemsize < 4 else x


def causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[T, S] boolean mask for T new queries at the end of S keys."""
    i = torch.arange(t, device=device)[:, None] + (s - t)
    j = torch.arange(s, device=device)[None, :]
    return j <= i


def attention(
    q_BHTE: torch.Tensor,
    k_BHSE: torch.Tensor,
    v_BHSV: torch.Tensor,
    scale: float,
    backend: str,
    mask: torch.Tensor | DocumentMask | None = None,
) -> torch.Tensor:
    """Causal attention through the chosen backend; returns [B, H, T, V].

    `mask` replaces the plain causal mask: a DocumentMask (document masking: sparse kernels on
    CUDA, see `document_backend`) or a bool [B or 1, 1, T, S] tensor (dense, through SDPA).
    """
    t, s = q_BHTE.shape[-2], k_BHSE.shape[-2]
    if isinstance(mask, DocumentMask) and t == s:
        # one dtype for the sparse kernels (under autocast rope leaves q, k in fp32 and v in
        # bf16; FlexAttention has no backward for mixed dtypes): the narrowest of the three
        dt = min((q_BHTE.dtype, k_BHSE.dtype, v_BHSV.dtype), key=lambda d: d.itemsize)
        q_BHTE, k_BHSE, v_BHSV = (x.to(dt) for x in (q_BHTE, k_BHSE, v_BHSV))
        kind = document_backend(backend, q_BHTE)
        if kind == "flash_varlen":
            resolve_backend("flash", q_BHTE)  # raises with the fix when flash-attn cannot run
            _log_choice("flash-attn varlen", "document mask as cu_seqlens")
            return _flash_varlen(q_BHTE, k_BHSE, v_BHSV, scale, mask)
        if kind == "flex" and _flex_works(q_BHTE, v_BHSV, mask, scale):
            _log_choice("flex", f"document mask as a block mask on {q_BHTE.device.type}")
            return _flex(q_BHTE, k_BHSE, v_BHSV, scale, mask, compiled=q_BHTE.is_cuda)
    mask = _dense(mask)
    backend = resolve_backend(backend, q_BHTE)
    if backend == "flash" and mask is None and t == s:
        from flash_attn import flash_attn_func  # optional, CUDA only

        v = v_BHSV.shape[-1]
        qq, kk, vv = one_head_dim(q_BHTE, k_BHSE, v_BHSV)
        out = flash_attn_func(
            qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
            softmax_scale=scale, causal=True,
        )  # fmt: skip
        return out[..., :v].transpose(1, 2)
    if backend in ("sdpa", "flash", "flex"):
        # is_compiling first: a compiled graph that read `_logged` would be guarded on it and
        # recompiled when an eager forward (evaluation) adds to it. A training call only (with
        # grad): evaluation's masked or cached calls may take another kernel
        if (not torch.compiler.is_compiling() and q_BHTE.requires_grad
                and "sdpa kernel" not in _logged):  # fmt: skip
            m = mask if mask is not None or t == s else causal_mask(t, s, q_BHTE.device)
            why = f"q {tuple(q_BHTE.shape)}, v {tuple(v_BHSV.shape)}, {q_BHTE.dtype}"
            _log_choice("sdpa kernel", f"{sdpa_kernel_name(q_BHTE, k_BHSE, v_BHSV, m)}: {why}")
        if mask is None and t == s:
            return F.scaled_dot_product_attention(
                q_BHTE, k_BHSE, v_BHSV, is_causal=True, scale=scale
            )
        m = mask if mask is not None else causal_mask(t, s, q_BHTE.device)
        return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSV, attn_mask=m, scale=scale)
    m = mask if mask is not None else causal_mask(t, s, q_BHTE.device)
    return reference_attention(q_BHTE, k_BHSE, v_BHSV, scale, m)


class MLACache:
    """Per-layer compressed cache: the normalised latent [B, S, R] and the rotated rope key [B, S, P]."""

    def __init__(self, num_layers: int):
        self.c_kv: list[torch.Tensor | None] = [None] * num_layers
        self.k_rope: list[torch.Tensor | None] = [None] * num_layers

    @property
    def seq_len(self) -> int:
        c = self.c_kv[0]
        return 0 if c is None else c.shape[1]

    def update(self, layer: int, c_BTR: torch.Tensor, kr_BTP: torch.Tensor):
        if self.c_kv[layer] is None:
            self.c_kv[layer], self.k_rope[layer] = c_BTR, kr_BTP
        else:
            self.c_kv[layer] = torch.cat([self.c_kv[layer], c_BTR], dim=1)
            self.k_rope[layer] = torch.cat([self.k_rope[layer], kr_BTP], dim=1)
        return self.c_kv[layer], self.k_rope[layer]

    def bytes_per_token(self) -> int:
        total = 0
        for c, k in zip(self.c_kv, self.k_rope):
            if c is not None:
                total += c.shape[-1] * c.element_size() + k.shape[-1] * k.element_size()
        return total


class MLA(nn.Module):
    """DeepSeek multi-head latent attention; parameter names follow the HF checkpoint layout."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        h, d = cfg.num_heads, cfg.hidden_size
        self.h, self.n, self.p, self.v, self.r = (
            h, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
        )  # fmt: skip
        e = self.n + self.p
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * e, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)  # 1e-6 whatever rms_norm_eps
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * e, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.r + self.p, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.r, h * (self.n + self.v), bias=False)
        self.o_proj = nn.Linear(h * self.v, d, bias=False)
        self.scale = softmax_scale(cfg)
        # q_a_proj and kv_a_proj_with_mqa read the same x: one GEMM over both weights, whose
        # narrow outputs (512, 576 at 1B) each run far below the GPU's matmul rate. Set by
        # `train.compile` (never under ZeRO-3, whose hooks gather a weight only in its module's call)
        self.fuse_input_proj = False

    def _down(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(q_a_proj(x) or None without q compression, kv_a_proj_with_mqa(x))."""
        if self.cfg.q_lora_rank is None:
            return None, self.kv_a_proj_with_mqa(x_BTD)
        if not self.fuse_input_proj:
            return self.q_a_proj(x_BTD), self.kv_a_proj_with_mqa(x_BTD)
        w = torch.cat([self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight])
        return F.linear(x_BTD, w).split([self.cfg.q_lora_rank, self.r + self.p], dim=-1)

    def _q(self, x_BTD: torch.Tensor, qa: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x_BTD.shape
        if qa is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(qa))
        q_BHTE = q.view(b, t, self.h, self.n + self.p).transpose(1, 2)
        return q_BHTE[..., : self.n], q_BHTE[..., self.n :]

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: MLACache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        interleave = self.cfg.rope.interleave
        cos1, sin1 = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, P2]
        qa, ckv = self._down(x_BTD)
        qn_BHTN, qr_BHTP = self._q(x_BTD, qa)
        qr_BHTP = apply_rope(qr_BHTP, cos1, sin1, interleave)
        c_BTR = self.kv_a_layernorm(ckv[..., : self.r])
        kr_BTP = apply_rope(ckv[..., self.r :].unsqueeze(1), cos1, sin1, interleave).squeeze(1)

        if cache is not None:
            c_BSR, kr_BSP = cache.update(self.layer_idx, c_BTR, kr_BTP)
            o_BHTV = self._absorbed(qn_BHTN, qr_BHTP, c_BSR, kr_BSP, mask)
        else:
            s = t
            kv = self.kv_b_proj(c_BTR).view(b, s, self.h, self.n + self.v).transpose(1, 2)
            kn_BHSN, v_BHSV = kv[..., : self.n], kv[..., self.n :]
            k_BHSE = torch.cat([kn_BHSN, kr_BTP.unsqueeze(1).expand(b, self.h, s, self.p)], dim=-1)
            q_BHTE = torch.cat([qn_BHTN, qr_BHTP], dim=-1)
            o_BHTV = attention(q_BHTE, k_BHSE, v_BHSV, self.scale, self.cfg.attn_backend, mask)
        return self.o_proj(o_BHTV.transpose(1, 2).reshape(b, t, self.h * self.v))

    def _absorbed(self, qn_BHTN, qr_BHTP, c_BSR, kr_BSP, mask):
        """Attention in latent space: scores = (q_nope·W_UK)·cᵀ + q_rope·k_ropeᵀ, out = (p·c)·W_UVᵀ."""
        w = self.kv_b_proj.weight.view(self.h, self.n + self.v, self.r)
        w_uk_HNR, w_uv_HVR = w[:, : self.n], w[:, self.n :]
        ql_BHTR = torch.einsum("bhtn,hnr->bhtr", qn_BHTN, w_uk_HNR)
        s_BHTS = torch.matmul(ql_BHTR, c_BSR.unsqueeze(1).transpose(-1, -2))
        s_BHTS = s_BHTS + torch.matmul(qr_BHTP, kr_BSP.unsqueeze(1).transpose(-1, -2))
        s_BHTS = _atleast_fp32(s_BHTS) * self.scale
        t, s = s_BHTS.shape[-2:]
        mask = _dense(mask)
        if mask is None:  # causal: every query has a key, no all-masked row to zero
            m = causal_mask(t, s, s_BHTS.device)
            p_BHTS = torch.softmax(s_BHTS.masked_fill(~m, float("-inf")), dim=-1)
        else:
            p_BHTS = masked_softmax(s_BHTS, mask)
        p_BHTS = p_BHTS.to(c_BSR.dtype)
        ol_BHTR = torch.matmul(p_BHTS, c_BSR.unsqueeze(1))
        return torch.einsum("bhtr,hvr->bhtv", ol_BHTR, w_uv_HVR)
