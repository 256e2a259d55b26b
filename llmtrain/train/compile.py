"""Regional torch.compile (`train.compile=true`): each decoder block compiled on its own.

Why regional: blocks are identical code, so the first block's graph serves every layer (compile
time is one block's, not the model's), and a graph break stays inside one block. Inductor fuses
what eager runs as separate memory-bound kernels: RMSNorm, RoPE, SiLU·up, the router's
sigmoid/top-k bookkeeping, residual adds.

What stays eager, and why:
- With expert parallelism the MoE layer exchanges rows with a host-sized all-to-all, so there the
  pieces around it are compiled instead: attention, the norms, the router, the shared experts and
  the expert GEMMs (whose row count changes every step: compiled with dynamic shapes).
- The embedding, the fused LM head + cross-entropy (large GEMMs in chunks; on CUDA the
  softmax and gradient of each chunk are compiled on their own, `LMHead.compile_ce`) and the
  MTP glue.
- ZeRO-3 is refused (see `Config.validate`): it gathers weights in module hooks that compiled
  code cannot run, which would break every block into pieces. So is a MoE model outside bf16:
  torch traces the grouped GEMM in bf16 only, and the per-expert loop would recompile each step.
- Document-mask forms are built before the layers (`DocumentMask.prepare`); flash-attn's varlen
  kernel runs eager inside a block, as its document count changes every batch.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmtrain.config import CUDA_GRAPH_MODES
from llmtrain.model.attention import MLA, MLACache, flash_attn_available
from llmtrain.model.layers import MLP
from llmtrain.model.loss import LMHead
from llmtrain.model.moe import MoE
from llmtrain.model.transformer import DecoderLayer

logger = logging.getLogger(__name__)


def compile_for_training(mod: nn.Module, dynamic: bool = False, mode: str = "default") -> None:
    """Replace `mod.forward` by a compiled one that runs in training mode only.

    Evaluation and generation (eval mode, a KV cache, batch shapes that change per request)
    keep the eager forward: compiled, each new shape would recompile until torch gives up.
    Module hooks (the training engine's) stay outside the compiled region. Static shapes by
    default: a training run's shapes are fixed (an MTP depth's shorter length compiles once
    more), and static graphs get the better kernels. `mode` is torch.compile's."""
    eager = mod.forward
    compiled = torch.compile(eager, dynamic=dynamic, mode=None if mode == "default" else mode)

    def forward(*args, **kwargs):
        cached = any(isinstance(a, MLACache) for a in (*args, *kwargs.values()))
        if mod.training and torch.is_grad_enabled() and not cached:
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    mod.forward = forward


def uses_cuda_graphs(mode: str) -> bool:
    """Whether torch.compile's `mode` records CUDA graphs (on CUDA; CPU runs them as compiled)."""
    return mode in CUDA_GRAPH_MODES


def compile_blocks(model: nn.Module, expert_parallel: bool, mode: str = "default") -> list[str]:
    """Compile `model`'s decoder blocks (MTP blocks included) in place for training; returns
    what was compiled, by module name. Call before the training engine wraps the model.

    `mode` (train.compile_mode) is torch.compile's. With CUDA graphs each block's forward and
    backward replay as one graph launch; every row count in a block on one rank is fixed (T·K
    routed rows), so one recording serves every step. Expert parallelism takes the default mode
    for its expert GEMMs (compiled with dynamic shapes: the rows received change every step);
    its config refuses the CUDA-graph modes (`Config.validate`)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # built under zero.Init
        raise ValueError(
            "compile_blocks: the model's parameters are ZeRO-3 partitioned; compiled blocks (and "
            "their fused GEMMs, which read weights outside their modules' gathering hooks) need "
            "parallel.zero_stage=1 or 2"
        )
    flash_attn_available()  # probed (an import) here, not inside a trace
    done = []
    for name, layer in model.named_modules():
        if not isinstance(layer, DecoderLayer):
            continue
        if isinstance(layer.mlp, MoE) and expert_parallel:
            moe = layer.mlp
            parts = {"self_attn": layer.self_attn, "input_layernorm": layer.input_layernorm,
                     "post_attention_layernorm": layer.post_attention_layernorm,
                     "mlp.gate": moe.gate, "mlp.shared_experts": moe.shared_experts}  # fmt: skip
            for part, mod in parts.items():
                if mod is not None:
                    compile_for_training(mod, mode=mode)
                    done.append(f"{name}.{part}")
            compile_for_training(moe.experts, dynamic=True)  # rows received differ every step
            done.append(f"{name}.mlp.experts")
        else:
            compile_for_training(layer, mode=mode)
            done.append(name)
    for mod in model.modules():
        if isinstance(mod, LMHead):  # its chunks' softmax + gradient (CUDA; see LMHead)
            mod.compile_ce = True
        elif isinstance(mod, MLA):  # one GEMM for the two down-projections of x
            mod.fuse_input_proj = True
        elif isinstance(mod, MLP):  # one GEMM for gate and up
            mod.fuse_gate_up = True
    if done:
        logger.info("torch.compile (mode %s): %d regions (%s ... %s)", mode, len(done), done[0],
                    done[-1])  # fmt: skip
    return done


def compile_stats() -> dict[str, int]:
    """What torch.compile did in this process: graphs made, frames compiled (a recompile counts
    again), graph breaks (each one splits a block and costs speed: should be 0 on one rank) and
    graphs that a CUDA-graph mode ran without CUDA graphs (torch skips them silently but for a
    log line: mutated inputs, CPU tensors; 0 wanted; also counts on CPU, which has none)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames_compiled": int(counters["frames"]["ok"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }
