"""Small building blocks: RMSNorm, the SwiGLU MLP, rotary embeddings (default and YaRN).

Shape legend: B batch, T query length, S key length, D hidden, F ffn width, H heads,
P rope dims (qk_rope_head_dim), P2 = P // 2 rotary frequencies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as DeepSeek and HF do."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float() if x.dtype.itemsize < 4 else x  # at least fp32 (float64 stays float64)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used for dense layers and shared experts."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        # gate and up in one GEMM (twice as wide: a shared expert's 768 columns run well below
        # the GPU's matmul rate). Set by `train.compile` (then eval and generation take it too,
        # same results), never under ZeRO-3 (see MLA's)
        self.fuse_gate_up = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_gate_up:
            w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
            g, u = F.linear(x, w).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------- rotary embeddings


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """m(s, k) = 0.1·k·ln s + 1 (YaRN's attention temperature), 1 for s <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [P2] and the cos/sin scale, for default RoPE or YaRN.

    YaRN blends interpolated and extrapolated frequencies with a linear ramp between the
    correction dims of beta_fast / beta_slow (floored / ceiled), as DeepSeek-V3 and HF do.
    """
    base = rope.theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_extra = 1.0 / pos
    if rope.type == "default":
        return inv_extra, 1.0
    factor = rope.factor
    inv_inter = 1.0 / (factor * pos)
    orig = rope.original_max_position_embeddings

    def corr_dim(n_rot: float) -> float:
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra_w = 1 - ramp
    inv = inv_inter * (1 - extra_w) + inv_extra * extra_w
    # HF's rule: attention_factor if given, else the ratio m(f, mscale)/m(f, mscale_all_dim)
    # when both are set, else m(f, 1).
    if rope.attention_factor is not None:
        att = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        att = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        att = yarn_mscale(factor)
    return inv, float(att)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times m(factor, mscale_all_dim)^2 under YaRN."""
    scale = cfg.qk_head_dim**-0.5
    r = cfg.rope
    if r.type != "default" and r.mscale_all_dim:
        m = yarn_mscale(r.factor, r.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Holds inv_freq and returns (cos, sin) [B?, T, P2] for given positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rope = cfg.rope
        self.dim = cfg.qk_rope_head_dim
        self.register_buffer("inv_freq", torch.empty(self.dim // 2), persistent=False)
        self.attention_scaling = 1.0

    def reset_parameters(self) -> None:
        inv, self.attention_scaling = rope_inv_freq(self.rope, self.dim)
        self.inv_freq = inv.to(self.inv_freq.device)

    def _apply(self, fn, recurse=True):
        """Keep the frequencies fp32 through `model.to(bf16)`: rounded to bf16 they are off by
        up to 4e-3 relative, a rotation error of several radians at position 32k."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(self.rope, self.dim)[0].to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[..., None].float() * self.inv_freq.float()
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate the last dim of x [..., T, P] by (cos, sin) [T, P2] or [B, 1, T, P2].

    interleave=True pairs (x0,x1),(x2,x3)... (DeepSeek's layout); False pairs x_i with x_{i+P/2}.
    The output is laid out [real parts | imaginary parts] in both cases: q and k share the layout,
    so their dot product equals that of the pairwise-interleaved output.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
