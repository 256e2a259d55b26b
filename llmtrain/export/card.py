"""The model card (README.md with Hub metadata) of an export: what was trained, on what, how far."""

from __future__ import annotations

import re

import yaml

from llmtrain.accounting import count


def model_card(
    src, hf_cfg: dict, mtp: bool, law: str | None, license: str, files: list[str]
) -> str:
    cfg, st = src.config, src.state
    mc = cfg.model
    c = count(mc, seq_len=cfg.train.seq_len)
    arch = hf_cfg["architectures"][0]
    specs = [s.get("path", "") if isinstance(s, dict) else str(s) for s in cfg.data.sources]
    datasets = [s[3:].split("#")[0].split("@")[0].split(":")[0] for s in specs
                if s.startswith("hf:")]  # fmt: skip
    meta = {
        "license": license,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["llmtrain", "mixture-of-experts", "mla", hf_cfg["model_type"]],
    }
    if datasets:
        meta["datasets"] = datasets
    mtp_row = [
        f"| multi-token prediction modules (in the files besides the total, each with a "
        f"copy of the embedding and head; unused by transformers) | {c.mtp_params:,} |"
    ]
    mtp_row = mtp_row if mc.mtp_depth and mtp else []
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", ""]
    lines += [
        f"# {arch} trained with llmtrain",
        "",
        f"A DeepSeek-style MoE decoder (MLA attention, {mc.n_routed_experts} routed + {mc.n_shared_experts} shared "
        f"experts, top-{mc.num_experts_per_tok}, {mc.scoring_func} gating) that stock `transformers` loads as "
        f"`{arch}` without remote code:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("<this repo>")',
        "```",
        "",
        "## Training facts",
        "",
        "| | |",
        "|---|---|",
        f"| total parameters | {c.total_params:,} |",
        f"| active parameters per token | {c.active_params:,} |",
        *mtp_row,
        f"| training steps | {st.get('step')} |",
        f"| tokens seen | {st.get('tokens_seen', 0):,} |",
        f"| training FLOPs (from the model accounting) | {st.get('flops', 0):.4g} |",
        f"| final training loss | {_f(st.get('loss'))} |",
        f"| final validation loss | {_f(st.get('val_loss'))} |",
        f"| data | {', '.join(_source(s) for s in cfg.data.sources)} |",
        f"| layout that trained it | world {st.get('world_size')}, ZeRO-{st.get('zero_stage')}, ep {st.get('ep_size')} |",
        f"| weight files | {len(files)} |",
        "",
    ]
    if law:
        from llmtrain.scaling.laws import load_law

        lw = load_law(law)
        pred = lw.loss(c.active_params, max(1, st.get("tokens_seen", 1)))
        lines += [
            "## Scaling-law prediction",
            "",
            f"Law `{lw.name}` (L = {lw.E:.4g} + {lw.A:.4g}/N^{lw.alpha:.4g} + {lw.B:.4g}/D^{lw.beta:.4g}, "
            f"N = active parameters, D = tokens seen) predicts **{pred:.4f}**; achieved validation loss "
            f"**{_f(st.get('val_loss'))}**.",
            "",
        ]
    if mc.mtp_depth:
        if mtp:
            lines += ["## Multi-token prediction", "",
                      f"The {mc.mtp_depth} MTP module(s) are written as DeepSeek-V3 ships them, at layer index "
                      f"{mc.num_layers} and up (with copies of the embedding and head), fed the main model's "
                      "state after its final norm, as engines that draft with them expect (vLLM, SGLang). "
                      "Stock transformers does not run MTP and leaves these weights unused; the main model is "
                      "unaffected.", ""]  # fmt: skip
        else:
            lines += ["## Multi-token prediction", "",
                      "The MTP modules were dropped at export (`--drop-mtp`): stock transformers cannot use them "
                      "at this depth, and they are not needed for next-token prediction.", ""]  # fmt: skip
    lines += [
        "## Config",
        "",
        "```yaml",
        yaml.safe_dump(redacted(cfg.to_dict()), sort_keys=False).strip(),
        "```",
        "",
    ]
    return "\n".join(lines)


_SECRET = re.compile(r"(^|_)(api_?key|key|token|secret|password|credentials?)$", re.I)


def redacted(d):
    """The config with values under secret-looking keys (train.deepspeed's comet.api_key ...)
    replaced: the card and llmtrain_config.yaml are published with the weights."""
    if isinstance(d, dict):
        return {k: "<redacted>" if _SECRET.search(str(k)) and v
                else redacted(v) for k, v in d.items()}  # fmt: skip
    if isinstance(d, list):
        return [redacted(v) for v in d]
    return d


def _source(s) -> str:
    """A data.sources entry as the card lists it: a path, or a mixture entry with its weight."""
    return f"{s.get('path')} (weight {s.get('weight', 1)})" if isinstance(s, dict) else str(s)


def _f(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "n/a"
