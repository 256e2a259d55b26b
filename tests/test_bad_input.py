"""Bad input over every command and entry point: each case ends non-zero within seconds with
exactly one line on stderr that says what is wrong, no traceback, and leaves saved files alone.

Cases run in-process through `llmtrain.cli.main` (fast); a few go through the real entry points
in subprocesses (`python -m llmtrain.cli`, `python -m llmtrain.train`, the deepspeed launcher).
Data-record cases assert only what holds whether bad records are fatal or skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import llmtrain
from llmtrain.cli import main
from llmtrain.errors import LlmtrainError

from .conftest import ROOT
from .train_utils import VENV_BIN, env, free_port

DEBUG = str(ROOT / "configs" / "debug.yaml")
FAMILY = str(next((ROOT / "configs" / "families").glob("*.yaml")))
SECONDS = 60  # "within seconds": generous for a loaded 2-core CI machine


# ---------------------------------------------------------------- helpers


def _hashes(paths: list[Path]) -> dict[str, str]:
    out = {}
    for p in paths:
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        out.update({str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
    return out


def expect_one_line_error(
    capsys, argv: list[str], *needles: str, keep: list[Path] = (), rc: int | None = 2
) -> str:
    """Run the CLI in-process; assert the failure contract; return the error line."""
    before = _hashes(list(keep))
    t0 = time.perf_counter()
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's usage errors exit from inside parse_args
        got = e.code
    took = time.perf_counter() - t0
    cap = capsys.readouterr()
    err = cap.err
    assert got != 0, f"{argv} succeeded:\n{cap.out[-2000:]}"
    if rc is not None:
        assert got == rc, (got, err)
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err[-3000:]}"
    line = lines[0]
    assert "Traceback" not in err and line.startswith("llmtrain"), line
    assert "internal error" not in line, line
    for n in needles:
        assert n.lower() in line.lower(), (n, line)
    assert took < SECONDS, f"took {took:.0f} s"
    assert _hashes(list(keep)) == before, "a file that was already saved changed"
    return line


def _write(p: Path, data: str | bytes) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    return p


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """One of our (sharded) checkpoints of a random debug model, as export reads them."""
    from llmtrain.config import load_config
    from llmtrain.export import save_consolidated
    from llmtrain.model import build_model

    cfg = load_config(DEBUG)
    torch.manual_seed(0)
    return save_consolidated(build_model(cfg.model), cfg, tmp_path_factory.mktemp("ck") / "ck")


def _copy_ckpt(ckpt: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(ckpt, dst)
    return dst


# ---------------------------------------------------------------- config and count

# (id, extra files {name: content}, argv after `llmtrain`, words the error must name)
CONFIG_CASES: list[tuple[str, dict, list[str], tuple[str, ...]]] = [
    ("yaml-tab", {"c.yaml": "model:\n\thidden_size: 64\n"}, ["count", "{c.yaml}"], ("tabs",)),
    ("yaml-syntax", {"c.yaml": "model: [1, 2\n"}, ["count", "{c.yaml}"], ("not valid YAML", "line")),
    ("yaml-not-utf8", {"c.yaml": b"model:\n  hidden_size: \xff\xfe\n"}, ["count", "{c.yaml}"], ("UTF-8",)),
    ("yaml-binary", {"c.yaml": bytes(range(256))}, ["count", "{c.yaml}"], ("c.yaml",)),
    ("yaml-top-level-list", {"c.yaml": "- 1\n- 2\n"}, ["count", "{c.yaml}"], ("mapping",)),
    ("config-missing", {}, ["count", "{tmp}/nope.yaml"], ("does not exist",)),
    ("config-is-dir", {"d/x": "1"}, ["count", "{tmp}/d"], ("config.json",)),
    ("unknown-key", {}, ["count", DEBUG, "model.hiden_size=64"], ("model.hiden_size", "known keys")),
    ("unknown-section", {"c.yaml": "modle:\n  hidden_size: 64\n"}, ["count", "{c.yaml}"], ("modle",)),
    ("mistyped-int", {}, ["count", DEBUG, "model.num_layers=four"], ("model.num_layers", "integer")),
    ("bool-for-int", {}, ["count", DEBUG, "model.num_layers=true"], ("model.num_layers",)),
    ("list-for-float", {}, ["count", DEBUG, "train.lr=[1]"], ("train.lr", "number")),
    ("nan", {}, ["count", DEBUG, "train.lr=nan"], ("train.lr", "finite")),
    ("inf", {}, ["count", DEBUG, "model.init_std=.inf"], ("model.init_std", "finite")),
    ("negative", {}, ["count", DEBUG, "model.num_layers=-1"], ("model.num_layers", "positive")),
    ("negative-lr", {}, ["count", DEBUG, "train.lr=-0.1"], ("train.lr", "positive")),
    ("beta-out-of-range", {}, ["count", DEBUG, "train.beta2=1.5"], ("train.beta2",)),
    ("override-bad-yaml", {}, ["count", DEBUG, "data.sources=[a"], ("data.sources=[a", "brackets")),
    ("override-empty-key", {}, ["count", DEBUG, "=3"], ("empty key",)),
    ("count-micro-batch-0", {}, ["count", DEBUG, "--world-size", "1", "--micro-batch", "0"], ("--micro-batch 0",)),
    ("duplicate-key", {"c.yaml": "model:\n  hidden_size: 64\nmodel:\n  num_layers: 2\n"}, ["count", "{c.yaml}"], ("duplicate key 'model'",)),
    ("override-no-equals", {}, ["count", DEBUG, "train.lr"], ("section.key=value",)),
    ("section-as-scalar", {}, ["count", DEBUG, "model=3"], ("model", "mapping")),
    ("dict-for-list", {}, ["count", DEBUG, "data.sources={a: 1}"], ("data.sources", "list")),
    ("impossible-ep", {}, ["count", DEBUG, "parallel.ep_size=3"], ("parallel.ep_size",)),
    ("heads-dont-divide", {}, ["count", DEBUG, "model.num_heads=5"], ("model.num_heads",)),
    ("zero-stage-4", {}, ["count", DEBUG, "parallel.zero_stage=4"], ("parallel.zero_stage",)),
    ("unknown-flag", {}, ["count", DEBUG, "--bogus"], ("--bogus", "--help")),
    ("count-zero-stage-0", {}, ["count", DEBUG, "--world-size", "2", "--zero-stage", "0"], ("--zero-stage", "choose from 1, 2, 3")),
    ("yarn-past-reach", {}, ["count", DEBUG, "model.rope.type=yarn", "model.rope.original_max_position_embeddings=64"],
     ("beyond YaRN's reach", "model.rope.factor to 8")),
    ("count-negative-seq-len", {}, ["count", DEBUG, "--seq-len", "0"], ("--seq-len",)),
    ("count-impossible-ep", {}, ["count", DEBUG, "--world-size", "4", "--ep-size", "3"], ("--ep-size 3",)),
    ("seq-len-too-long", {}, ["count", DEBUG, "train.seq_len=4096"], ("max_position_embeddings",)),
    # Hugging Face configs that are not DeepSeek's
    ("hf-no-model-type", {"h/config.json": json.dumps({"hidden_size": 64, "vocab_size": 10})},
     ["count", "{tmp}/h"], ("no model_type", "num_attention_heads")),
    ("hf-llama", {"h/config.json": json.dumps({"model_type": "llama", "hidden_size": 64})},
     ["count", "{tmp}/h/config.json"], ("llama", "DeepseekV3")),
    ("hf-not-json", {"h/config.json": "{not json"}, ["count", "{tmp}/h"], ("not valid JSON",)),
    ("hf-string-size", {"h/config.json": "@v3:hidden_size=wide"}, ["count", "{tmp}/h"], ("hidden_size",)),
    ("hf-gqa", {"h/config.json": "@v3:num_key_value_heads=2"}, ["count", "{tmp}/h"], ("num_key_value_heads",)),
    ("hf-overrides", {"h/config.json": "@v3:hidden_size=7168"}, ["count", "{tmp}/h", "model.hidden_size=128"],
     ("model.hidden_size=128", "YAML")),
    ("hf-gelu", {"h/config.json": "@v3:hidden_act=gelu"}, ["count", "{tmp}/h"], ("hidden_act='gelu'",)),
    ("eval-sharded-device", {}, ["eval", "{tmp}", "--sharded", "--device", "cuda"], ("--device/--dtype",)),
    ("eval-overrides-unsharded", {}, ["eval", "{tmp}", "parallel.ep_size=2"], ("apply with --sharded",)),
    ("eval-overrides-after-tasks", {}, ["eval", "{tmp}", "--tasks", "llmtrain_mc", "parallel.ep_size=2"],
     ("(parallel.ep_size=2) apply with --sharded",)),
    ("eval-sharded-hf-dir", {"h/config.json": "@v3:hidden_size=7168"}, ["eval", "{tmp}/h", "--sharded"],
     ("Hugging Face directory", "drop --sharded")),
    ("eval-sharded-no-checkpoint", {"r/checkpoints/x": ""}, ["eval", "{tmp}/r", "--sharded"], ("no complete checkpoint",)),
    ("eval-batch-size-negative", {}, ["eval", "{tmp}", "--batch-size", "-2"], ("--batch-size -2: give 1",)),
    ("eval-until-step-negative", {}, ["eval", "{tmp}", "--watch", "--until-step", "-1"], ("--until-step -1",)),
    ("eval-poll-zero", {}, ["eval", "{tmp}", "--watch", "--poll", "0"], ("--poll 0.0: give seconds",)),
    ("eval-device-typo", {}, ["eval", "{tmp}", "--tasks", "llmtrain_ppl", "--device", "gpu0"], ("--device gpu0",)),
    ("eval-device-no-cuda", {}, ["eval", "{tmp}", "--tasks", "llmtrain_ppl", "--device", "cuda:7"], ("--device cuda:7", "CUDA device")),
    ("count-unknown-flag", {}, ["count", str(ROOT / "configs" / "debug.yaml"), "--bogus"], ("llmtrain count: error: unrecognized", "see llmtrain count --help")),
    ("fit-unknown-flag", {}, ["scaling", "fit", "{tmp}/x.csv", "--bogus"], ("see llmtrain scaling fit --help",)),
]  # fmt: skip


def _materialise(tmp: Path, files: dict) -> dict[str, str]:
    names = {"tmp": str(tmp)}
    for name, content in files.items():
        if isinstance(content, str) and content.startswith("@v3:"):
            key, value = content[4:].split("=")
            hf = json.loads((ROOT / "tests" / "fixtures" / "deepseek_v3_config.json").read_text())
            hf[key] = int(value) if value.isdigit() else value
            content = json.dumps(hf)
        names[name] = str(_write(tmp / name, content))
    return names


def _fill(argv: list[str], names: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for k, v in names.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


@pytest.mark.parametrize("files,argv,needles", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])  # fmt: skip
def test_config_and_count(tmp_path, capsys, files, argv, needles):
    argv = _fill(argv, _materialise(tmp_path, files))
    expect_one_line_error(capsys, argv, *needles)


def test_debug_flag_and_env_show_the_traceback(capsys, monkeypatch):
    from llmtrain.config import ConfigError

    with pytest.raises(ConfigError, match="hiden_size"):
        main(["--debug", "count", DEBUG, "model.hiden_size=1"])
    monkeypatch.setenv("LLMTRAIN_DEBUG", "1")
    with pytest.raises(ConfigError, match="hiden_size"):
        main(["count", DEBUG, "model.hiden_size=1"])


def test_verbose_flag_anywhere_on_the_line(capsys):
    assert main(["count", DEBUG, "-v"]) == 0
    assert main(["count", DEBUG, "--verbose", "--json"]) == 0
    assert main(["-v", "count", DEBUG]) == 0


def test_an_error_every_rank_agreed_on_is_said_by_rank_0_only(capsys, monkeypatch):
    """A stop the ranks agreed on collectively: one line for the job, not one per rank."""
    import llmtrain.cli as cli
    from llmtrain.train.loop import AgreedStop, TrainingError

    def stop(args, err=AgreedStop):
        raise err("stopped by SIGTERM after step 3: saved; continue with resume=auto")

    monkeypatch.setattr(cli, "cmd_count", stop)
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        assert main(["count", DEBUG]) == 2
        assert capsys.readouterr().err.count("error: stopped by SIGTERM") == lines
    monkeypatch.setattr(cli, "cmd_count", lambda a: stop(a, TrainingError))  # one rank's own
    assert main(["count", DEBUG]) == 2
    assert "error: stopped by" in capsys.readouterr().err


def test_traceback_env_prints_a_bugs_traceback_not_a_users(capsys, monkeypatch):
    """LLMTRAIN_TRACEBACK=1 (unattended runs, e.g. the GPU check): a bug's traceback goes to
    stderr before its one line, exit code unchanged; a user error stays one line."""
    import llmtrain.cli as cli

    def broken(args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setenv("LLMTRAIN_TRACEBACK", "1")
    assert main(["count", DEBUG, "model.hiden_size=1"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setattr(cli, "cmd_count", broken)
    assert main(["count", DEBUG]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err, err
    assert err.rstrip().splitlines()[-1].startswith("llmtrain count: error: internal error")
    monkeypatch.delenv("LLMTRAIN_TRACEBACK")
    assert main(["count", DEBUG]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_short_run_clamps_warmup_instead_of_refusing(caplog):
    from llmtrain.config import load_config

    with caplog.at_level("INFO", logger="llmtrain.config"):
        cfg = load_config(DEBUG, ["train.max_steps=10"])
    assert cfg.train.warmup_steps == 10
    assert "warmup_steps=20 exceeds train.max_steps=10" in caplog.text


# ---------------------------------------------------------------- Python API


def _hf_dir(tmp: Path, **changes) -> Path:
    hf = json.loads((ROOT / "tests" / "fixtures" / "deepseek_v3_config.json").read_text())
    hf.update(changes)
    return _write(tmp / "hf" / "config.json", json.dumps(hf)).parent


def _corrupt_index(tmp: Path) -> Path:
    """A debug-sized HF directory whose shard index is cut short (a copy interrupted)."""
    from llmtrain.config import load_config
    from llmtrain.hf import hf_config_from_model

    hf = _write(tmp / "hf" / "config.json",
                json.dumps(hf_config_from_model(load_config(DEBUG).model))).parent  # fmt: skip
    _write(hf / "model-00001-of-00001.safetensors", b"")
    return _write(hf / "model.safetensors.index.json", '{"weight_map": ').parent


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda t: _write(t / "x" / "config.json", '{"model_type": "gpt2"}').parent, "gpt2"),
        (lambda t: _write(t / "x" / "config.json", '{"hidden_size": 8}').parent, "model_type"),
        (lambda t: _write(t / "x" / "readme", "x").parent, "config.json"),
        (lambda t: t / "missing", "not a directory"),
        (lambda t: _hf_dir(t), "safetensors"),
        (_corrupt_index, "model.safetensors.index.json is corrupt"),
    ],
    ids=["gpt2", "no-model-type", "no-config", "missing-dir", "no-weights", "corrupt-index"],
)
def test_from_pretrained_raises_our_errors(tmp_path, make, needle):
    with pytest.raises(LlmtrainError, match=needle) as e:
        llmtrain.from_pretrained(make(tmp_path))
    assert "\n" not in str(e.value)


def test_from_pretrained_weights_of_another_model(tmp_path):
    """A model directory whose weights belong to a different config: one clear error."""
    from llmtrain.config import load_config
    from llmtrain.hf import hf_config_from_model, state_dict_to_hf
    from llmtrain.model import build_model
    from llmtrain.tensor_io import write_safetensors

    small = load_config(DEBUG).model
    other = load_config(DEBUG, ["model.hidden_size=128"]).model
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config_from_model(small)))
    sd = dict(state_dict_to_hf(build_model(other).state_dict(), other))
    write_safetensors(d / "model.safetensors", {k: v.contiguous() for k, v in sd.items()})
    with pytest.raises(LlmtrainError, match="do not fit|does not match"):
        llmtrain.from_pretrained(d)


# ---------------------------------------------------------------- export and checkpoints


def _truncate(f: Path) -> None:
    b = f.read_bytes()
    f.write_bytes(b[: len(b) // 2])


def _export_cases():
    def under_a_file(t, ck):
        _write(t / "afile", "x")
        return ["export", str(ck), "--out", str(t / "afile" / "hf")], ("afile", "is a file")

    def out_is_a_file(t, ck):
        return ["export", str(ck), "--out", str(_write(t / "f", "x"))], ("is a file",)

    def out_not_empty(t, ck):
        _write(t / "out" / "keep.txt", "mine")
        return ["export", str(ck), "--out", str(t / "out")], ("--overwrite",)

    def missing_ckpt(t, ck):
        return ["export", str(t / "nope"), "--out", str(t / "o")], ("neither a checkpoint",)

    def no_out(t, ck):
        return ["export", str(ck)], ("--out",)

    def truncated_shard(t, ck):
        ck2 = _copy_ckpt(ck, t / "ck2")
        _truncate(ck2 / "__0_0.distcp")
        return ["export", str(ck2), "--out", str(t / "o")], ("ck2",)

    def corrupt_metadata(t, ck):
        ck2 = _copy_ckpt(ck, t / "ck2")
        _write(ck2 / ".metadata", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
        return ["export", str(ck2), "--out", str(t / "o")], ("ck2",)

    def missing_shard(t, ck):
        ck2 = _copy_ckpt(ck, t / "ck2")
        (ck2 / "__0_0.distcp").unlink()
        return ["export", str(ck2), "--out", str(t / "o")], ("ck2",)

    def missing_metadata(t, ck):  # DCP's own index: named, not "no tensors.json"
        ck2 = _copy_ckpt(ck, t / "ck2")
        (ck2 / ".metadata").unlink()
        return ["export", str(ck2), "--out", str(t / "o")], ("but no .metadata",)

    def missing_index(t, ck):
        ck2 = _copy_ckpt(ck, t / "ck2")
        (ck2 / "tensors.json").unlink()
        return ["export", str(ck2), "--out", str(t / "o")], ("ck2",)

    def other_model(t, ck):
        ck2 = _copy_ckpt(ck, t / "ck2")
        y = (ck2 / "config.yaml").read_text().replace("hidden_size: 64", "hidden_size: 128")
        (ck2 / "config.yaml").write_text(y)
        return ["export", str(ck2), "--out", str(t / "o")], ("shape",)

    def newer_format(t, ck):  # a later release's checkpoint (or a damaged tensors.json)
        ck2 = _copy_ckpt(ck, t / "ck2")
        index = json.loads((ck2 / "tensors.json").read_text())
        _write(ck2 / "tensors.json", json.dumps({**index, "format": "llmtrain-dcp-99"}))
        return ["export", str(ck2), "--out", str(t / "o")], ("newer llmtrain",)

    def bad_dtype(t, ck):
        return ["export", str(ck), "--out", str(t / "o"), "--dtype", "fp8"], ("--dtype",)

    return {k: v for k, v in locals().items() if callable(v)}


EXPORT_CASES: dict[str, Callable] = _export_cases()


@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_export(tmp_path, capsys, ckpt, name):
    argv, needles = EXPORT_CASES[name](tmp_path, ckpt)
    keep = [ckpt] + [p for p in tmp_path.iterdir()]
    expect_one_line_error(capsys, argv, *needles, keep=keep)
    assert not any(p.name.endswith(".tmp-export") for p in tmp_path.rglob("*"))


# ---------------------------------------------------------------- scaling and hostfile


def _runs_csv(rows: list[tuple]) -> str:
    return "N,D,loss\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)


SCALING_CASES = [
    ("allocate-nan", {}, ["scaling", "allocate", "--flops", "nan"], ("--flops nan", "finite")),
    ("allocate-inf", {}, ["scaling", "allocate", "--flops", "inf"], ("finite",)),
    ("allocate-negative", {}, ["scaling", "allocate", "--flops=-1e20"], ("> 0",)),
    ("allocate-nothing", {}, ["scaling", "allocate"], ("--flops",)),
    ("allocate-unreachable-loss", {}, ["scaling", "allocate", "--target-loss", "1.0"], ("irreducible",)),
    ("allocate-missing-law", {}, ["scaling", "allocate", "--flops", "1e20", "--law", "{tmp}/no.json"], ("no.json",)),
    ("fit-missing-file", {}, ["scaling", "fit", "{tmp}/none.csv"], ("does not exist",)),
    ("fit-empty", {"r.csv": ""}, ["scaling", "fit", "{r.csv}"], ("no rows",)),
    ("fit-binary", {"r.csv": b"\xff\xfe\x00\x01" * 50}, ["scaling", "fit", "{r.csv}"], ("UTF-8",)),
    ("fit-text-in-number", {"r.csv": _runs_csv([(1e6, "many", 3.0)])}, ["scaling", "fit", "{r.csv}"], ("not a number",)),
    ("fit-one-budget", {"r.csv": _runs_csv([(1e6, 1e9, 3.1), (2e6, 5e8, 3.0), (4e6, 2.5e8, 3.2)])},
     ["scaling", "fit", "{r.csv}", "--approach", "2"], ("two or more",)),
    ("fit-one-size", {"r.csv": "N,C,loss\n" + "".join(f"1e6,{c},3\n" for c in [1e18] * 3 + [1e19] * 3)},
     ["scaling", "fit", "{r.csv}", "--approach", "2"], ("distinct model size",)),
    ("fit-duplicates", {"r.csv": _runs_csv([(1e6, 1e9, 3.0)] * 12)}, ["scaling", "fit", "{r.csv}"], ("approach",)),
    ("fit-flat", {"r.csv": "N,C,loss\n" + "".join(f"{n},{c},3.0\n" for c in (1e18, 1e19) for n in (1e6, 2e6, 4e6))},
     ["scaling", "fit", "{r.csv}", "--approach", "2"], ("curve upward",)),
    ("fit-rising", {"r.csv": "N,C,loss\n" + "".join(f"{n},{c},{3 + i * 0.1}\n" for c in (1e18, 1e19) for i, n in enumerate((1e6, 2e6, 4e6)))},
     ["scaling", "fit", "{r.csv}", "--approach", "2"], ("curve upward",)),
    ("fit-nan-loss", {"r.csv": _runs_csv([(1e6, 1e9, "nan")] * 3)}, ["scaling", "fit", "{r.csv}", "--approach", "3"], ("NaN",)),
    ("fit-zero-size", {"r.csv": "N,C,loss\n0,1e18,3\n1,1e18,3\n"}, ["scaling", "fit", "{r.csv}", "--approach", "2"], ("positive",)),
    ("fit-no-columns", {"r.csv": "a,b,loss\n1,2,3\n"}, ["scaling", "fit", "{r.csv}"], ("--n-col",)),
    ("fit-drop-too-many", {"r.csv": _runs_csv([(1e6, 1e9, 3.0)] * 3)}, ["scaling", "fit", "{r.csv}", "--drop-highest", "5"], ("--drop-highest",)),
    ("sweep-plan-bad-family", {}, ["scaling", "sweep", "plan", "--budgets", "1e15", "--family", "{tmp}/no.yaml", "--out", "{tmp}/s"], ("no.yaml",)),
    ("sweep-plan-nan-budget", {}, ["scaling", "sweep", "plan", "--budgets", "nan", "--family", FAMILY, "--out", "{tmp}/s"], ("--budgets",)),
    ("sweep-run-missing", {}, ["scaling", "sweep", "run", "{tmp}/nosweep"], ("nosweep",)),
    ("fit-planned-sweep", {"s/plan.json": "{}"}, ["scaling", "fit", "{tmp}/s"], ("no finished run", "sweep run")),
    ("hostfile-bad-line", {"h": "node1 slots=two\n"}, ["hostfile", "{h}"], ("h:1", "hostname slots=N")),
    ("hostfile-zero-slots", {"h": "node1 slots=0\n"}, ["hostfile", "{h}"], ("slots must be >= 1",)),
    ("hostfile-twice", {"h": "node1 slots=1\nnode1 slots=2\n"}, ["hostfile", "{h}"], ("twice",)),
    ("hostfile-empty", {"h": "# nothing\n"}, ["hostfile", "{h}"], ("no hosts",)),
    ("hostfile-missing", {}, ["hostfile", "{tmp}/nohosts"], ("does not exist",)),
    ("hostfile-binary", {"h": b"\xff\xfe\x00node"}, ["hostfile", "{h}"], ("not UTF-8",)),
]  # fmt: skip


@pytest.mark.parametrize("files,argv,needles", [c[1:] for c in SCALING_CASES],
                         ids=[c[0] for c in SCALING_CASES])  # fmt: skip
def test_scaling_and_hostfile(tmp_path, capsys, files, argv, needles):
    argv = _fill(argv, _materialise(tmp_path, files))
    expect_one_line_error(capsys, argv, *needles, keep=[tmp_path])


# ---------------------------------------------------------------- train (in-process)


@pytest.fixture
def one_process_env():
    """`train` in this process joins a group of one and sets RANK/WORLD_SIZE...; undo that."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _parquet(path: Path, column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: [f"document {i} " * 50 for i in range(50)]}), path)
    return path


