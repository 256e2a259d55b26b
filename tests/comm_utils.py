"""Strict communication devices for CPU tests: run code as if every process group served
another device, and fail on any tensor our code hands a collective elsewhere.

gloo takes CPU tensors, so the CPU suite cannot tell a collective that got a CPU tensor from
one that got a tensor on the group's device (NCCL would fail). `record_collectives(fn)` runs
`fn` with:

- `comm.comm_device(group)` answering a declared device (default `meta`) for every group;
- `comm._to`, the one place comm moves tensors, moving to that device by wrapping the data in
  `OnDeclaredDevice` (a tensor subclass: the bytes stay on the CPU so gloo can still send them)
  and copying them back out;
- every torch.distributed collective wrapped: a call reached from llmtrain's own code must come
  through llmtrain.parallel.comm with every tensor on the declared device; a call from
  llmtrain code that bypasses comm fails; calls made inside DeepSpeed or torch are recorded
  but not checked (those libraries place their own tensors).

It returns the records of the calls made through comm: (op, group size, source) tuples.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmtrain.parallel import comm

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter", "barrier", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv",
               "isend", "irecv", "monitored_barrier")  # fmt: skip


class OnDeclaredDevice(torch.Tensor):
    """A tensor 'on the declared communication device' (its bytes stay on the CPU)."""


class CommDeviceError(AssertionError):
    pass


@dataclass
class Record:
    op: str
    source: str  # "comm" (llmtrain through the helper) or "library" (deepspeed / torch)
    caller: str  # the llmtrain function that called comm


def _origin(frame) -> tuple[str, str]:
    """Who called the collective: walk out of torch and this file to the first module that is
    llmtrain's comm helper, other llmtrain code, or a library."""
    caller = ""
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod == "llmtrain.parallel.comm":
            f = frame.f_back
            while f is not None and f.f_globals.get("__name__", "") == mod:
                f = f.f_back
            if f is not None:
                caller = f"{f.f_globals.get('__name__')}.{f.f_code.co_name}"
            return "comm", caller
        if mod.startswith("llmtrain"):
            return "bypass", f"{mod}.{frame.f_code.co_name}:{frame.f_lineno}"
        if mod.startswith(("deepspeed", "torch")) or mod == __name__:
            # DeepSpeed and torch.distributed.checkpoint pick their collectives' devices
            # themselves (DCP uses object collectives on the group's device)
            if mod.startswith(("deepspeed", "torch.distributed.checkpoint")):
                return "library", mod
            frame = frame.f_back
            continue
        return "other", mod  # test code setting things up
    return "other", ""


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _plain(a):
    if isinstance(a, OnDeclaredDevice):
        return a.as_subclass(torch.Tensor)
    if isinstance(a, list):
        return [_plain(x) for x in a]
    return a


def record_collectives(fn: Callable, *args, device: str = "meta", **kwargs):
    """Run `fn(*args, **kwargs)` under strict communication devices; returns (fn's result,
    the list of Records of collectives that went through comm). Raises CommDeviceError on the
    first collective that bypasses comm or gets a tensor off the declared device."""
    declared = torch.device(device)
    records: list[Record] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    real_to = comm._to

    def fake_to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        if dev == declared:
            if isinstance(t, OnDeclaredDevice):
                return t
            return t.detach().clone().as_subclass(OnDeclaredDevice)  # a copy, like a transfer
        if isinstance(t, OnDeclaredDevice):
            return real_to(t.as_subclass(torch.Tensor).clone(), dev)
        return real_to(t, dev)

    def wrap(name, f):
        @functools.wraps(f)
        def checked(*a, **kw):
            source, caller = _origin(sys._getframe(1))
            if source == "bypass":
                raise CommDeviceError(
                    f"{caller} calls torch.distributed.{name} directly; use llmtrain.parallel.comm"
                )
            if source == "comm":
                for t in _tensors(a, kw):
                    if not isinstance(t, OnDeclaredDevice):
                        raise CommDeviceError(
                            f"{name} from {caller} got a tensor on {t.device}, not on the "
                            f"group's device {declared}"
                        )
                if "device" in kw and kw["device"] is not None:
                    if torch.device(kw["device"]) != declared:
                        raise CommDeviceError(f"{name} from {caller}: device={kw['device']}")
                    kw["device"] = torch.device("cpu")
                records.append(Record(name, source, caller))
                a = tuple(_plain(x) for x in a)
                kw = {k: _plain(v) for k, v in kw.items()}
            return f(*a, **kw)

        return checked

    with contextlib.ExitStack() as stack:
        for name, f in real.items():
            setattr(dist, name, wrap(name, f))
            stack.callback(setattr, dist, name, f)
        comm._to = fake_to
        stack.callback(setattr, comm, "_to", real_to)
        real_device = comm.comm_device
        comm.comm_device = lambda group=None: declared
        stack.callback(setattr, comm, "comm_device", real_device)
        result = fn(*args, **kwargs)
    return result, records
