"""Mixture-of-experts scaling laws: the fine-grained law of Krajewski et al. (2024) and the joint
law of Ludziejewski et al. (2025), their compute- and memory-constrained allocations, and fits of
both forms to runs that vary experts E and granularity G.

Names: n_act active parameters, n_tot total parameters, D tokens, E experts (the expansion rate
total/active routed parameters: E experts with top-1 routing, or n_routed/top_k), G granularity
(dense FFN width / expert width; a token goes to G experts of 1/G the width).

Fits use the dense fit's loss (llmtrain.scaling.fit): the *sum* of Huber(δ=1e-3) on log loss,
L-BFGS-B from a grid of starts, polish and bootstrap refits at tight tolerances. Both laws are
sums of exponentials of functions linear in the fitted parameters (a, b, c, g in logs), so one
objective, log-sum-exp over terms, serves both; for the dense form it is fit._objective exactly.
"""

from __future__ import annotations

import csv
import itertools
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import brentq, minimize, minimize_scalar

from llmtrain.scaling.fit import (
    DELTA,
    TIGHT,
    Runs,
    check_runs,
    group_budgets,
    single_threaded_blas,
)
from llmtrain.scaling.laws import Law, ScalingError
from llmtrain.scaling.registry import get_spec

POW2 = tuple(2**k for k in range(11))  # granularities the allocation searches: 1 .. 1024
LUDZIEJEWSKI_EXPERTS = (1, 2, 4, 8, 16, 32)  # the expert counts the paper trained

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- Ludziejewski et al. 2025


@dataclass(frozen=True)
class JointLaw:
    """L = a·Ê^δ·N_act^(α+γ ln Ê) + b·Ê^ω·D^(β+ζ ln Ê) + c; α, β < 0 as the paper prints them."""

    a: float
    alpha: float
    delta: float
    gamma: float
    b: float
    beta: float
    omega: float
    zeta: float
    E_start: float
    E_max: float
    c: float
    name: str = "custom"
    vocab: int = 50257
    width_per_block: int = 64

    def ehat(self, E):
        """Eq. 4: Ê = 1 / (1/(E − 1 + (1/E_start − 1/E_max)⁻¹) + 1/E_max); Ê(1) = E_start."""
        E = np.asarray(E, dtype=float)
        return 1.0 / (
            1.0 / (E - 1.0 + 1.0 / (1.0 / self.E_start - 1.0 / self.E_max)) + 1.0 / self.E_max
        )

    def reduced(self, E: float) -> Law:
        """The law at fixed E in Chinchilla form (the paper's Table 4), as a dense Law."""
        le = math.log(float(self.ehat(E)))
        m, mu = self.a * math.exp(self.delta * le), self.alpha + self.gamma * le
        n, nu = self.b * math.exp(self.omega * le), self.beta + self.zeta * le
        return Law(E=self.c, A=m, B=n, alpha=-mu, beta=-nu, name=f"{self.name}@E={E:g}")

    def loss(self, n_act, d, E):
        le = np.log(self.ehat(E))
        return (self.a * np.exp(self.delta * le) * np.power(n_act, self.alpha + self.gamma * le)
                + self.b * np.exp(self.omega * le) * np.power(d, self.beta + self.zeta * le) + self.c)  # fmt: skip

    # Parameter counting of App. A (embeddings included, n_blocks = d/64, SwiGLU 3d hidden).
    def d_model(self, n_act: float) -> float:
        V, w = self.vocab, self.width_per_block
        if n_act <= 0:
            raise ScalingError("active parameters must be positive")
        return brentq(lambda d: 2 * d * V + 13 * d**3 / w - n_act, 1e-9, 1e7)

    def total_params(self, n_act: float, E: float) -> float:
        d = self.d_model(n_act)
        return 2 * d * self.vocab + (4 + 9 * E) * d**3 / self.width_per_block

    def memory_bytes(self, n_act: float, E: float, kv_tokens: int = 0, nbytes: int = 2) -> float:
        """Weights plus a KV cache of 2·T·n_blocks·d values (Sec. 4.3), `nbytes` each."""
        d = self.d_model(n_act)
        return nbytes * (
            self.total_params(n_act, E) + 2 * kv_tokens * (d / self.width_per_block) * d
        )

    def allocate(self, flops: float, E: float = 1) -> dict:
        law = self.reduced(E)
        a = law.allocate(flops)
        return {"flops": flops, "experts": E, "n_act": a["n_opt"], "tokens": a["d_opt"],
                "n_total": self.total_params(a["n_opt"], E), "loss": a["loss"],
                "tokens_per_param": a["tokens_per_param"],
                "method": f"closed form at fixed E (Chinchilla form, Hoffmann et al. eq. 4): "
                          f"m = a·Ê^δ = {law.A:.4g}, μ = α+γ ln Ê = {-law.alpha:.4f}, "
                          f"n = b·Ê^ω = {law.B:.4g}, ν = β+ζ ln Ê = {-law.beta:.4f}; {a['closed_form']}"}  # fmt: skip

    def allocate_memory(self, flops: float, memory_bytes: float, experts=LUDZIEJEWSKI_EXPERTS,
                        kv_tokens: int = 16384, nbytes: int = 2) -> dict:  # fmt: skip
        """Sec. 4.3: per E, the compute-optimal N_act, or the largest N_act whose weights and KV
        cache fit in memory if that is smaller (a larger, undertrained model is worse in loss and
        memory); then the E with the lowest loss."""
        rows = []
        for E in experts:
            opt = self.allocate(flops, E)
            fits = lambda n, E=E: self.memory_bytes(n, E, kv_tokens, nbytes) - memory_bytes  # noqa: E731
            if fits(1e3) > 0:
                continue  # not even a 1K-parameter model fits
            n_max = brentq(fits, 1e3, 1e16, xtol=1.0)
            n = min(opt["n_act"], n_max)
            d = flops / (6 * n)
            rows.append({"experts": E, "n_act": n, "tokens": d, "n_total": self.total_params(n, E),
                         "loss": float(self.loss(n, d, E)), "memory_bound": n_max < opt["n_act"],
                         "memory_bytes": self.memory_bytes(n, E, kv_tokens, nbytes)})  # fmt: skip
        if not rows:
            raise ScalingError(f"no model fits in {memory_bytes / 1e9:.3g} GB; raise --memory")
        best = min(rows, key=lambda r: r["loss"])
        return {**best, "flops": flops, "per_experts": rows, "kv_tokens": kv_tokens,
                "method": "per E: N_act = min(compute-optimal, largest fitting memory) by Brent's "
                          "root finder (scipy.optimize.brentq); the E with the lowest loss"}  # fmt: skip


