"""One GPU: where a training step's time goes (model forward + backward in bf16, no optimizer).

    python benchmarks/gpu_profile.py [--config configs/moe_1b.yaml] [--micro 8] [--seq 2048]
                                     [--compile]

Builds the model as DeepSpeed's bf16 engine would hold it (bf16 parameters, fp32 routing state),
runs warm-up steps, then profiles a few with torch.profiler and prints the top CUDA kernels /
ops (of the compiled blocks with --compile, as train.compile=true runs them), the step time, the achieved TFLOP/s against the config's FLOPs per token, how much of
the step the GPU sat idle (host-bound), and the GPU time by kernel kind (matmul, attention,
Inductor's fused kernels, eager ATen kernels, index/sort, copies, communication). Writes the table to --out (default
$OUT/gpu_profile_<config>.txt when $OUT is set). Needs CUDA.

--kernels instead times the step's kernels one by one at the config's shapes (B=--micro, T=--seq),
forward + backward in bf16, with fresh random inputs, in three tables:
1. the device's ceilings: a bf16 8192x8192x8192 matrix product (the rate MFU's 989 TFLOP/s peak
   is a datasheet figure for) and a device-to-device copy (bytes read + written);
2. every weight matmul of the step (llmtrain.accounting.matmuls: attention projections, dense
   and shared-expert MLPs, the router in fp32, the routed experts' grouped GEMM with balanced
   counts, the LM head in the fused loss's chunks): ms per micro-batch, TFLOP/s, share of FLOPs;
3. the attention kernels (MLA's q/k head dim beside its narrower v): SDPA as torch dispatches
   it (and which kernel that is), SDPA forced onto cuDNN, onto its efficient kernel, onto its
   flash kernel with v zero-padded to the q/k width (flash wants one head dim), flash-attn when
   installed, and compiled FlexAttention (causal, and with 4 documents per row). Each row gives
   ms, TFLOP/s (the accounting's convention: causal, backward = 2 x forward) and the largest
   output difference from SDPA's own pick; a kernel that cannot run says why. This picks
   attn_backend on a new GPU.
After SDPA's own row in table 3 a line bounds the step: matmuls at their measured rates plus SDPA's
attention, with every other kernel (norms, RoPE, routing, permutation, loss, optimizer) free.
The MFU no code change can beat without faster GEMM or attention kernels, or other shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T_START = time.monotonic()  # before the module's torch import and CUDA init (PEAK_BF16 below)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "configs" / "moe_1b.yaml"))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks")
    ap.add_argument("--cpu", action="store_true", help="smoke-test this script on CPU (no figures)")
    ap.add_argument("--kernels", action="store_true", help="time the step's kernels one by one")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    t_start = T_START
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmtrain.accounting import RUNTIME_BYTES, count
    from llmtrain.config import load_config
    from llmtrain.model import build_model
    from llmtrain.train.profiling import time_by_kind

    if not torch.cuda.is_available() and not args.cpu:
        print("benchmarks/gpu_profile.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    dev = "cpu" if args.cpu else "cuda"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    cfg = load_config(args.config, args.overrides)
    if args.kernels:
        limit = float(os.environ.get("STEP_LIMIT", 0)) - 10  # gpu_check.sh's step limit
        deadline = t_start + (limit if limit > 0 else 600)
        path = _out_path(args, "gpu_kernels")
        with open(path or os.devnull, "w") as f:  # row by row: a timeout keeps the rows done
            for line in kernel_tables(cfg, args.micro, args.seq, dev, sync, deadline):
                print(line, flush=True)
                f.write(line + "\n")
                f.flush()
        return
    model = build_model(cfg.model, device=dev)
    for m in model.moe_layers():  # what the engine holds: bf16 params, fp32 master router
        m.gate.set_fp32_weight(m.gate.weight.detach().clone())
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.train()
    if args.compile:
        from llmtrain.train.compile import compile_blocks

        compile_blocks(model, expert_parallel=False)
    v = cfg.model.vocab_size
    ids = torch.randint(0, v, (args.micro, args.seq + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        out = model(x, labels=y, check_inputs=False)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dt = (time.perf_counter() - t) / args.steps
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    tokens = args.micro * args.seq
    flops = count(cfg.model, seq_len=args.seq).flops_per_token * tokens
    events = prof.key_averages()
    kinds = time_by_kind(events, per=args.steps)  # GPU kernels only
    gpu_us = sum(kinds.values())
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
    runtime = "n/a on CPU"
    if dev == "cuda":  # device memory torch's allocator does not hold: context, loaded kernels,
        # cuBLAS/cuDNN workspaces; llmtrain.accounting.RUNTIME_BYTES["cuda"] states it, unmeasured
        free, total = torch.cuda.mem_get_info()
        outside = (total - free - torch.cuda.memory_reserved()) / 2**20
        stated = RUNTIME_BYTES["cuda"] / 2**20
        runtime = f"{outside:.0f} MiB (llmtrain count assumes {stated:.0f})"
    by_kind = ", ".join(f"{k} {us / 1e3:.1f} ms ({us / 1e6 / dt:.0%})" for k, us in kinds.items())
    lines = [
        f"config {Path(args.config).name} ({'compiled' if args.compile else 'eager'}): "
        f"{tokens} tokens/micro-batch, fwd+bwd {dt * 1e3:.1f} ms, "
        f"{tokens / dt:,.0f} tokens/s, {flops / dt / 1e12:.0f} TFLOP/s "
        f"({flops / dt / PEAK_BF16:.1%} of {PEAK_TF}), GPU busy {gpu_us / 1e6 / dt:.0%} of the step, "
        f"peak memory {peak_gib:.1f} GiB",
        f"CUDA memory outside torch's allocator (context, kernels, workspaces): {runtime}",
        f"GPU kernel time per fwd+bwd by kind: {by_kind or 'n/a (no CUDA kernels)'}",
        events.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=60),
    ]
    text = "\n".join(lines)
    print(text)
    _write(args, text, "gpu_profile")


def _out_path(args, kind: str) -> str:
    """--out, else $OUT/<kind>_<config>.txt when $OUT is set, else none."""
    if args.out:
        return args.out
    if os.environ.get("OUT"):
        return str(Path(os.environ["OUT"]) / f"{kind}_{Path(args.config).stem}.txt")
    return ""


def _write(args, text: str, kind: str) -> None:
    out = _out_path(args, kind)
    if out:
        Path(out).write_text(text + "\n")


def _device_peak() -> float:
    """The dense bf16 datasheet peak MFU is taken against: the GPU's own from the trainer's
    table (an H100/H200 SXM: 989 TFLOP/s; PCIe and NVL parts less), else an H100 SXM's."""
    import torch

    from llmtrain.train.metrics import gpu_peak

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return gpu_peak(name, "bf16") or 989e12


