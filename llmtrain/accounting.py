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
    # every attention QK/AV term the FLOPs line holds, the MTP blocks' included
    attn_all = (c.num_layers + c.mtp_depth) * attn_term
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
        attn_flops_per_token=attn_all,
        mtp_flops_per_token=mtp_flops,
        seq_len=t,
        kv_cache_bytes_per_token=c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * nbytes,
        kv_cache_bytes_per_token_mha=c.num_layers
        * c.num_heads
        * (c.qk_head_dim + c.v_head_dim)
        * nbytes,
        layers=layers + mtp_layers,
    )


@dataclass(frozen=True)
class Matmul:
    """One kind of weight matmul in a training step, forward: [m, k] @ [k, n], `count` times.

    The routed experts are one grouped GEMM: m rows (tokens × top-k) over `groups` weights of
    [k, n] each. `fp32`: computed in fp32 whatever the training precision (the router).
    Backward does two matmuls of the same FLOPs (input and weight gradients)."""

    name: str
    m: int
    k: int
    n: int
    count: int = 1
    groups: int = 1
    fp32: bool = False

    @property
    def train_flops(self) -> float:
        return 6.0 * self.m * self.k * self.n * self.count


def matmuls(c: ModelConfig, tokens: int) -> list[Matmul]:
    """Every weight matmul of one forward + backward over `tokens` tokens, by shape, from the
    config alone (the model's layer names). 6 × Σ m·k·n·count equals `count()`'s matmul FLOPs
    (flops_per_token less the attention terms) × tokens: what a step can be timed against,
    GEMM by GEMM, to bound its MFU before any other kernel runs."""
    d, h, t = c.hidden_size, c.num_heads, tokens
    moe = c.num_moe_layers + c.mtp_depth  # every MTP block is a MoE layer
    blocks = c.num_layers + c.mtp_depth
    out: list[Matmul] = []
    if c.q_lora_rank is None:
        out.append(Matmul("self_attn.q_proj", t, d, h * c.qk_head_dim, blocks))
    else:
        out += [
            Matmul("self_attn.q_a_proj", t, d, c.q_lora_rank, blocks),
            Matmul("self_attn.q_b_proj", t, c.q_lora_rank, h * c.qk_head_dim, blocks),
        ]
    r = c.kv_lora_rank
    out += [
        Matmul("self_attn.kv_a_proj_with_mqa", t, d, r + c.qk_rope_head_dim, blocks),
        Matmul("self_attn.kv_b_proj", t, r, h * (c.qk_nope_head_dim + c.v_head_dim), blocks),
        Matmul("self_attn.o_proj", t, h * c.v_head_dim, d, blocks),
    ]
    dense = c.num_layers - c.num_moe_layers
    if dense:
        f = c.intermediate_size
        out += [
            Matmul("mlp.gate_proj", t, d, f, dense),
            Matmul("mlp.up_proj", t, d, f, dense),
            Matmul("mlp.down_proj", t, f, d, dense),
        ]
    e, f, rows = c.n_routed_experts, c.moe_intermediate_size, t * c.num_experts_per_tok
    out += [
        Matmul("mlp.gate", t, d, e, moe, fp32=True),
        Matmul("mlp.experts.w_gate_up", rows, d, 2 * f, moe, groups=e),
        Matmul("mlp.experts.w_down", rows, f, d, moe, groups=e),
    ]
    if c.n_shared_experts:
        fs = f * c.n_shared_experts
        out += [
            Matmul("mlp.shared_experts.gate_proj", t, d, fs, moe),
            Matmul("mlp.shared_experts.up_proj", t, d, fs, moe),
            Matmul("mlp.shared_experts.down_proj", t, fs, d, moe),
        ]
    if c.mtp_depth:
        out.append(Matmul("eh_proj", t, 2 * d, d, c.mtp_depth))
    out.append(Matmul("lm_head", t, d, c.vocab_size, 1 + c.mtp_depth))  # MTP shares the head
    return out


