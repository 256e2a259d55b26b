"""Scaling laws against published results (vendored in tests/data/scaling) and closed forms."""

import csv
import json

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from llmtrain.cli import main
from llmtrain.scaling.fit import Runs, fit_approach1, fit_approach2, fit_approach3
from llmtrain.scaling.io import read_csv
from llmtrain.scaling.laws import BUILTIN_LAWS, ScalingError, load_law

from .conftest import ROOT

DATA = ROOT / "tests" / "data" / "scaling"  # provenance and licences: tests/data/README.md


def epoch_runs():
    rows = list(csv.DictReader(open(DATA / "epoch_chinchilla" / "svg_extracted_data.csv")))
    N = np.array([float(r["Model Size"]) for r in rows])
    C = np.array([float(r["Training FLOP"]) for r in rows])
    L = np.array([float(r["loss"]) for r in rows])
    keep = L < np.sort(L)[-5]  # Epoch drops the 5 highest-loss points
    N, C, L = N[keep], C[keep], L[keep]
    return Runs(N, C / (6 * N), C, L, np.ones(len(L), bool))


@pytest.fixture(scope="module")
def epoch_fit():
    return fit_approach3(epoch_runs(), bootstrap=40, seed=0)


def test_approach3_reproduces_epoch_refit(epoch_fit):
    p = epoch_fit["params"]
    assert len(epoch_runs()) == 240
    assert p["E"] == pytest.approx(1.8172, abs=0.02)
    assert p["alpha"] == pytest.approx(0.3478, abs=0.01)
    assert p["beta"] == pytest.approx(0.3658, abs=0.01)
    assert p["A"] == pytest.approx(482.01, rel=0.1)
    assert p["B"] == pytest.approx(2085.43, rel=0.1)
    assert p["a_exp"] == pytest.approx(0.51, abs=0.01)
    assert epoch_fit["starts"] == 4500 and not epoch_fit["on_grid_edge"]
    ci = epoch_fit["bootstrap"]["ci95"]
    for k, v in (("E", 1.8172), ("alpha", 0.3478), ("beta", 0.3658)):
        assert ci[k][0] <= v <= ci[k][1], (k, ci[k])


def test_averaging_the_huber_loss_would_be_caught(epoch_fit):
    """The objective is the sum over runs; averaging it shrinks the gradient below L-BFGS's
    tolerance and the grid search ends near its starting values, far from Epoch's refit."""
    from llmtrain.scaling.fit import DELTA, _objective, grid_search

    runs = epoch_runs()
    logs = (np.log(runs.N), np.log(runs.D), np.log(runs.loss))
    theta = np.array([6.0, 7.0, 0.6, 0.35, 0.37])
    pred = np.logaddexp(
        np.logaddexp(theta[0] - theta[3] * logs[0], theta[1] - theta[4] * logs[1]), theta[2]
    )
    r = np.abs(pred - logs[2])
    huber = np.where(r <= DELTA, 0.5 * r**2, DELTA * (r - 0.5 * DELTA))
    assert _objective(theta, *logs)[0] == pytest.approx(huber.sum())
    grid = epoch_fit["grid_best"]  # the sum, before the final polish
    assert grid["B"] == pytest.approx(2085.43, rel=0.1) and grid["alpha"] == pytest.approx(
        0.3478, abs=0.01
    )
    mean_best, _, _ = grid_search(*logs, reduce="mean")
    assert abs(np.exp(mean_best.x[1]) / 2085.43 - 1) > 0.3


def test_approach2_on_llama3_isoflops():
    rows = list(csv.DictReader(open(DATA / "llama3_isoflops" / "isoflops_points.csv")))
    C = np.array([float(r["compute_budget"]) for r in rows])
    D = np.array([float(r["training_tokens"]) for r in rows])
    L = np.array([float(r["validation_loss"]) for r in rows])
    out = fit_approach2(Runs(C / (6 * D), D, C, L, np.ones(len(L), bool)), bootstrap=50)
    assert out["n_budgets"] == 10
    assert out["b_exp"] == pytest.approx(0.53, abs=0.03)  # Llama 3: D* ∝ C^0.53
    assert out["d_coef"] == pytest.approx(0.29, rel=0.25)
    lo, hi = out["bootstrap"]["ci95"]["b_exp"]
    assert lo < out["b_exp"] < hi


