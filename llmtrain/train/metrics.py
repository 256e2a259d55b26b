"""Metrics of a run: JSONL (rank 0, one object per logged step), TensorBoard, a progress line.

Expert load per MoE layer: max/mean and MaxVio = (max − mean)/mean (Wang et al. 2024, the
aux-loss-free balancing paper), and the range of the correction bias.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# dense peaks per GPU for MFU (TFLOP/s x 1e12): bf16 tensor cores, TF32 tensor cores, and fp32
# without them (torch's default float32_matmul_precision "highest"); None: not in the table, so
# measured. Data-sheet figures halved where the sheet quotes sparsity. First match wins, so the
# PCIe / NVL parts come before the SXM name they contain (GB200 before B200)
_GPU_PEAKS = (  # (name fragment, bf16, tf32, fp32)
    ("H100 PCIe", 756e12, 378e12, 51e12),
    ("H100 NVL", 835e12, 418e12, 60e12),
    ("H200 NVL", 835e12, 418e12, 60e12),
    ("H800 PCIe", 756e12, 378e12, 51e12),
    ("H100", 989e12, 494.5e12, 67e12),
    ("H200", 989e12, 494.5e12, 67e12),
    ("H800", 989e12, 494.5e12, 67e12),
    ("H20", 148e12, 74e12, None),
    ("GB200", 2500e12, 1250e12, None),
    ("B200", 2250e12, 1125e12, None),
    ("A100", 312e12, 156e12, 19.5e12),
    ("A800", 312e12, 156e12, 19.5e12),
    ("L40S", 362e12, 183e12, 91.6e12),
    ("MI300X", 1307.4e12, None, None),
    ("MI325X", 1307.4e12, None, None),
)


def measure_matmul_ceiling(
    device, dtype: torch.dtype, n: int | None = None, reps: int | None = None
) -> float:
    """FLOP/s of the best timing of `reps` back-to-back n³ products (one device sync per timing,
    so launch latency is amortised). A GPU: best of 3 timings of 10 8192³ products (a 1024³
    product is too short to time its throughput there); a CPU: best of 10 single 1024³ ones
    (a busy machine's slow moments are left out)."""
    cpu = device.type == "cpu"
    n, reps = n or (1024 if cpu else 8192), reps or (1 if cpu else 10)
    trials = 10 if cpu else 3
    # a generator of its own: the run's random streams (restored on resume) must not move
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n**3 / best


def gpu_peak(name: str, dtype: str) -> float | None:
    """The dense peak of the GPU called `name` for `dtype` (fp32: TF32's only where torch lets
    fp32 matmuls use it), None for a GPU or precision not in the table."""
    for frag, bf16, tf32, fp32 in _GPU_PEAKS:
        if frag in name:
            if dtype != "fp32":
                return bf16
            return fp32 if torch.get_float32_matmul_precision() == "highest" else tf32
    return None


def peak_flops_per_device(device, dtype: str, warn: bool = False) -> float:
    """The MFU denominator: the GPU's data-sheet dense peak, else a measured matmul ceiling
    (below the peak, so MFU reads high: `warn` says so and how to set the peak)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        peak = gpu_peak(name, dtype)
        if peak is not None:
            return peak
    if device.type == "cpu":
        # the faster of fp32 and bf16 products: a CPU without AVX512-BF16/AMX emulates bf16 at
        # ~1% of its fp32 rate (a 1024³ product took 2.6 s on a 2-core EPYC), hence bf16 at 256³
        rate = measure_matmul_ceiling(device, torch.float32)
        if dtype == "bf16":
            rate = max(rate, measure_matmul_ceiling(device, torch.bfloat16, n=256))
        return rate
    rate = measure_matmul_ceiling(device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    if warn and device.type == "cuda":
        logger.warning(
            "%s (%s) is not in llmtrain's table of dense peaks: MFU is against a measured matmul "
            "ceiling of %.0f TFLOP/s, below the data-sheet peak, so it reads high; set "
            "train.peak_flops=<dense peak FLOP/s per device> for MFU as published",
            name, dtype, rate / 1e12,
        )  # fmt: skip
    return rate


def memory_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def expert_stats(model, loads_LE: torch.Tensor | None = None, ep_size: int = 1) -> dict:
    """Per MoE layer: max/mean load and the bias range; MaxVio over layers. `loads_LE` is the
    step's global token count per expert (summed over ranks); else the last local forward.
    With expert parallelism, `moe/ep_rank_max_over_mean`: the routed rows of the busiest
    position in the expert-parallel group (its experts' loads) over the mean position's. Dispatch
    is dropless, so a routing collapse shows here (memory grows with it) before that rank runs
    out of memory. The loads are summed over the expert-data-parallel replicas: with world >
    ep_size it is their average, and one replica's hot rank shows diluted."""
    out = {}
    vios, ratios, ranks = [], [], []
    layers = model.moe_layers()
    names = model.moe_layer_names() if hasattr(model, "moe_layer_names") else None
    names = names or [f"layer{i}" for i in range(len(layers))]
    for i, m in enumerate(layers):
        c = (loads_LE[i] if loads_LE is not None else m.last_counts).double().cpu()
        mean = c.mean().clamp(min=1e-9)
        ratios.append(float(c.max() / mean))
        vios.append(float((c.max() - mean) / mean))
        if ep_size > 1:  # rank r holds experts r·E/ep … (r+1)·E/ep − 1
            rows = c.view(ep_size, -1).sum(1)
            ranks.append(float(rows.max() / rows.mean().clamp(min=1e-9)))
        b = m.gate.e_score_correction_bias
        out[f"moe/{names[i]}/max_over_mean"] = ratios[-1]
        out[f"moe/{names[i]}/bias_range"] = float(b.max() - b.min())
    if vios:
        out["moe/maxvio_mean"] = sum(vios) / len(vios)
        out["moe/maxvio_max"] = max(vios)
        out["moe/max_over_mean"] = max(ratios)
    if ranks:
        out["moe/ep_rank_max_over_mean"] = max(ranks)
    return out


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl. A line that is not one (cut off by a crash, a full disk or
    a lost node) is dropped with a warning: it must not stop a resume or a scaling fit. A skipped
    step's non-finite values read back as None (written null: strict JSON)."""
    out, torn = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
        else:
            torn += 1
    if torn:
        logger.warning("%s: dropped %d line(s) that are not a metrics record", path, torn)
    return out


def _json_value(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _json_line(r: dict) -> str:
    """One strict-JSON line (a non-finite value, as older runs wrote them, becomes null)."""
    return json.dumps({k: _json_value(v) for k, v in r.items()}, allow_nan=False) + "\n"


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        t,
        start_step: int,
        flops_per_token: float,
        peak: float,
        world: int,
        ep_size: int = 1,
    ):
        self.rank, self.flops_per_token, self.peak, self.world = rank, flops_per_token, peak, world
        self.ep_size = ep_size  # for moe/ep_rank_max_over_mean
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.bar = None
        self.acc_time = 0.0
        self.acc_tokens = 0
        if rank != 0:
            return
        if start_step and self.path.exists():  # drop lines past the checkpoint we resumed from
            keep = [r for r in read_records(self.path) if r["step"] <= start_step]
            tmp = self.path.with_name(self.path.name + ".tmp")  # a kill here loses no history
            tmp.write_text("".join(_json_line(r) for r in keep))
            os.replace(tmp, self.path)
        elif not start_step and self.path.exists():
            self.path.unlink()
        self.file = open(self.path, "a")
        if t.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                logger.warning("tensorboard is not installed; metrics go to metrics.jsonl only")
        from tqdm import tqdm

        self.bar = tqdm(
            total=t.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
        )

    def tick(self, dt: float, tokens: int) -> None:
        self.acc_time += dt
        self.acc_tokens += tokens
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict, model, dt: float, tokens: int, loads_LE=None) -> None:
        self.acc_time += dt
        self.acc_tokens += tokens
        tok_s = self.acc_tokens / max(self.acc_time, 1e-9)
        self.acc_time, self.acc_tokens = 0.0, 0
        record["tokens_per_s"] = tok_s
        record["tflops_per_device"] = tok_s * self.flops_per_token / self.world / 1e12
        record["mfu"] = tok_s * self.flops_per_token / self.world / self.peak
        record["memory_gib"] = memory_bytes(next(model.parameters()).device) / 2**30
        record.update(expert_stats(model, loads_LE, self.ep_size))
        if self.rank != 0:
            return
        # strict JSON: a skipped step's NaN loss is written null (jq and most parsers refuse NaN)
        self.file.write(_json_line(record))
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])
        if self.bar is not None:
            post = {
                "loss": f"{record['loss']:.4f}",
                "lr": f"{record['lr']:.2e}",
                "tok/s": f"{tok_s:.0f}",
            }
            if "val_loss" in record:
                post["val"] = f"{record['val_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.rank == 0:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
            if self.bar is not None:
                self.bar.close()