# ---------------------------------------------------------------- memory per rank
#
# What one rank holds while training, from the config alone. Model states follow DeepSpeed
# 0.19.8 as our engine configures it (llmtrain/parallel/engine.py: a torch AdamW, default ZeRO
# buckets, contiguous_gradients on, overlap_comm off below stage 3):
#
# - stage 0 (one fp32 process): weights, `param.grad` and AdamW's two moments for every
#   parameter; at the accumulation boundary the engine flattens all gradients into one bucket
#   of up to MEMORY_OPT_ALLREDUCE_SIZE elements before its all-reduce (runtime/engine.py
#   `allreduce_bucket`), a second gradient-sized copy.
# - stage 1/2 (runtime/zero/stage_1_and_2.py): every rank keeps all the weights it computes
#   with in one flat buffer; the master copy of its partition is a clone (`weights_partition =
#   ...clone()`, even in fp32) and the moments are per partition. Gradients are copied into a
#   contiguous reduce bucket of `reduce_bucket_size` elements (5e8 by default, so below 500M
#   local parameters it holds every local gradient) and reduced into the rank's partition
#   (stage 2: every micro-batch; stage 1: at the boundary, with full gradients in `param.grad`
#   and the partition's in the accumulation buffer `all_grad_tensors` until then). Reducing
#   flattens one destination rank's slice at a time; so does `step`, one group at a time.
#   The updated weights are all-gathered in place into the flat buffer (runtime/utils.py
#   all_gather_dp_groups takes all_gather_into_tensor when torch has it, so
#   `allgather_bucket_size` allocates nothing here).
# - stage 3 (runtime/zero/stage3.py): weights, master, moments and gradients per partition, plus
#   parameters below `stage3_param_persistence_threshold` held whole, plus the gathered ("live")
#   parameters: a parameter is not released while its next use lies within
#   `stage3_max_reuse_distance` elements of the trace (partitioned_param_coordinator.py
#   `__params_to_release`), so a model whose forward+backward trace is shorter than that keeps
#   every parameter gathered from its forward use to its backward use.
# Non-expert parameters are partitioned over all W ranks, routed experts (E/P per rank) over the
# W/P expert-data-parallel ranks.

# DeepSpeed 0.19.8 defaults (runtime/zero/config.py; runtime/engine.py), in elements
DS_ALLREDUCE_BUCKET = 500_000_000  # engine.MEMORY_OPT_ALLREDUCE_SIZE (stage 0 gradient flatten)
DS_REDUCE_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size
DS_ALLGATHER_BUCKET = 500_000_000  # zero_optimization.allgather_bucket_size (unused: see above)
DS_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size
DS_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold
DS_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters
DS_MAX_REUSE = 1_000_000_000  # stage3_max_reuse_distance

# Resident memory of the framework itself, per rank (bytes), reported on its own line.
# cpu: RSS of a trainer process just before DeepSpeed initialises, less the fp32 weights it has
#   built by then: python + torch 2.13 + deepspeed 0.19.8 + tokenizers imported, gloo process
#   group and DeepSpeed's CPU comm op loaded, data opened. Measured 2026-11-30 on the 2-core
#   benchmark machine (configs/bench_moe_150m.yaml): 987 - 627 MiB at 1 rank, 699 - 338 MiB on
#   each of 2 ranks (EP 2); RSS of bare `import torch, deepspeed` + gloo init is 262 MiB.
# cuda: the CUDA context plus torch's kernels on the device, a typical figure for an H100-class
#   GPU with lazy module loading; not measured here (no GPU in this session): see provenance.
RUNTIME_BYTES = {"cpu": 361 * 2**20, "cuda": 600 * 2**20}
RUNTIME_PROVENANCE = {
    "cpu": "measured: trainer RSS before deepspeed.initialize minus its weights, 2026-11-30, "
    "torch 2.13.0+cpu, deepspeed 0.19.8 (benchmarks/memory_per_rank.py notes)",
    "cuda": "stated, not measured: CUDA context + loaded kernels of torch on an H100/H200 "
    "(~0.5-0.7 GiB with CUDA_MODULE_LOADING=LAZY)",
}
# Host-side activations are allocated below glibc's mmap threshold and stay in the process heap
# after backward frees them, so on CPU they add to the peak of the optimizer step (measured).