def test_approach1_uses_only_finished_runs_by_default():
    r = read_csv(DATA / "misfitting_li2025" / "scaling_results_min.csv")
    assert r.final.sum() < len(r) / 10
    out = fit_approach1(r)
    assert "end-of-schedule" in out["note"]
    # the envelope rebuilt here: finished runs, budgets grouped within 5% in C, each budget's
    # lowest loss kept where it beats every smaller budget, N ∝ C^a by least squares in logs
    fin = r.subset(r.final)
    order = np.argsort(fin.C, kind="stable")
    groups, start = [], None
    for i in order:
        if start is None or fin.C[i] > start * 1.05:
            groups.append([])
            start = fin.C[i]
        groups[-1].append(i)
    env, best = [], np.inf
    for g in groups:
        i = min(g, key=lambda j: fin.loss[j])
        if fin.loss[i] < best:
            best = fin.loss[i]
            env.append(i)
    a_ref = np.polyfit(np.log(fin.C[env]), np.log(fin.N[env]), 1)[0]
    assert len(out["envelope"]) == len(env) >= 3
    assert out["a_exp"] == pytest.approx(a_ref, rel=1e-9)
    inter = fit_approach1(r, allow_intermediate=True)
    assert "intermediate" in inter["note"] and inter["a_exp"] != out["a_exp"]


def test_closed_form_allocation_is_the_constrained_minimum():
    for law in BUILTIN_LAWS.values():
        c = 1e21
        a = law.allocate(c)
        res = minimize_scalar(
            lambda ln, law=law, c=c: law.loss(np.exp(ln), c / (6 * np.exp(ln))),
            bounds=(10, 40),
            method="bounded",
        )
        assert a["n_opt"] == pytest.approx(np.exp(res.x), rel=1e-3)
        assert 6 * a["n_opt"] * a["d_opt"] == pytest.approx(c)
        assert law.flops_for_loss(a["loss"])["flops"] == pytest.approx(c, rel=1e-6)
        assert law.tokens_for_params(a["n_opt"])["d_opt"] == pytest.approx(a["d_opt"], rel=1e-6)
        assert law.params_for_tokens(a["d_opt"])["n_opt"] == pytest.approx(a["n_opt"], rel=1e-6)
    with pytest.raises(ScalingError, match="irreducible"):
        BUILTIN_LAWS["chinchilla"].flops_for_loss(1.5)


def test_chinchilla_law_at_gopher_compute():
    a = BUILTIN_LAWS["chinchilla"].allocate(5.76e23)
    assert a["n_opt"] == pytest.approx(40e9, rel=0.05)  # Hoffmann et al. Table 3, approach 3


def _synthetic(budgets=(1e18, 1e19, 1e20), per=6, law=BUILTIN_LAWS["epoch"], noise=0.0):
    rng = np.random.default_rng(0)
    N, D, C, L = [], [], [], []
    for c in budgets:
        center = law.allocate(c)["n_opt"]
        for n in center * np.logspace(-1, 1, per):
            d = c / (6 * n)
            (
                N.append(n),
                D.append(d),
                C.append(c),
                L.append(law.loss(n, d) * np.exp(noise * rng.normal())),
            )
    return Runs(np.array(N), np.array(D), np.array(C), np.array(L), np.ones(len(L), bool))


def test_approaches_agree_on_a_known_law():
    law = BUILTIN_LAWS["epoch"]
    r = _synthetic()
    a2 = fit_approach2(r)
    assert a2["a_exp"] == pytest.approx(law.a, abs=0.02)
    a3 = fit_approach3(r)
    assert a3["params"]["alpha"] == pytest.approx(law.alpha, abs=0.01)
    assert a3["params"]["E"] == pytest.approx(law.E, abs=0.01)