# ---------------------------------------------------------------- Krajewski et al. 2024


@dataclass(frozen=True)
class GranularLaw:
    """L = c + (g/G^γ + a)/N^α + b/D^β, N total non-embedding parameters, expansion E fixed."""

    a: float
    alpha: float
    b: float
    beta: float
    g: float
    gamma: float
    c: float
    name: str = "custom"
    expansion: float = 64
    c_f: float = 6.0
    c_r: float = 14.0
    width_per_block: int = 64

    def loss(self, n_total, d, G):
        return self.c + (self.g / np.power(G, self.gamma) + self.a) / np.power(n_total, self.alpha) + self.b / np.power(d, self.beta)  # fmt: skip

    def shape(self, n_blocks: float) -> dict:
        d = self.width_per_block * n_blocks
        return {
            "n_blocks": n_blocks,
            "d_model": d,
            "n_act": 12 * d * d * n_blocks,
            "n_total": d * d * (8 * self.expansion + 4) * n_blocks,
        }

    def flops_per_token(self, n_blocks: float, G: float) -> float:
        d = self.width_per_block * n_blocks
        return (12 * d * d * self.c_f + d * self.expansion * G * self.c_r) * n_blocks

    def _best_at(self, flops: float, G: float) -> tuple[float, float]:
        def f(x):
            nb = math.exp(x)
            return float(
                self.loss(self.shape(nb)["n_total"], flops / self.flops_per_token(nb, G), G)
            )

        r = minimize_scalar(f, bounds=(-5.0, 12.0), method="bounded", options={"xatol": 1e-10})
        return float(r.fun), math.exp(r.x)

    def allocate(self, flops: float, G: float | None = None, choices=POW2) -> dict:
        """Minimise L over n_blocks (Brent, bounded) for each G; the best G unless one is given."""
        if flops <= 0:
            raise ScalingError(f"compute must be positive, got {flops}")
        best = None
        for g in [G] if G else choices:
            loss, nb = self._best_at(flops, g)
            if best is None or loss < best[0]:
                best = (loss, nb, g)
        loss, nb, g = best
        s = self.shape(nb)
        fpt = self.flops_per_token(nb, g)
        return {"flops": flops, "granularity": g, "experts": self.expansion * g,
                "expansion": self.expansion, "top_k": g, **s, "tokens": flops / fpt,
                "flops_per_token": fpt, "loss": loss,
                "method": "scipy.optimize.minimize_scalar (bounded Brent) over n_blocks with "
                          "d_model = 64·n_blocks, " + ("G fixed" if G else
                          f"for each G in {{{choices[0]}..{choices[-1]}}} (powers of 2), best G")}  # fmt: skip

    def for_active(self, n_act: float, choices=POW2) -> dict:
        """The budget whose compute-optimal model has `n_act` active parameters (Table 2 rows)."""
        f = lambda lf: math.log(self.allocate(10**lf, choices=choices)["n_act"] / n_act)  # noqa: E731
        return self.allocate(10 ** brentq(f, 10, 35, xtol=1e-9), choices=choices)


