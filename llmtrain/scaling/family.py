"""Model families: turn a parameter count into a concrete config by the rules a family file
states (see configs/families/*.yaml), counting MoE models by active parameters."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml

from llmtrain.accounting import count
from llmtrain.config import Config, from_dict, load_config
from llmtrain.scaling.laws import ScalingError, deepseek_batch_tokens, deepseek_lr


class Family:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ScalingError(f"family file {self.path} does not exist")
        raw = yaml.safe_load(self.path.read_text()) or {}
        if "family" not in raw:
            raise ScalingError(f"{self.path}: needs a 'family:' section (see configs/families/)")
        self.rules: dict[str, Any] = raw["family"]
        self.overrides: dict[str, Any] = raw.get("overrides") or {}
        base = (self.path.parent / self.rules["base"]).resolve()
        self.base = load_config(base, [f"{k}={v}" for k, v in self.overrides.items()])

    def config_for_hidden(self, hidden: int) -> Config:
        r = self.rules
        cfg = copy.deepcopy(self.base)
        m = cfg.model
        m.hidden_size = hidden
        m.num_layers = max(int(r["min_layers"]), round(hidden / r["width_per_layer"]))
        m.num_heads = max(1, hidden // int(r["head_dim"]))
        m.qk_nope_head_dim = int(r["head_dim"])
        m.v_head_dim = int(r["head_dim"])
        m.qk_rope_head_dim = int(r.get("qk_rope_head_dim", m.qk_rope_head_dim))
        m.intermediate_size = int(r["ffn_ratio"] * hidden)
        m.moe_intermediate_size = max(4, int(r["expert_ratio"] * hidden))
        m.kv_lora_rank = max(4, int(r["kv_lora_ratio"] * hidden))
        q = r.get("q_lora_ratio")
        m.q_lora_rank = None if q is None else max(4, int(q * hidden))
        m.first_k_dense_replace = min(m.first_k_dense_replace, m.num_layers - 1)
        return cfg.validate()

    def candidates(self) -> list[Config]:
        r = self.rules
        step = int(r["width_multiple"])
        return [
            self.config_for_hidden(h)
            for h in range(int(r["min_hidden"]), int(r["max_hidden"]) + 1, step)
        ]

    def closest(self, n_params: float) -> tuple[Config, int]:
        best = min(
            ((c, count(c.model, seq_len=c.train.seq_len).active_params) for c in self.candidates()),
            key=lambda cn: abs(math.log(cn[1] / n_params)),
        )
        return best


def training_config(
    fam: Family, n_target: float, flops: float, hyper: bool = True
) -> tuple[Config, dict]:
    """The family member nearest `n_target` active params, trained for `flops` FLOPs.

    With `hyper`, the global batch (tokens) and peak LR follow DeepSeek LLM (2024):
    B_opt = 0.2920·C^0.3271, η_opt = 0.3118·C^−0.1250. The validation sample stays the family
    config's (eval_batches of its own global batch), so every run of a sweep is scored on the
    same sequences whatever its batch."""
    cfg, n_active = fam.closest(n_target)
    t = cfg.train
    t.eval_sequences = t.eval_sequences or t.eval_batches * t.global_batch_size
    fpt = count(cfg.model, seq_len=t.seq_len).flops_per_token
    tokens = flops / fpt
    if hyper:
        b_tokens = deepseek_batch_tokens(flops)
        seqs = max(
            t.micro_batch_size,
            round(b_tokens / t.seq_len / t.micro_batch_size) * t.micro_batch_size,
        )
        t.global_batch_size = int(seqs)
        t.lr = float(deepseek_lr(flops))
    steps = max(1, math.ceil(tokens / (t.global_batch_size * t.seq_len)))
    t.max_steps = steps
    t.warmup_steps = min(t.warmup_steps, max(1, steps // 10))
    info = {
        "target_params": n_target,
        "active_params": n_active,
        "flops_per_token": fpt,
        "flops": flops,
        "tokens": steps * t.global_batch_size * t.seq_len,
        "steps": steps,
        "global_batch_tokens": t.global_batch_size * t.seq_len,
        "lr": t.lr,
    }
    return cfg.validate(), info


def write_config(cfg: Config, path: Path, header: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    path.write_text("".join(f"# {l}\n" for l in header.splitlines()) + text)
    from_dict(Config, yaml.safe_load(text)).validate()  # what we wrote loads back
