"""`llmtrain scaling allocate --law krajewski2024|ludziejewski2025`, `scaling fit --law
moe-joint|moe-granular` and `scaling sweep plan --experts ...`: text and JSON reports."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from llmtrain.scaling.laws import ScalingError, fmt_si, load_law
from llmtrain.scaling.registry import get_spec

logger = logging.getLogger(__name__)


def _row(label: str, value: str) -> None:
    print(f"  {label:<22}{value}")


def allocate(args) -> int:
    from llmtrain.scaling.moe import LUDZIEJEWSKI_EXPERTS, load_moe_law

    spec = get_spec(args.law)
    law = load_moe_law(args.law)
    for flag, v in (("--experts", args.experts), ("--granularity", args.granularity)):
        if v is not None and v < 1:
            raise ScalingError(f"{flag} {v}: give a whole number >= 1")
    if args.memory is not None and not args.memory > 0:
        raise ScalingError(f"--memory {args.memory}: give the memory limit in GB (> 0)")
    if args.flops is None:
        raise ScalingError(
            f"--law {args.law} answers --flops C (with --experts, --granularity, --memory)"
        )
    if spec.kind == "joint":
        if args.granularity not in (None, 1):
            raise ScalingError(
                f"{args.law} has no granularity (its experts are FFN-sized); drop --granularity"
            )
        if args.memory is not None:
            experts = [args.experts] if args.experts else list(LUDZIEJEWSKI_EXPERTS)
            a = law.allocate_memory(args.flops, args.memory * 1e9, experts, args.kv_tokens)
        else:
            if args.experts is not None and args.experts > max(LUDZIEJEWSKI_EXPERTS):
                logger.warning("--experts %d lies beyond the E <= %d the paper fitted: an "
                               "extrapolation", args.experts, max(LUDZIEJEWSKI_EXPERTS))  # fmt: skip
            a = law.allocate(args.flops, args.experts or 8)
            a["per_experts"] = [law.allocate(args.flops, e) for e in LUDZIEJEWSKI_EXPERTS]
        a["granularity"], a["top_k"] = 1, 1
    else:
        if args.memory is not None:
            raise ScalingError(
                f"{args.law} has no memory model; use --law ludziejewski2025 --memory"
            )
        if args.experts not in (None, law.expansion):
            raise ScalingError(f"{args.law} was fitted at expansion E = {law.expansion:g}; drop "
                               f"--experts{' or use krajewski2024-e16' if args.experts == 16 else ''}")  # fmt: skip
        a = law.allocate(args.flops, args.granularity)
    a["law"] = spec.to_json()
    a["c_6nd"] = 6 * a["n_act"] * a["tokens"]
    if args.to_config:
        from llmtrain.scaling.family import Family, write_config
        from llmtrain.scaling.moe_sweep import config_for, moe_rules

        E = (
            int(round(a["experts"] / a["granularity"]))
            if spec.kind == "granular"
            else int(a["experts"])
        )
        G = int(a["granularity"])
        k1 = int(moe_rules(args.to_config)["top_k"])
        # Krajewski et al. count N without embeddings; Ludziejewski et al. with them (registry)
        cfg, info = config_for(Family(args.to_config), a["n_act"], a["flops"], E, G, k1, hyper=True,
                               non_embedding=spec.kind == "granular")  # fmt: skip
        out = Path(args.out or "allocated.yaml")
        write_config(cfg, out, f"llmtrain scaling allocate --flops {a['flops']:.4g} --law {args.law} "
                     f"--to-config {args.to_config}\nlaw: N_act {a['n_act']:.4g}, E {E}, G {G} -> "
                     f"{info['active_params']:,} active, {info['total_params']:,} total params, "
                     f"{info['n_routed_experts']} routed experts top-{info['top_k']}")  # fmt: skip
        a["config"] = {"path": str(out), **info}
    if args.json:
        print(json.dumps(a, indent=1, default=float))
        return 0
    print(
        f"allocation of C={args.flops:g} under {args.law}: {spec.paper} (arXiv {spec.arxiv}, {spec.table})"
    )
    print(f"  form: {spec.form}")
    print(f"  FLOPs model: {spec.flops_model}")
    _row("active params", f"{fmt_si(a['n_act'])}")
    _row("total params", f"{fmt_si(a['n_total'])}")
    _row("tokens", f"{fmt_si(a['tokens'])}  ({a['tokens'] / a['n_act']:.1f} per active param)")
    _row(
        "experts",
        f"{a['experts']:g}"
        + (f" (expansion {a['expansion']:g} x granularity)" if "expansion" in a else ""),
    )
    _row("granularity / top-k", f"{a['granularity']:g} / {a['top_k']:g}")
    _row("predicted loss", f"{a['loss']:.4f}")
    _row("6·N_act·D", f"{a['c_6nd']:.4g} FLOPs")
    if "flops_per_token" in a:  # Krajewski's FLOPs model counts the router
        _row("FLOPs/token (law)", f"{a['flops_per_token']:.4g} vs 6·N_act {6 * a['n_act']:.4g}")
    print(f"  method: {a['method']}")
    for r in a.get("per_experts", []):
        bound = " (memory-bound)" if r.get("memory_bound") else ""
        print(f"    E={r['experts']:>3g}: N_act {fmt_si(r['n_act']):>6}, total {fmt_si(r['n_total']):>6}, "
              f"D {fmt_si(r['tokens']):>6}, loss {r['loss']:.4f}{bound}")  # fmt: skip
    if "config" in a:
        c = a["config"]
        print(f"wrote {c['path']}: {c['active_params']:,} active / {c['total_params']:,} total params, "
              f"{c['n_routed_experts']} experts top-{c['top_k']}, {c['tokens']:,} tokens; "
              f"{c['flops_per_token']:.4g} FLOPs/token (6·N_active = {c['flops_6n_per_token']:.4g})")  # fmt: skip
    return 0


def _parse_fix(items: list[str] | None, form: str) -> dict[str, float]:
    """NAME=VALUE, or NAME alone to hold it at Ludziejewski et al.'s / Krajewski et al.'s value."""
    fixed = {}
    src = get_spec("ludziejewski2025" if form == "moe-joint" else "krajewski2024").coefficients
    for it in items or []:
        name, _, val = it.partition("=")
        if not val and name not in src:
            raise ScalingError(f"--fix {name}: no published value to hold it at; give {name}=VALUE")
        try:
            fixed[name] = float(val) if val else float(src[name])
        except ValueError as e:
            raise ScalingError(f"--fix {it}: {val!r} is not a number") from e
    return fixed


def fit(args) -> int:
    from llmtrain.scaling import moe

    cols = {"n_act": args.active_col, "n_total": args.total_col, "experts": args.experts_col,
            "granularity": args.granularity_col}  # fmt: skip
    if args.d_col is not None:  # asked for by name, even one the defaults would also try
        cols["D"] = args.d_col
    if args.loss_col is not None:
        cols["loss"] = args.loss_col
    runs = moe.load_moe_runs(args.runs, **cols)
    t0 = time.perf_counter()
    res = moe.fit_moe(runs, args.law, args.bootstrap, args.seed, _parse_fix(args.fix, args.law),
                      args.grid)  # fmt: skip
    res["seconds"] = time.perf_counter() - t0
    if args.plot:
        moe.plot_vs_experts(runs, res, Path(args.plot))
    out = moe.jsonable(res)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    ci = res.get("bootstrap", {}).get("ci95", {})
    print(f"{res['n_runs']} runs; {args.law}: sum of Huber(1e-3) on log loss, L-BFGS-B from "
          f"{res['starts']} starts ({res['starts_converged']} converged); {res['seconds']:.1f} s")  # fmt: skip
    if args.bootstrap:
        print(f"95% bootstrap intervals over {args.bootstrap} resamples of the runs")
    for k, v in res["params"].items():
        tag = (
            "  (held)"
            if k in res["fixed"]
            else (f"  [{ci[k][0]:.4g}, {ci[k][1]:.4g}]" if k in ci else "")
        )
        if k in ci and ci[k][1] - ci[k][0] <= 1e-6 * abs(v):
            tag += "  (not identified: no resample moved it)"
        print(f"  {k:<6} {v:>10.4g}{tag}")
    if "E_start" in res:
        print(
            f"  Ê transform held at E_start={res['E_start']:g}, E_max={res['E_max']:g} (published)"
        )
    print(f"  residual rms (log loss): {res['residual_rms']:.4f}")
    key = "experts" if args.law == "moe-joint" else "granularity"
    eci = res.get("bootstrap", {}).get("effect_ci95")
    print(
        f"predicted loss against {key} at the runs' median active size and tokens (vs {key} = 1):"
    )
    for j, e in enumerate(res["effect"]):
        band = f"  95% [{eci[j][0]:+.2%}, {eci[j][1]:+.2%}]" if eci else ""
        print(f"  {key} {e[key]:>5g}: loss {e['loss']:.4f}  {e['rel']:+.2%}{band}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def sweep_plan(args) -> int:
    from llmtrain.scaling.moe_sweep import plan_moe
    from llmtrain.scaling.registry import is_moe_law

    if is_moe_law(args.law):  # centre on the joint law's N_act at the smallest E planned
        from llmtrain.scaling.moe import JointLaw, load_moe_law

        moe_law = load_moe_law(args.law)
        if not isinstance(moe_law, JointLaw):
            raise ScalingError(
                f"sweep plan centres sizes on a dense law or ludziejewski2025, not {args.law}"
            )
        law = moe_law.reduced(min(args.experts or [1]))
    else:
        law = load_law(args.law)
    m = plan_moe(args.budgets, args.family, Path(args.out), law, args.sizes,
                 args.spread, args.experts, args.granularity, args.hyper, args.center_factor,
                 args.active)  # fmt: skip
    for r in m["runs"]:
        print(f"{r['name']}: {r['active_params']:,} active / {r['total_params']:,} total params, "
              f"E={r['experts']} G={r['granularity']} top-{r['top_k']}, "
              f"FLOPs/token {r['flops_per_token']:.4g} (6·N_active {r['flops_6n_per_token']:.4g}), "
              f"{r['tokens']:,} tokens, {r['steps']} steps")  # fmt: skip
    print(f"{len(m['runs'])} runs planned in {args.out}")
    return 0
