"""One step of a real run under torch.profiler (`train.profile_step`).

Why: the bare model's forward + backward (benchmarks/gpu_profile.py) says what the kernels cost;
a run also pays for the engine (DeepSpeed's hooks, fp32 gradient accumulation, the optimizer
step), data and logging, which only a profile of a trainer's step shows. Rank 0 is profiled
and writes a text summary (GPU time by kernel kind, the top ops by device and by host time) and,
unless `train.profile_trace=false`, a Chrome trace under `<run_dir>/profile/`; the step's
metrics record says `profiled` (its time includes the profiler's).
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

KERNEL_KINDS = (  # (kind, substrings of an ATen/library CUDA kernel's name), first match wins
    ("communication", ("nccl",)),
    ("attention", ("fmha", "flash", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
    ("index/sort/scatter", ("index", "scatter", "gather", "sort", "radix", "cub::", "embedding")),
    ("eager elementwise/reduce", ("elementwise", "vectorized", "reduce", "softmax", "norm")),
)


def kernel_kind(name: str) -> str:
    """What a CUDA kernel does, from its name (cuBLAS/CUTLASS GEMMs, cuDNN/flash attention,
    Inductor's Triton kernels, ATen's eager kernels), so a profile says how much of the step
    is matmul and attention and how much is everything else.

    Inductor names a fused kernel after the ops it feeds (`triton_poi_fused__grouped_mm_mul_silu`
    is elementwise work around a GEMM), so Triton kernels are sorted first: only its templates
    (`triton_tem_`) are matmuls, or attention for FlexAttention's."""
    low = name.lower()
    if low.startswith("triton_"):
        if low.startswith("triton_tem_"):
            return "attention" if "attention" in low else "matmul"
        return "fused (triton)"
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def device_kernels(events) -> list:
    """The GPU kernels among `key_averages()` rows: a CPU op's row repeats the device time of
    the kernels it launched, and compiled code adds user-annotation rows over its kernels."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def time_by_kind(events, per: int = 1) -> dict[str, float]:
    """GPU kernel microseconds by `kernel_kind`, divided by `per` (steps profiled)."""
    kinds: dict[str, float] = {}
    for e in device_kernels(events):
        k = kernel_kind(e.key)
        kinds[k] = kinds.get(k, 0.0) + e.self_device_time_total / per
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


@contextlib.contextmanager
def step_profiler(enabled: bool, device: torch.device) -> Iterator[object | None]:
    """A torch.profiler over the block when `enabled` (CPU ops, and CUDA kernels on a GPU), else
    None. The block should end by synchronising the device, so its kernels are in."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        yield prof


def summary(prof, step: int, step_s: float, rows: int = 40) -> str:
    """Text summary of a profiled step: wall time, GPU busy time by kernel kind, top ops."""
    events = prof.key_averages()
    kinds = time_by_kind(events)
    busy = sum(kinds.values()) / 1e6
    lines = [f"step {step}: {step_s:.3f} s with the profiler on"]
    if kinds:
        by = ", ".join(
            f"{k} {us / 1e3:.1f} ms ({us / 1e6 / step_s:.0%})" for k, us in kinds.items()
        )
        lines += [
            f"GPU kernels busy {busy:.3f} s ({busy / step_s:.0%} of the step); by kind: {by}",
            "top ops by GPU time:",
            events.table(
                sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70
            ),
        ]
    lines += [
        "top ops by host time (the Python and launch work a GPU may wait on):",
        events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70),
    ]
    return "\n".join(lines)


def write_step_profile(prof, run_dir: Path, step: int, step_s: float, trace: bool = True) -> Path:
    """Write rank 0's `profile/step_<step>_rank0.txt` and (`trace`) its Chrome trace, gzipped;
    returns the text file's path."""
    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    text = out / f"step_{step}_rank0.txt"
    text.write_text(summary(prof, step, step_s) + "\n")
    if not trace:
        return text
    raw = out / f"step_{step}_rank0.trace.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return text
