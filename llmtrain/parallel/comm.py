"""Collectives that put tensors on the device their group's backend serves, in one place.

Why: gloo takes CPU tensors, NCCL takes CUDA tensors of the current device. Call sites hand in
tensors wherever they live (a CPU checkpoint fragment, a CUDA load counter) and get results back
on the caller's device; only this module knows which device a group communicates on. The CPU
suite cannot see a mismatch (gloo accepts CPU tensors), so tests wrap a group with a declared
communication device and fail on any tensor that reaches a collective elsewhere.

Every function takes `group=None` (the default group) like torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_DEVICE_OVERRIDE: dict[Any, torch.device] = {}


def comm_device(group=None) -> torch.device:
    """The device whose tensors the group's backend takes."""
    if group in _DEVICE_OVERRIDE:
        return _DEVICE_OVERRIDE[group]
    backend = dist.get_backend(group)
    if backend == "nccl" or (backend != "gloo" and "cuda" in str(backend)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def declare_device(group, device: torch.device | str | None) -> None:
    """Tests: make `comm_device(group)` answer `device` (None removes the declaration)."""
    if device is None:
        _DEVICE_OVERRIDE.pop(group, None)
    else:
        _DEVICE_OVERRIDE[group] = torch.device(device)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """Reduce `t` over the group; returns the result on `t`'s device (also written into `t`)."""
    dev = comm_device(group)
    buf = _to(t.contiguous(), dev)
    dist.all_reduce(buf, op=op, group=group)
    if buf is not t:
        t.copy_(buf)
    return t


def all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape on all ranks), on `t`'s device."""
    dev = comm_device(group)
    buf = _to(t.contiguous(), dev)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    return [_to(p, t.device) for p in parts]


def all_to_all_single(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None
) -> torch.Tensor:
    """Rows of `x` split by `in_splits` go to each rank; returns the rows received, on x's device."""
    dev = comm_device(group)
    buf = _to(x.contiguous(), dev)
    out = buf.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, buf, out_splits, in_splits, group=group)
    return _to(out, x.device)


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """`t` from global rank `src` on every rank, on `t`'s device (also written into `t`)."""
    dev = comm_device(group)
    buf = _to(t.contiguous(), dev)
    dist.broadcast(buf, src=src, group=group)
    if buf is not t:
        t.copy_(buf)
    return t


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """A picklable object from global rank `src` (object collectives use the group's device)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=comm_device(group))
    return box[0]


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's picklable object, in rank order (object collectives use the group's device)."""
    box: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(box, obj, group=group)
    return box


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def new_cpu_group():
    """A gloo group over every rank, for collectives run off the training thread (a background
    checkpoint write): its operations never interleave with the training group's. All ranks
    must call it, in the same order. None when not distributed."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo")
