"""MoE scaling laws: published tables reproduced from published coefficients, fits recovering
known coefficients, MoE sweep planning and the CLI."""

import csv
import json
import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from llmtrain.cli import main
from llmtrain.scaling.laws import Law, ScalingError
from llmtrain.scaling.moe import (
    GranularLaw,
    JointLaw,
    MoERuns,
    fit_moe,
    load_moe_law,
    lse_huber,
)
from llmtrain.scaling.registry import REGISTRY, get_spec

from .conftest import ROOT

MOE_FAMILY = ROOT / "configs" / "families" / "debug_moe_family.yaml"
LUDZ = REGISTRY["ludziejewski2025"]
KRAJ = REGISTRY["krajewski2024"]


def test_ludziejewski_table4_is_table3_reduced():
    """App. B: Table 4 (per-E Chinchilla coefficients) follows from Table 3 and the Ê transform."""
    law = load_moe_law("ludziejewski2025")
    assert float(law.ehat(1)) == pytest.approx(LUDZ.coefficients["E_start"])
    for E, (m, mu, n, nu) in LUDZ.published["table4"].items():
        r = law.reduced(E)
        assert r.A == pytest.approx(m, rel=5e-3) and r.B == pytest.approx(n, rel=5e-3)
        assert -r.alpha == pytest.approx(mu, abs=2e-4) and -r.beta == pytest.approx(nu, abs=2e-4)


def test_ludziejewski_table1_compute_optimal():
    """Table 1 (N_act, D per budget and E) from Table 3's coefficients. They are printed to 4
    decimals; on F/6 ~ 1e19-1e21 a 5e-5 change of an exponent moves N_opt by ~1-2 %, so 3 %."""
    law = load_moe_law("ludziejewski2025")
    worst = 0.0
    for F, row in LUDZ.published["table1"].items():
        for E, (n, d) in row.items():
            a = law.allocate(F, E)
            worst = max(worst, abs(a["n_act"] / n - 1), abs(a["tokens"] / d - 1))
            assert a["n_act"] == pytest.approx(n, rel=0.03), (F, E)
            assert a["tokens"] == pytest.approx(d, rel=0.03), (F, E)
            assert 6 * a["n_act"] * a["tokens"] == pytest.approx(F)
        ns = [law.allocate(F, E)["n_act"] for E in row]
        assert ns == sorted(ns, reverse=True)  # Finding 1: more experts, fewer active params
    assert worst < 0.03


def test_ludziejewski_closed_form_is_the_constrained_minimum():
    law = load_moe_law("ludziejewski2025")
    F = 1e21
    for E in (1, 8, 32):
        res = minimize_scalar(lambda x, E=E: law.loss(math.exp(x), F / (6 * math.exp(x)), E),
                              bounds=(15, 30), method="bounded", options={"xatol": 1e-9})  # fmt: skip
        assert law.allocate(F, E)["n_act"] == pytest.approx(math.exp(res.x), rel=1e-3)


def test_ludziejewski_table2_optimal_experts_under_memory():
    """Table 2: the optimal E under 24/80/640 GB with a 16k-token KV cache in bf16. Reproduced in
    9 of 12 cells; in the other three the paper's E is predicted < 0.4 % worse in loss than ours
    under the memory model the paper states (App. A, Sec. 4.3), a discrepancy we report."""
    law = load_moe_law("ludziejewski2025")
    t2 = LUDZ.published["table2"]
    same, off = 0, []
    for F, row in t2["rows"].items():
        for gb, e_paper in zip(t2["memory_gb"], row):
            a = law.allocate_memory(F, gb * 1e9, t2["experts_considered"], t2["kv_tokens"])
            assert a["memory_bytes"] <= gb * 1e9 * (1 + 1e-9)
            if a["experts"] == e_paper:
                same += 1
            else:
                lp = next(r["loss"] for r in a["per_experts"] if r["experts"] == e_paper)
                off.append((F, gb, a["experts"], e_paper, lp / a["loss"] - 1))
    assert same == 9, off
    assert all(0 < rel < 0.004 for *_, rel in off), off


