"""Export: trained checkpoints (any layout) -> stock transformers with the same logits; Hub push."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import llmtrain
from llmtrain.config import load_config
from llmtrain.export import ExportError, export, save_consolidated

from .conftest import ROOT
from .fake_hub import TOKEN, FakeHub
from .hf_utils import DEBUG_HF, make_hf_model
from .train_utils import run_train


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _train(path, cache, nproc, *extra):
    run_train(path, nproc, ["train.max_steps=4", "train.warmup_steps=1", f"data.cache_dir={cache}",
                            "train.sample_tokens=0", "train.save_every=4", "train.tensorboard=false", *extra])  # fmt: skip
    return path


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, cache):
    """2 ranks, ZeRO-2, experts split over 2 ranks, multi-token prediction on."""
    return _train(tmp_path_factory.mktemp("ep") / "run", cache, 2, "parallel.zero_stage=2", "parallel.ep_size=2",
                  "model.mtp_depth=1")  # fmt: skip


IDS = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(0))


def hf_logits_fresh_process(model_dir, repo=None, env_extra=None) -> torch.Tensor:
    """Load with stock transformers in a new process (offline unless a hub is given)."""
    code = (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({repo or str(model_dir)!r}, dtype=torch.float32).eval()\n"
        "ids = torch.load(sys.argv[1])\n"
        "with torch.no_grad(): torch.save(m(ids).logits, sys.argv[2])\n"
        "print(type(m).__name__)\n"
    )
    tmp = model_dir if repo is None else model_dir.parent
    tmp.mkdir(parents=True, exist_ok=True)
    ids_f, out_f = tmp / "ids.pt", tmp / "logits.pt"
    torch.save(IDS, ids_f)
    env = dict(os.environ, HF_HUB_OFFLINE="1" if repo is None else "0", **(env_extra or {}))
    p = subprocess.run(
        [sys.executable, "-c", code, str(ids_f), str(out_f)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(out_f), p.stdout.strip()


def test_zero2_ep2_export_loads_in_stock_transformers(ep_run, tmp_path):
    out = export(ep_run, tmp_path / "hf", dtype="fp32", shard_size="300KB")
    files = sorted(p.name for p in out.iterdir())
    assert (
        "model.safetensors.index.json" in files
        and sum(f.endswith(".safetensors") for f in files) > 1
    )
    for f in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    ):
        assert f in files, f
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "default" and "rope_theta" in cfg
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in idx  # experts of both EP ranks
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in idx
    assert (
        "model.layers.3.eh_proj.weight" in idx and "model.layers.3.shared_head.head.weight" in idx
    )  # MTP
    ours = llmtrain.from_pretrained(ep_run)
    assert (
        ours.moe_layers()[0].gate.e_score_correction_bias.abs().sum() > 0
    )  # trained bias survives
    with torch.no_grad():
        want = ours(IDS).logits
    got, cls = hf_logits_fresh_process(out)
    assert cls == "DeepseekV3ForCausalLM"
    assert (got - want).abs().max() < 1e-4
    card = (out / "README.md").read_text()
    assert (
        card.startswith("---\nlicense: apache-2.0")
        and "tokens seen" in card
        and "Multi-token" in card
    )
    # the card's parameter rows are what the files hold (the routers' bias is a buffer)
    from llmtrain.tensor_io import read_header

    numel = {"main": 0, "mtp": 0}
    for f in sorted(set(idx.values())):
        for name, h in read_header(out / f).items():
            if name == "__metadata__" or name.endswith("e_score_correction_bias"):
                continue
            if not name.startswith("model.layers.3."):
                numel["main"] += math.prod(h["shape"])
            elif not name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
                numel["mtp"] += math.prod(h["shape"])
    row = {r.split("|")[1].strip(): int(r.split("|")[2].replace(",", "")) for r in card.splitlines()
           if r.startswith("| ") and "parameters" in r or "prediction modules" in r}  # fmt: skip
    assert row["total parameters"] == numel["main"], (row, numel)
    assert [v for k, v in row.items() if k.startswith("multi-token")] == [numel["mtp"]], row


def test_verify_bf16_and_drop_mtp(ep_run, tmp_path):
    from llmtrain.export.verify import verify

    out = export(ep_run, tmp_path / "hf", dtype="bf16", mtp=False)
    idx_keys = json.loads((out / "config.json").read_text())
    assert idx_keys["torch_dtype"] == "bfloat16" and idx_keys["num_nextn_predict_layers"] == 0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("model.layers.3.") for k in f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    v = verify(out, ep_run)
    assert v["ok"], v
    with pytest.raises(ExportError, match="exists"):
        export(ep_run, out)


@pytest.mark.slow
def test_zero3_export(tmp_path, cache):
    run = _train(tmp_path / "run", cache, 2, "parallel.zero_stage=3")
    out = export(run, tmp_path / "hf", dtype="fp32")
    with torch.no_grad():
        want = llmtrain.from_pretrained(run)(IDS).logits
    got, _ = hf_logits_fresh_process(out)
    assert (got - want).abs().max() < 1e-4


def test_hf_to_ours_to_hf_is_byte_identical(tmp_path):
    from safetensors.torch import load_file

    hf = make_hf_model(seed=4, n_group=2, topk_group=1, vocab_size=1024)
    hf.save_pretrained(tmp_path / "orig")
    ours = llmtrain.from_pretrained(tmp_path / "orig")
    from llmtrain.config import Config

    ck = save_consolidated(ours, Config(model=ours.cfg), tmp_path / "ck")
    out = export(ck, tmp_path / "again", dtype="fp32")
    a = load_file(str(tmp_path / "orig" / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_softmax_model_exports_as_deepseek_v2(tmp_path):
    hf = make_hf_model(
        v2=True,
        seed=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        vocab_size=1024,
    )
    hf.save_pretrained(tmp_path / "orig")
    ours = llmtrain.from_pretrained(tmp_path / "orig")
    from llmtrain.config import Config

    out = export(
        save_consolidated(ours, Config(model=ours.cfg), tmp_path / "ck"),
        tmp_path / "v2",
        dtype="fp32",
    )
    got, cls = hf_logits_fresh_process(out)
    assert cls == "DeepseekV2ForCausalLM"
    with torch.no_grad():
        assert (got - hf(IDS).logits).abs().max() < 1e-4


def test_yarn_attention_factor_and_truncate_survive_the_export_config():
    """Read from a config.json and applied, so they must be written back too, or the exported
    model's logits differ from ours (4.9 and 4.4 at the parity test's size)."""
    from llmtrain.config import ModelConfig, RopeConfig
    from llmtrain.hf import hf_config_from_model, model_config_from_hf

    rope = RopeConfig(type="yarn", factor=4.0, original_max_position_embeddings=64,
                      attention_factor=1.3, truncate=False)  # fmt: skip
    back = model_config_from_hf(hf_config_from_model(ModelConfig(rope=rope)))
    assert back.rope.attention_factor == 1.3 and back.rope.truncate is False


def test_config_round_trips_keep_the_mtp_depth_and_read_yarn_as_transformers_does():
    """A softmax (DeepseekV2) export carries its MTP weights, so its config.json must say their
    depth, or they are dropped on the way back in; a YaRN config.json without
    original_max_position_embeddings takes the model's maximum, as transformers does."""
    from transformers import DeepseekV3Config

    from llmtrain.config import ModelConfig
    from llmtrain.hf import hf_config_from_model, model_config_from_hf

    v2 = ModelConfig(scoring_func="softmax", norm_topk_prob=False, bias_update_speed=0.0,
                     mtp_depth=1)  # fmt: skip
    out = hf_config_from_model(v2, mtp=True)
    assert out["model_type"] == "deepseek_v2" and model_config_from_hf(out, mtp=True).mtp_depth == 1
    out = hf_config_from_model(ModelConfig())
    out["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    out.pop("rope_scaling", None)
    want = DeepseekV3Config(**out).rope_parameters["original_max_position_embeddings"]
    got = model_config_from_hf(out).rope.original_max_position_embeddings
    assert got == want == out["max_position_embeddings"]


def test_softmax_half_rotation_is_refused_not_exported_wrong():
    """DeepseekV2 always rotates interleaved pairs: a softmax model trained with half rotation
    has no V2 equivalent, and writing one would give other logits."""
    from llmtrain.config import ModelConfig, RopeConfig
    from llmtrain.hf import hf_config_from_model

    cfg = ModelConfig(scoring_func="softmax", norm_topk_prob=False, bias_update_speed=0.0)
    assert hf_config_from_model(cfg)["model_type"] == "deepseek_v2"
    cfg.rope = RopeConfig(interleave=False)
    with pytest.raises(ValueError, match="rope.interleave=true"):
        hf_config_from_model(cfg)


def test_missing_or_corrupt_weights_are_named(ep_run, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(ep_run / "checkpoints" / "step_00000004", ck)
    index = json.loads((ck / "tensors.json").read_text())
    del index["tensors"]["model.layers.2.mlp.experts.w_down"]
    (ck / "tensors.json").write_text(json.dumps(index))
    with pytest.raises(ExportError, match="lacks 1 tensors"):
        export(ck, tmp_path / "a")
    shutil.copy(ep_run / "checkpoints" / "step_00000004" / "tensors.json", ck / "tensors.json")
    data = ck / "__1_0.distcp"  # rank 1's pieces
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ExportError, match="__1_0.distcp"):
        export(ck, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_text_generation_pipeline_on_export(ep_run, tmp_path):
    from transformers import pipeline

    out = export(ep_run, tmp_path / "hf", dtype="fp32")
    gen = pipeline("text-generation", model=str(out), device="cpu")
    text = gen("def ", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("def ") and len(text) > 4


def test_init_from_hf_checkpoint_starts_training_there(tmp_path, cache):
    """Continued pre-training: the first logged loss is the HF model's loss on that batch."""

    cfg = load_config(ROOT / "configs" / "debug.yaml", [f"data.cache_dir={cache}"])
    hf = make_hf_model(seed=6, **DEBUG_HF)
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    run_train(run, 1, ["train.max_steps=1", "train.warmup_steps=1", f"data.cache_dir={cache}", "train.sample_tokens=0",
                       f"train.init_from={tmp_path / 'hf'}", "model.aux_loss_alpha=0"])  # fmt: skip
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    bad = run_train(tmp_path / "bad", 1, [f"data.cache_dir={cache}", f"train.init_from={tmp_path / 'hf'}",
                                          "model.n_group=2", "model.topk_group=1"], check=False)  # fmt: skip
    assert bad.returncode == 2 and "model.n_group=2 (checkpoint: 4)" in bad.stderr
    assert first == pytest.approx(_hf_first_step_loss(hf, cfg), rel=1e-5)


def _hf_first_step_loss(hf, cfg) -> float:
    """transformers' mean loss over the micro-batches of step 0 (global batch 8, micro 4)."""
    from llmtrain.data.loader import PackedDataset, batches_for_step
    from llmtrain.data.prepare import prepare_data

    ds = PackedDataset(prepare_data(cfg.data, 1024), "train", cfg.train.seq_len)
    losses = []
    for mb in batches_for_step(ds, 0, 8, 0, 1, 4, cfg.train.seed):
        x, y = ds.batch(mb)
        with torch.no_grad():
            logits = hf(x).logits
        losses.append(
            torch.nn.functional.cross_entropy(logits.reshape(-1, 1024), y.reshape(-1)).item()
        )
    return sum(losses) / len(losses)


@pytest.mark.slow  # two 2-rank runs
@pytest.mark.parametrize("stage", [2, 3], ids=lambda s: f"zero{s}")
def test_init_from_at_ep2_gives_the_hf_models_first_loss(tmp_path, cache, stage):
    """Each rank reads only its experts (under ZeRO-3 into its partitions): the first loss is
    the HF model's loss on the step's batch, as at one rank."""

    cfg = load_config(ROOT / "configs" / "debug.yaml", [f"data.cache_dir={cache}"])
    hf = make_hf_model(seed=7, **DEBUG_HF)
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    run_train(run, 2, ["train.max_steps=1", "train.warmup_steps=1", f"data.cache_dir={cache}", "train.sample_tokens=0",
                       f"train.init_from={tmp_path / 'hf'}", "model.aux_loss_alpha=0",
                       f"parallel.zero_stage={stage}", "parallel.ep_size=2"])  # fmt: skip
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(_hf_first_step_loss(hf, cfg), rel=1e-5)


def _push(args, env):
    return subprocess.run([sys.executable, "-m", "llmtrain.cli", "export", *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip


def test_push_to_local_hub_and_load_back(ep_run, tmp_path):
    out = export(ep_run, tmp_path / "hf", dtype="fp32", shard_size="300KB")
    before = {p.name: p.stat().st_mtime for p in out.iterdir()}
    with FakeHub() as hub:
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1",
                   HF_HOME=str(tmp_path / "hfhome"), HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
        # refused, no token, invalid name: clear messages, export untouched
        hub.refuse_commits = True
        p = _push(["--push-only", str(out), "--push-to-hub", "org/tiny"], env)
        assert (
            p.returncode == 2
            and "refused" in p.stderr
            and "--push-only" in p.stderr
            and TOKEN not in p.stderr
        )
        no_tok = {k: v for k, v in env.items() if k != "HF_TOKEN"}
        p = _push(["--push-only", str(out), "--push-to-hub", "org/tiny"], no_tok)
        assert p.returncode == 2 and "no Hugging Face token" in p.stderr
        p = _push(["--push-only", str(out), "--push-to-hub", "org/bad name!"], env)
        assert p.returncode == 2 and "invalid" in p.stderr
        assert {q.name: q.stat().st_mtime for q in out.iterdir()} == before
        # retry without re-exporting
        hub.refuse_commits = False
        p = _push(["--push-only", str(out), "--push-to-hub", "org/tiny"], env)
        assert p.returncode == 0, p.stderr[-2000:]
        assert hub.seen_upload_modes == {"lfs", "regular"}  # LFS shards and inline small files
        assert (
            _push(
                ["--push-only", str(out), "--push-to-hub", "org/priv", "--private"], env
            ).returncode
            == 0
        )
        assert hub.repos["org/priv"]["private"] and not hub.repos["org/tiny"]["private"]
        # --private on an existing public repo: refused before anything is uploaded
        n_commits = len(hub.commits)
        p = _push(["--push-only", str(out), "--push-to-hub", "org/tiny", "--private"], env)
        assert p.returncode == 2 and "exists and is public" in p.stderr, p.stderr[-2000:]
        assert len(hub.commits) == n_commits
        # a later export in one file replaces the earlier shards (transformers would pick either)
        one = export(ep_run, tmp_path / "hf_one", dtype="fp32")
        assert _push(["--push-only", str(one), "--push-to-hub", "org/one"], env).returncode == 0
        assert _push(["--push-only", str(out), "--push-to-hub", "org/one"], env).returncode == 0
        weights = sorted(f for f in hub.repos["org/one"]["branches"]["main"] if "safetensors" in f)
        assert weights == sorted(p.name for p in out.iterdir() if "safetensors" in p.name), weights
        p = _push(["--push-only", str(out), "--push-to-hub", "org/tiny", "--revision", "v1"], env)
        assert p.returncode == 0 and "v1" in hub.repos["org/tiny"]["branches"]
        got, _ = hf_logits_fresh_process(tmp_path / "dl" / "x", repo="org/tiny", env_extra={
            "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf2")})  # fmt: skip
    with torch.no_grad():
        want = llmtrain.from_pretrained(ep_run)(IDS).logits
    assert (got - want).abs().max() < 1e-4


def test_push_refuses_an_incomplete_export_and_a_failed_upload_says_how_to_retry(ep_run, tmp_path):
    """A push deletes the Hub's earlier weight files: a folder with a shard missing or cut short
    (an export killed midway) is refused before anything is touched there. An unreachable Hub
    (a transport error, not an OSError) is one line saying nothing was committed."""
    import shutil
    import socket

    out = export(ep_run, tmp_path / "hf", dtype="fp32", shard_size="300KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    with FakeHub() as hub:
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1",
                   HF_HOME=str(tmp_path / "hfhome"), HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
        assert _push(["--push-only", str(out), "--push-to-hub", "org/x"], env).returncode == 0
        held, commits = dict(hub.repos["org/x"]["branches"]["main"]), len(hub.commits)
        for damage in ("missing", "truncated"):
            bad = tmp_path / damage
            shutil.copytree(out, bad)
            victim = bad / shards[1].name
            if damage == "missing":
                victim.unlink()
            else:
                victim.write_bytes(victim.read_bytes()[:-100])
            p = _push(["--push-only", str(bad), "--push-to-hub", "org/x"], env)
            assert p.returncode == 2 and "not a complete export" in p.stderr, p.stderr[-2000:]
            assert "Traceback" not in p.stderr
        assert hub.repos["org/x"]["branches"]["main"] == held and len(hub.commits) == commits
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    p = _push(["--push-only", str(out), "--push-to-hub", "org/x"],
              {**env, "HF_ENDPOINT": f"http://127.0.0.1:{dead}"})  # fmt: skip
    assert p.returncode == 2 and "nothing was committed" in p.stderr, p.stderr[-2000:]
    assert "--push-only" in p.stderr and "bug" not in p.stderr and TOKEN not in p.stderr


def test_secrets_in_the_config_are_not_published(ep_run, tmp_path):
    """train.deepspeed passes through DeepSpeed's own sections, some of which hold credentials
    (comet.api_key): the model card and llmtrain_config.yaml go to the Hub with the weights."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(ep_run, run)
    secret = "sk-SECRET123"
    for f in run.rglob("config.yaml"):
        d = yaml.safe_load(f.read_text())
        d["train"]["deepspeed"] = {**(d["train"].get("deepspeed") or {}),
                                   "comet": {"enabled": False, "api_key": secret}}  # fmt: skip
        f.write_text(yaml.safe_dump(d, sort_keys=False))
    out = export(run, tmp_path / "hf", dtype="fp32")
    for name in ("README.md", "llmtrain_config.yaml"):
        text = (out / name).read_text()
        assert secret not in text and "api_key" in text, name
    load_config(out / "llmtrain_config.yaml")  # still a config


def test_overwrite_never_deletes_a_run_or_other_files(ep_run, tmp_path):
    """`--overwrite` replaces an earlier export only: --out naming the run itself (or any run or
    checkpoint, or a folder that is not an export) is refused before anything is touched."""
    before = sorted(p.name for p in Path(ep_run).iterdir())
    for out in (ep_run, Path(ep_run) / "checkpoints"):
        with pytest.raises(ExportError, match="holds a run or checkpoint"):
            export(ep_run, out, dtype="fp32", overwrite=True)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an earlier export"):
        export(ep_run, other, dtype="fp32", overwrite=True)
    assert (other / "todo.txt").is_file() and sorted(
        p.name for p in Path(ep_run).iterdir()
    ) == before
    out = export(ep_run, tmp_path / "hf", dtype="fp32")
    assert export(ep_run, out, dtype="bf16", overwrite=True) == out  # an export: replaced


def test_verify_passes_when_the_prompt_holds_the_pad_id(tmp_path):
    """verify()'s random prompt holds token 0 at vocab 96 (seed 0), the pad_token_id it gives
    transformers' generate: without an explicit attention mask transformers masked that token
    and the greedy texts differed on a correct export."""
    from llmtrain.export.verify import verify

    hf = make_hf_model(seed=1)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    assert 0 in ids[0, :8]  # the case this test is about
    v = verify(tmp_path, tmp_path)
    assert v["max_abs_logit_diff"] <= v["bound"] and v["generate_equal"], v


def test_card_lists_mixture_sources_and_pinned_hub_datasets():
    """data.sources may hold mixture entries ({path, weight}) and hf:NAME#REVISION: the card's
    Hub metadata names the dataset, its table each source (a mixture entry broke the card)."""
    import types

    import yaml

    from llmtrain.export.card import model_card
    from llmtrain.hf import hf_config_from_model

    cfg = load_config(ROOT / "configs" / "debug.yaml",
                      ['data.sources=[{path: "hf:org/web:en@train#abc123", weight: 2}, a.jsonl]'])  # fmt: skip
    src = types.SimpleNamespace(config=cfg, state={"step": 1, "world_size": 1})
    card = model_card(src, hf_config_from_model(cfg.model), False, None, "apache-2.0", [])
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["datasets"] == ["org/web"], meta
    assert "| data | hf:org/web:en@train#abc123 (weight 2), a.jsonl |" in card


def test_hf_weights_that_do_not_fit_are_counted_and_named(tmp_path):
    """Loading an HF checkpoint (from_pretrained, train.init_from): extra tensors are all counted
    (not only the first named), and a missing expert's index is given."""
    from llmtrain.errors import LlmtrainError
    from llmtrain.hf import hf_config_from_model, state_dict_to_hf
    from llmtrain.model import build_model
    from llmtrain.tensor_io import write_safetensors

    cfg = load_config(ROOT / "configs" / "debug.yaml").model
    sd = {k: v.contiguous() for k, v in state_dict_to_hf(build_model(cfg).state_dict(), cfg)}
    extra = {f"model.layers.1.self_attn.x{i}.weight": torch.zeros(2) for i in range(3)}
    gone = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert gone in sd
    for name, w in (
        ("extra", {**sd, **extra}),
        ("gone", {k: v for k, v in sd.items() if k != gone}),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf_config_from_model(cfg)))
        write_safetensors(d / "model.safetensors", w)
        with pytest.raises(LlmtrainError) as e:
            llmtrain.from_pretrained(d)
        if name == "extra":
            assert "3 tensor(s) the model lacks" in str(e.value) and "x2.weight" in str(e.value)
        else:
            assert "down_proj weights of expert(s) [5] of model.layers.2" in str(e.value), e.value
