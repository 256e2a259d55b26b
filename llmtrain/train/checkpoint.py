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
from llmtrain.tensor_io import ShardWriter, TensorFileError, load_all
from llmtrain.train import faults, health

MOMENTS = ("exp_avg", "exp_avg_sq")
SHARD_BYTES = 2 * 2**30  # model weights are written in files of at most this size


class CheckpointError(RuntimeError):
    pass


def _ep_gather(t: torch.Tensor, group, ep_size: int) -> torch.Tensor:
    if ep_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(ep_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _full_tensors(engine, model):
    """Collective, one tensor at a time: (name, full fp32 tensor) for weights, router biases,
    then (name::moment, tensor) for both Adam moments; experts gathered over the EP group."""
    ep = engine.layout.ep_size
    group = model.moe_layers()[0].dispatcher.group if ep > 1 else None
    engine.relink_optimizer_state()
    params = list(model.named_parameters())
    for name, p in params:
        w = engine.full_param(p)
        yield "model", name, _ep_gather(w, group, ep) if is_expert_param(name) else w
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            yield "model", name, b.detach().float().cpu()
    for name, p in params:
        for key in MOMENTS:
            m = engine.full_moment(p, key)
            yield (
                "optimizer",
                f"{name}::{key}",
                _ep_gather(m, group, ep) if is_expert_param(name) else m,
            )
    yield "optimizer", "__rng__::torch_cpu", torch.get_rng_state()


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
    """All ranks call it. Tensors are gathered one at a time and rank 0 streams them into
    shards, so no rank ever holds more than one full tensor plus rank 0's current shard."""
    ckdir = run_dir / "checkpoints"
    final = ckdir / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    # NaN/inf state or a failed write (a full disk): nothing becomes `latest`, every rank stops
    guard = health.SaveGuard(step, ckdir)
    writers = {}
    if rank == 0:
        with guard.attempt():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            writers = {stem: ShardWriter(tmp, SHARD_BYTES, stem) for stem in ("model", "optimizer")}
    for stem, name, t in guard.wrap(_full_tensors(engine, model)):
        if rank == 0 and guard.ok:
            with guard.attempt():
                writers[stem].add(name, t)
                faults.maybe_disk_full(step, tmp)
    guard.agree()  # collective: before anything is renamed into place
    if rank == 0:
        with guard.attempt():
            for w in writers.values():
                w.finish()
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
            done = sorted(
                p for p in ckdir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
            )
            for old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    guard.agree()  # collective, in place of a barrier: a late write error stops every rank
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

    if not (ckpt / "state.json").is_file():
        raise CheckpointError(f"checkpoint {ckpt} lacks state.json")
    try:
        weights = load_all(ckpt, "model")
        moments = load_all(ckpt, "optimizer")
    except TensorFileError as e:
        raise CheckpointError(f"checkpoint {ckpt} is unusable: {e}") from e
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