def test_krajewski_table2_compute_optimal_granularity():
    """Table 2 from Table 1's coefficients and the FLOPs model of Eq. 10 / App. E: G exactly;
    D and FLOPs within 5 % and the loss within 0.02 (the paper optimised unrounded coefficients;
    the printed ones are 2-3 digits)."""
    law = load_moe_law("krajewski2024")
    for n_act, d, G, F, loss in KRAJ.published["table2"]:
        a = law.for_active(n_act)
        assert a["n_act"] == pytest.approx(n_act, rel=1e-6)
        assert a["granularity"] == G
        assert a["tokens"] == pytest.approx(d, rel=0.05)
        assert a["flops"] == pytest.approx(F, rel=0.05)
        assert a["loss"] == pytest.approx(loss, abs=0.02)


def test_krajewski_flops_model_and_loss_at_published_points():
    """The FLOPs column is the FLOPs model applied to the row's own N and D (to 3 digits), and
    each printed loss lies inside the range the law gives over its coefficients' rounding."""
    law = load_moe_law("krajewski2024")
    k = KRAJ.coefficients
    half = {"a": 0.05, "alpha": 5e-4, "b": 0.05, "beta": 5e-4, "g": 0.05, "gamma": 5e-3, "c": 5e-3}
    up = {"a": 1, "b": 1, "g": 1, "c": 1, "alpha": -1, "beta": -1, "gamma": -1}  # sign of dL/dθ
    lo = GranularLaw(**{p: k[p] - up[p] * half[p] for p in k})
    hi = GranularLaw(**{p: k[p] + up[p] * half[p] for p in k})
    for n_act, d, G, F, loss in KRAJ.published["table2"]:
        nb = (n_act / (12 * 64**2)) ** (1 / 3)
        s = law.shape(nb)
        assert s["n_act"] == pytest.approx(n_act)
        assert law.flops_per_token(nb, G) * d == pytest.approx(F, rel=0.006)
        assert lo.loss(s["n_total"], d, G) <= loss <= hi.loss(s["n_total"], d, G)


def test_granular_allocation_beats_its_neighbours():
    law = load_moe_law("krajewski2024")
    a = law.allocate(1e21)
    for G in (a["granularity"] / 2, a["granularity"] * 2):
        assert law.allocate(1e21, G)["loss"] > a["loss"]
    for f in (0.8, 1.25):  # another depth at the same budget is worse
        nb = a["n_blocks"] * f
        d = 1e21 / law.flops_per_token(nb, a["granularity"])
        assert law.loss(law.shape(nb)["n_total"], d, a["granularity"]) > a["loss"]


def test_objective_is_the_dense_fit_objective():
    """For the dense form the MoE objective is llmtrain.scaling.fit's Huber-on-log-LSE."""
    from llmtrain.scaling.fit import _objective

    rng = np.random.default_rng(0)
    logN, logD = rng.uniform(15, 20, 30), rng.uniform(18, 23, 30)
    logL = np.log(rng.uniform(2, 4, 30))
    theta = np.array([6.0, 7.0, 0.6, 0.35, 0.37])
    one, zero = np.ones(30), np.zeros(30)
    X = np.array([np.stack(t, 1) for t in ([one, zero, zero, -logN, zero],
                                           [zero, one, zero, zero, -logD], [zero, zero, one, zero, zero])])  # fmt: skip
    v, g = lse_huber(theta, X, logL)
    v0, g0 = _objective(theta, logN, logD, logL)
    assert v == pytest.approx(v0) and np.allclose(g, g0)


def _joint_runs(law: JointLaw, noise: float, seed: int = 0) -> MoERuns:
    rng = np.random.default_rng(seed)
    n, d, e = (a.ravel() for a in np.meshgrid([2e7, 6e7, 2e8, 6e8], [1e9, 4e9, 1.6e10], [1, 4, 16]))
    loss = law.loss(n, d, e) * np.exp(noise * rng.normal(size=n.size))
    return MoERuns(n, n * e, e.astype(float), np.ones(n.size), d, loss, np.ones(n.size, bool))


