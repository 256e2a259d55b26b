"""MoE families: vary experts E and granularity G at a fixed active size, count FLOPs per token
with llmtrain.accounting (routed + shared experts, router, MLA attention), and plan sweeps in the
manifest format `llmtrain scaling sweep run|collect` already read.

A variant (E, G) of a family member keeps its dense FFN width d_ff = intermediate_size and sets
expert width d_ff/G, n_routed = E·G·top_k₁ and top-k = G·top_k₁ (top_k₁: the family's top-k at
G = 1), so the active parameters stay fixed (up to the router) while total parameters grow with E
(Krajewski et al. 2024, Sec. 4: N_expert = G·E). E = 1 is the dense-equivalent model.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import yaml

from llmtrain.accounting import count
from llmtrain.config import Config
from llmtrain.scaling.family import Family, training_config, write_config
from llmtrain.scaling.laws import Law, ScalingError
from llmtrain.scaling.moe import body_total_params
from llmtrain.scaling.sweep import MANIFEST


def moe_rules(family: str | Path) -> dict:
    raw = yaml.safe_load(Path(family).read_text()) or {}
    rules = {"experts": [1, 4, 16], "granularity": [1], "top_k": 1, **(raw.get("moe") or {})}
    return rules


def variant(cfg: Config, experts: int, granularity: int, top_k1: int = 1) -> Config:
    """`cfg` with E experts (expansion) at granularity G; see the module docstring."""
    if experts < 1 or granularity < 1 or top_k1 < 1:
        raise ScalingError(
            f"experts={experts}, granularity={granularity}, top_k={top_k1} must be >= 1"
        )
    c = copy.deepcopy(cfg)
    m = c.model
    width = m.intermediate_size // granularity
    if width < 1 or m.intermediate_size % granularity:
        raise ScalingError(f"granularity {granularity} does not divide the dense FFN width "
                           f"{m.intermediate_size}; pick G dividing it")  # fmt: skip
    m.moe_intermediate_size = width
    m.num_experts_per_tok = granularity * top_k1
    m.n_routed_experts = experts * granularity * top_k1
    m.n_group, m.topk_group = 1, 1
    return c.validate()


class _Member:
    """Quacks like Family for training_config: always this config."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def closest(self, n_params: float) -> tuple[Config, int]:
        c = copy.deepcopy(self.cfg)
        return c, count(c.model, seq_len=c.train.seq_len).active_params


def closest_variant(fam: Family, n_act: float, experts: int, granularity: int, top_k1: int = 1,
                    non_embedding: bool = False):  # fmt: skip
    """The family member (with this E, G) whose active parameter count is nearest `n_act`
    (counted without the embedding and LM head when `non_embedding`, as Krajewski et al. do)."""
    best = None
    for base in fam.candidates():
        try:
            c = variant(base, experts, granularity, top_k1)
        except ScalingError:
            continue
        k = count(c.model, seq_len=c.train.seq_len)
        n = k.active_non_embedding_params if non_embedding else k.active_params
        if best is None or abs(math.log(n / n_act)) < abs(math.log(best[1] / n_act)):
            best = (c, n, base)
    if best is None:
        raise ScalingError(f"no member of {fam.path} admits granularity {granularity}")
    return best


def config_for(fam: Family, n_act: float, flops: float, experts: int, granularity: int,
               top_k1: int = 1, hyper: bool = False, base: Config | None = None,
               non_embedding: bool = False) -> tuple[Config, dict]:  # fmt: skip
    """The (E, G) variant of `base` (default: the member nearest `n_act`) trained for `flops`."""
    if base is None:
        cfg = closest_variant(fam, n_act, experts, granularity, top_k1, non_embedding)[0]
    else:
        cfg = variant(base, experts, granularity, top_k1)
    cfg, info = training_config(_Member(cfg), n_act, flops, hyper=hyper)
    c = count(cfg.model, seq_len=cfg.train.seq_len)
    info.update(experts=experts, granularity=granularity, top_k=cfg.model.num_experts_per_tok,
                n_routed_experts=cfg.model.n_routed_experts, total_params=c.total_params,
                body_total_params=body_total_params(c),
                active_non_embedding_params=c.active_non_embedding_params,
                flops_6n_per_token=6 * c.active_params)  # fmt: skip
    return cfg, info


def plan_moe(budgets: list[float], family: str, out: Path, law: Law, sizes: int = 1,
             spread: float = 4.0, experts=None, granularities=None, hyper: bool = False,
             center_factor: float = 1.0, active: list[float] | None = None) -> dict:  # fmt: skip
    """Per budget: `sizes` active sizes around the law's N_opt (or the `active` ones), and at each
    size every (E, G) of the family's `moe:` section (or the ones given)."""
    if not budgets or any(b <= 0 for b in budgets):
        raise ScalingError("give one or more positive FLOP budgets")
    fam = Family(family)
    rules = moe_rules(family)
    experts = [int(e) for e in (experts or rules["experts"])]
    granularities = [int(g) for g in (granularities or rules["granularity"])]
    top_k1 = int(rules["top_k"])
    out.mkdir(parents=True, exist_ok=True)
    runs, seen = [], set()
    for c in sorted(budgets):
        if active:
            targets = list(active)
        else:
            center = law.allocate(c)["n_opt"] * center_factor
            targets = center * spread ** np.linspace(-0.5, 0.5, sizes) if sizes > 1 else [center]
        for n in targets:
            base = closest_variant(fam, float(n), experts[0], granularities[0], top_k1)[2]
            for E in experts:  # one family member per target: the same width for every (E, G)
                for G in granularities:
                    cfg, info = config_for(fam, float(n), c, E, G, top_k1, hyper, base)
                    key = (c, cfg.model.hidden_size, E, G)
                    if key in seen:
                        continue
                    seen.add(key)
                    name = f"C{c:.0e}_N{info['active_params']:.3g}_E{E}_G{G}".replace("+", "")
                    path = out / "configs" / f"{name}.yaml"
                    write_config(
                        cfg, path, f"MoE sweep point: budget {c:.3g} FLOPs, {json.dumps(info)}"
                    )
                    runs.append({"name": name, "budget": c, "config": str(path.relative_to(out)),
                                 "run_dir": f"runs/{name}", **info})  # fmt: skip
    manifest = {"family": str(Path(family).resolve()), "law": law.to_json(),
                "budgets": sorted(budgets), "moe": {"experts": experts, "granularity": granularities,
                                                    "top_k": top_k1}, "runs": runs}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest
