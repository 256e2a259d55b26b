"""llmtrain: pre-train DeepSeek-style MLA + MoE models with DeepSpeed (ZeRO, expert parallelism),
count their parameters, FLOPs and memory, fit and use scaling laws, evaluate, and export to
Hugging Face. `llmtrain COMMAND --help` for each command."""

# The console script: parsing and dispatch only; the work lives in the packages.

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from llmtrain.config import ConfigError, ModelConfig, load_config


def _load_model_config(path: str, overrides: list[str]) -> tuple[ModelConfig, Any]:
    """Our YAML (with overrides) or a Hugging Face config.json; returns (model, config or None)."""
    p = Path(path)
    if p.is_dir() and (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        p = p / "config.yaml"  # one of our checkpoints
    elif p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json":
        from llmtrain.errors import UsageError
        from llmtrain.hf import model_config_from_hf, read_hf_config

        if overrides:
            raise UsageError(
                f"overrides ({' '.join(overrides)}) apply to YAML configs, not to a Hugging Face "
                "config.json; edit a copy of the JSON, or convert it to YAML first"
            )
        # a release's MTP layers (DeepSeek-V3: 1) are counted as the YAML twin counts them: the
        # "MTP parameters (extra)" row, their training FLOPs and their memory
        return model_config_from_hf(read_hf_config(p), mtp=True), None
    cfg = load_config(p, overrides)
    return cfg.model, cfg


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


_MEMORY_ROWS = [
    ("weights", "  parameters (as held, training dtype)"),
    ("master_weights", "  fp32 master copy (ZeRO partition)"),
    ("gradients", "  gradients"),
    ("optimizer", "  AdamW moments (fp32)"),
    ("deepspeed_buffers", "  DeepSpeed buckets / live params"),
    ("activations", "  activations (one micro-batch)"),
    ("runtime", "  runtime (framework resident)"),
    ("checkpoint_staging", "  async-save host copy (fp32 weights + moments)"),
]


def _memory_args(args: argparse.Namespace, cfg: Any, seq_len: int) -> dict[str, Any]:
    """The memory inputs: flags first, then the YAML's train/parallel sections, then defaults
    (a config.json has none: bf16, micro-batch 1, ZeRO-1, EP 1); `seq_len` as the FLOPs use."""

    def pick(flag: Any, section: str, key: str, default: Any) -> Any:
        if flag is not None:
            return flag
        return getattr(getattr(cfg, section), key) if cfg is not None else default

    return {
        "world_size": args.world_size,
        "zero_stage": pick(args.zero_stage, "parallel", "zero_stage", 1),
        "ep_size": pick(args.ep_size, "parallel", "ep_size", 1),
        "dtype": pick(args.dtype, "train", "dtype", "bf16"),
        "micro_batch": pick(args.micro_batch, "train", "micro_batch_size", 1),
        "seq_len": seq_len,
        "activation_checkpointing": pick(
            args.activation_checkpointing, "train", "activation_checkpointing", False
        ),
        "offload_optimizer": pick(args.offload_optimizer, "train", "offload_optimizer", False),
        "device": args.device,
        "attn_kernel": args.attn_kernel,
        "async_save": pick(args.async_save, "train", "async_save", False),
    }


def cmd_count(args: argparse.Namespace) -> int:
    from llmtrain.accounting import RUNTIME_PROVENANCE, count, matmuls, memory_per_rank
    from llmtrain.errors import UsageError

    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len {args.seq_len}: give a positive context length")
    if (args.world_size or 0) < 0 or (args.ep_size is not None and args.ep_size < 1):
        raise UsageError("--world-size must be >= 0 and --ep-size >= 1")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise UsageError(f"--micro-batch {args.micro_batch}: give at least 1 sequence")
    model_cfg, cfg = _load_model_config(args.config, args.overrides)
    if args.device is None:  # for memory: this machine's, as a run here would be
        args.device = "cpu"
        if args.world_size:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # one context length for FLOPs and memory alike; a config.json has no train.seq_len: its
    # maximum positions capped at 4096 (V3's 163,840 would make attention 80% of the FLOPs)
    seq_len = args.seq_len or (
        cfg.train.seq_len if cfg is not None else min(4096, model_cfg.max_position_embeddings)
    )
    c = count(model_cfg, seq_len=seq_len, kv_dtype=args.kv_dtype)
    mem = inputs = None
    if args.world_size:
        inputs = _memory_args(args, cfg, c.seq_len)
        ep = inputs["ep_size"]
        if args.world_size % ep or model_cfg.n_routed_experts % ep:
            raise UsageError(
                f"--ep-size {ep} must divide --world-size {args.world_size} and the "
                f"{model_cfg.n_routed_experts} routed experts"
            )
        try:
            mem = memory_per_rank(model_cfg, **inputs)
        except ValueError as e:
            raise ConfigError(f"--world-size/--ep-size/--zero-stage: {e}") from None
    mms = []
    if args.matmuls:
        micro = args.micro_batch or (cfg.train.micro_batch_size if cfg is not None else 1)
        mms = matmuls(model_cfg, micro * c.seq_len)
    if args.json:
        out = c.to_dict()
        if mms:
            out["matmuls"] = [{**m.__dict__, "train_flops": m.train_flops} for m in mms]
        if mem:
            out["memory_per_rank_bytes"] = mem
            out["memory_per_rank_inputs"] = inputs
            out["memory_runtime_provenance"] = RUNTIME_PROVENANCE[args.device]
        print(json.dumps(out, indent=2))
        return 0
    rows = [
        ("total parameters", _fmt(c.total_params)),
        ("active parameters / token", _fmt(c.active_params)),
        ("  input embedding", _fmt(c.embedding_params)),
        (
            "  LM head",
            _fmt(c.lm_head_params) + (" (tied)" if model_cfg.tie_word_embeddings else ""),
        ),
        ("non-embedding (total)", _fmt(c.non_embedding_params)),
        ("non-embedding (active)", _fmt(c.active_non_embedding_params)),
        ("routed-expert parameters", _fmt(c.expert_params)),
        ("MTP parameters (extra)", _fmt(c.mtp_params)),
        (f"training FLOPs / token (T={c.seq_len})", _fmt(c.flops_per_token)),
        ("  of which attention QK/AV", _fmt(c.attn_flops_per_token)),
        ("  6·N (N = active non-embedding)", _fmt(c.flops_6nd_per_token)),
        (f"KV cache / token ({args.kv_dtype}) MLA", f"{c.kv_cache_bytes_per_token:,} B"),
        ("KV cache / token, full MHA equivalent", f"{c.kv_cache_bytes_per_token_mha:,} B"),
    ]
    if mem and inputs:
        stage = int(mem["zero_stage"])
        ran = f"ZeRO-{stage}" + (
            f" (ZeRO-{inputs['zero_stage']} asked: one fp32 process runs stage 0)"
            if stage != inputs["zero_stage"]
            else ""
        )
        label = (
            f"memory / rank (W={args.world_size}, {ran}, EP={inputs['ep_size']}, {inputs['dtype']}, "
            f"B={inputs['micro_batch']}, T={inputs['seq_len']}"
            + (", act. ckpt" if inputs["activation_checkpointing"] else "")
            + (", offload" if inputs["offload_optimizer"] else "")
            + (", async save" if inputs["async_save"] else "")
            + f", {args.device})"
        )
        rows.append((label, _fmt_bytes(mem["total"])))
        rows += [(name, _fmt_bytes(mem[k])) for k, name in _MEMORY_ROWS
                 if k != "checkpoint_staging" or mem[k]]  # fmt: skip
        if mem["host_bytes"] and args.device == "cuda":
            what = ", ".join(x for x, on in (("offloaded optimizer", inputs["offload_optimizer"]),
                                             ("async-save copy", inputs["async_save"])) if on)  # fmt: skip
            rows.append((f"  host memory ({what})", _fmt_bytes(mem["host_bytes"])))
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if mem:
        print(f"runtime: {RUNTIME_PROVENANCE[args.device]}")
    print("\nper layer:  idx kind   attention       mlp total      mlp active")
    for l in c.layers:
        print(
            f"            {l.index:>3} {l.kind:<6} {_fmt(l.attn):>10} {_fmt(l.mlp_total):>14} {_fmt(l.mlp_active):>14}"
        )
    if mms:
        total = sum(m.train_flops for m in mms)
        print(f"\nweight matmuls of one micro-batch ({mms[-1].m:,} tokens): forward [m, k] @ [k, n], "
              "runs per micro-batch; backward does two of the same FLOPs; FLOPs: share of all matmuls'")  # fmt: skip
        print(f"{'matmul':<30} {'m x k x n':>22} {'groups':>6} {'runs':>5} {'FLOPs':>7}")
        for m in mms:
            shape = f"{m.m}x{m.k}x{m.n}"
            print(f"{m.name:<30} {shape:>22} {m.groups:>6} {m.count:>5} "
                  f"{m.train_flops / total:>7.1%}{'  fp32' if m.fp32 else ''}")  # fmt: skip
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from llmtrain.errors import once_a_node
    from llmtrain.train.loop import train

    overrides, resume = [], "never"
    for o in args.overrides:
        if o.startswith("resume="):
            resume = o.split("=", 1)[1]
        else:
            overrides.append(o)
    with once_a_node():  # each rank of a node reads the same file: said once a node
        cfg = load_config(args.config, overrides)
    train(cfg, args.run_dir, resume=resume, overwrite=args.overwrite)
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from llmtrain.data.prepare import describe, prepare_data

    cfg = load_config(args.config, args.overrides)
    if args.num_proc is not None:
        cfg.data.num_proc = args.num_proc
    print(describe(prepare_data(cfg.data, cfg.model.vocab_size)))
    return 0


def _check_device(device: str) -> None:
    """`--device` before any model is loaded: a typo or a missing GPU is the user's to fix."""
    import torch

    from llmtrain.errors import UsageError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device}: give cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: give cpu, cuda or cuda:N")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (dev.index or 0) >= n:
            raise UsageError(f"--device {device}: this machine has {n} CUDA device(s) usable by "
                             "this torch build; use --device cpu")  # fmt: skip


