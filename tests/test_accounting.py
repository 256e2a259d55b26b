import json
import re

import pytest

from llmtrain.accounting import _router_numel, count, memory_per_rank
from llmtrain.cli import main
from llmtrain.config import load_config

from .conftest import FIXTURES, ROOT


def _count_json(capsys, *args):
    assert main(["count", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "name,total,active",
    [("deepseek_v3", 671e9, 37e9), ("deepseek_v2", 236e9, 21e9), ("deepseek_v2_lite", 15.7e9, 2.4e9)],
)  # fmt: skip
def test_published_configs(capsys, name, total, active):
    """The papers' "activated" parameters are non-embedding ones (the input table is a lookup):
    one convention for all three (V2-Lite's with its 0.2B embedding would be 2.66B, +11%)."""
    out = _count_json(capsys, FIXTURES / f"{name}_config.json")
    assert out["total_params"] == pytest.approx(total, rel=0.01)
    assert out["active_non_embedding_params"] == pytest.approx(active, rel=0.025)
    assert out["active_params"] - out["active_non_embedding_params"] == out["embedding_params"]


def test_shipped_yaml_shapes_match_their_published_counterparts(capsys):
    for yaml_name, hf_name in [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v2_lite", "deepseek_v2_lite"),
    ]:
        ours = _count_json(capsys, ROOT / "configs" / f"{yaml_name}.yaml", "--seq-len", "4096")
        ref = _count_json(capsys, FIXTURES / f"{hf_name}_config.json", "--seq-len", "4096")
        for key in ("total_params", "active_params", "mtp_params", "flops_per_token"):
            assert ours[key] == ref[key], (yaml_name, key)
    assert ours["mtp_params"] == 0  # V2-Lite ships no MTP layer
    assert ref["mtp_params"] == 0


def test_a_release_config_counts_its_mtp_layers(capsys):
    out = _count_json(capsys, FIXTURES / "deepseek_v3_config.json")
    # DeepSeek-V3's report: 671B main model + 14B MTP module = 685B, where the MTP module's
    # 14B counts its own copy of the embedding and head (0.93B each)
    emb = out["embedding_params"]
    assert out["mtp_params"] + 2 * emb == pytest.approx(14e9, rel=0.05)
    assert out["mtp_flops_per_token"] > 0


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
    states = ("weights", "master_weights", "gradients", "optimizer")
    assert sum(z3[k] for k in states) < sum(z1[k] for k in states)
    with pytest.raises(ValueError, match="ep_size"):
        memory_per_rank(cfg, 4, 1, 3)


def test_cli_count_table_and_errors(capsys, tmp_path):
    assert main(["count", str(ROOT / "configs" / "debug.yaml"), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "active parameters" in out and "memory / rank" in out
    assert main(["count", str(ROOT / "configs" / "debug.yaml"), "model.num_heads=3"]) == 2
    assert "num_heads" in capsys.readouterr().err


# ---------------------------------------------------------------- memory per rank

PARTS = ("weights", "master_weights", "gradients", "optimizer", "deepspeed_buffers",
         "activations", "runtime", "checkpoint_staging")  # fmt: skip


def _debug_model_cfg():
    return load_config(ROOT / "configs" / "debug.yaml").model


def test_memory_breakdown_sums_to_total():
    cfg = _debug_model_cfg()
    for stage in (0, 1, 2, 3):
        m = memory_per_rank(cfg, 4, stage, 2, "bf16", micro_batch=2, seq_len=128)
        assert m["total"] == pytest.approx(sum(m[k] for k in PARTS))
        assert m["model_states"] == pytest.approx(sum(m[k] for k in PARTS[:5]))
        assert all(m[k] >= 0 for k in PARTS) and m["activations"] > 0 and m["runtime"] > 0


def test_async_save_copy_and_fp32_routers_are_counted():
    """train.async_save stages fp32 weights + both moments of the rank's partition in host
    memory; in bf16 every stage keeps each router's full fp32 weight on each rank (measured on
    the engine: tests/test_bf16.py)."""
    cfg = _debug_model_cfg()
    n = count(cfg).total_params
    for stage in (1, 3):
        plain = memory_per_rank(cfg, 4, stage, 1, "bf16")
        cpu = memory_per_rank(cfg, 4, stage, 1, "bf16", async_save=True)
        gpu = memory_per_rank(cfg, 4, stage, 1, "bf16", async_save=True, device="cuda")
        part = plain["master_weights"] / 4  # this rank's partition, in elements
        assert part == pytest.approx(n / 4, rel=0.3)
        assert cpu["checkpoint_staging"] == 12 * part
        assert cpu["total"] == pytest.approx(plain["total"] + 12 * part)
        assert gpu["checkpoint_staging"] == 0 and gpu["host_bytes"] == 12 * part
    routers = (cfg.num_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts * cfg.hidden_size
    for stage in (0, 1, 2, 3):
        bf16 = memory_per_rank(cfg, 4, stage, 1, "bf16")
        fp32 = memory_per_rank(cfg, 4, stage, 1, "fp32")
        assert bf16["weights"] == pytest.approx(2 * (fp32["weights"] / 4) + 4 * routers), stage


def test_zero_stages_divide_what_they_should():
    cfg = _debug_model_cfg()
    w = 8
    m = {z: memory_per_rank(cfg, w, z, 1, "bf16") for z in (0, 1, 2, 3)}
    n = count(cfg).total_params
    # stage 1 partitions the optimizer state (moments and master copy) over the W ranks
    assert m[0]["optimizer"] == 8 * n and m[1]["optimizer"] == pytest.approx(8 * n / w)
    assert m[0]["master_weights"] == 4 * n and m[1]["master_weights"] == pytest.approx(4 * n / w)
    # stage 2 also the gradients, stage 3 also the weights
    # (bf16 keeps gradients in fp32: DeepSpeed's grad_accum_dtype; stage 1 a full copy)
    assert m[2]["gradients"] < m[1]["gradients"] and m[2]["gradients"] == pytest.approx(4 * n / w)
    assert m[1]["gradients"] == pytest.approx(4 * n)  # bf16 grads freed as they are added
    routers = (
        4 * (cfg.num_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts * cfg.hidden_size
    )
    assert m[3]["weights"] < m[2]["weights"] == 2 * n + routers  # + the routers' fp32 copies
    for z in (1, 2, 3):  # each stage holds no more model state than the one below
        for k in ("optimizer", "master_weights", "gradients", "weights"):
            assert m[z][k] <= m[z - 1][k] or (z == 1 and k == "gradients")
    # ZeRO-3 pays for gathered parameters: on a model past stage3_max_reuse_distance it wins
    v3 = load_config(ROOT / "configs" / "deepseek_v3.yaml").model
    assert memory_per_rank(v3, 64, 3, 1)["total"] < memory_per_rank(v3, 64, 2, 1)["total"]


def test_expert_parallelism_divides_expert_state():
    cfg = _debug_model_cfg()
    c = count(cfg)
    dense, experts = c.total_params - c.expert_params, c.expert_params
    for ep in (1, 2, 4, 8):
        m = memory_per_rank(cfg, 8, 2, ep, "bf16")
        # each rank computes with all dense weights and E/P experts ...
        assert m["weights"] == pytest.approx(2 * (dense + experts / ep) + 4 * _router_numel(cfg))
        # ... and ZeRO splits expert state over the W/P ranks holding the same experts
        assert m["optimizer"] == pytest.approx(8 * (dense / 8 + experts / ep / (8 // ep)))
    with pytest.raises(ValueError, match="ep_size"):
        memory_per_rank(cfg, 8, 2, 3)


def test_activation_checkpointing_lowers_activations():
    cfg = load_config(ROOT / "configs" / "bench_28m.yaml").model
    full = memory_per_rank(cfg, 1, 1, 1, "bf16", micro_batch=4, seq_len=512)
    ckpt = memory_per_rank(cfg, 1, 1, 1, "bf16", micro_batch=4, seq_len=512, activation_checkpointing=True)  # fmt: skip
    assert ckpt["activations"] < full["activations"]
    assert ckpt["weights"] == full["weights"] and ckpt["optimizer"] == full["optimizer"]
    double = memory_per_rank(cfg, 1, 1, 1, "bf16", micro_batch=8, seq_len=512)
    assert double["activations"] > 1.8 * full["activations"]  # linear in tokens (+ head grad)


def test_cli_count_prints_and_json_carries_the_breakdown(capsys):
    cfg = str(ROOT / "configs" / "debug.yaml")
    args = ["count", cfg, "--world-size", "4", "--zero-stage", "2", "--ep-size", "2",
            "--micro-batch", "2", "--seq-len", "64", "--dtype", "bf16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for line in ("fp32 master copy", "AdamW moments", "activations", "runtime", "B=2, T=64"):
        assert line in out
    assert main([*args, "--activation-checkpointing", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    mem = j["memory_per_rank_bytes"]
    assert j["memory_per_rank_inputs"]["activation_checkpointing"] is True
    ref = memory_per_rank(_debug_model_cfg(), 4, 2, 2, "bf16", micro_batch=2, seq_len=64,
                          activation_checkpointing=True)  # fmt: skip
    assert mem == pytest.approx(ref)
    assert mem["total"] == pytest.approx(sum(mem[k] for k in PARTS))
    assert "measured" in j["memory_runtime_provenance"]
    assert main(["count", cfg, "--world-size", "4", "--ep-size", "3"]) == 2
    # on CUDA flash-attn is assumed (v padded to the q/k width); --attn-kernel fused is SDPA's,
    # v at its own width (MLA: narrower), so fewer activation bytes
    acts = {}
    for kernel in ([], ["--attn-kernel", "fused"]):
        assert main([*args, "--device", "cuda", "--json", *kernel]) == 0
        j = json.loads(capsys.readouterr().out)
        acts[bool(kernel)] = j["memory_per_rank_bytes"]["activations"]
        assert j["memory_per_rank_inputs"]["attn_kernel"] == (kernel[1] if kernel else None)
    assert acts[True] < acts[False]


def test_predicted_model_states_equal_real_bytes_after_one_step():
    """1 rank, fp32 (DeepSpeed stage 0): weights + gradients + AdamW moments, counted by hand."""
    import torch

    from llmtrain.model import build_model

    cfg = _debug_model_cfg()
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    model(x, labels=x).loss.backward()
    opt.step()
    params = list(model.parameters())
    real = {
        "weights": sum(p.nbytes for p in params),
        "gradients": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer": sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step"),
    }
    pred = memory_per_rank(cfg, 1, 2, 1, "fp32")
    assert pred["zero_stage"] == 0  # one fp32 process: the engine runs stage 0
    assert {k: pred[k] for k in real} == real
    assert pred["master_weights"] == 0


@pytest.mark.parametrize("mtp_depth", [0, 1, 2])
def test_predicted_activations_match_what_autograd_saves(mtp_depth):
    """Bytes of the distinct storages autograd saves in one forward (CPU fp32: SDPA's math
    kernel) against the prediction's `saved` term, with and without checkpointing, with and
    without MTP modules (which checkpointing leaves whole)."""
    import torch

    from llmtrain.accounting import activation_bytes, attention_kernel
    from llmtrain.model import build_model

    cfg = load_config(ROOT / "configs" / "debug.yaml", [f"model.mtp_depth={mtp_depth}"]).model
    model = build_model(cfg, seed=0)
    b, t = 4, 128
    x = torch.randint(0, cfg.vocab_size, (b, t))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for ckpt in (False, True):
        seen: dict[int, int] = {}

        def pack(tensor, seen=seen):
            st = tensor.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return tensor

        model.gradient_checkpointing = ckpt
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(x, labels=x).loss
        loss.backward()
        kernel = attention_kernel(cfg, "cpu", "fp32")
        pred = activation_bytes(cfg, b, t, "fp32", ckpt, kernel)
        assert sum(seen.values()) == pytest.approx(pred["saved"], rel=0.06)


@pytest.mark.parametrize("overrides", [[], ["model.mtp_depth=1"], ["model.q_lora_rank=null"]])
def test_matmul_inventory_is_the_models_weights_and_the_counted_flops(overrides):
    """matmuls() lists every weight matmul the built model has, with its shape and how many
    times it runs, and its FLOPs are count()'s less the attention terms."""
    from collections import Counter

    from llmtrain.accounting import matmuls
    from llmtrain.model import build_model

    cfg = load_config(ROOT / "configs" / "debug.yaml", overrides).model
    tokens = 96
    inv = {m.name: m for m in matmuls(cfg, tokens)}
    seen: Counter = Counter()
    for name, p in build_model(cfg).named_parameters():
        if p.dim() < 2 or name == "model.embed_tokens.weight":
            continue
        key = re.sub(r"^(model\.layers\.\d+\.|mtp\.\d+\.block\.|mtp\.\d+\.)", "", name)
        key = key.removesuffix(".weight")
        m = inv[key]
        shape = (
            (m.groups, m.k, m.n) if m.groups > 1 else (m.n, m.k)
        )  # experts [E,K,N], Linear [N,K]
        assert tuple(p.shape) == shape, name
        seen[key] += 1
    runs = {k: m.count for k, m in inv.items()}
    assert seen == {**runs, "lm_head": 1}  # one head, which each MTP module runs again
    assert runs["lm_head"] == 1 + cfg.mtp_depth
    assert inv["mlp.experts.w_down"].m == tokens * cfg.num_experts_per_tok
    n = count(cfg, seq_len=64)
    attn = n.attn_flops_per_token  # the MTP blocks' attention included
    assert sum(m.train_flops for m in inv.values()) == pytest.approx(
        (n.flops_per_token - attn) * tokens, rel=1e-12
    )


def test_count_lists_the_matmuls_of_a_micro_batch(capsys):
    """`llmtrain count --matmuls`: the same inventory, for the config's micro-batch (B × T)."""
    cfg = load_config(ROOT / "configs" / "debug.yaml")
    out = _count_json(capsys, ROOT / "configs" / "debug.yaml", "--matmuls", "--micro-batch", "3",
                      "model.mtp_depth=1")  # fmt: skip
    tokens = 3 * cfg.train.seq_len
    mms = {m["name"]: m for m in out["matmuls"]}
    assert mms["lm_head"]["m"] == tokens and mms["mlp.gate"]["fp32"] is True
    assert mms["mlp.experts.w_gate_up"]["groups"] == cfg.model.n_routed_experts
    attn = out["attn_flops_per_token"]
    assert sum(m["train_flops"] for m in mms.values()) == pytest.approx(
        (out["flops_per_token"] - attn) * tokens, rel=1e-12
    )
    assert main(["count", str(ROOT / "configs" / "debug.yaml"), "--matmuls"]) == 0
    text = capsys.readouterr().out
    assert "weight matmuls of one micro-batch" in text and "mlp.experts.w_down" in text


@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_attention_flops_are_the_models_qk_and_av_matmuls(mtp_depth):
    """The attention row against torch's FLOP counter on the reference kernel, whose QKᵀ and
    A·V are full [T, T] bmm's: × (T + 1) / 2T, the causal half, they are the row's FLOPs (an
    MTP module runs T - k positions, which the row rounds to T: within 1/T)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrain.model import build_model

    cfg = load_config(ROOT / "configs" / "debug.yaml",
                      ["model.attn_backend=reference", f"model.mtp_depth={mtp_depth}"]).model  # fmt: skip
    b, t = 2, 64
    x = torch.randint(0, cfg.vocab_size, (b, t))
    with FlopCounterMode(display=False) as fc:
        build_model(cfg, seed=0)(x, labels=x).loss.backward()
    bmm = fc.get_flop_counts()["Global"][torch.ops.aten.bmm] * (t + 1) / (2 * t)
    got = count(cfg, seq_len=t).attn_flops_per_token * b * t
    assert got == pytest.approx(bmm, rel=1e-12 if mtp_depth == 0 else 1.0 / t)


def test_count_predicts_memory_for_this_machine_by_default(capsys):
    """Without --device, memory is predicted for the device a run here would use."""
    import torch

    here = "cuda" if torch.cuda.is_available() else "cpu"
    out = _count_json(capsys, ROOT / "configs" / "debug.yaml", "--world-size", "1")
    assert out["memory_per_rank_inputs"]["device"] == here
    other = "cpu" if here == "cuda" else "cuda"
    forced = _count_json(
        capsys, ROOT / "configs" / "debug.yaml", "--world-size", "1", "--device", other
    )
    assert forced["memory_per_rank_inputs"]["device"] == other
    assert forced["memory_per_rank_bytes"]["runtime"] != out["memory_per_rank_bytes"]["runtime"]


def test_a_config_json_counts_flops_and_memory_at_one_length(capsys):
    """A config.json has no train.seq_len: FLOPs and memory both take min(4096, max positions)
    (V3's 163,840 positions would make attention most of the FLOPs line)."""
    out = _count_json(capsys, FIXTURES / "deepseek_v3_config.json", "--world-size", "1024",
                      "--ep-size", "64")  # fmt: skip
    assert out["seq_len"] == out["memory_per_rank_inputs"]["seq_len"] == 4096
    yaml = _count_json(capsys, ROOT / "configs" / "deepseek_v3.yaml", "--seq-len", "4096")
    assert out["flops_per_token"] == yaml["flops_per_token"]


def test_gpu_peaks_by_part_and_fp32_precision():
    """MFU's peak: PCIe/NVL parts are not the SXM part whose name they contain, and fp32 is
    TF32's peak only where torch lets fp32 matmuls use TF32 (its default does not)."""
    import torch

    from llmtrain.train.metrics import gpu_peak

    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert gpu_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert gpu_peak("NVIDIA H200 NVL", "bf16") == 835e12
    assert gpu_peak("NVIDIA GeForce RTX 3090", "bf16") is None
    assert gpu_peak("NVIDIA H800 PCIe", "bf16") == 756e12
    assert gpu_peak("NVIDIA H200", "bf16") == 989e12 and gpu_peak("NVIDIA H20", "bf16") == 148e12
    assert (
        gpu_peak("NVIDIA GB200", "bf16") == 2500e12 and gpu_peak("NVIDIA B200", "bf16") == 2250e12
    )
    assert gpu_peak("AMD Instinct MI300X", "bf16") == 1307.4e12
    assert gpu_peak("NVIDIA B200", "fp32") is None  # not in the table: measured
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert gpu_peak("NVIDIA H100 80GB HBM3", "fp32") == 67e12
        torch.set_float32_matmul_precision("high")
        assert gpu_peak("NVIDIA H100 80GB HBM3", "fp32") == 494.5e12
    finally:
        torch.set_float32_matmul_precision(before)