def test_joint_fit_recovers_the_law_within_its_intervals():
    truth = load_moe_law("ludziejewski2025")
    r = _joint_runs(truth, noise=0.003)
    res = fit_moe(r, "moe-joint", bootstrap=100, seed=1)
    ci = res["bootstrap"]["ci95"]
    for k in ("alpha", "beta", "c", "delta", "omega"):
        assert ci[k][0] <= getattr(truth, k) <= ci[k][1], (k, ci[k], getattr(truth, k))
    assert res["residual_rms"] < 0.006
    n, d = (float(np.exp(np.median(np.log(x)))) for x in (r.n_act, r.D))
    true_rel = truth.loss(n, d, 16) / truth.loss(n, d, 1) - 1
    e16 = [j for j, e in enumerate(res["effect"]) if e["experts"] == 16][0]
    lo, hi = res["bootstrap"]["effect_ci95"][e16]
    assert lo <= true_rel <= hi and hi < 0  # more experts: lower loss, and the fit says so


def test_granular_fit_recovers_the_law():
    """Synthetic runs from Krajewski's law with 0.2 % noise; c held (it is not identified at
    these sizes). A 95 % interval misses the truth one time in twenty: the seed is fixed."""
    truth = load_moe_law("krajewski2024")
    rng = np.random.default_rng(1)
    nt, d, g = (
        a.ravel() for a in np.meshgrid([1e8, 1e9, 1e10], [4e9, 3.2e10, 2.56e11], [1, 4, 16])
    )
    loss = truth.loss(nt, d, g) * np.exp(0.002 * rng.normal(size=nt.size))
    r = MoERuns(
        nt / 43, nt, np.full(nt.size, 64.0), g.astype(float), d, loss, np.ones(nt.size, bool)
    )
    res = fit_moe(r, "moe-granular", bootstrap=100, fixed={"c": truth.c})
    ci = res["bootstrap"]["ci95"]
    for k in ("g", "gamma", "alpha", "beta"):
        assert ci[k][0] <= getattr(truth, k) <= ci[k][1], (k, ci[k])
    assert res["effect"][-1]["rel"] < 0 and res["params"]["c"] == truth.c


def test_fit_errors_name_the_fix():
    truth = load_moe_law("ludziejewski2025")
    r = _joint_runs(truth, 0.0)
    with pytest.raises(ScalingError, match="same experts"):
        fit_moe(r.subset(r.experts == 4), "moe-joint")
    with pytest.raises(ScalingError, match="no parameter"):
        fit_moe(r, "moe-joint", fixed={"nope": 1.0})
    r.loss[0] = np.nan
    with pytest.raises(ScalingError, match="NaN"):
        fit_moe(r, "moe-joint")
    with pytest.raises(ScalingError, match="2501.12370"):
        get_spec("abnar2025")


def test_registry_entries_carry_their_source():
    for spec in REGISTRY.values():
        assert spec.paper and spec.form and spec.coefficients and spec.flops_model
        json.dumps(spec.to_json())
    assert load_moe_law("krajewski2024-e16").expansion == 16
    assert isinstance(load_moe_law("ludziejewski2025").reduced(8), Law)