def _show_watch_row(r: dict, as_json: bool) -> None:
    metrics = {k: v for k, v in r.items() if k.startswith("eval/")}
    if as_json:
        print(json.dumps({"step": r["step"], **metrics}), flush=True)
        return
    print(f"step {r['step']}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.4f}"
                                            for k, v in metrics.items()), flush=True)  # fmt: skip


def _watch_rc(res, idle_timeout: float | None) -> int:
    """0 once the run's last step is scored; 1 after --idle-timeout (None: not rank 0)."""
    if res is not None and not res.finished:
        print(f"stopped: no new checkpoint for {idle_timeout:.0f} s before the run's last step",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _check_eval_flags(args: argparse.Namespace, sharded: bool) -> None:
    """What `llmtrain eval` can refuse from its command line alone, before any export, wait or
    process group; `--tasks a b x.y=z`'s overrides are moved to args.overrides."""
    from llmtrain.errors import UsageError

    for flag, v, ok, need in (("--batch-size", args.batch_size, args.batch_size >= 1, "1 or more"),
                              ("--until-step", args.until_step, (args.until_step or 0) >= 0,
                               "a step >= 0"),
                              ("--poll", args.poll, args.poll > 0, "seconds > 0"),
                              ("--idle-timeout", args.idle_timeout, (args.idle_timeout or 0) >= 0,
                               "seconds >= 0")):  # fmt: skip
        if not ok:  # before any export or wait (a negative batch size scored nothing: exit 0)
            raise UsageError(f"{flag} {v}: give {need}")
    if any("=" in t for t in args.tasks):  # `--tasks a b x.y=z`: the overrides came after
        args.overrides = [*args.overrides, *(t for t in args.tasks if "=" in t)]
        args.tasks = [t for t in args.tasks if "=" not in t]
    if sharded and (args.device is not None or args.dtype is not None):
        raise UsageError("--sharded computes on each rank's own device in the run's "
                         "train.dtype: drop --device/--dtype (a train.dtype=... override "
                         "changes the dtype)")  # fmt: skip


def cmd_eval(args: argparse.Namespace) -> int:
    from llmtrain.errors import UsageError, once_a_node
    from llmtrain.eval import format_results, run_eval

    sharded = args.sharded or int(os.environ.get("WORLD_SIZE", "1")) > 1  # under a launcher
    with once_a_node() if sharded else contextlib.nullcontext():  # a node's ranks read alike
        _check_eval_flags(args, sharded)
    if sharded:
        from llmtrain.eval.sharded import evaluate_sharded, watch_sharded

        if args.watch:
            res = watch_sharded(args.model, args.tasks, args.overrides,
                                include_path=args.include_path, limit=args.limit,
                                batch_size=args.batch_size, max_length=args.max_length,
                                watch_kwargs=dict(poll=args.poll, until_step=args.until_step,
                                                  timeout=args.idle_timeout, out=args.out,
                                                  on_result=lambda r: _show_watch_row(r, args.json)))  # fmt: skip
            return _watch_rc(res, args.idle_timeout)

        res = evaluate_sharded(args.model, args.tasks, args.overrides,
                               include_path=args.include_path, limit=args.limit,
                               batch_size=args.batch_size, max_length=args.max_length)  # fmt: skip
        if res is None:  # ranks other than 0: rank 0 reports
            return 0
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2, default=str))
        print(json.dumps(res["results"], indent=2) if args.json else format_results(res))
        return 0
    if args.overrides:
        raise UsageError(f"overrides ({' '.join(args.overrides)}) apply with --sharded, to the "
                         "run's config; the export path takes none")  # fmt: skip
    args.device, args.dtype = args.device or "cpu", args.dtype or "float32"
    _check_device(args.device)
    if args.watch:
        from llmtrain.eval.watch import watch

        res = watch(args.model, args.tasks, poll=args.poll, until_step=args.until_step,
                    timeout=args.idle_timeout, out=args.out,
                    on_result=lambda r: _show_watch_row(r, args.json),
                    include_path=args.include_path, limit=args.limit, batch_size=args.batch_size,
                    device=args.device, dtype=args.dtype, max_length=args.max_length)  # fmt: skip
        return _watch_rc(res, args.idle_timeout)
    res = run_eval(args.model, args.tasks, include_path=args.include_path, limit=args.limit,
                   batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                   max_length=args.max_length)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps(res["results"], indent=2) if args.json else format_results(res))
    return 0


