"""lm-evaluation-harness on the exported model: it agrees with our own loss, the shipped offline
tasks and a user's --include-path work, and training logs periodic evaluations."""

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from llmtrain.cli import main  # noqa: E402
from llmtrain.config import load_config  # noqa: E402
from llmtrain.data.corpus import stdlib_files  # noqa: E402
from llmtrain.data.tokenizer import eos_id, train_bpe  # noqa: E402
from llmtrain.eval import TASKS_DIR, EvalError, run_eval  # noqa: E402
from llmtrain.export import save_consolidated  # noqa: E402
from llmtrain.model import build_model  # noqa: E402

from .conftest import ROOT  # noqa: E402
from .train_utils import metrics, run_train  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A debug-config model with sharp (non-uniform) predictions and a real BPE tokenizer."""
    tmp = tmp_path_factory.mktemp("evalck")
    tok = train_bpe([p.read_text() for p in stdlib_files()[:30]], 1024)
    tok.save(str(tmp / "tokenizer.json"))
    cfg = load_config(ROOT / "configs" / "debug.yaml", ["model.init_std=0.3", "model.mtp_depth=0"])
    model = build_model(cfg.model, device="cpu", seed=0)
    return save_consolidated(model, cfg, tmp / "ck", tmp / "tokenizer.json"), model, tok


def test_harness_perplexity_equals_exp_of_our_loss(checkpoint):
    ck, model, tok = checkpoint
    res = run_eval(ck, ["llmtrain_ppl", "llmtrain_mc"], limit=1)  # exports to a temp HF dir
    doc = json.loads((TASKS_DIR / "ppl.jsonl").read_text().splitlines()[0])["text"]
    ids = tok.encode(doc, add_special_tokens=False).ids
    assert len(ids) < 512  # one rolling window: context = [EOS] + the document, as in our packing
    # the harness reports word- and byte-level perplexity of the summed log-likelihood
    r = res["results"]["llmtrain_ppl"]
    n_words = len(re.split(r"\s+", doc))
    ll = -math.log(r["word_perplexity,none"]) * n_words
    assert -ll / len(doc.encode()) / math.log(2) == pytest.approx(r["bits_per_byte,none"], rel=1e-6)
    x = torch.tensor([[eos_id(tok)] + ids[:-1]])
    with torch.no_grad():
        ours = model(x, labels=torch.tensor([ids])).lm_loss.item()
    harness_token_ppl = math.exp(-ll / len(ids))
    assert harness_token_ppl == pytest.approx(math.exp(ours), rel=1e-3)
    assert abs(harness_token_ppl - 1024) > 50  # a sharp model: the check is not vacuous
    with torch.no_grad():  # without the EOS context the loss differs clearly
        shifted = model(torch.tensor([ids[:-1]]), labels=torch.tensor([ids[1:]])).lm_loss.item()
    assert abs(math.exp(shifted) / harness_token_ppl - 1) > 1e-2
    acc = res["results"]["llmtrain_mc"]["acc,none"]
    assert 0 <= acc <= 1


def test_cli_eval_hf_dir_with_user_tasks(checkpoint, tmp_path, capsys):
    from llmtrain.export import export

    hf = export(checkpoint[0], tmp_path / "hf", dtype="fp32")
    mine = tmp_path / "mytasks"
    mine.mkdir()
    shutil.copy(TASKS_DIR / "mc.jsonl", mine / "mc.jsonl")
    shutil.copy(TASKS_DIR / "utils.py", mine / "utils.py")
    (mine / "my_mc.yaml").write_text(
        (TASKS_DIR / "llmtrain_mc.yaml").read_text().replace("task: llmtrain_mc", "task: my_mc")
    )
    out = tmp_path / "res.json"
    rc = main(["eval", str(hf), "--tasks", "my_mc", "--include-path", str(mine), "--limit", "3",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    assert "my_mc/acc" in capsys.readouterr().out
    assert "my_mc" in json.loads(out.read_text())["results"]
    with pytest.raises(EvalError, match="unknown task"):
        run_eval(hf, ["no_such_task"])
    assert main(["eval", str(tmp_path / "nothing"), "--tasks", "llmtrain_mc"]) == 2


def test_training_logs_periodic_evals(tmp_path):
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and dog ran far away".split()
    src = tmp_path / "docs.jsonl"
    src.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words, 80))}) + "\n" for _ in range(300))
    )
    run = tmp_path / "run"
    p = run_train(run, 1, [f"data.sources=[{src}]", f"data.cache_dir={tmp_path / 'cache'}",
                       "data.tokenizer_train_bytes=100000", "data.val_percent=10",
                       "train.max_steps=4", "train.warmup_steps=1", "train.eval_every=2",
                       "train.sample_tokens=0", "train.save_every=4",
                       "train.eval_tasks=[llmtrain_mc]", "train.eval_tasks_limit=4"])  # fmt: skip
    assert "preparing data into" in p.stderr  # train prepares a missing cache, and says so
    recs = metrics(run)
    with_eval = [r["step"] for r in recs if "eval/llmtrain_mc/acc" in r]
    assert with_eval == [2, 4]
    assert all("loss" in r for r in recs)  # eval scores join the step's record