def test_bad_input_gets_clear_messages():
    r = _synthetic()
    with pytest.raises(ScalingError, match="too few"):
        fit_approach3(r.subset(np.arange(5)))
    with pytest.raises(ScalingError, match="one"):
        fit_approach2(r.subset(r.C == 1e18))
    bad = _synthetic()
    bad.loss[3] = np.nan
    with pytest.raises(ScalingError, match="NaN"):
        fit_approach3(bad)
    bad = _synthetic()
    bad.N[0] = -1
    with pytest.raises(ScalingError, match="positive"):
        fit_approach2(bad)
    flat = _synthetic()
    flat.loss[flat.C == 1e18] = np.linspace(3, 2, 6)  # monotone: no minimum
    out = fit_approach2(flat)  # that budget is reported and left out, the others still fit
    assert out["n_budgets"] == 2 and "curve upward" in out["excluded"][0]
    flat.loss[flat.C == 1e19] = np.linspace(3, 2, 6)
    with pytest.raises(ScalingError, match="curve upward"):
        fit_approach2(flat)


def test_fits_that_answer_no_allocation_are_refused(tmp_path):
    """Data that cannot give a compute-optimal allocation say so: a ladder at one tokens-per-
    parameter ratio (alpha and beta cannot be told apart: the fit once put alpha at 1.6 with a
    narrow interval), loss rising with model size (alpha < 0: a complex G), an IsoFLOP
    bootstrap with no residual to draw (a zero-width interval), a misspelt column (derived from
    the others instead), and a registered dense law is usable."""
    law = BUILTIN_LAWS["epoch"]
    rng = np.random.default_rng(1)
    n = np.logspace(7, 10, 16)
    d = 20 * n
    ladder = Runs(n, d, 6 * n * d, np.array([law.loss(a, b) for a, b in zip(n, d)])
                  * np.exp(0.005 * rng.normal(size=16)), np.ones(16, bool))  # fmt: skip
    with pytest.raises(ScalingError, match="cannot tell the model-size term"):
        fit_approach3(ladder)
    assert fit_approach3(_synthetic())["params"]["alpha"] > 0  # an IsoFLOP design passes
    rising = _synthetic()
    rising.loss = 2.0 + 0.02 * np.log(rising.N) + 50 / rising.D**0.3
    with pytest.raises(ScalingError, match="does not fall with both model size and data"):
        fit_approach3(rising)
    from llmtrain.scaling.laws import Law

    with pytest.raises(ScalingError, match="alpha=-0.1: A, B, alpha and beta must be positive"):
        Law(1.8, 400, 400, -0.1, 0.3).allocate(1e22)
    three = fit_approach2(_synthetic(per=3, noise=0.01), bootstrap=20)
    assert three["bootstrap"]["ci95"] == {} and "no interval" in three["bootstrap"]["note"]
    four = fit_approach2(_synthetic(per=4, noise=0.01), bootstrap=20)["bootstrap"]["ci95"]
    assert four["a_exp"][0] < four["a_exp"][1]
    f = tmp_path / "runs.csv"
    f.write_text("params,tokens,compute,loss\n1e8,2e9,1.6e18,3.0\n")
    with pytest.raises(ScalingError, match="--n-col 'non_embedding_params' is not a column"):
        read_csv(f, n_col="non_embedding_params")
    dense = load_law("krajewski2024-dense")
    assert (dense.alpha, dense.beta) == (0.126, 0.127) and dense.allocate(1e21)["n_opt"] > 0


def test_approach2_budget_with_a_far_minimum_is_excluded_not_a_crash():
    """A budget whose parabola puts its minimum far outside the sizes tried (N_opt underflowed
    to 0 once: ZeroDivisionError) is reported and left out of the power law."""
    law = BUILTIN_LAWS["epoch"]
    r = _synthetic(budgets=(1e18, 1e19, 1e20, 1e21))
    ref = fit_approach2(r.subset(r.C != 1e18))
    sel = r.C == 1e18
    x = np.log(r.N[sel])
    r.loss[sel] = 3 + 1e-4 * (x + 2000) ** 2  # convex, vertex at N = e^-2000 (underflows to 0)
    out = fit_approach2(r)
    assert out["n_budgets"] == 3 and len(out["excluded"]) == 1
    assert "far outside" in out["excluded"][0]
    assert out["a_exp"] == pytest.approx(ref["a_exp"]) and out["a_exp"] == pytest.approx(
        law.a, abs=0.02
    )
    boot = fit_approach2(r, bootstrap=5)
    assert boot["bootstrap"]["resamples"] == 5


