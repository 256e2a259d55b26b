"""Fitting scaling laws: Approach 1 (envelope), 2 (IsoFLOP parabolas), 3 (parametric Huber fit).

Approach 3 follows Hoffmann et al. (2022) as replicated by Besiroglu et al. (2024): minimise
the *sum* over runs of Huber_δ(LSE(a − α·ln N, b − β·ln D, e) − ln L), δ = 1e-3, with L-BFGS
from a grid of 4,500 starts; A = eᵃ, B = eᵇ, E = eᵉ. (Averaging instead of summing shrinks the
gradient below L-BFGS's tolerance and stops it at the starting values.) Intervals come from
bootstrap resamples of the runs, each refit from the full-data optimum.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from llmtrain.scaling.laws import Law, ScalingError

DELTA = 1e-3
# rms of log D about its best line in log N below which N and D cannot be told apart (0.1: D/N
# varies by ~10% around a power of N; Chinchilla's runs: ~1)
MIN_RATIO_SPREAD = 0.1
GRID = {
    "alpha": np.arange(0.0, 2.01, 0.5),
    "beta": np.arange(0.0, 2.01, 0.5),
    "e": np.arange(-1.0, 1.01, 0.5),
    "a": np.arange(0.0, 25.1, 5.0),
    "b": np.arange(0.0, 25.1, 5.0),
}
ORDER = ("a", "b", "e", "alpha", "beta")


@dataclass
class Runs:
    """Points of a fit: parameters N, tokens D, compute C, loss; `final` marks end-of-schedule."""

    N: np.ndarray
    D: np.ndarray
    C: np.ndarray
    loss: np.ndarray
    final: np.ndarray
    run: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, mask) -> Runs:
        idx = np.nonzero(mask)[0] if np.asarray(mask).dtype == bool else np.asarray(mask)
        return Runs(self.N[idx], self.D[idx], self.C[idx], self.loss[idx], self.final[idx],
                    [self.run[i] for i in idx] if self.run else [])  # fmt: skip


def _where(r: Runs, idx) -> str:
    """Where the points `idx` came from: file:line (CSV) or run directory, else row numbers."""
    idx = list(idx)[:5]
    if r.run:
        return ", ".join(str(r.run[i]) for i in idx)
    return "row(s) " + ", ".join(str(i) for i in idx)


def check_runs(r: Runs, what: str) -> None:
    for name in ("N", "D", "C", "loss"):
        v = getattr(r, name)
        bad = np.nonzero(~np.isfinite(v))[0]
        if len(bad):
            raise ScalingError(f"{what}: {name} is NaN or infinite at {_where(r, bad)}; "
                               "drop those runs (a crashed run has no final loss)")  # fmt: skip
        bad = np.nonzero(v <= 0)[0]
        if len(bad):
            raise ScalingError(f"{what}: {name} must be positive; it is not at {_where(r, bad)}")


# ---------------------------------------------------------------- Approach 3


def _objective(theta, logN, logD, logL, reduce: str = "sum"):
    a, b, e, alpha, beta = theta
    x = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)])
    m = x.max(axis=0)
    ex = np.exp(x - m)
    s = ex.sum(axis=0)
    lse = m + np.log(s)
    w = ex / s
    r = lse - logL
    small = np.abs(r) <= DELTA
    h = np.where(small, 0.5 * r * r, DELTA * (np.abs(r) - 0.5 * DELTA))
    dh = np.where(small, r, DELTA * np.sign(r))
    g = np.array([
        (dh * w[0]).sum(), (dh * w[1]).sum(), (dh * w[2]).sum(),
        -(dh * w[0] * logN).sum(), -(dh * w[1] * logD).sum(),
    ])  # fmt: skip
    if reduce == "mean":
        return h.mean(), g / len(r)
    return h.sum(), g


TIGHT = {"gtol": 1e-10, "ftol": 1e-15, "maxiter": 10000}


def _minimize(x0, logN, logD, logL, reduce="sum", tight: bool = False):
    """L-BFGS-B. The grid search runs at scipy's default tolerances; the winner and every
    bootstrap refit are polished with tight ones (at the defaults a refit started from the
    optimum stops almost at once, and the intervals come out ~30x too narrow)."""
    return minimize(_objective, x0, args=(logN, logD, logL, reduce), jac=True, method="L-BFGS-B",
                    options=TIGHT if tight else None)  # fmt: skip


def _law(theta, name="fit") -> Law:
    a, b, e, alpha, beta = theta
    return Law(
        E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta), name=name
    )


def grid_search(logN, logD, logL, reduce: str = "sum", progress: bool = False):
    """L-BFGS from every start of Hoffmann's grid at default tolerances; the best result."""
    starts = list(itertools.product(*(GRID[k] for k in ORDER)))
    best, n_ok = None, 0
    it = starts
    if progress:
        from tqdm import tqdm

        it = tqdm(starts, desc="approach 3 grid", unit="start", leave=False)
    for x0 in it:
        res = _minimize(np.array(x0, dtype=float), logN, logD, logL, reduce)
        if res.success or res.status == 0:
            n_ok += 1
        if best is None or res.fun < best.fun:
            best = res
    if best is None or not np.all(np.isfinite(best.x)) or n_ok == 0:
        raise ScalingError("approach 3 did not converge from any starting point; check the data")
    return best, n_ok, len(starts)


