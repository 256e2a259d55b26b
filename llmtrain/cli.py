"""The `llmtrain` console script: parsing and dispatch only; the work lives in the packages."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from llmtrain.config import ConfigError, ModelConfig, load_config


def _load_model_config(path: str, overrides: list[str]) -> tuple[ModelConfig, int | None]:
    """Our YAML (with overrides) or a Hugging Face config.json; returns (model, train seq_len)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json":
        from llmtrain.hf import model_config_from_hf

        if not p.is_file():
            raise ConfigError(f"{p} does not exist")
        return model_config_from_hf(json.loads(p.read_text())), None
    cfg = load_config(p, overrides)
    return cfg.model, cfg.train.seq_len


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def cmd_count(args: argparse.Namespace) -> int:
    from llmtrain.accounting import count, memory_per_rank

    model_cfg, seq_len = _load_model_config(args.config, args.overrides)
    c = count(model_cfg, seq_len=args.seq_len or seq_len, kv_dtype=args.kv_dtype)
    mem = None
    if args.world_size:
        mem = memory_per_rank(model_cfg, args.world_size, args.zero_stage, args.ep_size, args.dtype)
    if args.json:
        out = c.to_dict()
        if mem:
            out["memory_per_rank_bytes"] = mem
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
    if mem:
        label = f"memory / rank (W={args.world_size}, ZeRO-{args.zero_stage}, EP={args.ep_size})"
        rows.append((label, f"{mem['total'] / 2**30:.2f} GiB (no activations)"))
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("\nper layer:  idx kind   attention       mlp total      mlp active")
    for l in c.layers:
        print(
            f"            {l.index:>3} {l.kind:<6} {_fmt(l.attn):>10} {_fmt(l.mlp_total):>14} {_fmt(l.mlp_active):>14}"
        )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from llmtrain.train.loop import train

    overrides, resume = [], "never"
    for o in args.overrides:
        if o.startswith("resume="):
            resume = o.split("=", 1)[1]
        else:
            overrides.append(o)
    cfg = load_config(args.config, overrides)
    train(cfg, args.run_dir, resume=resume, overwrite=args.overwrite)
    return 0


