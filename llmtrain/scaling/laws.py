"""L(N, D) = E + A/N^α + B/D^β and what follows from it in closed form.

With compute C = k·N·D (k = 6 for the 6ND rule), minimising L subject to the budget gives
  N_opt = G·(C/k)^a,  D_opt = G⁻¹·(C/k)^b,  G = (αA / (βB))^(1/(α+β)),  a = β/(α+β),  b = α/(α+β)
(Hoffmann et al. 2022, eq. 4).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from scipy.optimize import brentq

from llmtrain.errors import LlmtrainError


class ScalingError(LlmtrainError, ValueError):
    """Bad input or an impossible question; the message says what to change."""


@dataclass(frozen=True)
class Law:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "custom"
    source: str = ""

    def check_minimum(self) -> None:
        """Compute-optimal allocation needs loss falling in N and in D (A, B, α, β > 0); else
        the closed form gives a maximum, or a complex G for α < 0."""
        bad = [f"{k}={getattr(self, k):.4g}" for k in ("A", "B", "alpha", "beta")
               if not (math.isfinite(getattr(self, k)) and getattr(self, k) > 0)]  # fmt: skip
        if bad:
            raise ScalingError(
                f"law {self.name!r} has {', '.join(bad)}: A, B, alpha and beta must be positive "
                "(loss falling with model size and with data) for a compute-optimal allocation; "
                "refit from runs where both help"
            )

    @property
    def a(self) -> float:
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def allocate(self, flops: float, k: float = 6.0) -> dict:
        if flops <= 0:
            raise ScalingError(f"compute must be positive, got {flops}")
        self.check_minimum()
        n = self.G * (flops / k) ** self.a
        d = (flops / k) ** self.b / self.G
        return {
            "flops": flops,
            "n_opt": n,
            "d_opt": d,
            "tokens_per_param": d / n,
            "loss": self.loss(n, d),
            "closed_form": f"N_opt = G*(C/{k:g})^a, D_opt = (C/{k:g})^b / G; G = (alpha*A/(beta*B))^(1/(alpha+beta)) "
            f"= {self.G:.6g}, a = beta/(alpha+beta) = {self.a:.4f}, b = alpha/(alpha+beta) = {self.b:.4f}",
        }

    def optimal_loss(self, flops: float, k: float = 6.0) -> float:
        return self.allocate(flops, k)["loss"]

    def flops_for_loss(self, target: float, k: float = 6.0) -> dict:
        """The smallest compute whose compute-optimal model reaches `target`."""
        if target <= self.E:
            raise ScalingError(
                f"target loss {target} is at or below the irreducible loss E={self.E:.4f}"
            )
        f = lambda lc: self.optimal_loss(10**lc, k) - target
        lo, hi = 0.0, 40.0
        if f(lo) < 0:
            return self.allocate(10**lo, k)
        if f(hi) > 0:
            raise ScalingError(f"target loss {target} needs more than 1e40 FLOPs under this law")
        return self.allocate(10 ** brentq(f, lo, hi, xtol=1e-12), k)

    def tokens_for_params(self, n: float, k: float = 6.0) -> dict:
        """Fixed model size: the compute (and tokens) for which N is the compute-optimal size."""
        if n <= 0:
            raise ScalingError("model size must be positive")
        self.check_minimum()
        flops = k * (n / self.G) ** (1 / self.a)
        return self.allocate(flops, k)

    def params_for_tokens(self, d: float, k: float = 6.0) -> dict:
        """Fixed token budget: the compute (and model size) for which D is compute-optimal."""
        if d <= 0:
            raise ScalingError("token budget must be positive")
        self.check_minimum()
        flops = k * (d * self.G) ** (1 / self.b)
        return self.allocate(flops, k)

    def to_json(self) -> dict:
        return asdict(self)


BUILTIN_LAWS = {
    "chinchilla": Law(1.69337, 406.401, 410.723, 0.33917, 0.28491, "chinchilla",
                      "Hoffmann et al. 2022, Approach 3 (unrounded)"),
    "epoch": Law(1.8172, 482.01, 2085.43, 0.3478, 0.3658, "epoch",
                 "Besiroglu et al. 2024, Chinchilla scaling: a replication attempt"),
}  # fmt: skip


def load_law(spec: str) -> Law:
    """A built-in name, or a JSON file written by `llmtrain scaling fit --json`."""
    if spec in BUILTIN_LAWS:
        return BUILTIN_LAWS[spec]
    from llmtrain.scaling.registry import NOT_REGISTERED, REGISTRY

    if spec in REGISTRY and REGISTRY[spec].kind == "dense":  # a registered dense law
        spec_ = REGISTRY[spec]
        k = spec_.coefficients
        return Law(*(float(k[n]) for n in ("E", "A", "B", "alpha", "beta")), name=spec,
                   source=f"{spec_.paper}, arXiv {spec_.arxiv}, {spec_.table}; {spec_.flops_model}")  # fmt: skip
    p = Path(spec)
    if not p.is_file():
        why = f" ({NOT_REGISTERED[spec]})" if spec in NOT_REGISTERED else ""
        raise ScalingError(
            f"law {spec!r}{why} is neither built in (dense: "
            f"{', '.join([*BUILTIN_LAWS, *(k for k, v in REGISTRY.items() if v.kind == 'dense')])}; MoE: "
            f"{', '.join(k for k, v in REGISTRY.items() if v.kind != 'dense')}) nor a fit JSON file"
        )
    data = json.loads(p.read_text())
    params = data.get("approach3", {}).get("params") or data.get("params") or data
    try:
        return Law(
            *(float(params[k]) for k in ("E", "A", "B", "alpha", "beta")),
            name=p.stem,
            source=str(p),
        )
    except KeyError as e:
        other = [k for k in ("approach1", "approach2") if k in data]
        hint = (f"; it holds {' and '.join(other)} (power laws N_opt ∝ C^a without a loss "
                "model): refit with --approach 3 or all to allocate from it") if other else ""  # fmt: skip
        raise ScalingError(f"{p} holds no Approach-3 fit (missing {e}){hint}") from e


# DeepSeek LLM (2024) hyper-parameter laws, C in FLOPs: batch in tokens, learning rate.
def deepseek_batch_tokens(flops: float) -> float:
    return 0.2920 * flops**0.3271


def deepseek_lr(flops: float) -> float:
    return 0.3118 * flops**-0.1250


def fmt_si(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return str(x)
    e = math.floor(math.log10(abs(x)) / 3) * 3
    sym = {0: "", 3: "K", 6: "M", 9: "B", 12: "T", 15: "P", 18: "E", 21: "Z", 24: "Y"}.get(e)
    return f"{x / 10**e:.3g}{sym}" if sym is not None else f"{x:.3e}"