PEAK_BF16 = _device_peak()
PEAK_TF = f"{PEAK_BF16 / 1e12:.0f}"


def _bench(fn, sync, min_s: float = 0.005) -> float:
    """Median seconds per call of fn: 2 warm-ups, then 5 timings of enough back-to-back calls
    to last min_s (launch and sync costs stay out of sub-millisecond kernels)."""
    fn()
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    reps = max(1, min(50, int(min_s / max(time.perf_counter() - t0, 1e-7))))
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return sorted(times)[2]


def ceiling_rows(dev: str, sync):
    """The device's two ceilings on random data: a bf16 matrix product (the trainer's own
    ceiling measurement) and a copy."""
    import torch

    from llmtrain.train.metrics import measure_matmul_ceiling

    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    n = 1024 if dev == "cpu" else 8192
    rate = measure_matmul_ceiling(torch.device(dev), dt, n=n, reps=10)
    name = f"matmul {n}^3 {str(dt).split('.')[-1]}"
    yield f"{name:<42} {2 * n**3 / rate * 1e3:>8.2f} {rate / 1e12:>8.1f} TFLOP/s ({rate / PEAK_BF16:.0%} of {PEAK_TF})"
    src = torch.randn(1 << (22 if dev == "cpu" else 29), device=dev, dtype=dt)
    dst = torch.empty_like(src)
    s = _bench(lambda: dst.copy_(src), sync)
    nbytes = 2 * src.numel() * src.element_size()
    name = f"copy {nbytes // 2**20} MiB read + written"
    yield f"{name:<42} {s * 1e3:>8.2f} {nbytes / s / 1e12:>8.2f} TB/s"


