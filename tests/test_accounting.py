import json

import pytest

from llmtrain.accounting import count, memory_per_rank
from llmtrain.cli import main
from llmtrain.config import load_config

from .conftest import FIXTURES, ROOT


def _count_json(capsys, *args):
    assert main(["count", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "name,total,active,field",
    [
        ("deepseek_v3", 671e9, 37e9, "active_params"),
        ("deepseek_v2", 236e9, 21e9, "active_params"),
        ("deepseek_v2_lite", 15.7e9, 2.4e9, "active_non_embedding_params"),
    ],
)
def test_published_configs(capsys, name, total, active, field):
    out = _count_json(capsys, FIXTURES / f"{name}_config.json")
    assert out["total_params"] == pytest.approx(total, rel=0.01)
    assert out[field] == pytest.approx(active, rel=0.03)
    for key in ("total_params", "active_params", "flops_per_token", "kv_cache_bytes_per_token"):
        assert key in out


def test_shipped_yaml_shapes_match_their_published_counterparts(capsys):
    for yaml_name, hf_name in [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v2_lite", "deepseek_v2_lite"),
    ]:
        ours = _count_json(capsys, ROOT / "configs" / f"{yaml_name}.yaml", "--seq-len", "4096")
        ref = _count_json(capsys, FIXTURES / f"{hf_name}_config.json", "--seq-len", "4096")
        assert ours["total_params"] == ref["total_params"]
        assert ours["active_params"] == ref["active_params"]


def test_moe_100m_is_about_100m_active():
    c = count(load_config(ROOT / "configs" / "moe_100m.yaml").model)
    assert 90e6 < c.active_params < 115e6


def test_flops_hand_computed_for_a_dense_toy():
    cfg = load_config(None, [
        "model.vocab_size=10", "model.hidden_size=4", "model.intermediate_size=8", "model.num_layers=1",
        "model.num_heads=2", "model.q_lora_rank=null", "model.kv_lora_rank=2", "model.qk_nope_head_dim=2",
        "model.qk_rope_head_dim=2", "model.v_head_dim=2", "model.first_k_dense_replace=1",
        "model.n_routed_experts=2", "model.num_experts_per_tok=1",
    ]).model  # fmt: skip
    c = count(cfg, seq_len=3, kv_dtype="fp32")
    # q 4*2*4=32, kv_a 4*4=16, kv_b 2*2*4=16, o 2*2*4=16 -> 80 matmul + 2 (kv norm)
    # mlp 3*4*8=96; norms 2*4; final norm 4; emb 40; head 40
    assert c.total_params == 80 + 2 + 96 + 8 + 4 + 40 + 40
    assert c.active_non_embedding_params == c.total_params - 40
    matmul = 80 + 96 + 40
    attn = 6 * 2 * (4 + 2) * (3 + 1) / 2
    assert c.flops_per_token == 6 * matmul + attn
    assert c.kv_cache_bytes_per_token == 1 * (2 + 2) * 4
    assert c.kv_cache_bytes_per_token_mha == 1 * 2 * (4 + 2) * 4


def test_memory_per_rank_partitions():
    cfg = load_config(ROOT / "configs" / "debug.yaml").model
    z0 = memory_per_rank(cfg, 4, 0, 1, "fp32")
    z1 = memory_per_rank(cfg, 4, 1, 1, "fp32")
    z3 = memory_per_rank(cfg, 4, 3, 2, "fp32")
    n = count(cfg).total_params
    assert z0["weights"] == n * 4 and z0["optimizer"] == n * 8
    assert z1["optimizer"] == pytest.approx(n * 8 / 4)
    assert z3["total"] < z1["total"]
    with pytest.raises(ValueError, match="ep_size"):
        memory_per_rank(cfg, 4, 1, 3)


def test_cli_count_table_and_errors(capsys, tmp_path):
    assert main(["count", str(ROOT / "configs" / "debug.yaml"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "active parameters" in out and "memory / rank" in out
    assert main(["count", str(ROOT / "configs" / "debug.yaml"), "model.num_heads=3"]) == 2
    assert "num_heads" in capsys.readouterr().err