def load_moe_law(name: str):
    spec = get_spec(name)
    k = spec.coefficients
    if spec.kind == "joint":
        return JointLaw(**k, name=name, vocab=spec.constants["vocab"])
    if spec.kind == "granular":
        c = spec.constants
        return GranularLaw(**k, name=name, expansion=c["expansion"], c_f=c["c_f"], c_r=c["c_r"],
                           width_per_block=c["width_per_block"])  # fmt: skip
    raise ScalingError(
        f"law {name!r} is a dense law; MoE allocation needs krajewski2024* or ludziejewski2025"
    )


# ---------------------------------------------------------------- runs that vary E and G


@dataclass
class MoERuns:
    n_act: np.ndarray
    n_total: np.ndarray
    experts: np.ndarray  # expansion: n_routed / top_k (1 for dense)
    granularity: np.ndarray
    D: np.ndarray
    loss: np.ndarray
    final: np.ndarray
    run: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, mask) -> MoERuns:
        idx = np.nonzero(mask)[0] if np.asarray(mask).dtype == bool else np.asarray(mask)
        return MoERuns(*(getattr(self, f)[idx] for f in ("n_act", "n_total", "experts", "granularity",
                       "D", "loss", "final")), [self.run[i] for i in idx] if self.run else [])  # fmt: skip

    def check(self, what: str) -> None:
        check_runs(Runs(self.n_act, self.D, 6 * self.n_act * self.D, self.loss, self.final), what)
        for name in ("n_total", "experts", "granularity"):
            v = getattr(self, name)
            if not np.all(np.isfinite(v)) or np.any(v <= 0):
                raise ScalingError(f"{what}: {name} must be positive and finite in every row")
        if np.any(self.experts < 1) or np.any(self.granularity < 1):
            raise ScalingError(f"{what}: experts and granularity must be >= 1 (dense: E = G = 1)")


COLUMNS = {  # accepted names, first match wins
    "n_act": ("active_params", "n_act", "N_act", "active", "N"),
    "n_total": ("body_total_params", "total_params", "n_total", "N_total", "total"),
    "experts": ("experts", "E", "n_experts", "expansion"),
    "granularity": ("granularity", "G"),
    "D": ("tokens", "D"),
    "loss": ("loss", "val_loss", "L"),
}


def read_moe_csv(path: Path, **override: str | None) -> MoERuns:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ScalingError(f"{path} holds no rows")
    have = set(rows[0])
    col = {}
    for key, names in COLUMNS.items():
        names = (override[key],) if override.get(key) else names
        col[key] = next((n for n in names if n in have), None)
        if col[key] is None and key not in ("granularity", "n_total"):
            raise ScalingError(f"{path}: no {key} column (tried {', '.join(names)}; columns: "
                               f"{sorted(have)}); name it with --{key.replace('_', '-')}-col")  # fmt: skip

    def num(row, key, i, default=math.nan):
        if col[key] is None:
            return default
        try:
            return float(row[col[key]])
        except (TypeError, ValueError) as e:
            raise ScalingError(f"{path}:{i}: column {col[key]!r} holds {row[col[key]]!r}") from e

    vals = {k: np.array([num(r, k, i + 2, 1.0 if k == "granularity" else math.nan)
                         for i, r in enumerate(rows)]) for k in COLUMNS}  # fmt: skip
    if col["n_total"] is None:
        vals["n_total"] = vals["n_act"] * vals["experts"]
        logger.warning("%s has no total-parameters column: N_total is estimated as N_act × E, "
                       "which overstates it (attention and shared parts are not multiplied); "
                       "give --total-col for the granular law", path)  # fmt: skip
    return MoERuns(vals["n_act"], vals["n_total"], vals["experts"], vals["granularity"], vals["D"],
                   vals["loss"], np.ones(len(rows), bool), [f"{path}:{i + 2}" for i in range(len(rows))])  # fmt: skip