def _matmul_seconds(m, rows: int, dev: str, dt, sync) -> tuple[float, str]:
    """Seconds of one forward + backward of matmul `m` with `rows` rows, and how it ran: a plain
    matmul, or the routed experts as the model runs them (torch's grouped GEMM where it can,
    else one matmul per expert) with balanced counts, as the bias balancing aims for."""
    import torch
    import torch.nn.functional as F

    from llmtrain.model.moe import grouped_mm_ok

    d = torch.float32 if m.fp32 else dt
    x = torch.randn(rows, m.k, device=dev, dtype=d, requires_grad=True)
    w_shape = (m.groups, m.k, m.n) if m.groups > 1 else (m.k, m.n)
    w = (torch.randn(w_shape, device=dev, dtype=d) * m.k**-0.5).requires_grad_()
    dy = torch.randn(rows, m.n, device=dev, dtype=d)
    how = "matmul"
    if m.groups > 1:
        counts = torch.full((m.groups,), rows // m.groups, dtype=torch.int64)
        counts[: rows % m.groups] += 1
        offs = torch.cumsum(counts, 0).to(device=dev, dtype=torch.int32)
        sizes = counts.tolist()
        how = "grouped_mm" if grouped_mm_ok(x, w) else "loop"

        def mm():
            if how == "grouped_mm":
                return F.grouped_mm(x, w, offs=offs)
            return torch.cat([xs @ w[e] for e, xs in enumerate(x.split(sizes))])
    else:

        def mm():
            return x @ w

    return _bench(lambda: torch.autograd.grad(mm(), (x, w), dy), sync), how


def matmul_rows(cfg, tokens: int, dev: str, sync, deadline: float, totals: dict):
    """One row per weight matmul of the step (llmtrain.accounting.matmuls), forward + backward
    through autograd as training runs it; adds the step's matmul seconds to totals["matmul_s"]
    (None when a row could not run)."""
    import torch

    from llmtrain.accounting import matmuls
    from llmtrain.model.loss import _chunk_rows

    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    inv = matmuls(cfg.model, tokens)
    step_flops = sum(m.train_flops for m in inv)
    totals["matmul_s"], totals["matmul_flops"] = 0.0, step_flops
    for m in inv:
        rows, scale, how = m.m, float(m.count), ""
        if m.name == "lm_head":  # the fused loss runs the head in chunks of tokens
            rows = min(m.m, _chunk_rows(cfg.model.vocab_size, torch.device(dev), m.m))
            scale, how = m.count * m.m / rows, f" ({rows}-row chunks)"
        label = f"{m.name}{how}"
        shape = f"{rows}x{m.k}x{m.n}" + (f" /{m.groups}" if m.groups > 1 else "")
        if time.monotonic() > deadline - 5:
            totals["matmul_s"] = None
            yield f"{label:<42} not run: out of time"
            continue
        try:
            s, how = _matmul_seconds(m, rows, dev, dt, sync)
            s *= scale
            if m.groups > 1:
                label = f"{m.name} ({how})"
            flops = m.train_flops
            if totals["matmul_s"] is not None:
                totals["matmul_s"] += s
            yield (f"{label:<42} {s * 1e3:>8.2f} {flops / s / 1e12:>8.1f} "
                   f"{flops / step_flops:>7.1%}  {shape}{' fp32' if m.fp32 else ''}")  # fmt: skip
        except Exception as err:  # this shape cannot run here: say why, go on
            totals["matmul_s"] = None
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:100]
            yield f"{label:<42} unsupported: {type(err).__name__}: {why}"