def _tokenizer_too_big(path: Path) -> Path:
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(2000)}
    vocab["<|endoftext|>"] = 2000
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path))
    return path


NOT_UTF8 = b'{"text": "\xff\xfe"}\n' + bytes(8)
TRAIN_CASES = {
    "missing-file": (lambda t: [f"data.sources=[{t}/missing.txt]"], ("missing.txt",)),
    "empty-file": (lambda t: [f"data.sources=[{_write(t / 'e.txt', '')}]"], ("no training text", "e.txt")),
    "empty-dir": (lambda t: [f"data.sources=[{(t / 'd').mkdir() or t / 'd'}]"], ("holds no files", "no training text", "/d")),
    "binary-file": (lambda t: [f"data.sources=[{_write(t / 'b.txt', bytes(range(256)) * 8)}]"], ("b.txt",)),
    "jsonl-not-json": (lambda t: [f"data.sources=[{_write(t / 'x.jsonl', 'not json' + chr(10))}]"], ("x.jsonl",)),
    "jsonl-no-text-field": (lambda t: [f"data.sources=[{_write(t / 'x.jsonl', json.dumps({'body': 'hi'}) + chr(10))}]"], ("text",)),
    "jsonl-not-utf8": (lambda t: [f"data.sources=[{_write(t / 'x.jsonl', NOT_UTF8)}]"], ("x.jsonl",)),
    "parquet-0-byte": (lambda t: [f"data.sources=[{_write(t / 'p.parquet', b'')}]"], ("p.parquet",)),
    "parquet-truncated": (lambda t: [f"data.sources=[{_truncate(_parquet(t / 'p.parquet')) or t / 'p.parquet'}]"], ("p.parquet",)),
    "parquet-no-column": (lambda t: [f"data.sources=[{_parquet(t / 'p.parquet', 'body')}]"], ("text",)),
    "tokenizer-too-big": (lambda t: [f"data.sources=[{_write(t / 'a.txt', 'w1 w2 w3 ' * 4000)}]",
                                     f"data.tokenizer={_tokenizer_too_big(t / 'tok.json')}"], ("vocab_size",)),
    "tokenizer-missing": (lambda t: [f"data.sources=[{_write(t / 'a.txt', 'abc ' * 4000)}]",
                                     f"data.tokenizer={t}/none.json"], ("tokenizer",)),
    "too-little-data": (lambda t: [f"data.sources=[{_write(t / 'a.txt', 'tiny')}]"], ("data",)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_train_bad_data(tmp_path, capsys, one_process_env, name):
    """Data problems: whether a bad record is fatal or skipped and counted, a source with nothing
    usable ends the run with one error line naming it (any of `needles`)."""
    make, needles = TRAIN_CASES[name]
    over = make(tmp_path)
    argv = ["train", DEBUG, "--run-dir", str(tmp_path / "run"), "train.max_steps=2",
            f"data.cache_dir={tmp_path / 'cache'}", "train.sample_tokens=0", *over]  # fmt: skip
    capsys.readouterr()
    t0 = time.perf_counter()
    got = main(argv)
    err = capsys.readouterr().err
    assert got != 0 and time.perf_counter() - t0 < SECONDS
    errors = [l for l in err.splitlines() if "error" in l.lower()]
    assert len(errors) == 1 and errors[0].startswith("llmtrain train: error:"), err[-3000:]
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    assert any(n.lower() in errors[0].lower() for n in needles), errors[0]


def test_train_resume_from_unusable_checkpoints(tmp_path, capsys, one_process_env, ckpt):
    """Resuming from a checkpoint without optimizer state or with a truncated shard: one line,
    and the checkpoint stays as it was."""
    src = tmp_path / "docs"  # many documents: some land in the validation split
    for i in range(200):
        _write(
            src / f"{i}.txt", "".join(f"def f{j}(x):\n    return x + {i * j}\n" for j in range(40))
        )

    def newer(c):  # a later release's format: refused by name, as export refuses it
        index = json.loads((c / "tensors.json").read_text())
        _write(c / "tensors.json", json.dumps({**index, "format": "llmtrain-dcp-99"}))

    for name, damage in (("no-optimizer", lambda c: None), ("truncated", lambda c: _truncate(c / "__0_0.distcp")),
                         ("newer-format", newer)):  # fmt: skip
        ck2 = _copy_ckpt(ckpt, tmp_path / name)
        damage(ck2)
        before = _hashes([ck2])
        got = main(["train", DEBUG, "--run-dir", str(tmp_path / f"run-{name}"), "train.max_steps=2",
                    f"data.cache_dir={tmp_path / 'cache'}", f"data.sources=[{src}]", f"resume={ck2}"])  # fmt: skip
        err = capsys.readouterr().err
        errors = [l for l in err.splitlines() if "error" in l.lower()]
        assert got != 0 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert str(ck2) in errors[0] or "checkpoint" in errors[0].lower(), errors[0]
        assert name != "newer-format" or "newer llmtrain" in errors[0], errors[0]
        assert _hashes([ck2]) == before


# ---------------------------------------------------------------- real entry points


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, **kw
    )


def test_console_entry_one_line_and_module_entry(tmp_path):
    bad = _write(tmp_path / "c.yaml", "train:\n\tlr: 1\n")
    p = _run([sys.executable, "-m", "llmtrain.cli", "count", str(bad)])
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "tabs" in p.stderr, p.stderr
    p = _run([sys.executable, "-m", "llmtrain.train", DEBUG, "--run-dir", str(tmp_path / "r"),
              "model.hiden_size=3"])  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "hiden_size" in p.stderr
    assert not (tmp_path / "r").exists()


def test_closed_stdout_is_not_an_error():
    """`llmtrain count ... | head -4`: the reader leaving early is a quiet exit 0."""
    p = subprocess.Popen([sys.executable, "-m", "llmtrain.cli", "count", DEBUG], cwd=ROOT,
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    p.stdout.close()  # before the child writes anything: its first write meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err == "", err


def test_deepspeed_launcher_entry_reports_config_errors(tmp_path):
    """`deepspeed --module llmtrain.train` (one rank keeps it light): the rank's one error line
    reaches stderr, the launcher exits non-zero, no traceback."""
    p = _run([str(VENV_BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port()),
              "--module", "llmtrain.train", DEBUG, "--run-dir", str(tmp_path / "r"),
              "parallel.ep_size=3"])  # fmt: skip
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-3000:]
    ours = [l for l in p.stderr.splitlines() if l.startswith("llmtrain")]
    assert ours == [
        "llmtrain train: error: parallel.ep_size=3 must divide model.n_routed_experts=8"
    ]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv,missing", [(["train"], "config, --run-dir"), (["count"], "config"),
                                          (["data", "prepare"], "config"), (["eval"], "model")])  # fmt: skip
def test_missing_arguments_name_only_required_ones(argv, missing, capsys):
    """`overrides` (nargs='*') is optional: the error must not list it as required."""
    from llmtrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.split("required: ")[1].split(" (see")[0] == missing
