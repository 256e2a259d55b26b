"""Typed config tree: dataclasses own the fields, YAML in configs/ is data loaded into them.

Why a hand-rolled loader rather than a framework: the tree is small, the rules are few
(unknown keys are errors, `a.b=c` overrides are parsed as YAML scalars, every cross-field
check raises a ValueError that names the field and says how to fix it), and the same
dataclasses are read by the accounting code without building a model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmtrain.errors import LlmtrainError

logger = logging.getLogger(__name__)

ROPE_TYPES = ("default", "yarn")
SCORING_FUNCS = ("sigmoid", "softmax")
ATTN_BACKENDS = ("auto", "sdpa", "flash", "reference")
MOE_IMPLS = ("auto", "grouped_mm", "loop")


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # those of COMPILE_MODES that record graphs


class ConfigError(LlmtrainError, ValueError):
    """A config value is wrong; the message names the field and what to change."""


@dataclass
class RopeConfig:
    """Rotary embedding of the decoupled rope dims (qk_rope_head_dim) only."""

    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    interleave: bool = True  # DeepSeek pairs (x0,x1),(x2,x3)...; False: half rotation
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # YaRN's temperature m(f, k) = 0.1·k·ln f + 1. With both set (DeepSeek-V2/V3 set them equal)
    # the softmax scale takes m(f, mscale_all_dim)² and cos/sin m(f, mscale)/m(f, mscale_all_dim),
    # as DeepSeek's reference and transformers do; mscale_all_dim 0 scales cos/sin by m(f, 1)
    # instead (transformers' reading of a config.json without the key).
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    attention_factor: float | None = None  # YaRN: overrides the cos/sin scale (transformers' key)
    truncate: bool = True  # YaRN: floor/ceil the ramp's correction dims (transformers' key)

    def validate(self, prefix: str = "model.rope") -> None:
        if self.type not in ROPE_TYPES:
            raise ConfigError(f"{prefix}.type={self.type!r} is unknown; use one of {ROPE_TYPES}")
        _positive(prefix, "theta", self.theta)
        if self.type == "default" and self.factor != 1.0:  # default RoPE has no scaling
            raise ConfigError(f"{prefix}.factor={self.factor} has no effect with {prefix}.type="
                              f"default; set {prefix}.type=yarn to scale RoPE, or drop the factor")  # fmt: skip
        if self.type == "yarn":
            if self.factor < 1:
                raise ConfigError(f"{prefix}.factor={self.factor} must be >= 1 for YaRN")
            _positive(
                prefix, "original_max_position_embeddings", self.original_max_position_embeddings
            )
            if self.attention_factor is not None and not self.attention_factor > 0:
                raise ConfigError(
                    f"{prefix}.attention_factor={self.attention_factor} must be positive; leave "
                    "it unset (null) to derive it from mscale / mscale_all_dim"
                )
            if self.beta_fast <= self.beta_slow:
                raise ConfigError(
                    f"{prefix}.beta_fast ({self.beta_fast}) must be larger than "
                    f"{prefix}.beta_slow ({self.beta_slow})"
                )


@dataclass
class ModelConfig:
    """MLA + DeepSeekMoE decoder. Field names follow DeepseekV3Config where one exists."""

    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 1024  # dense FFN width (the first_k_dense_replace layers)
    moe_intermediate_size: int = 256  # width of one routed / shared expert
    num_layers: int = 4
    num_heads: int = 8
    # MLA
    q_lora_rank: int | None = 128  # None: plain q projection
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # DeepSeekMoE
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"  # "sigmoid" (V3) | "softmax" (V2)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    bias_update_speed: float = 0.001  # gamma of the aux-loss-free balancing rule; 0 disables
    aux_loss_alpha: float = 0.0  # sequence-wise balance loss weight; 0 disables
    router_z_loss_coef: float = 0.0
    # multi-token prediction
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    init_std: float = 0.02
    rope: RopeConfig = field(default_factory=RopeConfig)
    attn_backend: str = "auto"  # "auto" | "sdpa" | "flash" | "reference"
    moe_impl: str = "auto"  # "auto" | "grouped_mm" | "loop"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def validate(self, prefix: str = "model") -> None:
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_layers", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "max_position_embeddings", "rms_norm_eps", "init_std", "routed_scaling_factor",
        ):  # fmt: skip
            _positive(prefix, name, getattr(self, name))
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"{prefix}.qk_rope_head_dim={self.qk_rope_head_dim} must be a positive even number "
                "(rotary dims come in pairs)"
            )
        if self.q_lora_rank is not None:
            _positive(prefix, "q_lora_rank", self.q_lora_rank)
        for name in ("n_shared_experts", "first_k_dense_replace", "mtp_depth"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}={getattr(self, name)} must be >= 0")
        for name in (
            "bias_update_speed",
            "aux_loss_alpha",
            "router_z_loss_coef",
            "mtp_loss_weight",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}={getattr(self, name)} must be >= 0")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"{prefix}.num_heads={self.num_heads} does not divide "
                f"{prefix}.hidden_size={self.hidden_size}; pick a head count that divides the width"
            )
        if self.first_k_dense_replace > self.num_layers:
            raise ConfigError(
                f"{prefix}.first_k_dense_replace={self.first_k_dense_replace} exceeds "
                f"{prefix}.num_layers={self.num_layers}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(
                f"{prefix}.scoring_func={self.scoring_func!r} is unknown; use one of {SCORING_FUNCS}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"{prefix}.num_experts_per_tok={self.num_experts_per_tok} > "
                f"{prefix}.n_routed_experts={self.n_routed_experts}; lower top-k or add experts"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"{prefix}.n_routed_experts={self.n_routed_experts} is not divisible by "
                f"{prefix}.n_group={self.n_group}; choose n_group dividing the expert count"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(
                f"{prefix}.topk_group={self.topk_group} > {prefix}.n_group={self.n_group}; "
                "topk_group is how many of the n_group groups a token may use"
            )
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and self.scoring_func == "sigmoid" and per_group < 2:
            raise ConfigError(
                f"{prefix}: sigmoid group-limited routing scores a group by its top-2 experts, "
                f"so each group needs >= 2 experts (have {per_group}); lower {prefix}.n_group"
            )
        if self.topk_group * per_group < self.num_experts_per_tok:
            raise ConfigError(
                f"{prefix}: topk_group={self.topk_group} groups of {per_group} experts hold fewer "
                f"than num_experts_per_tok={self.num_experts_per_tok}; raise topk_group"
            )
        if self.attn_backend not in ATTN_BACKENDS:
            raise ConfigError(
                f"{prefix}.attn_backend={self.attn_backend!r} is unknown; use one of {ATTN_BACKENDS}"
            )
        if self.moe_impl not in MOE_IMPLS:
            raise ConfigError(
                f"{prefix}.moe_impl={self.moe_impl!r} is unknown; use one of {MOE_IMPLS}"
            )
        self.rope.validate(prefix + ".rope")


@dataclass
class DataConfig:
    """Text sources, tokenizer and the prepared-shard cache."""

    sources: list = field(
        default_factory=lambda: ["builtin:stdlib"]
    )  # paths, hf:NAME[@SPLIT][#REV]
    text_field: str = "text"  # jsonl / parquet / datasets column
    streaming: bool = True  # hf: sources: stream (true) or let `datasets` download them first
    tokenizer: str = "train"  # "train" (byte-level BPE of model.vocab_size) or a tokenizer dir/file
    tokenizer_train_bytes: int = 20_000_000
    val_percent: float = 2.0  # documents held out for validation, by a stable hash of their key
    max_bytes: int = 0  # read about this many characters (0: all): each source its weight's
    # share, whole documents
    shard_tokens: int = 50_000_000
    cache_dir: str = ""  # default $LLMTRAIN_CACHE or ~/.cache/llmtrain
    doc_mask: bool = False  # attention stays inside each packed document
    num_proc: int = 0  # processes that parse and encode (0: all cores of this machine)
    max_bad_records: int = 1000  # malformed records skipped (and counted) before preparing fails
    chunk_bytes: int = 1 << 20  # text per unit of work (and per resumable progress record)

    def validate(self, prefix: str = "data") -> None:
        if isinstance(self.sources, str):
            self.sources = [self.sources]
        if not self.sources or not all(isinstance(s, (str, dict)) for s in self.sources):
            raise ConfigError(
                f"{prefix}.sources must be a non-empty list of paths, hf:NAME, "
                "or {path: ..., weight: ...} mappings"
            )
        if self.num_proc < 0 or self.max_bad_records < 0 or self.max_bytes < 0:
            raise ConfigError(f"{prefix}.num_proc, {prefix}.max_bad_records and {prefix}.max_bytes "
                              "must be >= 0 (max_bytes 0: all the data)")  # fmt: skip
        _positive(prefix, "chunk_bytes", self.chunk_bytes)
        if not 0 < self.val_percent < 50:
            raise ConfigError(f"{prefix}.val_percent={self.val_percent} must be in (0, 50)")
        _positive(prefix, "shard_tokens", self.shard_tokens)
        _positive(prefix, "tokenizer_train_bytes", self.tokenizer_train_bytes)


@dataclass
class TrainConfig:
    """One optimisation run. The global batch is fixed here; micro-batches and accumulation
    are derived from the world size, so a config means the same optimisation anywhere."""

    seq_len: int = 256
    global_batch_size: int = 8  # sequences per optimizer step, independent of world size
    micro_batch_size: int = 4  # sequences per rank per forward
    max_steps: int = 100
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: str = "cosine"  # "cosine" | "wsd" | "inv_sqrt"
    decay_fraction: float = 0.2  # WSD: the final fraction of steps that decays
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    seed: int = 1234
    dtype: str = "fp32"  # "fp32" | "bf16"
    log_every: int = 1
    eval_every: int = 50
    eval_batches: int = 4
    # validation sequences; 0: eval_batches global batches. A fixed count keeps runs of different
    # global batch sizes (a scaling sweep's) on the same validation sequences
    eval_sequences: int = 0
    save_every: int = 100
    keep_last: int = 2
    save_final: bool = True  # false: no checkpoint at the last step unless save_every falls there
    async_save: bool = False  # copy the state, write it in the background while training goes on
    max_nonfinite: int = 5  # stop after this many non-finite steps in a row
    # stop with a checkpoint at the first step boundary this many minutes after the job began
    # (SLURM_JOB_START_TIME, else the trainer's start; 0: never): the job's wall time less a
    # step and a save
    time_limit_minutes: float = 0.0
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder block (llmtrain.train.compile); ZeRO 1-2
    # torch.compile's mode for those blocks: default | reduce-overhead (CUDA graphs: one launch
    # per block's forward / backward, for when the host cannot keep the GPU fed) |
    # max-autotune | max-autotune-no-cudagraphs (GEMM autotuning: minutes more compiling)
    compile_mode: str = "default"
    offload_optimizer: bool = False
    peak_flops: float = 0.0  # per device, for MFU; 0 measures a matmul ceiling at start
    tensorboard: bool = True
    sample_tokens: int = 64  # length of the text sample generated at the end (0: none)
    profile_step: int = 0  # profile this step (as logged, from 1) into run_dir/profile/ (0: none)
    profile_trace: bool = True  # with it a Chrome trace (large for a step of many micro-batches)
    init_from: str = ""  # a Hugging Face DeepseekV3/V2 directory to continue pre-training from
    eval_tasks: list = field(default_factory=list)  # lm-evaluation-harness tasks run periodically
    eval_tasks_every: int = 0  # steps between those evaluations (0: with each train.eval_every)
    eval_tasks_limit: int = 0  # documents per task (0: all)
    deepspeed: dict = field(default_factory=dict)  # extra DeepSpeed keys merged over ours

    def validate(self, prefix: str = "train") -> None:
        for name in ("seq_len", "global_batch_size", "micro_batch_size", "max_steps", "log_every",
                     "eval_every", "eval_batches", "save_every", "keep_last",
                     "max_nonfinite"):  # fmt: skip
            _positive(prefix, name, getattr(self, name))
        if not self.time_limit_minutes >= 0:
            raise ConfigError(f"{prefix}.time_limit_minutes={self.time_limit_minutes}: use "
                              "minutes > 0, or 0 for no limit")  # fmt: skip
        if not isinstance(self.eval_sequences, int) or self.eval_sequences < 0:
            raise ConfigError(
                f"{prefix}.eval_sequences={self.eval_sequences!r}: use a count of validation "
                "sequences, or 0 for eval_batches global batches"
            )
        if self.dtype not in ("fp32", "bf16"):
            raise ConfigError(f"{prefix}.dtype={self.dtype!r}: use 'fp32' or 'bf16'")
        if not all(isinstance(x, str) for x in self.eval_tasks):
            raise ConfigError(f"{prefix}.eval_tasks must be a list of lm-eval task names")
        if self.eval_tasks_every < 0 or self.eval_tasks_limit < 0:
            raise ConfigError(
                f"{prefix}.eval_tasks_every and {prefix}.eval_tasks_limit must be >= 0"
            )
        if self.schedule not in ("cosine", "wsd", "inv_sqrt"):
            raise ConfigError(f"{prefix}.schedule={self.schedule!r}: use cosine, wsd or inv_sqrt")
        if self.warmup_steps < 0:
            raise ConfigError(f"{prefix}.warmup_steps={self.warmup_steps} must be >= 0")
        if self.warmup_steps > self.max_steps:
            # a short smoke run (train.max_steps=10) should not need a second override
            logger.info(
                "%s.warmup_steps=%d exceeds %s.max_steps=%d: warming up over the whole run "
                "(warmup_steps=%d)", prefix, self.warmup_steps, prefix, self.max_steps,
                self.max_steps,
            )  # fmt: skip
            self.warmup_steps = self.max_steps
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr={self.lr} must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{prefix}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{prefix}.decay_fraction={self.decay_fraction} must be in (0, 1]")
        decay_from = self.max_steps - max(1, int(round(self.decay_fraction * self.max_steps)))
        if self.schedule == "wsd" and self.warmup_steps > decay_from:
            # the decay (schedule.py) would start before the warmup ends: the LR would drop
            # from mid-warmup at once. Warm up until the decay instead, and say so
            logger.warning(
                "%s.warmup_steps=%d runs into the wsd decay, which starts at step %d (%s."
                "decay_fraction=%s of %d steps): warming up until then instead", prefix,
                self.warmup_steps, decay_from, prefix, self.decay_fraction, self.max_steps,
            )  # fmt: skip
            self.warmup_steps = decay_from
        # keys llmtrain derives from train.* / parallel.*: a different value here would make
        # DeepSpeed run another layout than the one the run reports and checkpoints
        derived = {("train_batch_size",): "train.global_batch_size",
                   ("train_micro_batch_size_per_gpu",): "train.micro_batch_size",
                   ("gradient_accumulation_steps",): "train.global_batch_size",
                   ("gradient_clipping",): "train.grad_clip",
                   ("zero_optimization", "stage"): "parallel.zero_stage",
                   ("bf16", "enabled"): "train.dtype", ("fp16",): "train.dtype",
                   ("optimizer",): "train.lr and friends"}  # fmt: skip
        for path, ours in derived.items():
            node: Any = self.deepspeed
            for k in path:
                node = node.get(k) if isinstance(node, dict) else None
            if node is not None:
                raise ConfigError(f"{prefix}.deepspeed.{'.'.join(path)} is set by llmtrain from "
                                  f"{ours}; set that instead")  # fmt: skip
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name}={getattr(self, name)} must be in [0, 1)")
        _positive(prefix, "eps", self.eps)
        for name in ("weight_decay", "grad_clip", "peak_flops", "sample_tokens", "profile_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name}={getattr(self, name)} must be >= 0")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"{prefix}.micro_batch_size={self.micro_batch_size} must divide "
                f"{prefix}.global_batch_size={self.global_batch_size}"
            )


@dataclass
class ParallelConfig:
    zero_stage: int = 1
    ep_size: int = 1
    backend: str = "auto"  # "auto" (nccl on CUDA, gloo on CPU) | "nccl" | "gloo"

    def validate(self, prefix: str = "parallel") -> None:
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(
                f"{prefix}.zero_stage={self.zero_stage}: use 1, 2 or 3 (stage 0 has no optimizer "
                "that skips non-finite steps; ZeRO-1 costs nothing on one process)"
            )
        _positive(prefix, "ep_size", self.ep_size)


@dataclass
class Config:
    """The whole tree; YAML files give any subset of it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> Config:
        self.model.validate()
        self.train.validate()
        self.parallel.validate()
        self.data.validate()
        m = self.model
        if m.scoring_func == "softmax" and m.bias_update_speed != 0:  # found at export, hours later
            raise ConfigError(
                f"model.scoring_func=softmax with model.bias_update_speed={m.bias_update_speed}: "
                "the correction bias it learns has no place in DeepseekV2 (softmax gating), so the "
                "run could not be exported; set model.bias_update_speed=0 or "
                "model.scoring_func=sigmoid"
            )
        if self.train.seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}; shorten the sequences or raise the limit"
            )
        r = m.rope
        reach = r.factor * r.original_max_position_embeddings
        if r.type == "yarn" and m.max_position_embeddings > reach:
            # positions past factor x original are extrapolated, not interpolated; transformers
            # only warns, so a Hugging Face config.json is not held to this (hf.py)
            raise ConfigError(
                f"model.max_position_embeddings={m.max_position_embeddings} is beyond YaRN's reach "
                f"model.rope.factor x model.rope.original_max_position_embeddings = {r.factor:g} "
                f"x {r.original_max_position_embeddings} = {reach:g}; raise model.rope.factor to "
                f"{m.max_position_embeddings / r.original_max_position_embeddings:g} or lower "
                "model.max_position_embeddings"
            )
        if self.parallel.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"parallel.backend={self.parallel.backend!r}: use auto, nccl or gloo")
        if self.model.mtp_depth and self.train.seq_len <= self.model.mtp_depth:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} leaves no position for model.mtp_depth="
                f"{self.model.mtp_depth}'s predictions; use train.seq_len > model.mtp_depth"
            )
        if self.train.compile and self.parallel.zero_stage == 3:
            raise ConfigError(
                "train.compile=true with parallel.zero_stage=3: ZeRO-3 gathers each weight in "
                "module hooks that compiled code cannot run, so every block would break into "
                "eager pieces; use parallel.zero_stage=1 or 2 with compile, or train.compile=false"
            )
        if self.train.compile_mode not in COMPILE_MODES:
            raise ConfigError(
                f"train.compile_mode={self.train.compile_mode!r}: use one of "
                f"{', '.join(COMPILE_MODES)}"
            )
        if self.train.compile_mode in CUDA_GRAPH_MODES:
            if self.parallel.ep_size > 1:
                raise ConfigError(
                    f"train.compile_mode={self.train.compile_mode} (CUDA graphs) with "
                    f"parallel.ep_size={self.parallel.ep_size}: the rows each rank receives change "
                    "every step and the shared experts run on a side stream, neither of which a "
                    "recorded graph can replay; use train.compile_mode=default (or "
                    "max-autotune-no-cudagraphs) with expert parallelism"
                )
            if self.train.activation_checkpointing:
                raise ConfigError(
                    f"train.compile_mode={self.train.compile_mode} (CUDA graphs) with "
                    "train.activation_checkpointing=true: torch's CUDA graph trees fail on the "
                    "recomputation of a checkpointed compiled block (pytorch/pytorch#154306, open: "
                    "'graph recording observed an input tensor deallocate ...'); use "
                    "train.compile_mode=default with activation checkpointing, or drop it"
                )
            if (self.train.deepspeed.get("bf16") or {}).get("immediate_grad_update") is False:
                raise ConfigError(
                    f"train.compile_mode={self.train.compile_mode} (CUDA graphs) with DeepSpeed's "
                    "bf16.immediate_grad_update=false: gradients kept across micro-batches would be "
                    "overwritten by the next replay; drop that train.deepspeed key"
                )
        if self.train.compile_mode != "default" and not self.train.compile:
            raise ConfigError(
                f"train.compile_mode={self.train.compile_mode} without train.compile=true compiles "
                "nothing; add train.compile=true, or drop train.compile_mode"
            )
        if self.train.compile and self.train.dtype != "bf16" and self.model.n_routed_experts:
            raise ConfigError(
                f"train.compile=true with train.dtype={self.train.dtype}: torch.compile traces the "
                "experts' grouped GEMM in bf16 only (other dtypes would recompile every step); "
                "use train.dtype=bf16 with compile, or train.compile=false"
            )
        if self.model.n_routed_experts % self.parallel.ep_size:
            raise ConfigError(
                f"parallel.ep_size={self.parallel.ep_size} must divide model.n_routed_experts="
                f"{self.model.n_routed_experts}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _positive(prefix: str, name: str, value: Any) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{prefix}.{name}={value} must be positive")


