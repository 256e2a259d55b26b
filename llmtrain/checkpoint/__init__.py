"""Checkpoint format below both the trainer and the export: sharded writes and reads at any
layout (format.py), the earlier consolidated format (legacy.py), and offline reading of one
tensor at a time for export and `llmtrain.from_pretrained`. Imports neither train/ nor
deepspeed."""

from __future__ import annotations

from pathlib import Path

import torch

from llmtrain.checkpoint.format import (
    MOMENTS,
    CheckpointError,
    ShardedReader,
    is_legacy,
    is_sharded,
    latest_checkpoint,
    resolve_checkpoint,
)
from llmtrain.checkpoint.legacy import LegacyReader, convert

__all__ = ["MOMENTS", "CheckpointError", "LegacyReader", "ShardedReader", "convert",
           "latest_checkpoint", "load_model", "open_checkpoint", "resolve_checkpoint"]  # fmt: skip


def open_checkpoint(path: str | Path) -> ShardedReader | LegacyReader:
    """An offline reader for a checkpoint or run directory, whichever format wrote it."""
    ck = resolve_checkpoint(path)
    if is_sharded(ck):
        return ShardedReader(ck)
    if is_legacy(ck):
        return LegacyReader(ck)
    have = [n for n in ("tensors.json", ".metadata") if (ck / n).is_file()]
    if have:  # a sharded checkpoint with one of its two index files: say which is gone
        gone = ({"tensors.json", ".metadata"} - set(have)).pop()
        raise CheckpointError(f"checkpoint {ck} has {have[0]} but no {gone}: it is incomplete "
                              "or damaged; resume from an earlier checkpoint")  # fmt: skip
    raise CheckpointError(
        f"checkpoint {ck} holds no weights (no tensors.json, no model.safetensors)"
    )


def load_model(path: str | Path, device="cpu", dtype: torch.dtype = torch.float32):
    """Our model with a checkpoint's weights (all experts), in eval mode."""
    from llmtrain.config import load_config
    from llmtrain.model import build_model

    reader = open_checkpoint(path)
    cfg = load_config(reader.dir / "config.yaml")
    model = build_model(cfg.model, device="meta")
    model = model.to_empty(device=device)
    model.tie_weights()
    model.init_weights()  # rope buffers
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    have = set(reader.names())
    missing = [n for n in dict(model.named_parameters()) if n not in have]
    if missing:
        raise CheckpointError(f"checkpoint {reader.dir} lacks {missing[:5]}")
    with torch.no_grad():
        for name in reader.names():
            if name in tensors:
                t = reader.read(name)
                if tuple(t.shape) != tuple(tensors[name].shape):
                    raise CheckpointError(
                        f"{name}: checkpoint shape {tuple(t.shape)} != model "
                        f"{tuple(tensors[name].shape)}"
                    )
                tensors[name].copy_(t)
    if dtype != torch.float32:
        model.to(dtype)
        for m in model.moe_layers():
            m.gate.float()
    return model.eval()
