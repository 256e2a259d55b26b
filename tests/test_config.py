import dataclasses

import pytest

from llmtrain.config import Config, ConfigError, ModelConfig, load_config, parse_overrides

from .conftest import ROOT


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    if path.parent.name == "families":  # model families: every member they can produce is valid
        from llmtrain.scaling.family import Family

        members = Family(path).candidates()
        assert len(members) > 3 and all(isinstance(c, Config) for c in members)
        return
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        ROOT / "configs" / "debug.yaml",
        ["model.num_layers=5", "train.lr=1e-3", "model.q_lora_rank=null", "model.rope.type=yarn",
         "model.rope.factor=4", "parallel.zero_stage=2"],
    )  # fmt: skip
    assert cfg.model.num_layers == 5
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.model.q_lora_rank is None
    assert cfg.model.rope.type == "yarn" and cfg.model.rope.factor == 4.0
    assert cfg.parallel.zero_stage == 2
    assert parse_overrides(["a.b.c=true"]) == {"a": {"b": {"c": True}}}
    # numbers are numbers inside mappings and lists too (YAML 1.1 reads 5e8 as a string)
    cfg = load_config(
        ROOT / "configs" / "debug.yaml",
        ["train.deepspeed.zero_optimization.reduce_bucket_size=5e8", "train.max_steps=1e3",
         "data.sources=[{path: a.jsonl, weight: 1e-1}]", 'data.tokenizer="5e8"'],
    )  # fmt: skip
    assert cfg.train.deepspeed["zero_optimization"]["reduce_bucket_size"] == 5e8
    assert cfg.train.max_steps == 1000 and cfg.data.sources[0]["weight"] == 0.1
    assert cfg.data.tokenizer == "5e8" and parse_overrides(["a=1e"]) == {"a": "1e"}
    for bad, what in (("train.eval_batches=0", "eval_batches"), ("data.max_bytes=-1", "max_bytes"),
                      ("train.eval_sequences=-1", "eval_sequences"),
                      ("train.time_limit_minutes=-5", "time_limit_minutes")):  # fmt: skip
        with pytest.raises(ConfigError, match=what):
            load_config(ROOT / "configs" / "debug.yaml", [bad])


def test_unknown_keys_are_errors_naming_them(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError, match="model.hiden_size"):
        load_config(p)
    with pytest.raises(ConfigError, match="trian"):
        load_config(None, ["trian.lr=1"])
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(None, ["model.num_layers=abc"])