def moe_shape(model) -> dict:
    """Experts (expansion n_routed/top_k), granularity (dense FFN width / expert width), top-k."""
    if model.n_routed_experts == 0 or model.num_layers <= model.first_k_dense_replace:
        return {"experts": 1.0, "granularity": 1.0, "top_k": 0}
    return {"experts": model.n_routed_experts / model.num_experts_per_tok,
            "granularity": model.intermediate_size / model.moe_intermediate_size,
            "top_k": model.num_experts_per_tok}  # fmt: skip


def body_total_params(c) -> int:
    """Total parameters outside the vocabulary matrices (input embedding, LM head): Krajewski et
    al.'s N, d²·(8E + 4)·n_blocks. With them the granular law's N of a small model is 3-4x
    larger (the debug family's), which bends the fitted size dependence."""
    return c.total_params - c.embedding_params - c.lm_head_params


def read_moe_run_dir(path: Path) -> MoERuns:
    """A run directory as llmtrain.scaling.io reads it, plus E, G and the granular law's total
    parameters (`body_total_params`) from config.yaml."""
    from llmtrain.accounting import count
    from llmtrain.config import load_config
    from llmtrain.scaling.io import read_run_dir

    r = read_run_dir(path)
    cfg = load_config(path / "config.yaml")
    s = moe_shape(cfg.model)
    n = len(r)
    tot = body_total_params(count(cfg.model, seq_len=cfg.train.seq_len))
    return MoERuns(r.N, np.full(n, float(tot)), np.full(n, s["experts"]),
                   np.full(n, s["granularity"]), r.D, r.loss, r.final, r.run)  # fmt: skip


def load_moe_runs(paths: list[str], final_only: bool = True, **cols) -> MoERuns:
    parts = []
    for p in map(Path, paths):
        if p.is_file():
            parts.append(read_moe_csv(p, **cols))
        elif (p / "metrics.jsonl").is_file():
            parts.append(read_moe_run_dir(p))
        elif p.is_dir():
            subs = sorted(p.rglob("metrics.jsonl"))
            if not subs:
                raise ScalingError(f"{p} holds no CSV and no finished run (no metrics.jsonl under "
                                   "it); a planned sweep: run `llmtrain scaling sweep run "
                                   f"{p}` first")  # fmt: skip
            parts.extend(read_moe_run_dir(q.parent) for q in subs)
        else:
            raise ScalingError(f"{p} does not exist")
    fields = ("n_act", "n_total", "experts", "granularity", "D", "loss", "final")
    r = MoERuns(*(np.concatenate([getattr(x, f) for x in parts]) for f in fields),
                [n for x in parts for n in x.run])  # fmt: skip
    return r.subset(r.final) if final_only else r


# ---------------------------------------------------------------- fitting


def lse_huber(theta, X_KTP, logL, delta: float = DELTA):
    """Σ_t Huber_δ(log Σ_k exp(X_k[t]·θ) − log L_t) and its gradient in θ."""
    x_KT = X_KTP @ theta
    m_T = x_KT.max(axis=0)
    ex_KT = np.exp(x_KT - m_T)
    s_T = ex_KT.sum(axis=0)
    w_KT = ex_KT / s_T
    r_T = m_T + np.log(s_T) - logL
    small = np.abs(r_T) <= delta
    h = np.where(small, 0.5 * r_T * r_T, delta * (np.abs(r_T) - 0.5 * delta))
    dh_T = np.where(small, r_T, delta * np.sign(r_T))
    return h.sum(), np.einsum("t,kt,ktp->p", dh_T, w_KT, X_KTP)


@dataclass(frozen=True)
class Form:
    name: str
    params: tuple[str, ...]  # θ order; a, b, c, g are fitted as logs
    grid: dict[str, tuple[float, ...]]
    paper_grid: dict[str, tuple[float, ...]]