def test_cli_allocate(capsys, tmp_path):
    assert (
        main(
            [
                "scaling",
                "allocate",
                "--law",
                "ludziejewski2025",
                "--flops",
                "1e21",
                "--experts",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for s in (
        "active params",
        "total params",
        "tokens",
        "predicted loss",
        "closed form",
        "arXiv 2502.05172",
    ):
        assert s in out
    assert main(["scaling", "allocate", "--law", "ludziejewski2025", "--flops", "1e22",
                 "--memory", "80", "--json"]) == 0  # fmt: skip
    a = json.loads(capsys.readouterr().out)
    assert a["experts"] == 16 and a["memory_bytes"] <= 80e9 * (1 + 1e-9) and "brentq" in a["method"]
    assert (
        main(["scaling", "allocate", "--law", "krajewski2024", "--flops", "2.95e18", "--json"]) == 0
    )
    a = json.loads(capsys.readouterr().out)
    assert a["granularity"] == 8 and a["experts"] == 64 * 8 and "Brent" in a["method"]
    assert a["n_total"] / a["n_act"] == pytest.approx((8 * 64 + 4) / 12)
    assert (
        main(["scaling", "allocate", "--law", "krajewski2024", "--flops", "1e20", "--experts", "8"])
        == 2
    )
    assert "expansion E = 64" in capsys.readouterr().err
    assert (
        main(["scaling", "allocate", "--law", "chinchilla", "--flops", "1e20", "--experts", "8"])
        == 2
    )


def test_cli_allocate_to_config_picks_experts_granularity_topk(capsys, tmp_path):
    from llmtrain.accounting import count
    from llmtrain.config import load_config

    out = tmp_path / "moe.yaml"
    assert main(["scaling", "allocate", "--law", "ludziejewski2025", "--flops", "1e12", "--experts", "4",
                 "--to-config", str(MOE_FAMILY), "--out", str(out), "--json"]) == 0  # fmt: skip
    a = json.loads(capsys.readouterr().out)
    m = load_config(out).model
    assert (m.n_routed_experts, m.num_experts_per_tok) == (4, 1)
    assert abs(math.log(count(m).active_params / a["n_act"])) < 0.3
    assert main(["scaling", "allocate", "--law", "krajewski2024", "--flops", "1e12",
                 "--to-config", str(MOE_FAMILY), "--out", str(out), "--json"]) == 0  # fmt: skip
    a = json.loads(capsys.readouterr().out)
    m = load_config(out).model
    G = a["granularity"]
    assert (m.n_routed_experts, m.num_experts_per_tok) == (64 * G, G)
    assert m.intermediate_size == G * m.moe_intermediate_size


def test_cli_sweep_plan_varies_experts_at_fixed_active_size(tmp_path, capsys):
    argv = ["scaling", "sweep", "plan", "--budgets", "3e11", "1e12", "--family", str(MOE_FAMILY),
            "--out", str(tmp_path), "--experts", "1", "4", "16", "--granularity", "1", "2", "--active", "1e5"]  # fmt: skip
    assert main(argv) == 0
    assert "6·N_active" in capsys.readouterr().out
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert len(m["runs"]) == 2 * 3 * 2
    act = [r["active_params"] for r in m["runs"]]
    assert max(act) / min(act) < 1.02  # fixed active size; only the router grows with E
    for r in m["runs"]:
        assert r["tokens"] * r["flops_per_token"] == pytest.approx(r["budget"], rel=0.05)
        assert r["flops_per_token"] > r["flops_6n_per_token"]  # attention included
    by_e = {r["experts"]: r["total_params"] for r in m["runs"] if r["granularity"] == 1}
    assert by_e[1] < by_e[4] < by_e[16]


def test_cli_fit_from_csv_with_plot(tmp_path, capsys):
    truth = load_moe_law("ludziejewski2025")
    r = _joint_runs(truth, noise=0.002)
    f = tmp_path / "runs.csv"
    with open(f, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["active_params", "total_params", "experts", "tokens", "loss"])
        w.writerows(zip(r.n_act, r.n_total, r.experts, r.D, r.loss))
    png, js = tmp_path / "e.png", tmp_path / "fit.json"
    argv = ["scaling", "fit", str(f), "--law", "moe-joint", "--bootstrap", "10", "--plot", str(png),
            "--out", str(js), "--fix", "gamma", "zeta"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "(held)" in text and "experts    16" in text and "95% [" in text
    assert png.stat().st_size > 15_000
    fit = json.loads(js.read_text())
    assert fit["params"]["gamma"] == truth.gamma
    assert fit["params"]["alpha"] == pytest.approx(truth.alpha, abs=0.02)
    # columns named on the command line are the ones read, even a default's own name, beside
    # another column the defaults would take first (here `tokens`, before `D`)
    g = tmp_path / "both.csv"
    with open(g, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["active_params", "total_params", "experts", "tokens", "D", "loss"])
        w.writerows(zip(r.n_act, r.n_total, r.experts, r.D * 1000, r.D, r.loss))
    fits = {}
    for col in ("D", "tokens"):
        assert main(["scaling", "fit", str(g), "--law", "moe-joint", "--d-col", col, "--json",
                     "--fix", "gamma", "zeta"]) == 0  # fmt: skip
        fits[col] = json.loads(capsys.readouterr().out)["params"]
    assert fits["D"]["alpha"] == pytest.approx(fit["params"]["alpha"], rel=1e-6)
    assert fits["D"]["b"] != pytest.approx(fits["tokens"]["b"], rel=1e-3)
    # a dense fit's flag is refused with an MoE law, not dropped (and the other way round)
    assert main([*argv, "--drop-highest", "3"]) == 2
    assert "--drop-highest" in capsys.readouterr().err
    assert main(["scaling", "fit", str(f), "--fix", "gamma"]) == 2
    assert "add --law" in capsys.readouterr().err


def test_run_directories_give_experts_granularity_and_total(tmp_path):
    """Run directories (config.yaml + metrics.jsonl, as the trainer writes them) are read with
    scaling.io, plus E, G and the granular law's total parameters from the config."""
    from llmtrain.accounting import count
    from llmtrain.scaling.family import Family, write_config
    from llmtrain.scaling.moe import load_moe_runs
    from llmtrain.scaling.moe_sweep import closest_variant, variant

    fam = Family(MOE_FAMILY)
    base = closest_variant(fam, 5e4, 1, 1)[2]
    for E, G in ((1, 1), (4, 2), (16, 1)):
        cfg = variant(base, E, G)
        cfg.train.max_steps, cfg.train.warmup_steps = 3, 1
        rd = tmp_path / f"E{E}G{G}"
        write_config(cfg, rd / "config.yaml")
        recs = [{"step": s, "loss": 5.0 - s - E / 100} for s in (1, 2, 3)]
        (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = load_moe_runs([str(tmp_path)])
    assert len(r) == 3 and sorted(r.experts.tolist()) == [1, 4, 16]
    assert sorted(r.granularity.tolist()) == [1, 1, 2]
    e16 = variant(base, 16, 1)
    c = count(e16.model, seq_len=e16.train.seq_len)  # Krajewski's N: no embedding, no LM head
    assert r.n_total[r.experts == 16][0] == c.total_params - c.embedding_params - c.lm_head_params
    assert c.embedding_params > 0  # (this family ties the head to it)


def test_sweep_collect_keeps_experts_for_the_moe_fit(tmp_path):
    from llmtrain.scaling.moe import read_moe_csv
    from llmtrain.scaling.moe_sweep import plan_moe
    from llmtrain.scaling.sweep import collect

    m = plan_moe(
        [3e11], str(MOE_FAMILY), tmp_path, Law(1.5, 400, 400, 0.34, 0.28), experts=[1, 4, 16]
    )
    for r in m["runs"]:  # fake finished runs, as sweep.is_finished and collect read them
        rd = tmp_path / r["run_dir"]
        (rd / "checkpoints").mkdir(parents=True)
        (rd / "checkpoints" / "latest").write_text(f"step_{r['steps']:08d}")
        (rd / "metrics.jsonl").write_text(json.dumps({"step": r["steps"], "loss": 4.0}) + "\n")
    runs = read_moe_csv(collect(tmp_path))
    assert sorted(runs.experts.tolist()) == [1, 4, 16]
    assert runs.n_total.max() > runs.n_act.max() * 2
    body = sorted(r["body_total_params"] for r in m["runs"])  # the granular law's N, collected
    assert sorted(runs.n_total.tolist()) == body and body[0] < min(
        r["total_params"] for r in m["runs"]
    )