BAD = [
    ({"num_heads": 7}, "num_heads"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ({"n_group": 4, "topk_group": 5}, "topk_group"),
    ({"n_routed_experts": 10, "n_group": 4}, "n_group"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"kv_lora_rank": -1}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
    ({"attn_backend": "xformers"}, "attn_backend"),
    ({"n_routed_experts": 16, "n_group": 16, "topk_group": 1}, "n_group"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[b[1] for b in BAD])
def test_impossible_model_configs_name_the_field(change, field):
    cfg = dataclasses.replace(ModelConfig(), **change)
    with pytest.raises(ConfigError, match=field):
        cfg.validate()


def test_unknown_rope_type_and_cross_section_checks():
    with pytest.raises(ConfigError, match="model.rope.type"):
        load_config(None, ["model.rope.type=ntk"])
    with pytest.raises(ConfigError, match="seq_len"):
        load_config(None, ["train.seq_len=100000"])
    with pytest.raises(ConfigError, match="ep_size"):
        load_config(None, ["parallel.ep_size=3"])
    with pytest.raises(ConfigError, match="train.compile=true with parallel.zero_stage=3"):
        load_config(None, ["parallel.zero_stage=3", "train.compile=true", "train.dtype=bf16"])
    with pytest.raises(ConfigError, match="train.compile=true with train.dtype=fp32"):
        load_config(None, ["train.compile=true", "train.dtype=fp32"])
    with pytest.raises(ConfigError, match="train.compile_mode='fast': use one of default"):
        load_config(None, ["train.compile=true", "train.compile_mode=fast"])
    with pytest.raises(ConfigError, match="add train.compile=true"):
        load_config(None, ["train.compile_mode=reduce-overhead"])
    graphs = ["train.compile=true", "train.dtype=bf16", "train.compile_mode=reduce-overhead"]
    with pytest.raises(ConfigError, match="with parallel.ep_size=2: the rows"):
        load_config(None, [*graphs, "parallel.ep_size=2"])
    with pytest.raises(ConfigError, match="immediate_grad_update=false"):
        load_config(None, [*graphs, "train.deepspeed={bf16: {immediate_grad_update: false}}"])
    with pytest.raises(ConfigError, match="activation_checkpointing=true: .*154306"):
        load_config(None, [*graphs, "train.activation_checkpointing=true"])
    load_config(
        None, ["train.compile=true", "train.dtype=bf16", "train.activation_checkpointing=true"]
    )
    load_config(
        None, ["train.compile=true", "train.dtype=bf16", "train.compile_mode=reduce-overhead"]
    )
    yarn = ["model.rope.type=yarn", "model.rope.original_max_position_embeddings=128"]
    with pytest.raises(ConfigError, match="beyond YaRN's reach .* raise model.rope.factor to 4"):
        load_config(None, [*yarn, "model.rope.factor=2", "model.max_position_embeddings=512"])
    load_config(None, [*yarn, "model.rope.factor=4", "model.max_position_embeddings=512"])


def test_a_hf_config_past_yarns_reach_still_loads():
    """transformers warns, and loads such a config.json: so do we (count, export, eval)."""
    from llmtrain.hf import model_config_from_hf, read_hf_config

    hf = read_hf_config(ROOT / "tests" / "fixtures" / "deepseek_v2_lite_config.json")
    hf["rope_scaling"] = {**hf["rope_scaling"], "factor": 4}  # reach 16K of its 163,840
    assert model_config_from_hf(hf).rope.factor == 4


def test_bad_config_fails_before_any_allocation():
    from llmtrain.model import build_model

    cfg = ModelConfig(num_heads=7)
    with pytest.raises(ConfigError):
        build_model(cfg)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(ROOT / "configs" / "debug.yaml", ["model.mtp_depth=2"])
    cfg.save(tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg


def test_yaml_and_override_syntax_errors_are_config_errors(tmp_path):
    from llmtrain.errors import LlmtrainError

    bad = tmp_path / "tab.yaml"
    bad.write_text("train:\n\tlr: 1\n")
    with pytest.raises(ConfigError, match="tabs") as e:
        load_config(bad)
    assert isinstance(e.value, LlmtrainError) and isinstance(e.value, ValueError)
    with pytest.raises(ConfigError, match=r"data.sources=\[a"):
        parse_overrides(["data.sources=[a"])


@pytest.mark.parametrize("override", ["train.lr=nan", "train.lr=.inf", "model.init_std=-.inf",
                                      "model.rms_norm_eps=NaN"])  # fmt: skip
def test_non_finite_numbers_are_refused(override):
    with pytest.raises(ConfigError, match="finite"):
        load_config(ROOT / "configs" / "debug.yaml", [override])


def test_one_source_as_a_string_and_warmup_clamped():
    cfg = load_config(ROOT / "configs" / "debug.yaml", ["data.sources=a.txt", "train.max_steps=5"])
    assert cfg.data.sources == ["a.txt"]
    assert cfg.train.warmup_steps == 5  # debug.yaml's 20 clamped to the run
    with pytest.raises(ConfigError, match="warmup_steps=-1"):
        load_config(ROOT / "configs" / "debug.yaml", ["train.warmup_steps=-1"])


DEBUG_YAML = ROOT / "configs" / "debug.yaml"


def test_duplicate_yaml_keys_are_errors(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `model:` section would silently
    replace the whole first one."""
    f = tmp_path / "dup.yaml"
    f.write_text("model:\n  hidden_size: 64\n  num_heads: 4\nmodel:\n  vocab_size: 512\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'model' \(first at line 1\)"):
        load_config(f)


def test_config_mends_from_the_audit():
    # a mapping override after a dotted one keeps the dotted one (either order)
    over = ["model.rope.factor=4", "model.rope={type: yarn, original_max_position_embeddings: 128}"]
    for order in (over, over[::-1]):
        c = load_config(DEBUG_YAML, order + ["model.max_position_embeddings=512"])
        assert c.model.rope.factor == 4 and c.model.rope.type == "yarn"
    # the closest key is named
    with pytest.raises(ConfigError, match=r"did you mean model\.hidden_size\?"):
        load_config(DEBUG_YAML, ["model.hiden_size=64"])
    # what llmtrain derives cannot be overridden behind its back through train.deepspeed
    for key, ours in (("zero_optimization.stage=3", "parallel.zero_stage"),
                      ("bf16.enabled=true", "train.dtype"), ("train_batch_size=16", "train.global_batch_size")):  # fmt: skip
        with pytest.raises(ConfigError, match=ours):
            load_config(DEBUG_YAML, [f"train.deepspeed.{key}"])
    load_config(DEBUG_YAML, ["train.deepspeed.zero_optimization.overlap_comm=true"])  # others pass
    with pytest.raises(ConfigError, match=r"no effect with model\.rope\.type=default"):
        load_config(DEBUG_YAML, ["model.rope.factor=4"])
    with pytest.raises(ConfigError, match="train.seq_len > model.mtp_depth"):
        load_config(DEBUG_YAML, ["model.mtp_depth=2", "train.seq_len=2"])
    # wsd: a warmup that runs into the decay warms up until the decay starts (no LR drop)
    c = load_config(DEBUG_YAML, ["train.schedule=wsd", "train.max_steps=400", "train.warmup_steps=380",
                                 "train.decay_fraction=0.2"])  # fmt: skip
    assert c.train.warmup_steps == 320