LOGGED = ("a", "b", "c", "g")
JOINT = Form("moe-joint", ("a", "delta", "alpha", "gamma", "b", "omega", "beta", "zeta", "c"),
             # 108 starts (the fit runs on centred logs); interactions start at 0
             {"a": (30.0, 300.0), "b": (30.0, 300.0), "c": (0.5, 1.0, 2.0), "alpha": (-0.1, -0.3, -0.6),
              "beta": (-0.1, -0.3, -0.6), "delta": (0.0,), "gamma": (0.0,), "omega": (0.0,), "zeta": (0.0,)},
             # App. B of Ludziejewski et al. 2025: 3^9 starts
             {"a": (30.0, 100.0, 300.0), "b": (30.0, 100.0, 300.0), "c": (0.5, 1.0, 2.0),
              "alpha": (-0.05, -0.25, -0.5), "beta": (-0.05, -0.25, -0.5), "delta": (-0.5, 0.0, 0.5),
              "gamma": (-0.5, 0.0, 0.5), "omega": (-0.5, 0.0, 0.5), "zeta": (-0.5, 0.0, 0.5)})  # fmt: skip
GRANULAR = Form("moe-granular", ("g", "gamma", "alpha", "a", "b", "beta", "c"),
                {"g": (1.0, 10.0), "gamma": (0.3, 1.0), "alpha": (0.1, 0.4), "a": (10.0, 100.0),
                 "b": (10.0, 100.0), "beta": (0.1, 0.4), "c": (0.5, 1.5)},
                {"g": (1.0, 3.0, 10.0), "gamma": (0.3, 0.6, 1.0), "alpha": (0.1, 0.3, 0.6),
                 "a": (3.0, 30.0, 300.0), "b": (3.0, 30.0, 300.0), "beta": (0.1, 0.3, 0.6),
                 "c": (0.5, 1.0, 2.0)})  # fmt: skip
FORMS = {f.name: f for f in (JOINT, GRANULAR)}


def _to_theta(name, v):
    return math.log(v) if name in LOGGED else float(v)


def _from_theta(name, t):
    return math.exp(t) if name in LOGGED else float(t)


def centering(form: Form, r: MoERuns) -> tuple[tuple[float, ...], list[tuple[str, str, float]]]:
    """Fits run on logs centred at the runs' means (far better conditioned); in centred
    coordinates θc[k] = θ[k] + s·θ[dep] for these (k, dep, s), every other entry unchanged."""
    mN, mD, mT = (float(np.mean(np.log(x))) for x in (r.n_act, r.D, r.n_total))
    if form is JOINT:
        return (mN, mD, mT), [("a", "alpha", mN), ("delta", "gamma", mN), ("b", "beta", mD),
                              ("omega", "zeta", mD)]  # fmt: skip
    return (mN, mD, mT), [("g", "alpha", -mT), ("a", "alpha", -mT), ("b", "beta", -mD)]


def _shift(form: Form, th, pairs, sign: int):
    out = np.array(th, dtype=float)
    for k, dep, s in pairs:
        out[form.params.index(k)] += sign * s * out[form.params.index(dep)]
    return out


def design(
    form: Form, r: MoERuns, E_start: float, E_max: float, centers=(0.0, 0.0, 0.0)
) -> np.ndarray:
    """X_KTP: each term's log as a linear function of θ, per run (logs minus `centers`)."""
    lN, lD = np.log(r.n_act) - centers[0], np.log(r.D) - centers[1]
    one, zero = np.ones(len(r)), np.zeros(len(r))
    if form is JOINT:
        e = JointLaw(1, 0, 0, 0, 1, 0, 0, 0, E_start, E_max, 1).ehat(r.experts)
        le = np.log(e)
        t0 = [one, le, lN, le * lN, zero, zero, zero, zero, zero]
        t1 = [zero, zero, zero, zero, one, le, lD, le * lD, zero]
        t2 = [zero] * 8 + [one]
        return np.array([np.stack(t0, 1), np.stack(t1, 1), np.stack(t2, 1)])
    lT, lG = np.log(r.n_total) - centers[2], np.log(r.granularity)
    t0 = [one, -lG, -lT, zero, zero, zero, zero]  # g·G^-γ·N^-α
    t1 = [zero, zero, -lT, one, zero, zero, zero]  # a·N^-α
    t2 = [zero, zero, zero, zero, one, -lD, zero]  # b·D^-β
    t3 = [zero] * 6 + [one]
    return np.array([np.stack(t, 1) for t in (t0, t1, t2, t3)])