@dataclass
class ParamSplit:
    """Parameters one rank computes with (`held`) and its ZeRO partition (`part`)."""

    dense: float  # non-expert parameters (all ranks hold them)
    experts_local: float  # routed-expert parameters of this rank's E/P experts
    part: float  # this rank's ZeRO partition: dense / W + experts_local / (W / P)
    largest_group_part: float  # biggest parameter group's partition (step flattens one at a time)
    persistent: float  # ZeRO-3 parameters below the persistence threshold (held whole)
    # whole (unpartitioned) sizes of the rank's parameter groups, in param_groups order:
    # non-expert groups, then the expert group (EP > 1)
    group_sizes: tuple[list[float], list[float]] = ([], [])

    @property
    def held(self) -> float:
        return self.dense + self.experts_local


def _param_split(c: ModelConfig, world_size: int, ep_size: int) -> ParamSplit:
    n = count(c)
    expert_one = 3 * c.hidden_size * c.moe_intermediate_size
    mtp_experts = c.mtp_depth * c.n_routed_experts * expert_one if c.n_routed_experts else 0
    experts = n.expert_params + mtp_experts
    dense = n.total_params + n.mtp_params - experts
    local = experts / ep_size
    edp = world_size // ep_size
    d = c.hidden_size
    # parameter groups (engine.param_groups): matrices with decay, vectors without; with expert
    # parallelism DeepSpeed splits each into its non-expert and expert part
    vectors = sum(l.norms for l in n.layers) + d + c.kv_lora_rank * len(n.layers)
    if c.q_lora_rank is not None:
        vectors += c.q_lora_rank * len(n.layers)
    vectors += 3 * d * c.mtp_depth
    if ep_size > 1:
        groups = [(dense - vectors) / world_size, vectors / world_size, local / edp]
    else:
        groups = [(dense - vectors + local) / world_size, vectors / world_size]
    # ZeRO-3 keeps parameters of <= 1e5 elements whole: norms, routers, small projections
    small = [s for s in _param_shapes(c) if s <= DS_PERSISTENCE_THRESHOLD]
    if ep_size > 1:
        sizes = ([dense - vectors, vectors], [local])
    else:
        sizes = ([dense - vectors + local, vectors], [])
    return ParamSplit(
        dense, local, dense / world_size + local / edp, max(groups), float(sum(small)), sizes
    )


def _ipg_bucket(w: int, zero_stage: int, used: float, device: str) -> float:
    """Bytes of ZeRO-1/2's reduce bucket: torch.empty(reduce_bucket_size) (stage_1_and_2.py
    setup_buckets), which a GPU's allocator reserves whole and a CPU's only where written (the
    `used` elements). Its dtype: fp32 where bf16 is accumulated in fp32 at stage 1 outside
    BF16_Optimizer (offload: use_grad_accum_attribute), else the training dtype (measured on 2
    gloo ranks, tests/test_bf16.py)."""
    nbytes = 4 if (w < 4 and zero_stage == 1) else w
    return nbytes * (DS_REDUCE_BUCKET if device == "cuda" else used)


def _fallback_flatten_peak(sizes: list[float], bucket: int = DS_ALLREDUCE_BUCKET) -> float:
    """Largest copy engine.allreduce_no_retain makes of these whole tensors (BF16_Optimizer's
    per-group fp32 gradient buffers): tensors join a bucket until it passes `bucket` elements;
    a bucket of one tensor is all-reduced in place (_flatten_dense_tensors of one tensor is a
    view), one of several is concatenated into a new tensor."""
    peak, cur = 0.0, []
    for n in sizes:
        cur.append(n)
        if sum(cur) > bucket:
            if len(cur) > 1:
                peak = max(peak, sum(cur))
            cur = []
    if len(cur) > 1:
        peak = max(peak, sum(cur))
    return peak