def kernel_tables(cfg, micro: int, seq: int, dev: str, sync, deadline: float):
    """Yields the --kernels tables' lines (module docstring), the bound after SDPA's own row."""
    from llmtrain.accounting import count

    c = cfg.model
    tokens = micro * seq
    dtname = "fp32" if dev == "cpu" else "bf16"
    yield f"device ceilings, random data ({dev}): matmul best of 3 timings of 10, copy median of 5"
    yield from ceiling_rows(dev, sync)
    yield ""
    yield (f"weight matmuls of one micro-batch ({tokens} tokens), {dtname}, forward + backward, "
           f"all layers:")  # fmt: skip
    yield f"{'matmul':<42} {'ms':>8} {'TFLOP/s':>8} {'FLOPs':>7}  m x k x n [/groups]"
    totals: dict = {}
    yield from matmul_rows(cfg, tokens, dev, sync, deadline, totals)
    yield ""
    blocks = c.num_layers + c.mtp_depth
    bound_done = False
    for line in attention_table(cfg, micro, seq, dev, sync, deadline, totals):
        yield line
        if not bound_done and "attention_s" in totals:
            bound_done = True
            mm_s, at_s = totals.get("matmul_s"), totals["attention_s"]
            if mm_s is None or at_s is None:
                yield "bound: not computed (a matmul or SDPA's attention did not run)"
                continue
            flops = count(c, seq_len=seq).flops_per_token * tokens
            floor = mm_s + blocks * at_s
            yield (f"bound: matmuls {mm_s * 1e3:.1f} ms + attention {blocks} x {at_s * 1e3:.2f} ms "
                   f"= {floor * 1e3:.1f} ms per micro-batch with every other kernel free: "
                   f"<= {tokens / floor:,.0f} tokens/s, MFU <= {100 * flops / floor / PEAK_BF16:.3g}% "
                   f"of {PEAK_TF} TFLOP/s (matmuls alone {totals['matmul_flops'] / mm_s / 1e12:.0f} "
                   f"TFLOP/s)")  # fmt: skip