def _law(form: Form, p: dict, E_start: float, E_max: float, name: str = "fit"):
    if form is JOINT:
        return JointLaw(**{k: p[k] for k in form.params}, E_start=E_start, E_max=E_max, name=name)
    return GranularLaw(**{k: p[k] for k in form.params}, name=name)


def _predict(form, law, r: MoERuns):
    if form is JOINT:
        return law.loss(r.n_act, r.D, r.experts)
    return law.loss(r.n_total, r.D, r.granularity)


def effect_table(form: Form, law, r: MoERuns) -> list[dict]:
    """Predicted loss at the runs' median active size and tokens for each E (or G) in the data,
    relative to E = 1 (G = 1): the size of the experts (granularity) effect."""
    n, n_t, d = (float(np.exp(np.median(np.log(x)))) for x in (r.n_act, r.n_total, r.D))
    if form is JOINT:
        vals = sorted(set(r.experts.tolist()) | {1.0})
        base = float(law.loss(n, d, 1.0))
        return [{"experts": v, "loss": float(law.loss(n, d, v)),
                 "rel": float(law.loss(n, d, v)) / base - 1} for v in vals]  # fmt: skip
    vals = sorted(set(r.granularity.tolist()) | {1.0})
    base = float(law.loss(n_t, d, 1.0))
    return [{"granularity": v, "loss": float(law.loss(n_t, d, v)),
             "rel": float(law.loss(n_t, d, v)) / base - 1} for v in vals]  # fmt: skip


@single_threaded_blas
def fit_moe(r: MoERuns, form: str = "moe-joint", bootstrap: int = 0, seed: int = 0,
            fixed: dict[str, float] | None = None, grid: str | dict = "default",
            E_start: float = 2.0732, E_max: float = 290.4521) -> dict:  # fmt: skip
    """Fit `form` to the runs; `fixed` holds parameters at given values (natural units).
    The joint law's Ê transform keeps E_start and E_max fixed (default: the published ones)."""
    f = FORMS[form]
    r.check(form)
    fixed = dict(fixed or {})
    bad = set(fixed) - set(f.params)
    if bad:
        raise ScalingError(f"{form} has no parameter(s) {sorted(bad)}; its parameters: {f.params}")
    free = [k for k in f.params if k not in fixed]
    if len(r) < len(free) + 2:
        raise ScalingError(f"{form} fits {len(free)} free parameters; {len(r)} runs are too few "
                           f"(give at least {len(free) + 2}, or hold some with --fix)")  # fmt: skip
    key = "experts" if f is JOINT else "granularity"
    effect_params = {"delta", "gamma", "omega", "zeta"} if f is JOINT else {"g", "gamma"}
    if len(np.unique(getattr(r, key))) < 2 and not effect_params <= set(fixed):
        raise ScalingError(
            f"{form}: every run has the same {key}, so its effect cannot be "
            f"fitted; vary it or hold {sorted(effect_params)} with --fix"
        )
    centers, pairs = centering(f, r)
    for k, dep, _ in pairs:
        if k in fixed and dep not in fixed:
            raise ScalingError(f"holding {k} needs {dep} held too (--fix {k} {dep})")
    X = design(f, r, E_start, E_max, centers)
    logL = np.log(r.loss)
    idx = [f.params.index(k) for k in free]
    raw = {k: fixed.get(k, 1.0 if k in LOGGED else 0.0) for k in f.params}
    base = _shift(f, [_to_theta(k, raw[k]) for k in f.params], pairs, +1)

    def obj(x, X=X, logL=logL):
        th = base.copy()
        th[idx] = x
        v, g = lse_huber(th, X, logL)
        return v, g[idx]

    grids = f.paper_grid if grid == "paper" else f.grid if grid == "default" else {**f.grid, **grid}
    starts = list(itertools.product(*(grids[k] for k in free)))
    best, n_ok = None, 0
    for s in starts:
        full = {**raw, **dict(zip(free, s))}
        x0 = _shift(f, [_to_theta(k, full[k]) for k in f.params], pairs, +1)[idx]
        res = minimize(obj, x0, jac=True, method="L-BFGS-B")
        n_ok += bool(res.success)
        if np.all(np.isfinite(res.x)) and (best is None or res.fun < best.fun):
            best = res
    if best is None:
        raise ScalingError(f"{form} did not converge from any start; check the data")
    pol = minimize(obj, best.x, jac=True, method="L-BFGS-B", options=TIGHT)
    if pol.fun <= best.fun:
        best = pol
    th = base.copy()
    th[idx] = best.x
    th = _shift(f, th, pairs, -1)
    p = {k: _from_theta(k, t) for k, t in zip(f.params, th)}
    law = _law(f, p, E_start, E_max)
    pred = _predict(f, law, r)
    out = {"form": form, "params": p, "free": free, "fixed": fixed, "n_runs": len(r),
           "starts": len(starts), "starts_converged": n_ok, "objective": float(best.fun),
           "residual_rms": float(np.sqrt(np.mean((logL - np.log(pred)) ** 2))),
           "effect": effect_table(f, law, r)}  # fmt: skip
    if f is JOINT:
        out["E_start"], out["E_max"] = E_start, E_max
    if bootstrap:
        rng = np.random.default_rng(seed)
        samples, effects = [], []
        for _ in range(bootstrap):
            i = rng.integers(0, len(r), len(r))
            res = minimize(obj, best.x.copy(), args=(X[:, i], logL[i]), jac=True,
                           method="L-BFGS-B", options=TIGHT)  # fmt: skip
            t = base.copy()
            t[idx] = res.x
            t = _shift(f, t, pairs, -1)
            bp = {k: _from_theta(k, v) for k, v in zip(f.params, t)}
            samples.append([bp[k] for k in free])
            effects.append([e["rel"] for e in effect_table(f, _law(f, bp, E_start, E_max), r)])
        s, e = np.array(samples), np.array(effects)
        out["bootstrap"] = {
            "resamples": bootstrap, "seed": seed,
            "ci95": {k: np.percentile(s[:, j], [2.5, 97.5]).tolist() for j, k in enumerate(free)},
            "effect_ci95": [np.percentile(e[:, j], [2.5, 97.5]).tolist() for j in range(e.shape[1])],
        }  # fmt: skip
        out["bootstrap_samples"] = s.tolist()
    out["law"] = law
    return out