def _param_shapes(c: ModelConfig) -> list[int]:
    """Element counts of every non-expert parameter tensor (for ZeRO-3 persistence)."""
    d, h = c.hidden_size, c.num_heads
    one: list[int] = []
    if c.q_lora_rank is None:
        one.append(d * h * c.qk_head_dim)
    else:
        one += [d * c.q_lora_rank, c.q_lora_rank, c.q_lora_rank * h * c.qk_head_dim]
    one += [d * (c.kv_lora_rank + c.qk_rope_head_dim), c.kv_lora_rank]
    one += [c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim), h * c.v_head_dim * d, d, d]
    out: list[int] = []
    for i in range(c.num_layers + c.mtp_depth):
        out += one
        if c.is_moe_layer(i) or i >= c.num_layers:
            out.append(c.n_routed_experts * d)
            out += (
                [d * c.moe_intermediate_size * c.n_shared_experts] * 3 if c.n_shared_experts else []
            )
        else:
            out += [d * c.intermediate_size] * 3
    out += [c.vocab_size * d, d] + ([] if c.tie_word_embeddings else [c.vocab_size * d])
    out += [2 * d * d, d, d, d] * c.mtp_depth
    return out


def attention_kernel(c: ModelConfig, device: str, dtype: str) -> str:
    """Which kernel runs training attention, as far as memory goes: "flash" (flash-attn, CUDA
    half precision), "fused" (torch SDPA's flash / efficient kernels), "math" (SDPA's fallback,
    which keeps the [T, T] probabilities: torch's CPU flash kernel needs equal q/k and v head
    dims, MLA's differ) or "reference"."""
    if c.attn_backend == "reference":
        return "reference"
    if device == "cuda":
        return "flash" if dtype != "fp32" and c.attn_backend in ("auto", "flash") else "fused"
    return "fused" if c.qk_head_dim == c.v_head_dim else "math"


