"""Hugging Face DeepseekV3 / DeepseekV2 format: config fields and weight names, both directions.

Our parameter names equal HF's except the routed experts (stacked here, per-expert on disk)
and the MTP modules (our `mtp.{k}` is HF's `model.layers.{L+k}`).

Shape legend: E experts, D hidden, F expert width.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmtrain.config import ConfigError, ModelConfig, RopeConfig
from llmtrain.errors import MissingFileError, WeightsMismatchError

logger = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@contextlib.contextmanager
def quiet_transformers_load():
    """transformers 5 logs a load report listing the MTP layers an export carries (at layer
    index L + k) as UNEXPECTED: by design, since DeepseekV3ForCausalLM has no MTP; keep only
    errors while our own code loads an export."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


# ---------------------------------------------------------------- config


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    src = {**legacy, **params}
    theta = src.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope = RopeConfig(
        theta=float(theta),
        type=kind,
        interleave=bool(hf.get("rope_interleave", True)),
    )
    if kind == "yarn":
        factor = src.get("factor")
        # as transformers reads it: a top-level value first, then the rope dict's, else the
        # model's max_position_embeddings
        orig = hf.get("original_max_position_embeddings") or src.get(
            "original_max_position_embeddings"
        ) or hf["max_position_embeddings"]  # fmt: skip
        if factor is None:
            factor = hf["max_position_embeddings"] / orig
        rope.factor = float(factor)
        rope.original_max_position_embeddings = int(orig)
        rope.beta_fast = float(src.get("beta_fast") or 32)
        rope.beta_slow = float(src.get("beta_slow") or 1)
        rope.mscale = float(src.get("mscale") or 0)
        rope.mscale_all_dim = float(src.get("mscale_all_dim") or 0)
        if src.get("attention_factor") is not None:
            rope.attention_factor = float(src["attention_factor"])
        rope.truncate = bool(src.get("truncate", True))
    elif kind != "default":
        raise ConfigError(
            f"rope type {kind!r} in the HF config is not supported; only default or yarn rotary "
            "scaling maps onto our model"
        )
    return rope


# What transformers' DeepseekV3Config / DeepseekV2Config (5.x) put in place of a key config.json
# lacks, for the keys whose absence would not fail at weight loading (test_hf_parity checks these
# against the installed classes). Reading 1 where transformers reads 8 would change the logits.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                    "norm_topk_prob": True, "q_lora_rank": 1536, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "rope_interleave": True, "hidden_act": "silu",
                    "max_position_embeddings": 4096},
    "deepseek_v2": {"n_group": None, "topk_group": None, "routed_scaling_factor": 1.0,
                    "norm_topk_prob": False, "q_lora_rank": 1536, "n_shared_experts": 2,
                    "first_k_dense_replace": 0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "topk_method": "greedy", "hidden_act": "silu", "max_position_embeddings": 2048},
}  # fmt: skip

# config.json fields a DeepSeek MLA + MoE model cannot do without
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
               "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok")  # fmt: skip


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face `config.json` (or the directory holding one) as a dict; ConfigError if not."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise MissingFileError(
            f"{p} not found; give a Hugging Face model directory (config.json + *.safetensors)"
        )
    try:
        hf = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON ({e}); give a Hugging Face config.json") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{p} must hold a JSON object of config fields")
    return hf


