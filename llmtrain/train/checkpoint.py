"""Consolidated, layout-free checkpoints: full fp32 weights, full Adam moments, run state.

Why our own format rather than DeepSpeed's files: DeepSpeed's MoE checkpoint code is keyed to
its own MoE class (expert names like `deepspeed_moe.experts.deepspeed_experts.N`), its
`zero_to_fp32` fails on MoE checkpoints, and loading at another world size needs an offline
conversion. Here every rank contributes its partition through DeepSpeed's full-state API,
experts are gathered across the expert-parallel group, and rank 0 writes tensors under their
model names. Any world size, ZeRO stage or ep_size reads it back, the export reads it without a
process group, and expert optimizer moments survive a change of layout.

Layout:  RUN/checkpoints/step_00000100/{model.safetensors, optimizer.safetensors, state.json,
         config.yaml, tokenizer.json}  and  RUN/checkpoints/latest  (names the last complete one)
A checkpoint is written under `.tmp`, then renamed; `latest` is replaced atomically after.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.parallel.engine import is_expert_param

MOMENTS = ("exp_avg", "exp_avg_sq")
SHARD_BYTES = 2 * 2**30  # model weights are written in files of at most this size


def write_sharded(
    tensors: dict[str, torch.Tensor], out: Path, stem: str, max_bytes: int
) -> list[str]:
    """safetensors files of <= max_bytes each, plus `{stem}.safetensors.index.json` when > 1."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v.contiguous()
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(out / f"{stem}.safetensors"), metadata={"format": "pt"})
        return [f"{stem}.safetensors"]
    names, weight_map = [], {}
    for i, sh in enumerate(shards, start=1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in sh})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return names


def weight_files(ckpt: Path) -> dict[str, str]:
    """tensor name -> file, for a sharded or single-file checkpoint; missing files are errors."""
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        for f in sorted(set(wmap.values())):
            if not (ckpt / f).is_file():
                raise CheckpointError(
                    f"checkpoint {ckpt} is missing the shard {f} named in its index"
                )
        return wmap
    single = ckpt / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no model.safetensors (nor an index)")
    try:
        with safe_open(str(single), "pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{single} is unreadable: {e}") from e


class CheckpointError(RuntimeError):
    pass


def _ep_gather(t: torch.Tensor, group, ep_size: int) -> torch.Tensor:
    if ep_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(ep_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def gather_full_state(engine, model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Collective: every rank calls it; returns full tensors (meaningful on every rank)."""
    ep = engine.layout.ep_size
    group = model.moe_layers()[0].dispatcher.group if ep > 1 else None
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, torch.Tensor] = {}
    engine.relink_optimizer_state()
    for name, p in model.named_parameters():
        expert = is_expert_param(name)
        w = engine.full_param(p)
        weights[name] = _ep_gather(w, group, ep) if expert else w
        for key in MOMENTS:
            m = engine.full_moment(p, key)
            moments[f"{name}::{key}"] = _ep_gather(m, group, ep) if expert else m
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            weights[name] = b.detach().float().cpu()
    moments["__rng__::torch_cpu"] = torch.get_rng_state()
    return weights, moments


def save_checkpoint(
    run_dir: Path,
    step: int,
    engine,
    model,
    state: dict[str, Any],
    config_yaml: str,
    tokenizer_file: Path | None,
    keep_last: int,
    rank: int,
) -> Path | None:
    from safetensors.torch import save_file

    weights, moments = gather_full_state(engine, model)
    ckdir = run_dir / "checkpoints"
    final = ckdir / f"step_{step:08d}"
    if rank == 0:
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_sharded(weights, tmp, "model", SHARD_BYTES)
        save_file(
            {k: v.contiguous() for k, v in moments.items()}, str(tmp / "optimizer.safetensors")
        )
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        if tokenizer_file is not None and tokenizer_file.is_file():
            shutil.copy(tokenizer_file, tmp / "tokenizer.json")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        latest_tmp = ckdir / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, ckdir / "latest")
        done = sorted(p for p in ckdir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    ptr = run_dir / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    d = run_dir / "checkpoints" / ptr.read_text().strip()
    if not (d / "state.json").is_file():
        raise CheckpointError(f"{ptr} names {d.name}, which is incomplete or missing")
    return d


def read_checkpoint(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    for f in ("optimizer.safetensors", "state.json"):
        if not (ckpt / f).is_file():
            raise CheckpointError(f"checkpoint {ckpt} lacks {f}")
    wmap = weight_files(ckpt)
    try:
        weights = {}
        for f in sorted(set(wmap.values())):
            weights.update(load_file(str(ckpt / f)))
        moments = load_file(str(ckpt / "optimizer.safetensors"))
    except Exception as e:  # safetensors raises its own error types on corrupt files
        raise CheckpointError(f"checkpoint {ckpt} is unreadable: {e}") from e
    return weights, moments, json.loads((ckpt / "state.json").read_text())


def local_slice(name: str, full: torch.Tensor, model) -> torch.Tensor:
    """This rank's part of a full tensor (its experts under expert parallelism)."""
    if not is_expert_param(name):
        return full
    mod = model.get_submodule(name.rsplit(".", 1)[0])
    n = getattr(mod, name.rsplit(".", 1)[1]).shape[0]
    return full[mod.offset : mod.offset + n]


def load_weights_into(model, weights: dict[str, torch.Tensor]) -> None:
    """Before the engine exists: copy (sliced) weights and buffers into the module."""
    params = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    missing = [n for n in params if n not in weights]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {missing[:5]} — was it written for another model config?"
        )
    with torch.no_grad():
        for name, p in params.items():
            v = local_slice(name, weights[name], model)
            if v.shape != p.shape:
                raise CheckpointError(
                    f"{name}: checkpoint shape {tuple(v.shape)} != model {tuple(p.shape)}; the checkpoint "
                    "comes from another model config"
                )
            p.copy_(v)
        for name, b in bufs.items():
            if name in weights:
                b.copy_(weights[name])


def restore_optimizer(engine, model, weights, moments, step: int) -> None:
    """After the engine exists: fp32 master weights and both Adam moments, at any layout."""
    engine.ensure_optimizer_state(step)
    for name, p in model.named_parameters():
        engine.set_full(p, local_slice(name, weights[name], model), None)
        for key in MOMENTS:
            engine.set_full(p, local_slice(name, moments[f"{name}::{key}"], model), key)