# ---------------------------------------------------------------- loading


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    base, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(base):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
        return from_dict(base, value, where)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        if not math.isfinite(value):
            raise ConfigError(f"{where}={value} must be a finite number")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r} must be a string")
        return value
    if base is list:
        if isinstance(value, str):  # one source given as a string
            return [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r} must be a list, e.g. [a, b]")
    if base is dict and not isinstance(value, dict):
        raise ConfigError(f"{where}={value!r} must be a mapping, e.g. {{key: value}}")
    return value  # list and dict contents, Any: taken as given


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys are errors that list the known ones."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        import difflib

        loc = f"{where}." if where else ""
        close = {k: difflib.get_close_matches(k, list(types_), n=1) for k in unknown}
        hint = "; ".join(f"did you mean {loc}{c[0]}?" for k, c in close.items() if c)
        raise ConfigError(
            f"unknown key(s) {', '.join(loc + k for k in unknown)}"
            + (f" ({hint})" if hint else "")
            + f"; known keys{' of ' + where if where else ''}: {', '.join(sorted(types_))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, types_[name], f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
        node = nxt
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        node[last] = _merge(node[last], value)  # a.b={...} after a.b.c=... keeps a.b.c
    else:
        node[last] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`a.b=c` strings to a nested dict; values are parsed as YAML scalars (1, 1e-3, true, null)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        if not key.strip() or any(not part for part in key.strip().split(".")):
            raise ConfigError(f"override {item!r} has an empty key; write section.key=value")
        try:
            value = _load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)}); "
                "quote it or close its brackets, e.g. data.sources=[a.jsonl]"
            ) from e
        _set_dotted(tree, key.strip(), value)
    return tree


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The short part of a PyYAML error: what and where (line:column), without the snippet."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML keeps the last one
    silently: a second `model:` section would replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats: PyYAML (YAML 1.1) reads 5e8 and 1e-3 (no dot) as strings, which typed
# float fields convert but values inside a mapping or list (train.deepspeed, mixture weights) keep
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def _read_yaml(p: Path) -> Any:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte {e.start}); give a YAML file"
        ) from e
    try:
        return _load_yaml(text)
    except yaml.YAMLError as e:
        hint = (
            "YAML forbids tabs for indentation; indent with spaces"
            if "\t" in text
            else "fix the YAML syntax there"
        )
        raise ConfigError(f"config file {p} is not valid YAML ({_yaml_problem(e)}); {hint}") from e


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply `a.b=c` overrides, build the tree and validate it."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(
                f"config {p} is a directory; give the YAML file (e.g. {p}/config.yaml)"
            )
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; check the path")
        loaded = _read_yaml(p) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    return from_dict(Config, data).validate()