def model_config_from_hf(hf: dict[str, Any], mtp: bool = False) -> ModelConfig:
    """Map a DeepseekV3/V2 `config.json` dict onto ModelConfig (V2: softmax gating, interleaved);
    `mtp`: with the release's MTP layers (num_nextn_predict_layers), which transformers skips.

    Anything else (another architecture, missing or mistyped fields) is a ConfigError that says
    which fields and that only DeepSeek MLA + MoE configs are read."""
    if not isinstance(hf, dict):
        raise ConfigError("a Hugging Face config must be a JSON object of fields")
    mtype = hf.get("model_type")
    missing = [k for k in HF_REQUIRED if k not in hf]
    if mtype is not None and mtype not in ("deepseek_v3", "deepseek_v2"):
        raise ConfigError(
            f"model_type {mtype!r} is not supported: llmtrain reads DeepseekV3/V2 (MLA + "
            "DeepSeekMoE) configs only; start from a deepseek_v3 config or a YAML config"
        )
    if missing:
        what = "has no model_type and " if mtype is None else ""
        raise ConfigError(
            f"the Hugging Face config {what}lacks the DeepSeek MLA/MoE fields "
            f"{', '.join(missing)}; llmtrain reads DeepseekV3/V2 configs only"
        )
    bad = [k for k in HF_REQUIRED if isinstance(hf[k], bool) or not isinstance(hf[k], int)]
    if bad:
        raise ConfigError(
            "the Hugging Face config has non-integer "
            + ", ".join(f"{k}={hf[k]!r}" for k in bad)
            + "; these must be whole numbers"
        )
    try:
        return _model_config_from_hf(hf, mtype or "deepseek_v3", mtp)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"the Hugging Face config has an unusable value: {e!r}") from e


def _model_config_from_hf(hf: dict[str, Any], mtype: str, mtp: bool) -> ModelConfig:
    v2 = mtype == "deepseek_v2"
    hf = {**HF_DEFAULTS[mtype], **hf}
    if hf["hidden_act"] not in ("silu", "swish"):
        raise ConfigError(
            f"hidden_act={hf['hidden_act']!r} is not supported: llmtrain's MLPs and experts are "
            "SwiGLU (silu), as every DeepSeek release is"
        )
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(
            f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads}; MLA has "
            "one latent for all heads, so they must be equal"
        )
    n_group = hf.get("n_group") or 1
    topk_group = hf.get("topk_group") or 1
    if v2 and hf.get("topk_method", "greedy") == "greedy":
        n_group, topk_group = 1, 1
    norm_topk = bool(hf["norm_topk_prob"])
    if v2 and norm_topk:
        # transformers' DeepseekV2 router never renormalises; follow it so logits match.
        logger.warning(
            "DeepseekV2 config sets norm_topk_prob, which transformers ignores; so do we"
        )
        norm_topk = False
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        n_routed_experts=hf["n_routed_experts"],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        num_experts_per_tok=hf["num_experts_per_tok"],
        n_group=n_group,
        topk_group=topk_group,
        scoring_func="softmax" if v2 else "sigmoid",
        norm_topk_prob=norm_topk,
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
        bias_update_speed=0.0 if v2 else 0.001,
        rms_norm_eps=float(hf["rms_norm_eps"]),
        tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        max_position_embeddings=hf["max_position_embeddings"],
        init_std=float(hf.get("initializer_range", 0.02)),
        rope=_rope_from_hf(hf),
    )
    if v2:
        cfg.rope.interleave = True  # V2 always rotates complex pairs
    if hf.get("moe_layer_freq", 1) not in (None, 1):
        raise ConfigError(
            f"moe_layer_freq={hf['moe_layer_freq']} is not supported: every layer from "
            "first_k_dense_replace on is MoE here (and in stock transformers, which ignores the "
            "field; DeepSeek's own code makes only every moe_layer_freq-th layer MoE)"
        )
    if hf.get("attention_bias"):
        raise ConfigError(
            "attention_bias=true is not supported (DeepSeek models have none); set it to false"
        )
    if mtp:
        cfg.mtp_depth = int(hf.get("num_nextn_predict_layers") or 0)
    cfg.validate()
    return cfg