def cmd_hostfile(args: argparse.Namespace) -> int:
    from llmtrain.parallel.hostfile import parse_hostfile

    hosts = parse_hostfile(args.hostfile)
    for h, n in hosts.items():
        print(f"{h} slots={n}")
    n = len(hosts)
    print(f"{n} node{'s' if n != 1 else ''}, {sum(hosts.values())} ranks")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from llmtrain.checkpoint import convert

    out = convert(args.old, args.new)
    print(f"converted {args.old} -> {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llmtrain.export import export

    if args.push_only is None:
        from llmtrain.errors import UsageError

        if not args.checkpoint or not args.out:
            raise UsageError(
                "give a checkpoint or run directory and --out DIR (or --push-only DIR)"
            )
        from llmtrain.export import resolve_checkpoint

        # resolved once: a trainer saving meanwhile moves `latest`, and verify must compare the
        # export with the checkpoint it was made from
        ck = resolve_checkpoint(args.checkpoint)
        out = export(ck, args.out, dtype=args.dtype, shard_size=args.shard_size, mtp=not args.drop_mtp,
                     overwrite=args.overwrite, law=args.law, license=args.license)  # fmt: skip
        print(f"exported to {out}")
        if args.verify is None:  # default: verify when both models fit in memory comfortably
            from llmtrain.accounting import count
            from llmtrain.config import load_config as _load

            n = count(_load(ck / "config.yaml").model).total_params
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            args.verify = 3 * 4 * n < ram  # ours + transformers' copy in fp32, with headroom
            if not args.verify:
                print(
                    f"skipping verification: {n / 1e9:.1f}B parameters do not fit twice in memory (--verify forces it)"
                )
        if args.verify:
            from llmtrain.export.verify import verify

            v = verify(out, ck)
            print(f"verify with stock transformers: max |logit diff| {v['max_abs_logit_diff']:.2e} "
                  f"(bound {v['bound']:.0e}), greedy generate equal: {v['generate_equal']}")  # fmt: skip
            if not v["ok"]:
                print(
                    "llmtrain export: error: verification failed; the export differs from the model",
                    file=sys.stderr,
                )
                return 1
    else:
        out = Path(args.push_only)
    if args.push_to_hub:
        from llmtrain.export.hub import push

        url = push(out, args.push_to_hub, private=args.private, revision=args.revision)
        print(f"pushed {out} to {url}")
    return 0


def _scaling(name: str):
    def run(args: argparse.Namespace) -> int:
        from llmtrain.scaling import commands

        return getattr(commands, name)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="llmtrain", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--debug", action="store_true", help="show tracebacks (also LLMTRAIN_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("count", help="parameters, FLOPs, KV cache and memory from a config alone")
    c.add_argument("config", help="our YAML config, or a Hugging Face config.json / model dir")
    c.add_argument("overrides", nargs="*", default=[], help="a.b=c overrides (YAML configs only)")
    c.add_argument("--json", action="store_true", help="print every count as JSON")
    c.add_argument("--seq-len", type=int, default=None,
                   help="sequence length for attention FLOPs and activations (default: train.seq_len; "
                        "for a config.json, its max positions capped at 4096)")  # fmt: skip
    c.add_argument("--kv-dtype", default="bf16", choices=["fp32", "bf16", "fp16", "fp8"],
                   help="element type of the inference KV cache (default bf16)")  # fmt: skip
    c.add_argument("--world-size", type=int, default=0, help="also predict memory per rank")
    c.add_argument("--zero-stage", type=int, default=None, choices=[1, 2, 3],
                   help="default: parallel.zero_stage, or 1")  # fmt: skip
    c.add_argument("--ep-size", type=int, default=None, help="default: parallel.ep_size, or 1")
    c.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                   help="training dtype (default: train.dtype, bf16 for a config.json)")  # fmt: skip
    c.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank per forward (default: train.micro_batch_size, or 1)")  # fmt: skip
    c.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="activations of a recomputed block (default: train.activation_checkpointing)")  # fmt: skip
    c.add_argument("--offload-optimizer", action="store_true", default=None,
                   help="AdamW state in host memory (default: train.offload_optimizer)")  # fmt: skip
    c.add_argument("--async-save", action="store_true", default=None,
                   help="count train.async_save's host copy of the checkpoint pieces")  # fmt: skip
    c.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="whose runtime overhead and attention kernel to assume (default: cuda "
                        "where torch sees a GPU, else cpu)")  # fmt: skip
    c.add_argument("--attn-kernel", default=None, choices=["flash", "fused", "math", "reference"],
                   help="the training attention kernel, for its activations (default: flash-attn "
                        "on CUDA in half precision; 'fused' for SDPA's kernels, e.g. a GPU "
                        "without flash-attn)")  # fmt: skip
    c.add_argument("--matmuls", action="store_true",
                   help="also list every weight matmul of a micro-batch: shape, runs, FLOPs share "
                        "(what benchmarks/gpu_profile.py --kernels times one by one)")  # fmt: skip
    c.set_defaults(func=cmd_count)

    t = sub.add_parser("train", help="train (one process, or under the deepspeed launcher)")
    t.add_argument("config", help="YAML config")
    t.add_argument(
        "overrides", nargs="*", default=[], help="a.b=c overrides; resume=auto continues the run"
    )
    t.add_argument("--run-dir", required=True, help="where metrics, checkpoints and samples go")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    t.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    t.set_defaults(func=cmd_train)

    sc = sub.add_parser("scaling", help="scaling laws: allocate, fit, sweep").add_subparsers(
        dest="scaling_cmd", required=True
    )
    a = sc.add_parser(
        "allocate", help="compute-optimal N and D for a FLOP budget (and inverse queries)"
    )
    a.add_argument("--flops", type=float, help="training compute budget C in FLOPs (e.g. 1e21)")
    a.add_argument("--target-loss", type=float, help="compute needed to reach this loss")
    a.add_argument("--params", type=float, help="fixed model size: its compute-optimal tokens")
    a.add_argument("--tokens", type=float, help="fixed token budget: its compute-optimal model")
    a.add_argument(
        "--law",
        default="epoch",
        help="epoch (Besiroglu et al.'s refit of Chinchilla, the default), chinchilla (Hoffmann "
        "et al.'s Approach 3), krajewski2024[-e16], ludziejewski2025, or a fit JSON",
    )
    a.add_argument(
        "--to-config", metavar="FAMILY.yaml", help="write a ready-to-run config of this family"
    )
    a.add_argument("--out", help="where --to-config writes (default allocated.yaml)")
    a.add_argument("--json", action="store_true")
    a.add_argument("--experts", type=int, help="MoE laws: number of experts E (expansion)")
    a.add_argument("--granularity", type=int, help="krajewski2024: fix the granularity G")
    a.add_argument("--memory", type=float, metavar="GB", help="ludziejewski2025: memory limit")
    a.add_argument("--kv-tokens", type=int, default=16384, help="with --memory: KV-cache tokens")
    a.set_defaults(func=_scaling("allocate"))
    f = sc.add_parser("fit", help="fit scaling laws to runs (CSV files and/or run directories)")
    f.add_argument("runs", nargs="+", help="CSV files of (N, D, loss) rows and/or run or sweep directories")  # fmt: skip
    f.add_argument("--approach", choices=["1", "2", "3", "all"], default="all",
                   help="Chinchilla's approaches: 1 envelope, 2 IsoFLOP parabolas, 3 parametric loss")  # fmt: skip
    f.add_argument("--bootstrap", type=int, default=0, metavar="K",
                   help="K bootstrap refits for confidence intervals (0: none)")  # fmt: skip
    f.add_argument("--seed", type=int, default=0, help="bootstrap resampling seed")
    f.add_argument("--plot", metavar="OUT.png", help="write the fits' plots here")
    f.add_argument("--json", action="store_true", help="print the fit as JSON")
    f.add_argument("--out", metavar="FIT.json",
                   help="also write the fit (its Approach-3 law is readable by --law)")  # fmt: skip
    f.add_argument("--n-col", help="parameters column (default: N, params, parameters ...)")
    f.add_argument("--d-col", help="tokens column (default: D, tokens, data ...)")
    f.add_argument("--c-col", help="compute column (default: C, flops, compute ...)")
    f.add_argument("--loss-col", help="loss column (default: loss, val_loss ...)")
    f.add_argument(
        "--drop-highest",
        type=int,
        default=0,
        metavar="K",
        help="drop the K highest-loss rows (as Epoch AI drop 5 of Chinchilla's runs); rows are "
        "points, mid-schedule checkpoints included, dropped before each approach picks "
        "its points",
    )
    f.add_argument(
        "--intermediate", action="store_true", help="approach 1: use mid-schedule checkpoints too"
    )
    f.add_argument("--law", choices=["moe-joint", "moe-granular"], help="fit an MoE law instead")
    f.add_argument("--fix", nargs="+", metavar="NAME[=VALUE]", help="MoE laws: hold parameters")
    f.add_argument("--grid", choices=["default", "paper"], default="default", help="MoE start grid")
    for col in ("active", "total", "experts", "granularity"):
        f.add_argument(f"--{col}-col", default=None, help=f"MoE laws: the {col} column")
    f.set_defaults(func=_scaling("fit"))
    sw = sc.add_parser("sweep", help="IsoFLOP sweeps: plan | run | collect").add_subparsers(
        dest="sweep_cmd", required=True
    )
    sp = sw.add_parser("plan", help="choose each budget's model sizes and write their configs")
    sp.add_argument("--budgets", type=float, nargs="+", required=True,
                    help="compute budgets C in FLOPs, one IsoFLOP curve each")  # fmt: skip
    sp.add_argument("--family", required=True, help="a model family YAML (configs/families/)")
    sp.add_argument("--out", required=True, help="the sweep directory to write")
    sp.add_argument("--law", default="epoch", help="centres each budget's sizes on its N_opt")
    sp.add_argument("--sizes", type=int, default=4, help="model sizes per budget (default 4)")
    sp.add_argument("--spread", type=float, default=8.0, help="largest / smallest size per budget")
    sp.add_argument("--hyper", action="store_true", help="batch and LR from DeepSeek's power laws")
    sp.add_argument(
        "--center-factor", type=float, default=1.0, help="centre sizes on this x the law's N_opt"
    )
    sp.add_argument("--experts", type=int, nargs="+", help="MoE sweep: experts E per active size")
    sp.add_argument("--granularity", type=int, nargs="+", help="MoE sweep: granularities G")
    sp.add_argument("--active", type=float, nargs="+", help="MoE sweep: fixed active sizes")
    sr = sw.add_parser("run", help="train the planned runs not yet finished (resumable)")
    sr.add_argument("sweep", help="the sweep directory")
    sr.add_argument(
        "--print-commands", action="store_true", help="print deepspeed commands instead"
    )
    sr.add_argument("--nproc", type=int, default=1, help="ranks per run (deepspeed --num_gpus)")
    scl = sw.add_parser("collect", help="finished runs' final losses -> results.csv")
    scl.add_argument("sweep", help="the sweep directory")
    scl.add_argument("--out", help="CSV path (default SWEEP/results.csv)")
    for x in (sp, sr, scl):
        x.set_defaults(func=_scaling("sweep"))

    e = sub.add_parser(
        "export", help="checkpoint -> Hugging Face DeepseekV3/V2 directory (and Hub)"
    )
    e.add_argument("checkpoint", nargs="?", help="a checkpoint or run directory")
    e.add_argument("--out", help="output directory")
    e.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="weights' type in the files (router weights and biases stay fp32)")  # fmt: skip
    e.add_argument("--shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    e.add_argument(
        "--drop-mtp", action="store_true", help="leave multi-token-prediction weights out"
    )
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    e.add_argument(
        "--law", help="a scaling law (name or fit JSON) whose prediction goes in the card"
    )
    e.add_argument("--license", default="apache-2.0", help="the model card's licence")
    e.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare with stock transformers after writing (default: on when it fits in memory)",
    )
    e.add_argument("--push-to-hub", metavar="ORG/NAME", help="then upload to this Hub repository")
    e.add_argument("--private", action="store_true", help="create the Hub repository private")
    e.add_argument("--revision", default=None, help="Hub branch to push to (default main)")
    e.add_argument(
        "--push-only", metavar="DIR", help="push an existing export again (no re-export)"
    )
    e.set_defaults(func=cmd_export)

    dp = sub.add_parser("data", help="data preparation").add_subparsers(
        dest="data_cmd", required=True
    )
    d = dp.add_parser("prepare", help="tokenize data.sources into the shared cache (resumable)")
    d.add_argument("config", help="YAML config (its data and model.vocab_size sections)")
    d.add_argument("overrides", nargs="*", default=[], help="a.b=c overrides")
    d.add_argument("--num-proc", type=int, default=None, help="processes (default data.num_proc)")
    d.set_defaults(func=cmd_data_prepare)

    ev = sub.add_parser("eval", help="lm-evaluation-harness tasks on a run, checkpoint or HF dir")
    ev.add_argument("model", help="a run directory, a checkpoint, or a Hugging Face directory")
    ev.add_argument("overrides", nargs="*", default=[],
                    help="--sharded: a.b=c overrides of the run's config (e.g. parallel.ep_size)")  # fmt: skip
    ev.add_argument("--sharded", action="store_true",
                    help="load the run's checkpoint at its own layout over the ranks of a "
                         "deepspeed launch (ZeRO partitions, experts split), no export: no rank "
                         "holds more than it trained with (the default under a launcher)")  # fmt: skip
    ev.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ev.add_argument("--tasks", nargs="+", default=["llmtrain_ppl", "llmtrain_mc"],
                    help="task names; the shipped offline tasks are llmtrain_ppl, llmtrain_mc, "
                         "llmtrain_gen")  # fmt: skip
    ev.add_argument("--include-path", action="append", default=[], help="your task YAML folder")
    ev.add_argument("--limit", type=int, default=None, help="documents per task")
    ev.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    ev.add_argument("--device", default=None, help="cpu (default), cuda or cuda:N")
    ev.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the exported model's dtype in transformers (default float32)")  # fmt: skip
    ev.add_argument("--max-length", type=int, default=None,
                    help="context length in tokens (default: the model's maximum positions); "
                         "the run's train.seq_len gives periodic evaluation's scores (fp32 runs; "
                         "--sharded for bf16 ones)")  # fmt: skip
    ev.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON (with --watch: a JSON line per checkpoint)",
    )
    ev.add_argument(
        "--out",
        help="also write the full results JSON here (with --watch: the "
        "JSON-lines file, default RUN/eval_watch.jsonl)",
    )
    ev.add_argument("--watch", action="store_true",
                    help="MODEL is a run directory: evaluate each checkpoint as it lands, outside "
                         "the training job, until the run's last step is evaluated")  # fmt: skip
    ev.add_argument("--poll", type=float, default=60.0, help="--watch: seconds between looks")
    ev.add_argument("--until-step", type=int, default=None,
                    help="--watch: stop after this step (default: the last step the run saves)")  # fmt: skip
    ev.add_argument("--idle-timeout", type=float, default=None,
                    help="--watch: give up (exit 1) after this many seconds without a new "
                         "checkpoint; default: wait as long as the run lasts")  # fmt: skip
    ev.set_defaults(func=cmd_eval)

    c = sub.add_parser("checkpoint", help="checkpoint tools")
    csub = c.add_subparsers(dest="checkpoint_cmd", required=True)
    cc = csub.add_parser("convert", help="consolidated (earlier) checkpoint -> sharded format")
    cc.add_argument("old", help="a checkpoint in the consolidated format")
    cc.add_argument("new", help="where to write the sharded checkpoint")
    cc.set_defaults(func=cmd_checkpoint)

    h = sub.add_parser("hostfile", help="check a deepspeed hostfile before a multi-node launch")
    h.add_argument("hostfile")
    h.set_defaults(func=cmd_hostfile)
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point: every failure is one line on stderr and a non-zero exit.

    Our own errors (`LlmtrainError`) and OS/path errors exit 2 with their message; anything else
    is a bug and exits 1 with its type and a hint. `--debug` (anywhere on the line) or
    LLMTRAIN_DEBUG=1 re-raises instead, with the traceback; LLMTRAIN_TRACEBACK=1 prints a bug's
    traceback before its line, leaving logging as it is (unattended runs: the GPU check). A
    reader that closes our stdout early (`llmtrain count ... | head -4`) is not an error: the
    rest of the output is dropped, exit 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LLMTRAIN_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if any(a in ("-v", "--verbose") for a in argv):  # anywhere on the line, as --debug
        argv = ["-v", *(a for a in argv if a not in ("-v", "--verbose"))]
    words = [a for a in argv if not a.startswith("-")]
    depth = 3 if words[:2] == ["scaling", "sweep"] else 2 if words[:1] == ["scaling"] else 1
    cmd = " ".join(words[:depth])
    try:
        rc = _run(argv, debug)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        _say(f"llmtrain {cmd}: interrupted".replace("  ", " "))
        return 130
    except Exception as e:
        if debug:
            raise
        if not is_user_error(e) and os.environ.get("LLMTRAIN_TRACEBACK", "") not in ("", "0"):
            traceback.print_exc()  # a bug's traceback, without --debug's log levels
        quiet = (
            getattr(e, "same_on_every_rank", False) and os.environ.get("RANK", "0") != "0"
        ) or (getattr(e, "same_on_every_node", False) and os.environ.get("LOCAL_RANK", "0") != "0")
        if not quiet:
            _say(f"llmtrain {cmd}: error: {describe_error(e)}".replace("  ", " "))
        return 2 if is_user_error(e) else 1


