"""Logits of our model vs stock transformers' DeepseekV3/V2 on the same weights (fp32, 1e-4)."""

import zlib

import pytest
import torch

import llmtrain
from llmtrain.hf import state_dict_to_hf

from .hf_utils import YARN, make_hf_model

V3_CASES = {
    "base": {},
    "no_q_lora": {"q_lora_rank": None},
    "yarn": {"rope_parameters": YARN, "rope_interleave": True},
    "yarn_half_rotation": {"rope_parameters": YARN, "rope_interleave": False},
    "half_rotation": {"rope_interleave": False},
    "group_limited": {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "group_limited_top1": {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 1},
    "yarn_attention_factor": {"rope_parameters": {**YARN, "attention_factor": 1.3}},
    "yarn_no_truncate": {"rope_parameters": {**YARN, "truncate": False}},
    "yarn_no_mscale_keys": {"rope_parameters": {k: v for k, v in YARN.items() if "mscale" not in k}},
    "tied": {"tie_word_embeddings": True},
    "all_moe": {"first_k_dense_replace": 0},
    "two_dense_top4_unnormed": {"first_k_dense_replace": 2, "num_experts_per_tok": 4, "norm_topk_prob": False},
    "no_shared_v_ne_qk": {"n_shared_experts": 0, "v_head_dim": 24, "qk_nope_head_dim": 16},
    "everything": {"q_lora_rank": None, "rope_parameters": YARN, "rope_interleave": False,
                   "n_group": 4, "topk_group": 3, "num_experts_per_tok": 3, "tie_word_embeddings": True,
                   "first_k_dense_replace": 0, "n_shared_experts": 2},
}  # fmt: skip

V2_CASES = {
    "greedy": {},
    "group_limited": {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    "yarn_no_q_lora": {"rope_parameters": YARN, "q_lora_rank": None, "num_experts_per_tok": 3},
    "tied_all_moe": {"tie_word_embeddings": True, "first_k_dense_replace": 0},
}


def _compare(hf_model, tmp_path, seq=33):
    hf_model.save_pretrained(tmp_path)
    ours = llmtrain.from_pretrained(tmp_path)
    ids = torch.randint(
        0, hf_model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ref = hf_model(ids).logits
        got = ours(ids).logits
    assert got.shape == ref.shape
    return ours, (ref - got).abs().max().item()


@pytest.mark.parametrize("name", list(V3_CASES))
def test_v3_logits_match(name, tmp_path):
    hf = make_hf_model(seed=zlib.crc32(name.encode()) % 1000, **V3_CASES[name])
    _, err = _compare(hf, tmp_path)
    assert err < 1e-4, f"{name}: max-abs logits diff {err:.2e}"


@pytest.mark.parametrize("name", list(V2_CASES))
def test_v2_softmax_logits_match(name, tmp_path):
    hf = make_hf_model(v2=True, seed=zlib.crc32(name.encode()) % 1000, **V2_CASES[name])
    ours, err = _compare(hf, tmp_path)
    assert ours.cfg.scoring_func == "softmax"
    assert err < 1e-4, f"{name}: max-abs logits diff {err:.2e}"


def test_parity_would_catch_a_wrong_router_bias(tmp_path):
    """Guard that the comparison is sharp: dropping the bias must break parity."""
    hf = make_hf_model(seed=3, n_group=4, topk_group=2)
    hf.save_pretrained(tmp_path)
    ours = llmtrain.from_pretrained(tmp_path)
    for m in ours.moe_layers():
        m.gate.e_score_correction_bias.zero_()
    ids = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() > 1e-3


def test_weights_round_trip_to_hf_names(tmp_path):
    hf = make_hf_model(seed=5, n_group=2, topk_group=1)
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ours = llmtrain.from_pretrained(tmp_path)
    back = dict(state_dict_to_hf(ours.state_dict(), ours.cfg))
    assert set(back) == set(on_disk)
    for k, t in on_disk.items():
        assert torch.equal(back[k], t), k


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_backends_agree_on_hf_weights(backend, tmp_path):
    hf = make_hf_model(seed=9, rope_parameters=YARN)
    hf.save_pretrained(tmp_path)
    ours = llmtrain.from_pretrained(tmp_path)
    ours.cfg.attn_backend = backend
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max() < 1e-4


def test_a_left_padded_batch_matches_transformers_on_every_path(tmp_path):
    """Left pads under the mask check_mask asks for (pad & causal): a pad's query may attend no
    key. Each path gives the real tokens transformers' logits, none NaN (a NaN pad row once
    reached every token through 0·NaN in the next layer), and a float mask is refused."""
    from llmtrain.model import MLACache
    from llmtrain.model.attention import causal_mask

    hf = make_hf_model(seed=3)
    hf.save_pretrained(tmp_path)
    ours = llmtrain.from_pretrained(tmp_path)
    t = 12
    ids = torch.randint(1, 96, (2, t), generator=torch.Generator().manual_seed(0))
    real = torch.ones(2, t, dtype=torch.bool)
    real[1, :4] = False
    mask = real[:, None, None, :] & causal_mask(t, t, ids.device)
    with torch.no_grad():
        ref = hf(ids, attention_mask=real.long()).logits[real]
        for backend, cache in (("sdpa", None), ("sdpa", MLACache(ours.cfg.num_layers)),
                               ("reference", None)):  # fmt: skip
            ours.cfg.attn_backend = backend
            got = ours(ids, attention_mask=mask, cache=cache).logits
            assert not got.isnan().any(), (backend, cache)
            assert (got[real] - ref).abs().max() < 1e-4, (backend, cache)
        with pytest.raises(ValueError, match="must be boolean"):
            ours(ids, attention_mask=mask.float())


def test_missing_config_keys_read_as_transformers_reads_them(tmp_path):
    """A config.json without n_group / topk_group / routed_scaling_factor: transformers fills its
    class defaults (8, 4, 2.5 for V3), and so must we, or the logits differ silently."""
    import json

    from transformers import DeepseekV2Config, DeepseekV3Config

    from llmtrain.hf import HF_DEFAULTS

    for mtype, cls in (("deepseek_v3", DeepseekV3Config), ("deepseek_v2", DeepseekV2Config)):
        got = cls()
        for k, v in HF_DEFAULTS[mtype].items():
            assert getattr(got, k, v) == v, f"{mtype}.{k}: transformers {getattr(got, k)!r}"
    hf = make_hf_model(seed=4, n_routed_experts=16)
    hf.save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    for k in ("n_group", "topk_group", "routed_scaling_factor"):
        c.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(c))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (ref.config.n_group, ref.config.topk_group) == (8, 4)
    ours = llmtrain.from_pretrained(tmp_path)
    assert (ours.cfg.n_group, ours.cfg.topk_group, ours.cfg.routed_scaling_factor) == (8, 4, 2.5)
    ids = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ref(ids).logits - ours(ids).logits).abs().max() < 1e-4


def test_unsupported_hidden_act_is_refused():
    from llmtrain.config import ConfigError
    from llmtrain.hf import model_config_from_hf

    from .hf_utils import TINY

    hf = {"model_type": "deepseek_v3", **TINY}
    assert model_config_from_hf({**hf, "hidden_act": "swish"}).n_routed_experts == 8
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        model_config_from_hf({**hf, "hidden_act": "gelu"})
    # DeepSeek's own code makes every 2nd layer MoE, transformers every one: refused, not guessed
    assert model_config_from_hf({**hf, "moe_layer_freq": 1}).n_routed_experts == 8
    with pytest.raises(ConfigError, match="moe_layer_freq=2 is not supported"):
        model_config_from_hf({**hf, "moe_layer_freq": 2})