def jsonable(res: dict) -> dict:
    out = {k: v for k, v in res.items() if k not in ("law", "bootstrap_samples")}
    out["law"] = asdict(res["law"])
    return out


# ---------------------------------------------------------------- plots


def plot_vs_experts(r: MoERuns, res: dict, out: Path) -> Path:
    """Loss against E (joint) or G (granular) at fixed active size and tokens, with the fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    f = FORMS[res["form"]]
    law = res["law"]
    key = "experts" if f is JOINT else "granularity"
    x = getattr(r, key)
    # "fixed active size": sizes (and token counts) within 5 % are one group; E moves the router
    key_T = group_budgets(r.n_act) * (len(r) + 1) + group_budgets(r.D)
    groups = [key_T == k for k in np.unique(key_T)]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    cmap = plt.get_cmap("viridis")
    xs = np.logspace(0, np.log10(max(2.0, x.max()) * 1.5), 80)
    for j, sel in enumerate(groups):
        n, d = (
            float(np.exp(np.mean(np.log(r.n_act[sel])))),
            float(np.exp(np.mean(np.log(r.D[sel])))),
        )
        col = cmap(j / max(1, len(groups) - 1))
        ax.scatter(x[sel], r.loss[sel], color=col, s=24, zorder=3,
                   label=f"N_act={n:.3g}, D={d:.3g}")  # fmt: skip
        if f is JOINT:
            ys = law.loss(np.mean(r.n_act[sel]), np.mean(r.D[sel]), xs)
        else:
            ys = law.loss(np.mean(r.n_total[sel]), np.mean(r.D[sel]), xs)
        ax.plot(xs, ys, color=col, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("experts E (expansion n_routed/top-k)" if f is JOINT else "granularity G")
    ax.set_ylabel("final loss")
    ax.set_title(f"{res['form']} fit: loss against {key} at fixed active size "
                 f"(rms log-residual {res['residual_rms']:.4f})", fontsize=9)  # fmt: skip
    ax.xaxis.set_minor_formatter(NullFormatter())
    if len(groups) <= 12:
        ax.legend(fontsize=7)
    from llmtrain.scaling.plots import save_figure

    return save_figure(fig, out)
