"""Parameters, FLOPs, KV-cache bytes and memory per rank from a config alone (no model built).

Conventions (stated, since every paper counts a little differently):
- total / active parameters count every weight (embeddings, norms, router) except buffers such as
  the router's correction bias; "active" counts K routed experts per token instead of all E.
- "non-embedding" leaves out the input embedding table only (a lookup, no compute); an untied LM
  head is a matmul every token pays for and stays in. This is the convention under which
  DeepSeek-V2-Lite has 2.4B active parameters; 6·N·D uses N = active non-embedding parameters.
- training FLOPs per token = 6 × active *matmul* parameters (every linear layer a token passes
  through, LM head and router included; the embedding lookup is not a matmul) plus the attention
  term 6 × L × H × (d_qk + d_v) × (T + 1) / 2: QKᵀ and A·V over the causal context, averaged over
  the T positions of a sequence, forward (×2) + backward (×4).
- MTP modules are reported apart and added to the training FLOPs when enabled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmtrain.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass
class LayerCount:
    index: int
    kind: str  # "dense" | "moe" | "mtp"
    attn: int
    mlp_total: int
    mlp_active: int
    norms: int
    extra: int = 0  # MTP projections and norms
    attn_matmul: int = 0
    extra_matmul: int = 0

    @property
    def total(self) -> int:
        return self.attn + self.mlp_total + self.norms + self.extra

    @property
    def active(self) -> int:
        return self.attn + self.mlp_active + self.norms + self.extra

    @property
    def matmul_active(self) -> int:
        return self.attn_matmul + self.mlp_active + self.extra_matmul


@dataclass
class Counts:
    total_params: int
    active_params: int
    embedding_params: int  # the input embedding table
    lm_head_params: int  # 0 when tied to the embedding
    non_embedding_params: int
    active_non_embedding_params: int
    expert_params: int  # routed experts only: the part split by expert parallelism
    mtp_params: int
    flops_per_token: float
    flops_6nd_per_token: float
    attn_flops_per_token: float
    mtp_flops_per_token: float
    seq_len: int
    kv_cache_bytes_per_token: int
    kv_cache_bytes_per_token_mha: int
    layers: list[LayerCount] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "layers"}
        d["layers"] = [
            {
                "index": l.index,
                "kind": l.kind,
                "attn": l.attn,
                "mlp_total": l.mlp_total,
                "mlp_active": l.mlp_active,
                "total": l.total,
                "active": l.active,
            }
            for l in self.layers
        ]
        return d


def attn_params(c: ModelConfig) -> tuple[int, int]:
    """(all parameters, matmul parameters) of one MLA block."""
    d, h, e = c.hidden_size, c.num_heads, c.qk_head_dim
    if c.q_lora_rank is None:
        q_mm, q_norm = d * h * e, 0
    else:
        q_mm, q_norm = d * c.q_lora_rank + c.q_lora_rank * h * e, c.q_lora_rank
    kv_mm = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * h * (
        c.qk_nope_head_dim + c.v_head_dim
    )
    o_mm = h * c.v_head_dim * d
    mm = q_mm + kv_mm + o_mm
    return mm + q_norm + c.kv_lora_rank, mm


def mlp_params(c: ModelConfig, moe: bool) -> tuple[int, int]:
    """(total, active) parameters of the feed-forward part (router included for MoE)."""
    d = c.hidden_size
    if not moe:
        n = 3 * d * c.intermediate_size
        return n, n
    one = 3 * d * c.moe_intermediate_size
    router = c.n_routed_experts * d
    shared = c.n_shared_experts * one
    return (
        router + shared + c.n_routed_experts * one,
        router + shared + c.num_experts_per_tok * one,
    )


def _layer(c: ModelConfig, i: int, kind: str) -> LayerCount:
    moe = kind == "mtp" or c.is_moe_layer(i)
    a, a_mm = attn_params(c)
    mt, ma = mlp_params(c, moe and c.n_routed_experts > 0)
    lc = LayerCount(
        i, kind if kind == "mtp" else ("moe" if moe else "dense"), a, mt, ma, 2 * c.hidden_size
    )
    lc.attn_matmul = a_mm
    if kind == "mtp":
        d = c.hidden_size
        lc.extra_matmul = 2 * d * d
        lc.extra = lc.extra_matmul + 3 * d  # enorm, hnorm, shared_head.norm
    return lc


def count(c: ModelConfig, seq_len: int | None = None, kv_dtype: str = "bf16") -> Counts:
    """Everything `llmtrain count` prints, from the config alone."""
    t = seq_len or c.max_position_embeddings
    d, v = c.hidden_size, c.vocab_size
    layers = [_layer(c, i, "main") for i in range(c.num_layers)]
    mtp_layers = [_layer(c, c.num_layers + k, "mtp") for k in range(c.mtp_depth)]
    emb = v * d
    head = 0 if c.tie_word_embeddings else v * d
    body_total = sum(l.total for l in layers) + d + head  # + final norm + head
    body_active = sum(l.active for l in layers) + d + head
    mtp_params = sum(l.total for l in mtp_layers)
    expert_one = 3 * d * c.moe_intermediate_size
    experts = sum(c.n_routed_experts * expert_one for l in layers if l.kind == "moe")

    head_mm = v * d
    matmul_active = sum(l.matmul_active for l in layers) + head_mm
    attn_term = 6 * c.num_heads * (c.qk_head_dim + c.v_head_dim) * (t + 1) / 2
    attn_flops = c.num_layers * attn_term
    mtp_flops = sum(6 * (l.matmul_active + head_mm) + attn_term for l in mtp_layers)
    nbytes = DTYPE_BYTES[kv_dtype]
    return Counts(
        total_params=emb + body_total,
        active_params=emb + body_active,
        embedding_params=emb,
        lm_head_params=head,
        non_embedding_params=body_total,
        active_non_embedding_params=body_active,
        expert_params=experts,
        mtp_params=mtp_params,
        flops_per_token=6 * matmul_active + attn_flops + mtp_flops,
        flops_6nd_per_token=6 * body_active,
        attn_flops_per_token=attn_flops,
        mtp_flops_per_token=mtp_flops,
        seq_len=t,
        kv_cache_bytes_per_token=c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * nbytes,
        kv_cache_bytes_per_token_mha=c.num_layers
        * c.num_heads
        * (c.qk_head_dim + c.v_head_dim)
        * nbytes,
        layers=layers + mtp_layers,
    )


def memory_per_rank(
    c: ModelConfig,
    world_size: int,
    zero_stage: int,
    ep_size: int = 1,
    dtype: str = "bf16",
) -> dict[str, float]:
    """Bytes of weights, gradients and AdamW state per rank (activations excluded).

    Mixed precision keeps an fp32 master copy plus two fp32 moments (12 bytes/param); fp32
    training keeps the two moments (8 bytes/param). Dense parameters are partitioned over all
    `world_size` ranks, routed experts over the `world_size / ep_size` ranks holding the same
    experts, after dividing them by `ep_size`: ZeRO-1 splits optimizer state, ZeRO-2 also
    gradients, ZeRO-3 also weights.
    """
    if world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide world_size={world_size}")
    n = count(c)
    w = DTYPE_BYTES[dtype]
    opt = 12 if dtype != "fp32" else 8
    dense = n.total_params + n.mtp_params - n.expert_params
    expert = n.expert_params / ep_size
    edp = world_size // ep_size

    def part(num: float, dp: int, stage_needed: int) -> float:
        return num / dp if zero_stage >= stage_needed else num

    weights = part(dense, world_size, 3) + part(expert, edp, 3)
    grads = part(dense, world_size, 2) + part(expert, edp, 2)
    optim = part(dense, world_size, 1) + part(expert, edp, 1)
    out = {"weights": weights * w, "grads": grads * w, "optimizer": optim * opt}
    out["total"] = sum(out.values())
    return out