def hf_config_from_model(cfg: ModelConfig, mtp: bool = False) -> dict[str, Any]:
    """The config.json stock transformers reads: V3 for sigmoid gating, V2 for softmax.

    Writes both the current `rope_parameters` and the legacy `rope_theta`/`rope_scaling` keys,
    so older transformers releases read the same RoPE.
    """
    v2 = cfg.scoring_func == "softmax"
    r = cfg.rope
    rope_params: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    legacy = None
    if r.type == "yarn":
        extra = {
            "factor": r.factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
            "beta_fast": r.beta_fast,
            "beta_slow": r.beta_slow,
            "mscale": r.mscale,
            "mscale_all_dim": r.mscale_all_dim,
        }
        if r.attention_factor is not None:  # written only when set: transformers' absent = derive
            extra["attention_factor"] = r.attention_factor
        if not r.truncate:
            extra["truncate"] = False
        rope_params.update(extra)
        legacy = {"type": "yarn", "rope_type": "yarn", **extra}
    out: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v2" if v2 else "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "rope_parameters": rope_params,
        "rope_theta": r.theta,
        "rope_scaling": legacy,
    }
    if v2:
        if not cfg.rope.interleave:
            raise ValueError(
                "softmax gating with rope.interleave=false has no DeepseekV2 equivalent in "
                "transformers (DeepseekV2 always rotates interleaved pairs); train with "
                "model.rope.interleave=true to export this model"
            )
        if cfg.norm_topk_prob:
            raise ValueError(
                "softmax gating with norm_topk_prob=true has no DeepseekV2 equivalent in "
                "transformers (its router never renormalises); set model.norm_topk_prob=false"
            )
        grouped = cfg.n_group > 1 and cfg.topk_group < cfg.n_group
        out["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    else:
        out["rope_interleave"] = cfg.rope.interleave
        out["scoring_func"] = "sigmoid"
        out["topk_method"] = "noaux_tc"
    # V2 has no MTP of its own, but a softmax export carries the MTP weights as V3's do: the depth
    # is what reads them back (from_pretrained(mtp=True), init_from)
    out["num_nextn_predict_layers"] = cfg.mtp_depth if mtp else 0
    return out


# ---------------------------------------------------------------- weights


def _mtp_prefix(cfg: ModelConfig, k: int) -> str:
    return f"model.layers.{cfg.num_layers + k}."


_SKIPPED = "<beyond num_layers>"


def _our_name(name: str, cfg: ModelConfig) -> str | None:
    """Our name for a (non-per-expert) HF name: MTP layers at index L+k become `mtp.k.*`; None
    for tensors shared with the main model; _SKIPPED for layers past num_layers (MTP not asked)."""
    for k in range(cfg.mtp_depth):
        hf_pre = _mtp_prefix(cfg, k)
        if name.startswith(hf_pre):
            ours, rest = f"mtp.{k}.", name[len(hf_pre) :]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                return ours + rest
            if rest == "shared_head.norm.weight":
                return ours + "norm.weight"
            if rest.startswith(("shared_head.head.", "embed_tokens.")):
                return None  # shared with the main model
            return ours + "block." + rest
    if name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_layers:
        return _SKIPPED
    return name


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (per-expert or fused 3D experts) to ours; MTP layers at index L+k to `mtp.k`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    skipped = []
    for name, t in hf_sd.items():
        m = _EXPERT_RE.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5.x in-memory layout
            out[name[: -len("gate_up_proj")] + "w_gate_up"] = t.transpose(1, 2).contiguous()
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[name[: -len("down_proj")] + "w_down"] = t.transpose(1, 2).contiguous()
            continue
        if ".shared_experts." in name and cfg.n_shared_experts == 0 and t.numel() == 0:
            continue  # transformers writes empty shared-expert tensors when there are none
        out[name] = t
    for prefix, per in experts.items():
        n = len(per)
        if sorted(per) != list(range(cfg.n_routed_experts)):
            raise WeightsMismatchError(
                f"{prefix}: found experts {sorted(per)[:5]}... ({n} of "
                f"{cfg.n_routed_experts}); the checkpoint is missing experts"
            )
        gu = [torch.cat([per[e]["gate"].t(), per[e]["up"].t()], dim=1) for e in range(n)]
        out[prefix + ".w_gate_up"] = torch.stack(gu)
        out[prefix + ".w_down"] = torch.stack([per[e]["down"].t() for e in range(n)])
    # MTP renames: model.layers.{L+k}.X -> mtp.k.{block.X | enorm | hnorm | eh_proj | norm}
    renamed: dict[str, torch.Tensor] = {}
    for name, t in out.items():
        ours = _our_name(name, cfg)
        if ours is _SKIPPED:
            skipped.append(name)
        elif ours is not None:
            renamed[ours] = t
    if skipped:
        logger.info("ignored %d weights of layers beyond num_layers (MTP not loaded)", len(skipped))
    if cfg.tie_word_embeddings:
        renamed.pop("lm_head.weight", None)
    return renamed


def state_dict_to_hf(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, expert_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ours to HF's on-disk names, one tensor at a time (experts split per expert).

    `expert_offset`: global index of the first expert in the stacked tensors given (the export
    streams a layer's experts one at a time)."""
    for name, t in sd.items():
        if name.startswith("mtp."):
            k = int(name.split(".")[1])
            rest = name.split(".", 2)[2]
            pre = _mtp_prefix(cfg, k)
            if rest.startswith("block."):
                name = pre + rest[len("block.") :]
            elif rest == "norm.weight":
                name = pre + "shared_head.norm.weight"
            else:
                name = pre + rest
        if name.endswith("mlp.experts.w_gate_up"):
            base = name[: -len("w_gate_up")]
            f = t.shape[-1] // 2
            for e in range(t.shape[0]):
                yield f"{base}{e + expert_offset}.gate_proj.weight", t[e, :, :f].t().contiguous()
                yield f"{base}{e + expert_offset}.up_proj.weight", t[e, :, f:].t().contiguous()
        elif name.endswith("mlp.experts.w_down"):
            base = name[: -len("w_down")]
            for e in range(t.shape[0]):
                yield f"{base}{e + expert_offset}.down_proj.weight", t[e].t().contiguous()
        elif cfg.scoring_func == "softmax" and name.endswith("e_score_correction_bias"):
            if torch.count_nonzero(t):
                raise ValueError(f"{name} is non-zero but DeepseekV2 has no correction bias")
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            yield name, t


# ---------------------------------------------------------------- loading


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF model directory: `model.safetensors[.index.json]`, else any *.safetensors."""
    from llmtrain.tensor_io import load_all, read_tensors

    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return load_all(path, "model")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingFileError(
            f"{path} holds no *.safetensors weights; copy the model's weights there"
        )
    return {name: t for f in files for name, t, _ in read_tensors(f)}


def _hf_files(path: Path) -> dict[str, Path]:
    """tensor name -> file of a HF model directory (index, single file, or any *.safetensors)."""
    from llmtrain.tensor_io import read_header, tensor_files

    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return {k: path / f for k, f in tensor_files(path, "model").items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    return {k: f for f in files for k in read_header(f)}


def _hf_sources(names, cfg: ModelConfig) -> dict[str, list[tuple[str, str, int]]]:
    """Our tensor name -> the HF tensors it is made of: (hf name, part, expert index), part
    one of whole | fused (stacked experts [E, out, in]) | gate | up | down (one expert's)."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    for hf_name in names:
        m = _EXPERT_RE.match(hf_name)
        if m:
            stem = _our_name(m.group(1) + ".w_down", cfg)
            if stem not in (None, _SKIPPED):
                ours = stem[: -len("w_down")] + ("w_down" if m.group(3) == "down" else "w_gate_up")
                out.setdefault(ours, []).append((hf_name, m.group(3), int(m.group(2))))
        elif hf_name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            stem = _our_name(hf_name.rsplit(".", 1)[0] + ".", cfg)
            if stem not in (None, _SKIPPED):
                ours = stem + ("w_gate_up" if hf_name.endswith("gate_up_proj") else "w_down")
                out[ours] = [(hf_name, "fused", -1)]
        else:
            ours = _our_name(hf_name, cfg)
            if ours not in (None, _SKIPPED):
                out.setdefault(ours, []).append((hf_name, "whole", -1))
    return out


@torch.no_grad()
def load_hf_into(model, path: Path, cfg: ModelConfig, gather=None, partition=None) -> None:
    """Copy a HF checkpoint into a built model, reading only what this rank holds.

    Routed experts: only this rank's experts (each `Experts` module's [offset, offset+El) rows).
    `partition(p)`, for weights cut into flat partitions (ZeRO-3), returns (start, numel, local
    1-D tensor) of what this rank keeps of `p` flattened, or None when `p` is whole: only the
    rows that hold those elements are read (safetensors slices), so no rank reads more than its
    share plus a row at each end. `gather(p)` (the older way, used when `partition` is None) is a
    context in which `p` is whole and writes are kept. A file is closed once no later weight
    needs it. Raises ValueError naming what does not match."""
    from safetensors import safe_open

    from llmtrain.model.moe import Router

    path = Path(path)
    files = _hf_files(path)
    sources = _hf_sources(files, cfg)
    params = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    whole = gather or (lambda p: contextlib.nullcontext())
    extra = [src[0][0] for ours, src in sources.items()
             if ours not in params and ours not in bufs
             and not (".shared_experts." in ours and cfg.n_shared_experts == 0)  # empty ones
             and not (ours == "lm_head.weight" and cfg.tie_word_embeddings)]  # fmt: skip
    if extra:  # every one counted, a few named: a config of another size shows at once
        raise ValueError(f"checkpoint {path} has {len(extra)} tensor(s) the model lacks, e.g. "
                         f"{sorted(extra)[:4]}")  # fmt: skip
    missing = [n for n in params if n not in sources]
    if cfg.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    # most releases ship no MTP layers (transformers saves none, though its config.json says
    # num_nextn_predict_layers=1): the run's own MTP layers keep their fresh initialisation
    fresh = sorted({int(n.split(".")[1]) for n in missing if n.startswith("mtp.")})
    missing = [n for n in missing if not n.startswith("mtp.")]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing[:6]} for this model config")
    if fresh:
        logger.warning(
            "%s holds no weights for MTP layer(s) %s of model.mtp_depth=%d: they start from a "
            "fresh initialisation", path, ", ".join(map(str, fresh)), cfg.mtp_depth,
        )  # fmt: skip

    targets = [(n, t, True) for n, t in params.items() if n in sources]
    targets += [(n, t, False) for n, t in bufs.items() if n in sources]
    last_use = {files[h]: i for i, (n, _, _) in enumerate(targets) for h, _, _ in sources[n]}
    handles: dict[Path, tuple[Any, contextlib.ExitStack]] = {}

    def read(hf_name: str):
        f = files[hf_name]
        if f not in handles:
            stack = contextlib.ExitStack()
            handles[f] = (stack.enter_context(safe_open(str(f), framework="pt")), stack)
        return handles[f][0]

    try:
        for i, (ours, w, is_param) in enumerate(targets):
            part = partition(w) if (is_param and partition is not None) else None
            if part is not None:
                start, numel, local = part
                shape = tuple(getattr(w, "ds_shape", w.shape))
                rows = _source_rows(model, ours, shape, sources[ours], read, path)
                if numel > 0:
                    local.narrow(0, 0, numel).copy_(_flat_range(rows, shape, start, numel))
                gate = model.get_submodule(ours.rsplit(".", 1)[0]) if "." in ours else None
                if isinstance(gate, Router) and local.dtype != torch.float32:
                    # a router partitioned in bf16: the file's exact values, whole (each rank
                    # routes with all of them), for the engine's fp32 master and routing copy
                    full = math.prod(shape)
                    gate.exact_fp32_weight = _flat_range(rows, shape, 0, full).float().view(shape)
            else:
                with whole(w) if is_param else contextlib.nullcontext():
                    rows = _source_rows(model, ours, tuple(w.shape), sources[ours], read, path)
                    w.copy_(_flat_range(rows, tuple(w.shape), 0, w.numel()).view(w.shape))
            for f in [f for f in handles if last_use[f] <= i]:
                handles.pop(f)[1].close()
    finally:
        for _, stack in handles.values():
            stack.close()


def _flat_range(rows, shape: tuple[int, ...], start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of a tensor of `shape` flattened, from `rows(r0, r1)`:
    rows [r0, r1) of its [prod(shape[:-1]), shape[-1]] view (a 1-D tensor: rows of one)."""
    c = shape[-1] if len(shape) > 1 else 1
    r0, r1 = start // c, -(-(start + numel) // c)
    return rows(r0, r1).reshape(-1).narrow(0, start - r0 * c, numel)


def _source_rows(model, ours: str, shape, src, read, path: Path):
    """`rows(r0, r1)` of our tensor `ours` (of `shape`) made from the HF tensors `src`, reading
    only those rows. Experts: ours [El, in, out] is HF's [E, out, in] transposed (or per-expert
    [out, in] tensors), so our row (e, i) is column i of HF's expert offset + e."""
    part = src[0][1]
    if part == "whole":
        name = src[0][0]
        sl = read(name).get_slice(name)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise ValueError(f"{name}: checkpoint shape {got} != model {tuple(shape)}")
        if len(shape) > 2:
            return lambda r0, r1: sl[:].reshape(-1, shape[-1])[r0:r1]
        return lambda r0, r1: sl[r0:r1].reshape(r1 - r0, -1)
    off = model.get_submodule(ours.rsplit(".", 1)[0]).offset
    n, inner = shape[0], shape[1]
    if part == "fused":  # transformers 5.x stacked layout [E, out, in]
        name = src[0][0]
        sl = read(name).get_slice(name)

        def expert_rows(e: int, i0: int, i1: int) -> torch.Tensor:
            return sl[off + e : off + e + 1, :, i0:i1][0].t()
    else:
        by = {(kind, e): hf_name for hf_name, kind, e in src}
        kinds = ("down",) if ours.endswith("w_down") else ("gate", "up")
        for kind in kinds:
            gone = [e for e in range(off, off + n) if (kind, e) not in by]
            if gone:
                raise ValueError(f"checkpoint {path} lacks the {kind}_proj weights of expert(s) "
                                 f"{gone[:8]} of {ours.rsplit('.', 1)[0]}")  # fmt: skip

        def expert_rows(e: int, i0: int, i1: int) -> torch.Tensor:
            cols = [read(by[k, off + e]).get_slice(by[k, off + e])[:, i0:i1].t() for k in kinds]
            return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)

    def rows(r0: int, r1: int) -> torch.Tensor:
        out = []
        for e in range(r0 // inner, -(-r1 // inner)):
            i0, i1 = max(r0 - e * inner, 0), min(r1 - e * inner, inner)
            out.append(expert_rows(e, i0, i1))
        return torch.cat(out) if len(out) > 1 else out[0]

    return rows


def from_pretrained(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    mtp: bool = False,
):
    """Load a HF DeepseekV3/V2 checkpoint directory (config.json + safetensors) into our model.

    `mtp=True` also loads the multi-token-prediction layers a DeepSeek-V3 release ships.
    Returns a `Transformer` in eval mode whose forward(input_ids).logits matches transformers.
    """
    from llmtrain.model import build_model

    path = Path(path)
    if (path / "state.json").is_file() or (path / "checkpoints").is_dir():
        from llmtrain.checkpoint import load_model

        return load_model(path, device, dtype)
    if not path.is_dir():
        raise MissingFileError(
            f"{path} is not a directory; give a Hugging Face model directory or one of our runs"
        )
    cfg = model_config_from_hf(read_hf_config(path), mtp=mtp)
    if not any(path.glob("*.safetensors")):  # before building a possibly huge model
        raise MissingFileError(
            f"{path} holds no *.safetensors weights; copy the model's weights there"
        )
    # allocated once, in `dtype` (routers fp32), and filled one weight at a time from the files
    # (safetensors slices): about 1x the model at peak, not the model plus the files read whole
    model = build_model(cfg, device="meta", dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.init_weights()  # buffers (rope), and the zero router bias a V2 checkpoint lacks
    try:
        load_hf_into(model, path, cfg)
    except ValueError as e:  # missing, extra or mis-shaped weights
        raise WeightsMismatchError(
            f"the weights in {path} do not fit its config.json: {' '.join(str(e).split())[:300]}"
        ) from e
    for m in model.moe_layers():
        m.gate.float()
    return model.eval()
