"""The parallel layout as one validated object, checked before any process group exists."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.config import Config, ConfigError


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp_size: int  # ranks that split the global batch (all of them: no tensor/pipeline parallel)
    ep_size: int  # ranks that split the routed experts
    edp_size: int  # ranks holding the same experts (expert data parallel) = world / ep
    micro_batch: int  # sequences per rank per forward
    grad_accum: int  # micro-batches per rank per optimizer step
    global_batch: int  # sequences per optimizer step
    seq_len: int
    zero_stage: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def describe(self) -> str:
        return (
            f"world {self.world_size} = dp {self.dp_size} (ep {self.ep_size} x edp {self.edp_size}); "
            f"global batch {self.global_batch} seq = {self.world_size} ranks x {self.micro_batch} micro "
            f"x {self.grad_accum} accum; {self.tokens_per_step:,} tokens/step; ZeRO-{self.zero_stage}"
        )


def make_layout(cfg: Config, world_size: int) -> Layout:
    """Derive micro-batching from the global batch; every impossibility says what to change."""
    t, p = cfg.train, cfg.parallel
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1")
    if world_size % p.ep_size:
        raise ConfigError(
            f"parallel.ep_size={p.ep_size} must divide the world size {world_size}; "
            f"use an ep_size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    if cfg.model.n_routed_experts % p.ep_size:
        raise ConfigError(
            f"parallel.ep_size={p.ep_size} must divide model.n_routed_experts={cfg.model.n_routed_experts}"
        )
    if t.global_batch_size % world_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by the world size "
            f"{world_size}; make it a multiple of {world_size}"
        )
    per_rank = t.global_batch_size // world_size
    micro = min(t.micro_batch_size, per_rank)
    if per_rank % micro:
        raise ConfigError(
            f"each rank gets {per_rank} sequences per step, not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}; pick a micro batch dividing {per_rank}"
        )
    return Layout(
        world_size=world_size,
        dp_size=world_size,
        ep_size=p.ep_size,
        edp_size=world_size // p.ep_size,
        micro_batch=micro,
        grad_accum=per_rank // micro,
        global_batch=t.global_batch_size,
        seq_len=t.seq_len,
        zero_stage=p.zero_stage,
    )