def attention_table(
    cfg, micro: int, seq: int, dev: str, sync, deadline: float, totals: dict | None = None
):
    """Yields the table's lines, one row per attention kernel at the config's shapes: fwd+bwd ms,
    TFLOP/s, max |out - SDPA's pick|.

    Each candidate's forward + backward is timed by `_bench` (2 warm-ups, median of 5 runs of
    back-to-back calls lasting at least 5 ms); one that raises (no such kernel here, a shape it
    refuses) reports the first line of why. Compiled FlexAttention comes
    last because its compilation (forward and backward) takes the longest: it is not started
    with less than 60 s to `deadline` (monotonic seconds; a cold compile of forward and
    backward), other rows with less than 5 s.
    totals["attention_s"]: seconds of SDPA's own pick, forward + backward (None if it failed)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from llmtrain.model.attention import (
        DocumentMask,
        _flex,
        attention,
        flash_attn_available,
        sdpa_kernel_name,
    )
    from llmtrain.model.layers import softmax_scale

    c = cfg.model
    b, h, t, e, vd = micro, c.num_heads, seq, c.qk_head_dim, c.v_head_dim
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    scale = softmax_scale(c)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(b, h, t, e, device=dev, dtype=dt, generator=g) for _ in range(2))
    v = torch.randn(b, h, t, vd, device=dev, dtype=dt, generator=g)
    dout = torch.randn(b, h, t, vd, device=dev, dtype=dt, generator=g)
    flops = 3 * b * h * t * (t + 1) / 2 * 2 * (e + vd)  # count(): causal, bwd = 2 x fwd

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def forced(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v)

        return fn

    def flash_padded(q, k, v):  # SDPA's flash kernel wants v as wide as q and k
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, F.pad(v, (0, e - vd)))[..., :vd]

    # int64 ids in both rows (as arange gives): one dtype, so the second flex row reuses the
    # first one's compiled kernels instead of compiling again
    causal = DocumentMask(torch.zeros(b, t, dtype=torch.long, device=dev))
    docs = DocumentMask(torch.arange(t, device=dev).div(t // 4, rounding_mode="floor")
                        .clamp(max=3).expand(b, t).contiguous())  # fmt: skip
    fraction = sum((n * (n + 1) / 2) for n in [t // 4] * 3 + [t - 3 * (t // 4)]) / (t * (t + 1) / 2)
    pick = sdpa_kernel_name(*(x.detach().requires_grad_() for x in (q, k, v)))  # as timed
    rows: list[tuple[str, object, float]] = [
        (f"sdpa (torch's pick: {pick})", sdpa, 1.0),
        ("sdpa cudnn", forced(SDPBackend.CUDNN_ATTENTION), 1.0),
        ("sdpa efficient", forced(SDPBackend.EFFICIENT_ATTENTION), 1.0),
        ("sdpa flash, v padded", flash_padded, 1.0),
    ]
    if flash_attn_available():
        rows.append(("flash-attn", lambda q, k, v: attention(q, k, v, scale, "flash"), 1.0))
    compiled = dev == "cuda"
    rows += [  # documents first: what FlexAttention is here for (train data.doc_mask=true)
        ("flex compiled, 4 docs/row", lambda q, k, v: _flex(q, k, v, scale, docs, compiled),
         fraction),
        ("flex compiled, causal", lambda q, k, v: _flex(q, k, v, scale, causal, compiled), 1.0),
    ]  # fmt: skip
    yield (f"attention kernels, {'bf16' if dt == torch.bfloat16 else 'fp32'} on {dev}: B={b} "
           f"H={h} T={t} qk={e} v={vd}, causal; forward + backward, median of 5 timings")  # fmt: skip
    yield f"{'kernel':<42} {'ms':>8} {'TFLOP/s':>8} {'max|out - sdpa|':>16}"
    ref = None
    totals = {} if totals is None else totals
    for i_row, (name, fn, frac) in enumerate(rows):
        if i_row == 1:  # SDPA's own pick is done (or failed): the bound can be drawn
            totals.setdefault("attention_s", None)
        if time.monotonic() > deadline - (60 if name.startswith("flex") else 5):
            yield f"{name:<42} not run: out of time"
            continue
        try:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))

            def run(fn=fn, qq=qq, kk=kk, vv=vv):
                o = fn(qq, kk, vv)
                torch.autograd.grad(o, (qq, kk, vv), dout)  # no .grad accumulation timed
                return o

            ms = _bench(run, sync) * 1e3  # back to back, as the matmul rows: no launch gaps
            out = run().detach().float()
            if ref is None:
                ref = out
            # the document-masked row computes other attention: no difference to show
            diff = "-" if frac != 1.0 else f"{(out - ref).abs().max().item():.2e}"
            tflops = flops * frac / (ms / 1e3) / 1e12
            if i_row == 0:
                totals["attention_s"] = ms / 1e3
            yield f"{name:<42} {ms:>8.2f} {tflops:>8.1f} {diff:>16}"
        except Exception as err:  # this kernel cannot run here: say why, go on
            why = (str(err).strip().splitlines() or [type(err).__name__])[0][:100]
            yield f"{name:<42} unsupported: {type(err).__name__}: {why}"


if __name__ == "__main__":
    main()