def single_threaded_blas(fn):
    """Run `fn` with BLAS on one thread: scipy's L-BFGS-B calls BLAS on vectors of 5-9
    parameters, and OpenBLAS threads on a busy machine made each iteration ~60-90x slower
    (the 4,500-start Approach-3 fit: 6 starts/s instead of 370)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapper


@single_threaded_blas
def fit_approach3(
    r: Runs, bootstrap: int = 0, seed: int = 0, reduce: str = "sum", progress: bool = False
) -> dict:
    check_runs(r, "approach 3")
    if len(r) < 10:
        raise ScalingError(
            f"approach 3 fits 5 parameters; {len(r)} runs are too few (give at least 10)"
        )
    if len(np.unique(r.N)) < 3 or len(np.unique(r.D)) < 3:
        raise ScalingError(
            "approach 3 needs at least 3 distinct model sizes and 3 distinct token counts"
        )
    logN, logD, logL = np.log(r.N), np.log(r.D), np.log(r.loss)
    spread = float(np.std(logD - np.polyval(np.polyfit(logN, logD, 1), logN)))
    if spread < MIN_RATIO_SPREAD:  # D a power of N (a ladder at 20 tokens a parameter)
        raise ScalingError(
            f"approach 3 cannot tell the model-size term from the data term: the runs' token "
            f"counts follow their model sizes (log D off a line in log N by {spread:.3f} rms), so "
            "any split of the loss between A/N^alpha and B/D^beta fits (and bootstrap intervals "
            "read narrow); add runs at other tokens per parameter (an IsoFLOP sweep: `llmtrain "
            "scaling sweep plan`), or fit approach 1"
        )
    best, n_ok, n_starts = grid_search(logN, logD, logL, reduce, progress)
    grid_theta = best.x.copy()
    polished = _minimize(best.x, logN, logD, logL, reduce, tight=True)
    if polished.fun <= best.fun:
        best = polished
    theta = best.x
    law = _law(theta)
    if not (law.alpha > 0 and law.beta > 0):  # A, B, E are exponentials: positive
        raise ScalingError(
            f"approach 3's best fit has alpha={law.alpha:.4g}, beta={law.beta:.4g}: in these runs "
            "loss does not fall with both model size and data (larger runs under-trained or "
            "mis-tuned?), so no compute-optimal allocation follows; check the runs, or fit "
            "approach 2 (IsoFLOP parabolas)"
        )
    edge = []
    for k, v in zip(ORDER, theta):
        lo, hi = GRID[k].min(), GRID[k].max()
        if v <= lo + 1e-6 or v >= hi - 1e-6:
            edge.append(k)
    pred = np.log([law.loss(n, d) for n, d in zip(r.N, r.D)])
    out = {
        "params": {
            "E": law.E,
            "A": law.A,
            "B": law.B,
            "alpha": law.alpha,
            "beta": law.beta,
            "a_exp": law.a,
            "b_exp": law.b,
            "G": law.G,
        },  # fmt: skip
        "theta": dict(zip(ORDER, map(float, theta))),
        "objective": float(best.fun),
        "n_runs": len(r),
        "starts": n_starts,
        "grid_best": _law(grid_theta).to_json(),
        "starts_converged": n_ok,
        "on_grid_edge": edge,
        "residual_rms": float(np.sqrt(np.mean((logL - pred) ** 2))),
        "reduce": reduce,
    }
    if bootstrap:
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(bootstrap):
            idx = rng.integers(0, len(r), len(r))
            res = _minimize(theta.copy(), logN[idx], logD[idx], logL[idx], reduce, tight=True)
            bl = _law(res.x)
            samples.append([bl.E, bl.A, bl.B, bl.alpha, bl.beta, bl.a, bl.b])
        s = np.array(samples)
        names = ("E", "A", "B", "alpha", "beta", "a_exp", "b_exp")
        out["bootstrap"] = {
            "resamples": bootstrap,
            "seed": seed,
            "ci95": {
                n: [float(np.percentile(s[:, i], 2.5)), float(np.percentile(s[:, i], 97.5))]
                for i, n in enumerate(names)
            },
            "samples": s.tolist(),
        }
    out["law"] = law
    return out


# ---------------------------------------------------------------- Approach 2


def group_budgets(C: np.ndarray, rel_tol: float = 0.05) -> np.ndarray:
    """Label runs by compute budget: budgets within `rel_tol` of each other are one group."""
    order = np.argsort(C)
    labels = np.empty(len(C), dtype=int)
    g, ref = -1, None
    for i in order:
        if ref is None or C[i] > ref * (1 + rel_tol):
            g, ref = g + 1, C[i]
        labels[i] = g
    return labels


def _powerlaw(x, y):
    """y = k·x^p by least squares in log space; returns (p, k)."""
    p, logk = np.polyfit(np.log(x), np.log(y), 1)
    with np.errstate(over="ignore"):  # a degenerate bootstrap draw: inf, not an exception
        return float(p), float(np.exp(logk))


def _frontier_bootstrap(fits: list[tuple], seed: int) -> dict:
    """Intervals of the N_opt and D_opt exponents over resampled frontiers (C, N_opt, D_opt)."""
    if not fits:
        raise ScalingError(
            "no bootstrap resample could be fitted; the data are too few or too flat"
        )
    laws_n = [_powerlaw(c, n) for c, n, _ in fits]
    sa = [p for p, _ in laws_n]
    sb = [_powerlaw(c, d)[0] for c, _, d in fits]
    return {"resamples": len(fits), "seed": seed,
            "ci95": {"a_exp": np.percentile(sa, [2.5, 97.5]).tolist(), "b_exp": np.percentile(sb, [2.5, 97.5]).tolist()},
            "n_curves": laws_n}  # fmt: skip


FAR_OUTSIDE = 1.0  # a vertex more than this many spans (in log N) beyond the sizes tried


def _isoflop_minima(r: Runs, labels, k: float) -> list[dict]:
    """One parabola in log N per budget. A budget that cannot give a minimum (under 3 sizes, no
    upward curvature, a vertex far outside the sizes tried or under/overflowing) is returned with
    `excluded` set to the reason rather than raised: the other budgets still make a frontier."""
    out = []
    for g in np.unique(labels):
        sel = labels == g
        c = float(np.exp(np.mean(np.log(r.C[sel]))))
        m = {"C": c, "n_runs": int(sel.sum()), "inside_range": False, "excluded": None}
        out.append(m)
        x, y = np.log(r.N[sel]), r.loss[sel]
        if len(np.unique(x)) < 3:
            m["excluded"] = (f"{len(np.unique(x))} distinct model size(s); an IsoFLOP parabola "
                             "needs >= 3")  # fmt: skip
            continue
        c2, c1, c0 = np.polyfit(x, y, 2)
        m["coef"] = [float(c2), float(c1), float(c0)]
        if not c2 > 0:
            m["excluded"] = ("the losses do not curve upward in log N (no minimum); add sizes on "
                             "both sides of the optimum")  # fmt: skip
            continue
        xs = -c1 / (2 * c2)
        span = max(x.max() - x.min(), 1e-12)
        m["inside_range"] = bool(x.min() <= xs <= x.max())
        with np.errstate(over="ignore", under="ignore"):
            n_opt = float(np.exp(xs))
        if xs < x.min() - FAR_OUTSIDE * span or xs > x.max() + FAR_OUTSIDE * span:
            m["excluded"] = (f"the parabola's minimum (N={n_opt:.3g}) lies far outside the sizes "
                             f"tried ({np.exp(x.min()):.3g} to {np.exp(x.max()):.3g}); add sizes "
                             "towards it")  # fmt: skip
            continue
        if not (math.isfinite(n_opt) and n_opt > 0):
            m["excluded"] = "the parabola's minimum is not a finite model size"
            continue
        # D at the optimum from the budget's own runs (log D linear in log N at a fixed budget):
        # C/(6·N_opt) would mix conventions when C counts attention (sweeps, run directories)
        pd, qd = np.polyfit(x, np.log(r.D[sel]), 1)
        d_opt = float(np.exp(qd + pd * xs)) if np.ptp(np.log(r.D[sel])) > 0 else c / (k * n_opt)
        m.update(n_opt=n_opt, d_opt=d_opt, loss_min=float(c0 - c1 * c1 / (4 * c2)))
    return out


def fit_approach2(r: Runs, bootstrap: int = 0, seed: int = 0, k: float = 6.0) -> dict:
    """Power laws N_opt ∝ C^a, D_opt ∝ C^b through the budgets' parabola minima. Budgets without
    a usable minimum are listed under `excluded` (and in each minimum's `excluded`), not fitted;
    two usable budgets are needed."""
    check_runs(r, "approach 2")
    labels = group_budgets(r.C)
    if len(np.unique(labels)) < 2:
        raise ScalingError("approach 2 needs runs at two or more compute budgets (found one)")
    minima = _isoflop_minima(r, labels, k)
    used = [i for i, m in enumerate(minima) if m["excluded"] is None]
    excluded = [f"C≈{m['C']:.3g}: {m['excluded']}" for m in minima if m["excluded"]]
    if len(used) < 2:
        raise ScalingError(
            f"approach 2 found {len(used)} budget(s) with a usable IsoFLOP minimum and needs 2; "
            + "; ".join(excluded)
        )
    Cs = np.array([minima[i]["C"] for i in used])
    a, ka = _powerlaw(Cs, [minima[i]["n_opt"] for i in used])
    b, kb = _powerlaw(Cs, [minima[i]["d_opt"] for i in used])
    out = {
        "minima": minima,
        "a_exp": a,
        "n_coef": ka,
        "b_exp": b,
        "d_coef": kb,
        "n_budgets": len(used),
        "excluded": excluded,
    }
    if bootstrap:
        out["bootstrap"] = _isoflop_bootstrap(r, labels, minima, used, bootstrap, seed, k)
    return out


def _isoflop_bootstrap(r: Runs, labels, minima, used, bootstrap: int, seed: int, k: float):
    """Residual bootstrap of the IsoFLOP parabolas: the sizes tried stay as they are (resampling
    runs would often leave a budget under 3 distinct sizes and drop it, making the interval
    conditional on the budgets that survived); each budget's losses become its fitted parabola
    plus residuals drawn from all usable budgets (degrees-of-freedom corrected). A resample
    uses every budget whose parabola still has a usable minimum, as the point estimate does."""
    rng = np.random.default_rng(seed)
    groups = np.unique(labels)[used]
    fitted = {}
    pooled = []
    for g, i in zip(groups, used):
        sel = np.nonzero(labels == g)[0]
        yhat = np.polyval(minima[i]["coef"], np.log(r.N[sel]))
        fitted[g] = (sel, yhat)
        n = len(sel)
        if n > 3:
            pooled.append((r.loss[sel] - yhat) * math.sqrt(n / (n - 3)))
    if not pooled:
        return {"resamples": 0, "seed": seed, "ci95": {}, "residual_df": 0,
                "method": "residual (pooled, df-corrected)",
                "note": "no interval: every budget has exactly 3 model sizes, so its parabola "
                        "leaves no residual to resample; give 4 or more sizes a budget"}  # fmt: skip
    res = np.concatenate(pooled)
    idx = np.concatenate([fitted[g][0] for g in groups])
    fits, short = [], 0
    for _ in range(bootstrap):
        sub = r.subset(idx)
        sub.loss = np.concatenate([fitted[g][1] + rng.choice(res, len(fitted[g][0]))
                                   for g in groups])  # fmt: skip
        mm = [m for m in _isoflop_minima(sub, labels[idx], k) if m["excluded"] is None]
        if len(mm) < 2:
            short += 1
            continue
        fits.append(tuple(np.array([m[key] for m in mm]) for key in ("C", "n_opt", "d_opt")))
    out = _frontier_bootstrap(fits, seed)
    out["method"] = "residual (pooled, df-corrected)"
    out["residual_df"] = int(sum(len(p) for p in pooled))
    out["failed_resamples"] = short
    return out


# ---------------------------------------------------------------- Approach 1


def fit_approach1(
    r: Runs, bootstrap: int = 0, seed: int = 0, k: float = 6.0, allow_intermediate: bool = False
) -> dict:
    """Lower envelope of loss against compute over finished runs, then power laws in C.

    A checkpoint in the middle of a decaying schedule is not the loss a run of that length
    would reach, so by default only end-of-schedule points count.
    """
    check_runs(r, "approach 1")
    pts = r if allow_intermediate else r.subset(r.final)
    note = ("all checkpoints used (intermediate points of a decaying schedule overstate the loss of a "
            "finished run of that length)" if allow_intermediate else
            f"only end-of-schedule points used: {len(pts)} of {len(r)} points are finished runs")  # fmt: skip

    if len(pts) == 0:
        raise ScalingError(
            "approach 1 found no finished run (portion_steps_elapsed < 1 everywhere); "
            "give finished runs or pass --intermediate to use every checkpoint"
        )

    env = _envelope(pts)
    if len(env) < 3 or env.C.max() / env.C.min() < 3:
        raise ScalingError(f"approach 1 found {len(env)} envelope points over a compute range of "
                           f"{env.C.max() / env.C.min():.2g}x; it needs >= 3 spanning a wider range")  # fmt: skip
    a, ka = _powerlaw(env.C, env.N)
    b, kb = _powerlaw(env.C, env.D)
    out = {"note": note, "envelope": [{"C": float(c), "N": float(n), "D": float(d), "loss": float(l)}
                                      for c, n, d, l in zip(env.C, env.N, env.D, env.loss)],
           "a_exp": a, "n_coef": ka, "b_exp": b, "d_coef": kb}  # fmt: skip
    if bootstrap:
        # pairs bootstrap of the power-law fits over the envelope points. Resampling all points
        # and taking the envelope again is biased: a resample's minimum loss at a budget is
        # never below the full data's, and its interval excluded the estimate (Li et al. data)
        rng = np.random.default_rng(seed)
        fits = []
        for _ in range(bootstrap):
            i = rng.integers(0, len(env), len(env))
            if len(np.unique(env.C[i])) >= 2:
                fits.append((env.C[i], env.N[i], env.D[i]))
        out["bootstrap"] = _frontier_bootstrap(fits, seed)
        out["bootstrap"]["method"] = "pairs over the envelope points"
    return out


def _envelope(p: Runs) -> Runs:
    """The lowest loss reached at each compute budget, kept where it beats every smaller budget:
    one point per budget, whatever the row order. A budget is a group of runs within 5% in C
    (`group_budgets`): runs a sweep collects at one budget differ slightly in C (1.00048e12,
    1.0011e12, 1.0016e12: tokens are whole steps), and kept apart, two of them 0.1% apart in C
    set the power-law slope (bootstrap draws of such a pair overflowed)."""
    group = group_budgets(p.C)
    order = np.lexsort((p.loss, group))  # by budget, then loss: the first of each is its minimum
    keep, best, last = [], np.inf, None
    for i in order:
        if group[i] == last:
            continue
        last = group[i]
        if p.loss[i] < best:
            best = p.loss[i]
            keep.append(i)
    return p.subset(np.array(keep, dtype=int))