def test_cli_fit_recognises_common_columns_and_reports_degenerate_data(tmp_path, capsys):
    r = _synthetic(budgets=(1e18, 1e19, 1e20, 1e21))
    sel = r.C == 1e18
    r.loss[sel] = 3 + 1e-4 * (np.log(r.N[sel]) + 2000) ** 2
    f = tmp_path / "runs.csv"
    with open(f, "w") as fh:
        fh.write("params,tokens,compute,val_loss\n")
        fh.writelines(f"{n},{d},{c},{l}\n" for n, d, c, l in zip(r.N, r.D, r.C, r.loss))
    assert main(["scaling", "fit", str(f), "--approach", "2"]) == 0
    out = capsys.readouterr().out
    assert "not used: the parabola's minimum" in out and "N_opt ∝ C^" in out
    cases = {
        "one budget": ("N,D,loss\n1e6,1e8,3.0\n2e6,5e7,2.9\n4e6,2.5e7,3.1\n", "two or more"),
        "text in a number": ("N,D,loss\n1e6,abc,3.0\n", "not a number"),
        "no loss column": ("N,D,acc\n1e6,1e8,0.5\n", "no loss column"),
        "one size": ("N,C,loss\n" + "".join(f"1e6,{c},3\n" for c in (1e18, 1e18, 1e18, 1e19, 1e19, 1e19)), "distinct model size"),
    }  # fmt: skip
    for name, (text, msg) in cases.items():
        g = tmp_path / f"{name}.csv"
        g.write_text(text)
        assert main(["scaling", "fit", str(g), "--approach", "2"]) == 2, name
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, (name, err)


def test_plotted_approach3_frontier_counts_compute_as_the_runs_do(tmp_path, monkeypatch):
    """Runs whose C is 12·N·D (a sweep counts attention): the Approach 3 curve drawn against C
    passes through Approach 2's IsoFLOP minima at those C, as it would at C = 6ND."""
    from llmtrain.scaling import plots

    r = _synthetic()
    r = Runs(r.N, r.D, 2 * r.C, r.loss, r.final)
    results = {"approach2": fit_approach2(r), "approach3": fit_approach3(r)}
    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, out: figs.append(fig) or out)
    plots.plot_fits(r, results, tmp_path / "fit.png")
    (line,) = [x for x in figs[0].axes[1].get_lines() if x.get_label().startswith("approach3")]
    cs, ns = line.get_data()
    for m in results["approach2"]["minima"]:
        assert np.interp(np.log(m["C"]), np.log(cs), np.log(ns)) == pytest.approx(
            np.log(m["n_opt"]), abs=0.05
        ), m["C"]


