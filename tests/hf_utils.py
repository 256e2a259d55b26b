"""Tiny stock-transformers DeepseekV3/V2 models for parity tests."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=256,
    initializer_range=0.15,
    tie_word_embeddings=False,
)

# configs/debug.yaml's model as a transformers config (train.init_from tests)
DEBUG_HF = dict(vocab_size=1024, hidden_size=64, intermediate_size=192, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                first_k_dense_replace=1, routed_scaling_factor=1.0, max_position_embeddings=512,
                initializer_range=0.05)  # fmt: skip

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def make_hf_model(v2: bool = False, seed: int = 0, bias: bool = True, **over):
    """A randomly initialised stock-transformers model (eval mode) with a random router bias."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    kw = dict(TINY)
    kw.update(over)
    torch.manual_seed(seed)
    if v2:
        kw.pop("rope_interleave", None)
        kw.setdefault("topk_method", "greedy")
        kw["norm_topk_prob"] = False
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**kw))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**kw))
        if bias:
            with torch.no_grad():
                for layer in model.model.layers:
                    gate = getattr(layer.mlp, "gate", None)
                    if gate is not None:
                        gate.e_score_correction_bias.normal_(0, 0.05)
    return model.eval()