def activation_bytes(
    c: ModelConfig,
    micro_batch: int,
    seq_len: int,
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
    attn_backend: str = "math",
) -> dict[str, float]:
    """Peak bytes autograd keeps for one micro-batch of B sequences of T tokens.

    Counted per layer from what each op saves for backward (llmtrain/model): RMSNorm saves its
    normalised input and output (plus the fp32 upcast in bf16); MLA saves q, the latent, kv_b's
    output, the concatenated q/k, the attention output and o_proj's input; the fused kernels
    (sdpa, flash) save q, k, v, out and the log-sum-exp, the reference kernel the [T, T] scores.
    MoE saves router logits and scores in fp32 and, over the M = B·T·top_k routed rows, the
    gathered inputs, the [M, 2F] gate|up output, the SiLU product and the expert output; the
    shared expert saves four [N, F_shared] tensors. The fused LM head keeps the hidden gradient
    and the fp32 head-weight gradient, plus one [C, V] fp32 logits chunk while it runs.
    Backward needs the gradients of one layer's activations beside what is still saved (one
    layer's worth). With activation checkpointing only each layer's input is kept, and one layer
    is recomputed at a time.
    """
    a = DTYPE_BYTES[dtype]
    n = micro_batch * seq_len
    d, h = c.hidden_size, c.num_heads
    e, vd, r, p = c.qk_head_dim, c.v_head_dim, c.kv_lora_rank, c.qk_rope_head_dim

    def norm(width: int) -> float:
        """RMSNorm keeps its input (the fp32 upcast in half precision), x·rsqrt(mean x²) and
        the weighted output that the next matmul saves."""
        return n * width * (3 * a if a == 4 else 4 + 2 * a) + 4 * n

    layer_in = n * d * a  # a layer's input: all checkpointing keeps
    attn = norm(d)
    if c.q_lora_rank is not None:
        attn += norm(c.q_lora_rank)
    attn += norm(r) + (n * p * a if a == 4 else 0)  # normalised latent (fp32: the rope key's
    # columns share the latent's storage)
    # q, k, v as the kernel keeps them; SDPA's math kernel (chosen on CPU) computes in fp32
    ka = 4 if attn_backend == "math" else a
    attn += 2 * n * h * e * ka + n * h * vd * ka
    if attn_backend in ("math", "reference"):  # softmax probabilities [B, H, T, T]
        attn += micro_batch * h * seq_len * seq_len * ka
        if attn_backend == "reference":  # fp32 scores before the cast
            attn += micro_batch * h * seq_len * seq_len * 4
    else:  # fused kernels: output and log-sum-exp; flash pads v (and out) to the qk head dim
        vk = e if attn_backend == "flash" else vd
        attn += n * h * (2 * vk - vd) * a + n * h * vk * a + micro_batch * h * seq_len * 4
    attn += n * h * vd * a  # o_proj's input

    def ffn(moe: bool) -> float:
        out = norm(d)  # post-attention norm (its input: the residual after attention)
        if not moe:
            return out + 4 * n * c.intermediate_size * a
        m = n * c.num_experts_per_tok
        f = c.moe_intermediate_size
        out += n * c.n_routed_experts * 4 + 3 * n * c.num_experts_per_tok * 8  # scores, top-k
        if a < 4:
            out += n * d * 4  # router input upcast to fp32
        out += m * (3 * d + 4 * f) * a  # routed rows: input, output (x2), gate|up, SiLU, product
        out += 4 * n * f * c.n_shared_experts * a
        return out

    layers = [attn + ffn(c.is_moe_layer(i)) for i in range(c.num_layers)]
    v = c.vocab_size
    chunk = min(n, max(32, (1 << 22) // v))
    head = norm(d) + v * d * 4  # final norm (its output slot: grad_h), fp32 grad_w
    head_transient = chunk * v * 4 * (2 if a == 4 else 3)
    # an MTP module: enorm and hnorm (their inputs are the main model's embedding and hidden
    # state, saved there already; their outputs are saved once, as eh_proj's concatenated
    # input, which is where norm()'s output slot goes), one block (not checkpointed) and the head
    mtp = c.mtp_depth * (2 * norm(d) + attn + ffn(True) + head)
    largest = max(layers) if layers else 0.0
    if activation_checkpointing:
        saved = c.num_layers * layer_in + head + mtp
        recompute = largest
    else:
        saved = sum(layers) + head + mtp
        recompute = 0.0
    peak = saved + recompute + max(largest, head_transient)
    return {"saved": saved, "recompute": recompute, "working": max(largest, head_transient),
            "peak": peak}  # fmt: skip


def _router_numel(c: ModelConfig) -> int:
    """Router weights [E, D] of every MoE layer, the MTP blocks' included."""
    return (c.num_moe_layers + c.mtp_depth) * c.n_routed_experts * c.hidden_size


def memory_per_rank(
    c: ModelConfig,
    world_size: int,
    zero_stage: int,
    ep_size: int = 1,
    dtype: str = "bf16",
    micro_batch: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    offload_optimizer: bool = False,
    device: str = "cpu",
    attn_kernel: str | None = None,
    async_save: bool = False,
) -> dict[str, float]:
    """Predicted peak bytes per rank while training, broken down (the parts sum to `total`).

    weights: the parameters a rank computes with, in the training dtype (ZeRO-3: its partition
    plus the persistent small ones). master_weights: the fp32 copy of its ZeRO partition that
    the optimizer updates. gradients: the gradients it keeps between micro-batches.
    optimizer: AdamW's two fp32 moments. deepspeed_buffers: DeepSpeed's flat buffers at their
    peak (reduce bucket, stage-0 all-reduce flatten, one group's flattened gradient partition at
    the step, ZeRO-3 gathered live parameters). activations: the peak autograd keeps for one
    micro-batch of `seq_len` (0 when seq_len is None). runtime: the framework's own resident
    memory (RUNTIME_BYTES[device]). One fp32 process without offload runs DeepSpeed's stage 0,
    as the engine does, whatever stage is asked (`zero_stage` in the result). With
    `offload_optimizer` master weights, moments and the fp32 gradient partition live in host
    memory: on CUDA they move to `host_bytes`, on CPU they stay in the total. `attn_kernel`
    overrides `attention_kernel`'s config-only guess ("flash" on CUDA in half precision) when the
    caller knows which kernel runs (no flash-attn installed: "fused"). `async_save`
    (train.async_save) stages a copy of the rank's checkpoint pieces (fp32 weights and both
    moments of its partition) in host memory while the background write runs:
    `checkpoint_staging`, in `host_bytes` on CUDA and in the total on CPU. In bf16 each rank
    also keeps the routers' full fp32 weights at every stage (DeepSpeed casts the routers; routing
    is fp32; the engine refreshes them after each step), counted in `weights`.
    """
    if world_size < 1 or ep_size < 1 or world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide world_size={world_size}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: use 0, 1, 2 or 3")
    if device not in RUNTIME_BYTES:
        raise ValueError(f"device={device!r}: use one of {sorted(RUNTIME_BYTES)}")
    requested = zero_stage
    if world_size == 1 and dtype == "fp32" and not offload_optimizer:
        zero_stage = 0  # as the engine runs it (parallel/engine.py effective_zero_stage)
    s = _param_split(c, world_size, ep_size)
    w = DTYPE_BYTES[dtype]
    held = s.held
    out: dict[str, float] = {}
    if zero_stage == 0:
        out["weights"] = w * held
        out["master_weights"] = 4 * held if w < 4 else 0.0
        out["gradients"] = w * held + (4 * held if w < 4 else 0)  # bf16: fp32 accumulation too
        out["optimizer"] = 8 * held
        # its all-reduce flattens the gradients into a bucket; over one rank the engine skips
        # it (parallel/engine.py: the identity, 3 passes over every gradient)
        out["deepspeed_buffers"] = (
            (4 if w < 4 else w) * min(held, DS_ALLREDUCE_BUCKET) if world_size > 1 else 0.0
        )
    elif zero_stage in (1, 2):
        out["weights"] = w * held
        out["master_weights"] = 4 * s.part
        out["optimizer"] = 8 * s.part
        bucket = min(held, DS_REDUCE_BUCKET)
        flat = min(s.largest_group_part, bucket)
        if zero_stage == 1:
            # the post-backward epilogue runs after every micro-batch: it keeps this rank's
            # partition of the gradients in `all_grad_tensors` (the accumulation buffer) and
            # drops param.grad, which the next backward fills again in full; at the boundary
            # `reduce_gradients` copies every gradient into the reduce bucket and flattens one
            # destination rank's slice at a time (measured: 2 ranks, EP 1, within 3%)
            out["gradients"] = w * (held + s.part)
            if w < 4:
                # bf16 at stage 1 runs DeepSpeed's BF16_Optimizer (grad_accum_dtype fp32): a
                # full, unpartitioned fp32 gradient copy (bf16_optimizer.py fp32_groups_gradients;
                # measured: 2 ranks, 4.0 N B fp32). With immediate_grad_update (parallel/engine.py)
                # each bf16 param.grad is added into it and freed as backward produces it: none
                # is alive after a backward (tests/test_bf16.py)
                out["gradients"] = 4 * held
            bf16_opt = w < 4 and not offload_optimizer  # engine.py _do_optimizer_sanity_check
            if not bf16_opt:
                out["deepspeed_buffers"] = _ipg_bucket(w, 1, bucket, device) + w * flat
            elif world_size == 1:  # BF16_Optimizer over one rank: no reduction (see stage 0)
                out["deepspeed_buffers"] = 0.0
            else:
                # BF16_Optimizer has no reduce_gradients: the engine's buffered_allreduce_fallback
                # all-reduces its fp32 group buffers, copying only buckets of several groups
                out["deepspeed_buffers"] = 4 * max(_fallback_flatten_peak(g) for g in s.group_sizes)
        else:
            # every backward fills the bucket (min(held, reduce_bucket_size)) and reduces it into
            # the rank's gradient partition (grads_in_partition), flattening one destination
            # rank's slice at a time (allreduce_no_retain -> allreduce_bucket)
            # bf16: the partition is kept in fp32 (grad_accum_dtype fp32)
            out["gradients"] = (4 if w < 4 else w) * s.part
            out["deepspeed_buffers"] = _ipg_bucket(w, 2, bucket, device) + w * flat
    else:
        live = held if 2 * held <= DS_MAX_REUSE else DS_MAX_REUSE / 2 + DS_PREFETCH_BUCKET
        live = min(live, DS_MAX_LIVE, held)
        out["weights"] = w * (s.part + s.persistent)
        out["master_weights"] = 4 * s.part
        out["optimizer"] = 8 * s.part
        out["gradients"] = (4 if w < 4 else w) * s.part  # bf16: an fp32 partition (stage3.py)
        # gathered parameters, the reduce bucket (allocated once, resident once touched), and
        # reduce_scatter_coalesced's padded copy of the bucket (comm/coalesced_collectives.py
        # torch.cat of the partitions). Not modelled: on CPU glibc keeps the freed per-parameter
        # gather/gradient buffers in its heap, which grows over steps (see the benchmark notes)
        bucket = min(held, DS_REDUCE_BUCKET)
        out["deepspeed_buffers"] = w * (live + 2 * bucket)
        if w < 4 and device == "cuda":  # bf16: the fp32 IPG bucket, allocated whole on a GPU
            out["deepspeed_buffers"] += 4 * DS_REDUCE_BUCKET - w * bucket
    if w < 4:  # parallel/engine.py keep_routing_fp32: DeepSpeed casts the routers to bf16 at
        # every stage; each rank keeps their full fp32 weights beside them (routing is fp32)
        out["weights"] += 4 * _router_numel(c)
    if seq_len:
        backend = attn_kernel or attention_kernel(c, device, dtype)
        act = activation_bytes(c, micro_batch, seq_len, dtype, activation_checkpointing, backend)
        out["activations"] = act["peak"]
    else:
        out["activations"] = 0.0
    out["runtime"] = float(RUNTIME_BYTES[device])
    host = 0.0
    if offload_optimizer and zero_stage > 0:
        # ZeRO-Offload keeps an fp32 gradient partition and a training-dtype staging copy of
        # the partition beside the master and moments in host memory (stage_1_and_2.py
        # initialize_optimizer_states, param_buffer_of_bit16_for_cpu_offload_groups)
        staging = 4 * s.part + w * s.part
        if device == "cuda":
            host = out["master_weights"] + out["optimizer"] + staging
            out["master_weights"] = out["optimizer"] = 0.0
        else:
            out["gradients"] += 4 * s.part
            out["deepspeed_buffers"] += w * s.part
    out["model_states"] = sum(
        out[k] for k in ("weights", "master_weights", "gradients", "optimizer", "deepspeed_buffers")
    )
    # train/checkpointing.py save(asynchronous=True): every piece copied to host memory at once
    staging = 12.0 * (held if zero_stage == 0 else s.part) if async_save else 0.0
    if device == "cuda":
        host += staging
        out["checkpoint_staging"] = 0.0
    else:
        out["checkpoint_staging"] = staging
    out["total"] = (out["model_states"] + out["activations"] + out["runtime"]
                    + out["checkpoint_staging"])  # fmt: skip
    out["host_bytes"] = host
    out["zero_stage"] = float(zero_stage)  # the stage DeepSpeed runs
    out["zero_stage_requested"] = float(requested)
    return out