def test_cli_fit_json_plot_and_law_round_trip(tmp_path, capsys):
    r = _synthetic(noise=0.002)
    f = tmp_path / "runs.csv"
    with open(f, "w") as fh:
        fh.write(
            "params,tokens,L\n" + "".join(f"{n},{d},{l}\n" for n, d, l in zip(r.N, r.D, r.loss))
        )
    argv = ["scaling", "fit", str(f), "--n-col", "params", "--d-col", "tokens", "--loss-col", "L",
            "--approach", "all", "--bootstrap", "20", "--plot", str(tmp_path / "fit.png"), "--out", str(tmp_path / "fit.json")]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Approach 3" in text and "Approach 2" in text
    assert "intervals over 20 resamples" in text
    assert (tmp_path / "fit.png").stat().st_size > 20_000
    assert main(argv[: argv.index("--approach")] + ["--approach", "3"]) == 0  # no --bootstrap
    text = capsys.readouterr().out
    assert "resamples" not in text and "--bootstrap N for intervals" in text
    law = load_law(str(tmp_path / "fit.json"))
    assert law.alpha == pytest.approx(BUILTIN_LAWS["epoch"].alpha, abs=0.03)
    assert (
        main(
            [
                "scaling",
                "allocate",
                "--flops",
                "1e21",
                "--law",
                str(tmp_path / "fit.json"),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["n_opt"] > 0
    assert main(["scaling", "fit", str(f)]) == 2  # default column names absent
    assert "loss column" in capsys.readouterr().err


def test_allocate_to_config(tmp_path, capsys):
    out = tmp_path / "cfg.yaml"
    fam = ROOT / "configs" / "families" / "debug_family.yaml"
    assert (
        main(
            [
                "scaling",
                "allocate",
                "--flops",
                "1e13",
                "--to-config",
                str(fam),
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    a = json.loads(capsys.readouterr().out)
    from llmtrain.accounting import count
    from llmtrain.config import load_config

    cfg = load_config(out)
    n = count(cfg.model).active_params
    assert abs(np.log(n / a["n_opt"])) < 0.3
    tokens = cfg.train.max_steps * cfg.train.global_batch_size * cfg.train.seq_len
    fpt = count(cfg.model, seq_len=cfg.train.seq_len).flops_per_token
    assert tokens * fpt == pytest.approx(1e13, rel=0.05)
    assert cfg.train.lr == pytest.approx(0.3118 * 1e13**-0.125)


def test_sweep_plan_writes_an_isoflop_grid(tmp_path, capsys):
    fam = ROOT / "configs" / "families" / "debug_family.yaml"
    assert main(["scaling", "sweep", "plan", "--budgets", "3e11", "1e12", "1e14", "--family", str(fam),
                 "--out", str(tmp_path), "--sizes", "4", "--hyper"]) == 0  # fmt: skip
    m = json.loads((tmp_path / "manifest.json").read_text())
    from llmtrain.config import load_config

    batches, val = set(), set()
    for budget in (3e11, 1e12, 1e14):
        runs = [r for r in m["runs"] if r["budget"] == budget]
        assert len(runs) >= 3
        for r in runs:
            t = load_config(tmp_path / r["config"]).train
            assert r["tokens"] * r["flops_per_token"] == pytest.approx(budget, rel=0.1)
            batches.add(t.global_batch_size)
            val.add(t.eval_sequences)
    from llmtrain.scaling.family import Family

    base = Family(fam).base.train  # every run scored on the family's validation sequences
    assert len(batches) > 1 and val == {base.eval_batches * base.global_batch_size}, (batches, val)
    assert main(["scaling", "sweep", "run", str(tmp_path), "--print-commands"]) == 0
    assert "deepspeed --num_gpus 1 --module llmtrain.train" in capsys.readouterr().out
    with pytest.raises(ScalingError, match="no finished runs"):
        from llmtrain.scaling.sweep import collect

        collect(tmp_path)


@pytest.mark.slow
def test_sweep_runs_skips_finished_and_survives_a_crash(tmp_path, capsys):
    from llmtrain.scaling import sweep as sw
    from llmtrain.scaling.laws import Law

    fam = ROOT / "configs" / "families" / "debug_family.yaml"
    law = Law(1.5, 400, 400, 0.34, 0.28)
    m = sw.plan([2e10, 6e10], str(fam), tmp_path, law, sizes=3, spread=4)
    broken = tmp_path / m["runs"][0]["config"]
    broken.write_text(broken.read_text().replace("num_heads:", "num_heads: 1000\n  x_bad_key:"))
    status = sw.run(tmp_path)
    assert status[m["runs"][0]["name"]].startswith("FAILED")
    assert sum(v.startswith("done") for v in status.values()) == len(m["runs"]) - 1
    again = sw.run(tmp_path)
    assert all(v == "done (skipped)" for k, v in again.items() if k != m["runs"][0]["name"])
    out = sw.collect(tmp_path)
    assert len(out.read_text().splitlines()) == len(m["runs"])  # header + all but the broken one


# ---------------------------------------------------------------- audit regressions


def _llama3_runs(order=None) -> Runs:
    rows = list(csv.DictReader(open(DATA / "llama3_isoflops" / "isoflops_points.csv")))
    if order is not None:
        rows = [rows[i] for i in order(len(rows))]
    C = np.array([float(r["compute_budget"]) for r in rows])
    D = np.array([float(r["training_tokens"]) for r in rows])
    L = np.array([float(r["validation_loss"]) for r in rows])
    return Runs(C / (6 * D), D, C, L, np.ones(len(L), bool), [f"row{i}" for i in range(len(L))])


def test_approach1_envelope_does_not_depend_on_row_order():
    """IsoFLOP runs share C: the envelope keeps each budget's minimum, whatever the order (it
    gave N_opt ∝ C^0.445, 0.497 or 0.461 for the same Llama 3 points in three orders)."""
    rng = np.random.default_rng(0)
    fits = [fit_approach1(_llama3_runs(o)) for o in
            (None, lambda n: range(n - 1, -1, -1), lambda n: rng.permutation(n))]  # fmt: skip
    assert len({round(f["a_exp"], 12) for f in fits}) == 1
    assert len(fits[0]["envelope"]) <= 10  # at most one point per budget
    boot = fit_approach1(_llama3_runs(), bootstrap=100)["bootstrap"]["ci95"]["a_exp"]
    assert boot[0] <= fits[0]["a_exp"] <= boot[1]


def test_approach1_envelope_groups_budgets_whose_compute_differs_slightly():
    """A sweep's runs at one budget differ in C by whole steps of tokens (1.00048e12, 1.0011e12,
    ...): kept as separate compute values, a bootstrap draw of two of them 0.1% apart gave an
    overflowing slope (OverflowError) and the fit itself was skewed. Jittered Llama 3 points fit
    as the exact ones do."""
    exact = _llama3_runs()
    rng = np.random.default_rng(1)
    jitter = 1 + rng.uniform(0, 2e-3, len(exact.C))
    r = Runs(exact.N, exact.D, exact.C * jitter, exact.loss, exact.final, exact.run)
    a, b = fit_approach1(exact), fit_approach1(r, bootstrap=200)
    assert len(b["envelope"]) == len(a["envelope"])
    assert b["a_exp"] == pytest.approx(a["a_exp"], abs=0.01)
    lo, hi = b["bootstrap"]["ci95"]["a_exp"]
    assert np.isfinite([lo, hi]).all() and lo <= b["a_exp"] <= hi


def test_approach2_bootstrap_keeps_every_budget_and_brackets_the_estimate():
    """Resampling runs within a budget often left < 3 sizes; a resample losing a budget was
    thrown away (or, with one budget short, the whole bootstrap failed)."""
    r = read_csv(DATA / "epoch_chinchilla" / "svg_extracted_data.csv")
    keep = np.ones(len(r), bool)
    keep[np.argsort(r.loss, kind="stable")[-5:]] = False
    out = fit_approach2(r.subset(keep), bootstrap=50)
    b = out["bootstrap"]
    assert b["failed_resamples"] < 5 and b["resamples"] >= 45
    lo, hi = b["ci95"]["a_exp"]
    assert lo < out["a_exp"] < hi
    li = fit_approach2(
        read_csv(DATA / "misfitting_li2025" / "scaling_results_min.csv").subset(
            read_csv(DATA / "misfitting_li2025" / "scaling_results_min.csv").final
        ),
        bootstrap=50,
    )
    lo, hi = li["bootstrap"]["ci95"]["a_exp"]
    assert lo < li["a_exp"] < hi


def test_approach2_tokens_at_the_optimum_follow_the_runs_own_flops(tmp_path):
    """C counted with attention (sweeps, run directories) is not 6ND: D_opt comes from the
    budget's own (N, D) runs, not C/(6 N_opt)."""
    N = np.repeat([[1e6, 2e6, 4e6, 8e6]], 3, axis=0).ravel()
    C = np.repeat([1e15, 4e15, 1.6e16], 4)
    D = C / (7.2 * N)  # 1.2 x 6N FLOPs per token
    L = 2 + 0.1 * (np.log(N) - np.log(np.sqrt(C / 7.2 / 20))) ** 2
    out = fit_approach2(Runs(N, D, C, L, np.ones(len(L), bool)))
    for m in out["minima"]:
        assert m["d_opt"] == pytest.approx(m["C"] / (7.2 * m["n_opt"]), rel=1e-6)


def test_scaling_input_mistakes_get_one_line_each(tmp_path, capsys):
    bad = tmp_path / "nofinal.csv"
    bad.write_text(
        "N,D,C,loss,portion_steps_elapsed\n1e6,1e8,6e14,3.0,0.5\n2e6,1e8,1.2e15,2.9,0.5\n"
    )
    assert main(["scaling", "fit", str(bad), "--approach", "1"]) == 2
    assert "no finished run" in capsys.readouterr().err
    nan = tmp_path / "nan.csv"
    nan.write_text("N,D,loss\n1e6,1e8,3.0\n2e6,1e8,nan\n4e6,1e8,2.8\n")
    assert main(["scaling", "fit", str(nan), "--approach", "2"]) == 2
    assert f"{nan}:3" in capsys.readouterr().err  # the file's own line, not a row index
    assert main(["scaling", "fit", str(nan), "--drop-highest", "1"]) == 2
    assert f"{nan}:3" in capsys.readouterr().err
    fam = str(ROOT / "configs" / "families" / "debug_family.yaml")
    for argv, needle in (
        (["scaling", "allocate", "--law", "ludziejewski2025", "--flops", "1e22", "--experts", "0"], "--experts 0"),
        (["scaling", "allocate", "--law", "krajewski2024", "--flops", "1e20", "--granularity", "0"], "--granularity 0"),
        (["scaling", "allocate", "--law", "abnar2025", "--flops", "1e20"], "could not be retrieved"),
        (["scaling", "sweep", "plan", "--budgets", "1e12", "--family", fam, "--out", str(tmp_path / "s"), "--center-factor", "0"], "--center-factor"),
        (["scaling", "sweep", "plan", "--budgets", "1e20", "--family", fam, "--out", str(tmp_path / "s"), "--sizes", "4"], "needs >= 3"),
    ):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "internal error" not in err, (argv, err)


def test_drop_highest_drops_exactly_k_with_ties():
    from llmtrain.scaling.commands import drop_highest

    loss = np.array([2.0, 3.0, 2.5, 3.0, 3.0, 2.2])
    r = Runs(np.arange(1.0, 7), np.ones(6), np.ones(6), loss, np.ones(6, bool))
    assert sorted(drop_highest(r, 1).loss.tolist()) == [2.0, 2.2, 2.5, 3.0, 3.0]
    assert sorted(drop_highest(r, 4).loss.tolist()) == [2.0, 2.2]


def test_default_law_is_the_epoch_refit(capsys):
    assert main(["scaling", "allocate", "--flops", "5.76e23", "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert a["law"]["name"] == "epoch"
    assert a["d_opt"] / a["n_opt"] == pytest.approx(18.4, rel=0.05)


def test_sweep_sees_a_run_finished_by_a_save_killed_before_latest_moved(tmp_path):
    """The last save completed but `latest` still names the one before: the run is finished
    (resume=auto takes that save) and it is resumed, never restarted with --overwrite."""
    from llmtrain.scaling import sweep

    from .test_checkpoint import _fake_checkpoint

    run = tmp_path / "run"
    assert not sweep.is_finished(run, 10) and not sweep._has_checkpoint(run)
    _fake_checkpoint(run / "checkpoints", 5)  # killed before its first `latest` was written
    assert sweep._has_checkpoint(run) and not sweep.is_finished(run, 10)
    (run / "checkpoints" / "latest").write_text("step_00000005")
    _fake_checkpoint(run / "checkpoints", 10)
    assert sweep.is_finished(run, 10)
