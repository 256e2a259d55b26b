"""Figures a person can read at a glance: IsoFLOP curves with minima, the compute-optimal
frontier with its bootstrap band, and residuals of the parametric fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmtrain.scaling.fit import Runs, group_budgets


def plot_fits(runs: Runs, results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    ax = axes[0]
    labels = group_budgets(runs.C)
    cmap = plt.get_cmap("viridis")
    groups = np.unique(labels)
    a2 = results.get("approach2")
    for j, g in enumerate(groups):
        sel = labels == g
        col = cmap(j / max(1, len(groups) - 1))
        ax.scatter(
            runs.N[sel], runs.loss[sel], color=col, s=18, label=f"C={runs.C[sel].mean():.2g}"
        )
        if a2 and j < len(a2["minima"]):
            m = a2["minima"][j]
            xs = np.linspace(np.log(runs.N[sel].min()), np.log(runs.N[sel].max()), 100)
            if "coef" in m:
                ax.plot(np.exp(xs), np.polyval(m["coef"], xs), color=col, lw=1.2)
            if not m.get("excluded"):
                ax.plot(m["n_opt"], m["loss_min"], marker="*", color="red", ms=11, mec="k")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("loss")
    ax.set_title("IsoFLOP curves (★ = fitted minimum)")
    if len(groups) <= 12:
        ax.legend(fontsize=7)

    ax = axes[1]
    cgrid = np.logspace(np.log10(runs.C.min()) - 0.5, np.log10(runs.C.max()) + 1, 100)
    for key, color, pts_key in (("approach2", "C1", "minima"), ("approach1", "C2", "envelope")):
        res = results.get(key)
        if not res:
            continue
        pts = [p for p in res[pts_key] if not p.get("excluded")]
        ax.scatter(
            [p["C"] for p in pts],
            [p.get("n_opt", p.get("N")) for p in pts],
            color=color,
            s=22,
            zorder=3,
        )
        ax.plot(cgrid, res["n_coef"] * cgrid ** res["a_exp"], color=color,
                label=f"{key}: N_opt ∝ C^{res['a_exp']:.3f}")  # fmt: skip
        curves = res.get("bootstrap", {}).get("n_curves")
        if curves:
            preds = np.array([k * cgrid**p for p, k in curves])
            lo, hi = np.percentile(preds, [2.5, 97.5], axis=0)
            ax.fill_between(cgrid, lo, hi, color=color, alpha=0.2, label=f"{key} 95% band")
    a3 = results.get("approach3")
    if a3:
        # L(N, D) knows no compute: C = k·N·D at the runs' own k (a sweep counts attention, so
        # its k exceeds 6), for the curve to lie on the axis the other approaches' points use
        k = float(np.median(runs.C / (runs.N * runs.D)))
        law = a3["law"]
        ax.plot(cgrid, [law.allocate(c, k)["n_opt"] for c in cgrid], "k--",
                label=f"approach3: N_opt ∝ C^{law.a:.3f} (C = {k:.3g}·N·D)")  # fmt: skip
        s = a3.get("bootstrap", {}).get("samples")
        rows = [row for row in (s or [])[:300] if min(row[1:5]) > 0]  # A, B, alpha, beta > 0:
        if rows:  # a resample whose exponent is not positive has no optimum to draw
            from llmtrain.scaling.laws import Law

            preds = np.array(
                [[Law(*row[:5]).allocate(c, k)["n_opt"] for c in cgrid] for row in rows]
            )
            lo, hi = np.percentile(preds, [2.5, 97.5], axis=0)
            ax.fill_between(cgrid, lo, hi, color="gray", alpha=0.2, label="approach3 95% band")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute C (FLOPs)")
    ax.set_ylabel("compute-optimal N")
    ax.set_title("Compute-optimal frontier")
    ax.legend(fontsize=7)

    ax = axes[2]
    if a3:
        law = a3["law"]
        resid = np.log(runs.loss) - np.log([law.loss(n, d) for n, d in zip(runs.N, runs.D)])
        sc = ax.scatter(runs.C, resid, c=np.log10(runs.N), s=16, cmap="plasma")
        fig.colorbar(sc, ax=ax, label="log10 N")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"Approach 3 residuals (rms {a3['residual_rms']:.4f})")
    else:
        ax.text(0.5, 0.5, "no approach-3 fit", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("compute C (FLOPs)")
    ax.set_ylabel("log L − log L̂")
    from matplotlib.ticker import NullFormatter

    for a in axes:  # decade labels only: minor labels on log axes overlap
        a.xaxis.set_minor_formatter(NullFormatter())
        a.yaxis.set_minor_formatter(NullFormatter())
    return save_figure(fig, out)


def save_figure(fig, out: str | Path) -> Path:
    """Lay out, write (creating the folder) and close a Matplotlib figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