def _say(line: str) -> None:
    """One write for the line and its newline: ranks share stderr, and `print` writes the end
    separately when Python is unbuffered (PYTHONUNBUFFERED), so two ranks' lines could merge."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _run(argv: list[str], debug: bool) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    bad = [e for e in extra if "=" not in e or e.startswith("-") or not hasattr(args, "overrides")]
    if bad:  # said by the (sub)command whose --help lists what it takes
        _innermost(parser, argv).error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.cmd in ("train", "data"):
        logging.getLogger("llmtrain").setLevel(logging.INFO)
    return args.func(args)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so Python's exit-time flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def is_user_error(e: BaseException) -> bool:
    """Errors that carry a message the user can act on: ours, bad values, paths and disks."""
    from llmtrain.errors import LlmtrainError

    return isinstance(e, (LlmtrainError, ValueError, OSError))


def describe_error(e: BaseException) -> str:
    """One line saying what is wrong and what to do (no traceback)."""
    from llmtrain.errors import LlmtrainError

    if isinstance(e, LlmtrainError) or (isinstance(e, ValueError) and str(e)):
        msg = str(e)
    elif isinstance(e, OSError):
        what = (
            f"{e.strerror}: {e.filename}" if e.strerror and e.filename else (e.strerror or str(e))
        )
        hint = {
            errno.ENOSPC: "free disk space or write elsewhere",
            errno.EACCES: "check the permissions or choose another path",
            errno.ENOTDIR: "a parent of the path is a file; choose another path",
            errno.ENOENT: "check the path",
            errno.EISDIR: "give a file, not a directory",
        }.get(e.errno, "check the path")
        msg = f"{what}; {hint}"
    elif _lost_peer(e):
        msg = (
            f"lost contact with another rank ({' '.join(str(e).split())[:160]}): a rank failed or "
            "was killed, so look for the first error in the other ranks' output; the last "
            "checkpoint is kept, continue with resume=auto"
        )
    else:
        msg = (
            f"internal error {type(e).__name__}: {e} (this is a bug; rerun with --debug for the "
            "traceback and report it)"
        )
    return " ".join(msg.split()) or type(e).__name__


# what gloo / NCCL / the TCP store say when the rank at the other end is gone
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "NCCL communicator was aborted", "remote process exited", "Connection refused",
              "ProcessGroupNCCL's watchdog", "Socket Timeout", "failed to recv, got 0 bytes")  # fmt: skip


def _lost_peer(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(p in str(e) for p in _PEER_LOST)


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The deepest subcommand parser that `argv`'s words name (`scaling fit` -> its parser)."""
    for word in (a for a in argv if not a.startswith("-")):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, a pointer to --help instead."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def console() -> None:
    """The `llmtrain` script: `main`, then, after a command that started DeepSpeed (`train`), leave
    without C++ static destructors. Those of gloo / DeepSpeed threads occasionally abort a finished
    process at exit ("terminate called without an active exception"), turning a good run into
    SIGABRT. Everything a command writes is closed by the time `main` returns."""
    rc = main()
    if "deepspeed" in sys.modules:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):  # a reader closed the pipe: nothing to keep
                pass
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    console()
