"""What `llmtrain scaling allocate|fit|sweep` do, with their text and JSON reports."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from llmtrain.scaling.laws import ScalingError, deepseek_batch_tokens, deepseek_lr, fmt_si, load_law


def _print_allocation(a: dict, law) -> None:
    print(
        f"law {law.name}: L(N,D) = {law.E:.4f} + {law.A:.4g}/N^{law.alpha:.4f} + {law.B:.4g}/D^{law.beta:.4f}"
    )
    print(f"  compute C           {a['flops']:.4g} FLOPs")
    print(f"  N_opt               {fmt_si(a['n_opt'])} parameters")
    print(f"  D_opt               {fmt_si(a['d_opt'])} tokens")
    print(f"  tokens / parameter  {a['tokens_per_param']:.2f}")
    print(f"  predicted loss      {a['loss']:.4f}")
    print(f"  closed form         {a['closed_form']}")


def allocate(args) -> int:
    for flag in ("flops", "target_loss", "params", "tokens"):
        v = getattr(args, flag)
        if v is not None and not (np.isfinite(v) and v > 0):
            raise ScalingError(f"--{flag.replace('_', '-')} {v}: give a finite number > 0")

    from llmtrain.scaling.registry import is_moe_law

    if is_moe_law(args.law):  # krajewski2024*, ludziejewski2025: see moe_commands
        from llmtrain.scaling import moe_commands

        return moe_commands.allocate(args)
    for opt in ("experts", "granularity", "memory"):
        if getattr(args, opt, None) is not None:
            raise ScalingError(
                f"--{opt} needs an MoE law (--law krajewski2024 or ludziejewski2025)"
            )
    law = load_law(args.law)
    if args.target_loss is not None:
        a = law.flops_for_loss(args.target_loss)
        a["query"] = f"compute for loss {args.target_loss}"
    elif args.params is not None:
        a = law.tokens_for_params(args.params)
        a["query"] = f"compute-optimal tokens for N={args.params:g}"
    elif args.tokens is not None:
        a = law.params_for_tokens(args.tokens)
        a["query"] = f"compute-optimal model for D={args.tokens:g}"
    elif args.flops is not None:
        a = law.allocate(args.flops)
        a["query"] = f"allocation of C={args.flops:g}"
    else:
        raise ScalingError("give --flops, --target-loss, --params or --tokens")
    a["law"] = law.to_json()
    a["c_6nd"] = 6 * a["n_opt"] * a["d_opt"]
    a["deepseek_batch_tokens"] = deepseek_batch_tokens(a["flops"])
    a["deepseek_lr"] = deepseek_lr(a["flops"])
    if args.to_config:
        from llmtrain.scaling.family import Family, training_config, write_config

        cfg, info = training_config(Family(args.to_config), a["n_opt"], a["flops"], hyper=True)
        out = Path(args.out or "allocated.yaml")
        header = (f"llmtrain scaling allocate --flops {a['flops']:.4g} --law {args.law} --to-config {args.to_config}\n"
                  f"N_opt {a['n_opt']:.4g} -> family member with {info['active_params']:,} active params\n"
                  f"FLOPs/token (attention included) {info['flops_per_token']:.4g} vs 6N {6 * info['active_params']:.4g}\n"
                  f"tokens {info['tokens']:,} in {info['steps']} steps of {info['global_batch_tokens']:,} tokens\n"
                  f"batch and LR: DeepSeek LLM 2024, B_opt = 0.2920 C^0.3271 tokens, eta_opt = 0.3118 C^-0.1250")  # fmt: skip
        write_config(cfg, out, header)
        a["config"] = {"path": str(out), **info}
    if args.json:
        print(json.dumps(a, indent=2))
        return 0
    print(a["query"])
    _print_allocation(a, law)
    print(f"  6·N·D               {a['c_6nd']:.4g} FLOPs (the law's C = 6ND)")
    print(
        f"  DeepSeek batch / LR {fmt_si(a['deepseek_batch_tokens'])} tokens, {a['deepseek_lr']:.3g}"
    )
    if "config" in a:
        c = a["config"]
        print(f"wrote {c['path']}: {c['active_params']:,} active params, {c['tokens']:,} tokens, "
              f"{c['flops_per_token']:.4g} FLOPs/token (6N = {6 * c['active_params']:.4g})")  # fmt: skip
    return 0


def fit(args) -> int:
    moe_only = [f for f, on in (("--fix", args.fix), ("--grid", args.grid != "default")) if on]
    dense_only = [f for f, on in (("--approach", args.approach != "all"), ("--n-col", args.n_col),
                                  ("--c-col", args.c_col), ("--drop-highest", args.drop_highest),
                                  ("--intermediate", args.intermediate)) if on]  # fmt: skip
    if getattr(args, "law", None):  # moe-joint | moe-granular: see moe_commands
        from llmtrain.scaling import moe_commands

        if dense_only:  # a flag that would be dropped silently is a wrong fit the user trusts
            raise ScalingError(f"{', '.join(dense_only)}: for the dense fits (Chinchilla's "
                               f"approaches); --law {args.law} takes --active-col, --total-col, "
                               "--experts-col, --granularity-col, --d-col, --loss-col, --fix, --grid")  # fmt: skip
        return moe_commands.fit(args)
    if moe_only:
        raise ScalingError(f"{', '.join(moe_only)}: for the MoE laws; add --law moe-joint or "
                           "--law moe-granular")  # fmt: skip
    from llmtrain.scaling.fit import fit_approach1, fit_approach2, fit_approach3
    from llmtrain.scaling.io import load_runs

    cols = {
        "n_col": args.n_col,
        "d_col": args.d_col,
        "c_col": args.c_col,
        "loss_col": args.loss_col,
    }
    runs = load_runs(args.runs, **cols)
    if args.drop_highest < 0 or args.drop_highest >= len(runs):
        raise ScalingError(
            f"--drop-highest {args.drop_highest}: give 0 to {len(runs) - 1} (there are {len(runs)} points)"
        )
    if args.bootstrap < 0:
        raise ScalingError(f"--bootstrap {args.bootstrap}: give 0 or more resamples")
    if args.drop_highest:
        runs = drop_highest(runs, args.drop_highest)
    approaches = ["1", "2", "3"] if args.approach == "all" else [args.approach]
    finished = runs.subset(runs.final)
    results: dict = {"n_points": len(runs), "n_finished": len(finished)}
    t0 = time.perf_counter()
    errors = {}
    for ap in approaches:
        try:
            if ap == "3":
                results["approach3"] = fit_approach3(
                    finished, args.bootstrap, args.seed, progress=not args.json
                )
            elif ap == "2":
                results["approach2"] = fit_approach2(finished, args.bootstrap, args.seed)
            else:
                results["approach1"] = fit_approach1(
                    runs, args.bootstrap, args.seed, allow_intermediate=args.intermediate
                )
        except ScalingError as e:
            if args.approach != "all":
                raise
            errors[f"approach{ap}"] = str(e)
    results["seconds"] = time.perf_counter() - t0
    if errors:
        results["errors"] = errors
    if not any(k.startswith("approach") for k in results):
        raise ScalingError("no approach could fit these runs: " + "; ".join(errors.values()))
    if args.plot:
        from llmtrain.scaling.plots import plot_fits

        plot_fits(finished, results, Path(args.plot))
    out = _jsonable(results)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    _report(results, args)
    return 0


def _jsonable(results: dict) -> dict:
    out = {}
    for k, v in results.items():
        if isinstance(v, dict):
            v = {kk: vv for kk, vv in v.items() if kk != "law"}
            if "bootstrap" in v:
                v["bootstrap"] = {
                    kk: vv for kk, vv in v["bootstrap"].items() if kk not in ("samples", "n_curves")
                }
        out[k] = v
    return out


def _ci(res, key):
    ci = res.get("bootstrap", {}).get("ci95", {}).get(key)
    return f"  [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""


def _report(results: dict, args) -> None:
    print(
        f"{results['n_points']} points, {results['n_finished']} finished runs; fitted in {results['seconds']:.1f} s"
    )
    if "approach3" in results:
        r = results["approach3"]
        p = r["params"]
        ci = (f", 95% bootstrap intervals over {args.bootstrap} resamples" if args.bootstrap
              else " (--bootstrap N for intervals)")  # fmt: skip
        print(f"\nApproach 3 (sum of Huber(1e-3) on log loss, L-BFGS from {r['starts']} starts, "
              f"{r['starts_converged']} converged){ci}:")  # fmt: skip
        for k in ("E", "A", "B", "alpha", "beta", "a_exp", "b_exp"):
            print(f"  {k:<6} {p[k]:>10.4g}{_ci(r, k)}")
        edge = r["on_grid_edge"]
        print(f"  on the edge of the start grid: {', '.join(edge) if edge else 'no'}")
        print(f"  residual rms (log loss): {r['residual_rms']:.4f}")
    for key, title in (
        ("approach2", "Approach 2 (IsoFLOP parabolas)"),
        ("approach1", "Approach 1 (envelope)"),
    ):
        if key in results:
            r = results[key]
            print(f"\n{title}:")
            if key == "approach1":
                print(f"  {r['note']}")
            else:
                for m in r["minima"]:
                    if m["excluded"]:
                        print(f"  C={m['C']:.3g}: not used: {m['excluded']}")
                        continue
                    flag = "" if m["inside_range"] else "  (minimum outside the sizes tried)"
                    print(
                        f"  C={m['C']:.3g}: N_opt={fmt_si(m['n_opt'])}, D_opt={fmt_si(m['d_opt'])}, loss {m['loss_min']:.4f}{flag}"
                    )
            print(f"  N_opt ∝ C^{r['a_exp']:.4f}{_ci(r, 'a_exp')}")
            print(f"  D_opt ∝ C^{r['b_exp']:.4f}{_ci(r, 'b_exp')}")
            if r.get("bootstrap", {}).get("note"):
                print(f"  bootstrap: {r['bootstrap']['note']}")
    for k, v in results.get("errors", {}).items():
        print(f"\n{k}: not fitted: {v}")
    if args.plot:
        print(f"\nplot: {args.plot}")


def sweep(args) -> int:
    from llmtrain.scaling import sweep as sw

    if args.sweep_cmd == "plan" and (
        getattr(args, "experts", None) or getattr(args, "granularity", None)
    ):
        from llmtrain.scaling import moe_commands

        return moe_commands.sweep_plan(args)  # vary E and G at fixed active size
    if args.sweep_cmd == "plan":
        bad = [b for b in args.budgets if not (np.isfinite(b) and b > 0)]
        if bad:
            raise ScalingError(f"--budgets {bad[0]}: every budget must be a finite number > 0")
        if args.sizes < 1 or not (np.isfinite(args.spread) and args.spread >= 1):
            raise ScalingError("--sizes must be >= 1 and --spread a finite number >= 1")
        if not (np.isfinite(args.center_factor) and args.center_factor > 0):
            raise ScalingError(f"--center-factor {args.center_factor}: give a number > 0")
        m = sw.plan(
            args.budgets,
            args.family,
            Path(args.out),
            load_law(args.law),
            args.sizes,
            args.spread,
            args.hyper,
            args.center_factor,
        )
        for r in m["runs"]:
            print(
                f"{r['name']}: {r['active_params']:,} active params, {r['tokens']:,} tokens, {r['steps']} steps"
            )
        print(f"{len(m['runs'])} runs planned in {args.out}")
    elif args.sweep_cmd == "run":
        status = sw.run(Path(args.sweep), print_only=args.print_commands, nproc=args.nproc)
        failed = [k for k, v in status.items() if v.startswith("FAILED")]
        if failed:
            print(f"{len(failed)} run(s) failed: {', '.join(failed)}")
            return 1
    else:
        print(sw.collect(Path(args.sweep), Path(args.out) if args.out else None))
    return 0


def drop_highest(runs, k: int):
    """The runs without the `k` highest losses: exactly k, ties broken by order (a NaN loss is
    an error naming its row, not the highest loss)."""
    from llmtrain.scaling.fit import check_runs

    if (~np.isfinite(runs.loss)).any():
        check_runs(runs, "--drop-highest")
    keep = np.ones(len(runs), dtype=bool)
    keep[np.argsort(runs.loss, kind="stable")[len(runs) - k :]] = False
    return runs.subset(keep)