def cmd_hostfile(args: argparse.Namespace) -> int:
    from llmtrain.parallel.hostfile import parse_hostfile

    hosts = parse_hostfile(args.hostfile)
    for h, n in hosts.items():
        print(f"{h} slots={n}")
    print(f"{len(hosts)} nodes, {sum(hosts.values())} ranks")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from llmtrain.checkpoint import convert

    out = convert(args.old, args.new)
    print(f"converted {args.old} -> {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llmtrain.export import export

    if args.push_only is None:
        out = export(args.checkpoint, args.out, dtype=args.dtype, shard_size=args.shard_size, mtp=not args.drop_mtp,
                     overwrite=args.overwrite, law=args.law, license=args.license)  # fmt: skip
        print(f"exported to {out}")
        if args.verify is None:  # default: verify when both models fit in memory comfortably
            from llmtrain.accounting import count
            from llmtrain.config import load_config as _load
            from llmtrain.export import resolve_checkpoint

            n = count(_load(resolve_checkpoint(args.checkpoint) / "config.yaml").model).total_params
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            args.verify = 3 * 4 * n < ram  # ours + transformers' copy in fp32, with headroom
            if not args.verify:
                print(
                    f"skipping verification: {n / 1e9:.1f}B parameters do not fit twice in memory (--verify forces it)"
                )
        if args.verify:
            from llmtrain.export.verify import verify

            v = verify(out, args.checkpoint)
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
    p = argparse.ArgumentParser(prog="llmtrain", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("count", help="parameters, FLOPs, KV cache and memory from a config alone")
    c.add_argument("config", help="our YAML config, or a Hugging Face config.json / model dir")
    c.add_argument("overrides", nargs="*", help="a.b=c overrides (YAML configs only)")
    c.add_argument("--json", action="store_true")
    c.add_argument("--seq-len", type=int, default=None, help="context for the attention FLOPs")
    c.add_argument("--kv-dtype", default="bf16", choices=["fp32", "bf16", "fp16", "fp8"])
    c.add_argument("--world-size", type=int, default=0, help="also estimate memory per rank")
    c.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    c.add_argument("--ep-size", type=int, default=1)
    c.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    c.set_defaults(func=cmd_count)

    t = sub.add_parser("train", help="train (one process, or under the deepspeed launcher)")
    t.add_argument("config", help="YAML config")
    t.add_argument("overrides", nargs="*", help="a.b=c overrides; resume=auto continues the run")
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
    a.add_argument("--flops", type=float)
    a.add_argument("--target-loss", type=float, help="compute needed to reach this loss")
    a.add_argument("--params", type=float, help="fixed model size: its compute-optimal tokens")
    a.add_argument("--tokens", type=float, help="fixed token budget: its compute-optimal model")
    a.add_argument("--law", default="chinchilla", help="chinchilla, epoch, or a fit JSON")
    a.add_argument(
        "--to-config", metavar="FAMILY.yaml", help="write a ready-to-run config of this family"
    )
    a.add_argument("--out", help="where --to-config writes (default allocated.yaml)")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=_scaling("allocate"))
    f = sc.add_parser("fit", help="fit scaling laws to runs (CSV files and/or run directories)")
    f.add_argument("runs", nargs="+")
    f.add_argument("--approach", choices=["1", "2", "3", "all"], default="all")
    f.add_argument("--bootstrap", type=int, default=0, metavar="K")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--plot", metavar="OUT.png")
    f.add_argument("--json", action="store_true")
    f.add_argument("--out", metavar="FIT.json", help="also write the fit (readable by --law)")
    f.add_argument("--n-col", default="N")
    f.add_argument("--d-col", default="D")
    f.add_argument("--c-col", default="C")
    f.add_argument("--loss-col", default="loss")
    f.add_argument(
        "--drop-highest", type=int, default=0, metavar="K", help="drop the K highest-loss points"
    )
    f.add_argument(
        "--intermediate", action="store_true", help="approach 1: use mid-schedule checkpoints too"
    )
    f.set_defaults(func=_scaling("fit"))
    sw = sc.add_parser("sweep", help="IsoFLOP sweeps: plan | run | collect").add_subparsers(
        dest="sweep_cmd", required=True
    )
    sp = sw.add_parser("plan")
    sp.add_argument("--budgets", type=float, nargs="+", required=True)
    sp.add_argument("--family", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--law", default="chinchilla", help="centres each budget's sizes on its N_opt")
    sp.add_argument("--sizes", type=int, default=4)
    sp.add_argument("--spread", type=float, default=8.0, help="largest / smallest size per budget")
    sp.add_argument("--hyper", action="store_true", help="batch and LR from DeepSeek's power laws")
    sp.add_argument(
        "--center-factor", type=float, default=1.0, help="centre sizes on this x the law's N_opt"
    )
    sr = sw.add_parser("run")
    sr.add_argument("sweep")
    sr.add_argument(
        "--print-commands", action="store_true", help="print deepspeed commands instead"
    )
    sr.add_argument("--nproc", type=int, default=1)
    scl = sw.add_parser("collect")
    scl.add_argument("sweep")
    scl.add_argument("--out")
    for x in (sp, sr, scl):
        x.set_defaults(func=_scaling("sweep"))

    e = sub.add_parser(
        "export", help="checkpoint -> Hugging Face DeepseekV3/V2 directory (and Hub)"
    )
    e.add_argument("checkpoint", nargs="?", help="a checkpoint or run directory")
    e.add_argument("--out", help="output directory")
    e.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    e.add_argument("--shard-size", default="5GB")
    e.add_argument(
        "--drop-mtp", action="store_true", help="leave multi-token-prediction weights out"
    )
    e.add_argument("--overwrite", action="store_true")
    e.add_argument(
        "--law", help="a scaling law (name or fit JSON) whose prediction goes in the card"
    )
    e.add_argument("--license", default="apache-2.0")
    e.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare with stock transformers after writing (default: on when it fits in memory)",
    )
    e.add_argument("--push-to-hub", metavar="ORG/NAME")
    e.add_argument("--private", action="store_true")
    e.add_argument("--revision", default=None)
    e.add_argument(
        "--push-only", metavar="DIR", help="push an existing export again (no re-export)"
    )
    e.set_defaults(func=cmd_export)

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
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    bad = [e for e in extra if "=" not in e or e.startswith("-") or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.cmd == "train":
        logging.getLogger("llmtrain").setLevel(logging.INFO)
    try:
        return args.func(args)
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"llmtrain {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type, ...]:
    """Errors that carry a message for the user (no traceback): bad config, data, input."""
    from llmtrain.checkpoint import CheckpointError
    from llmtrain.data.corpus import DataError
    from llmtrain.export import ExportError
    from llmtrain.export.hub import HubError
    from llmtrain.parallel.hostfile import HostfileError
    from llmtrain.scaling.laws import ScalingError
    from llmtrain.tensor_io import TensorFileError
    from llmtrain.train.loop import TrainingError

    return (ConfigError, ValueError, FileNotFoundError, DataError, CheckpointError, TrainingError,
            ScalingError, HostfileError, ExportError, HubError, TensorFileError)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
