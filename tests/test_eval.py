"""lm-evaluation-harness on the exported model: it agrees with our own loss, the shipped offline
tasks and a user's --include-path work, and training logs periodic evaluations."""

import json
import math
import os
import re
import shutil
import subprocess
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from llmtrain.cli import main  # noqa: E402
from llmtrain.config import load_config  # noqa: E402
from llmtrain.data.corpus import stdlib_files  # noqa: E402
from llmtrain.data.tokenizer import eos_id, train_bpe  # noqa: E402
from llmtrain.eval import TASKS_DIR, EvalError, flat_metrics, run_eval  # noqa: E402
from llmtrain.export import save_consolidated  # noqa: E402
from llmtrain.model import build_model  # noqa: E402

from .conftest import ROOT  # noqa: E402
from .train_utils import VENV_BIN, env, free_port, metrics, run_then_exit, run_train  # noqa: E402


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


def _eval_run(tmp_path, name: str, nproc: int, *extra: str) -> list[dict]:
    src = tmp_path / "docs.jsonl"
    if not src.exists():
        rng = np.random.default_rng(0)
        words = "the cat sat on a mat and dog ran far away".split()
        src.write_text(
            "".join(
                json.dumps({"text": " ".join(rng.choice(words, 80))}) + "\n" for _ in range(300)
            )
        )
    run = tmp_path / name
    p = run_train(run, nproc, [f"data.sources=[{src}]", f"data.cache_dir={tmp_path / 'cache'}",
                           "data.tokenizer_train_bytes=100000", "data.val_percent=10",
                           "train.max_steps=4", "train.warmup_steps=1", "train.eval_every=2",
                           "train.sample_tokens=0", "train.save_every=4", *extra])  # fmt: skip
    return metrics(run), p


def test_training_logs_periodic_evals(tmp_path, capsys, monkeypatch):
    recs, p = _eval_run(tmp_path, "run", 1, "train.eval_tasks=[llmtrain_ppl,llmtrain_mc]",
                        "train.eval_tasks_limit=4")  # fmt: skip
    assert "preparing data into" in p.stderr  # train prepares a missing cache, and says so
    with_eval = [r["step"] for r in recs if "eval/llmtrain_mc/acc" in r]
    assert with_eval == [2, 4]
    assert all("loss" in r for r in recs)  # eval scores join the step's record
    # the last periodic scores are `llmtrain eval` of the step-4 checkpoint at train.seq_len,
    # through the export and stock transformers
    seq_len = load_config(tmp_path / "run" / "config.yaml").train.seq_len
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--tasks", "llmtrain_ppl", "llmtrain_mc",
                 "--limit", "4", "--max-length", str(seq_len), "--json"]) == 0  # fmt: skip
    offline = flat_metrics({"results": json.loads(capsys.readouterr().out)})
    assert offline.keys() == {k for k in recs[-1] if k.startswith("eval/")}
    for k, v in offline.items():
        assert recs[-1][k] == pytest.approx(v, rel=1e-5), k
    # --sharded: the checkpoint in the run's own engine, no export, the same scores, and only
    # the weight pieces read (no Adam moments, no RNG)
    import llmtrain.checkpoint.format as fmt
    from llmtrain.parallel.engine import Engine

    monkeypatch.setattr(Engine, "prepare_optimizer_state", lambda *a, **k: pytest.fail("Adam"))
    read, load_pieces = [], fmt.load_pieces
    monkeypatch.setattr(fmt, "load_pieces", lambda ck, pieces, blobs=(), **kw: (
        read.extend([p.key for p in pieces] + list(blobs)), load_pieces(ck, pieces, blobs, **kw))[1])  # fmt: skip
    assert main(["eval", str(tmp_path / "run"), "--sharded", "--tasks", "llmtrain_ppl",
                 "llmtrain_mc", "--limit", "4", "--max-length", str(seq_len), "--json"]) == 0  # fmt: skip
    sharded = flat_metrics({"results": json.loads(capsys.readouterr().out)})
    assert read and all(k.startswith("model/") for k in read), read
    # the group of one it made is gone with its variables (a later `llmtrain train` child
    # would take them for a launcher's, and a port this process may still hold)
    assert not {"WORLD_SIZE", "MASTER_PORT", "RANK"} & set(os.environ)
    # --watch --sharded: the run's one checkpoint (step 4, its last), then done
    watch_args = ["eval", str(tmp_path / "run"), "--watch", "--sharded", "--tasks", "llmtrain_ppl",
                  "llmtrain_mc", "--limit", "4", "--max-length", str(seq_len), "--poll", "0.1",
                  "--idle-timeout", "120", "--json", "--out", str(tmp_path / "w.jsonl")]  # fmt: skip
    assert main(watch_args) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["step"] == 4 and row.keys() - {"step"} == offline.keys()
    assert all(row[k] == pytest.approx(v, rel=1e-5) for k, v in offline.items())
    assert sharded.keys() == offline.keys()
    for k, v in offline.items():
        assert sharded[k] == pytest.approx(v, rel=1e-5), k


def test_sharded_eval_of_a_bf16_run_gives_its_periodic_scores(tmp_path, capsys):
    """Periodic evaluation computes in train.dtype; so does --sharded (the export path's fp32
    scores differ by ~2e-3 for a bf16 run)."""
    recs, _ = _eval_run(tmp_path, "run", 1, "train.dtype=bf16", "train.eval_tasks=[llmtrain_ppl]",
                        "train.eval_tasks_limit=4")  # fmt: skip
    seq_len = load_config(tmp_path / "run" / "config.yaml").train.seq_len
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--sharded", "--tasks", "llmtrain_ppl", "--limit",
                 "4", "--max-length", str(seq_len), "--json"]) == 0  # fmt: skip
    got = flat_metrics({"results": json.loads(capsys.readouterr().out)})
    assert got and all(got[k] == pytest.approx(recs[-1][k], rel=1e-6) for k in got), got
    # it holds the weights alone, 2 bytes a bf16 parameter at ZeRO-1 and ZeRO-3 alike: none of
    # the training engine's fp32 masters and accumulators (10 bytes), nor ZeRO-3's ~2 GB buckets
    from llmtrain.checkpoint.format import resolve_checkpoint
    from llmtrain.eval.sharded import _process_group, _Scorer

    ck = resolve_checkpoint(tmp_path / "run")
    for stage in (1, 3):
        with _process_group("auto"):
            before = _live_tensor_bytes()
            scorer = _Scorer([f"parallel.zero_stage={stage}"], ["llmtrain_ppl"], limit=4,
                             max_length=seq_len)  # fmt: skip
            res = flat_metrics(scorer(ck))
            held = _live_tensor_bytes() - before
            model = scorer.ckpt.model
            n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            del scorer, model
        assert all(res[k] == pytest.approx(got[k], rel=1e-6) for k in got), (stage, res)
        assert held < 2.5 * n, (stage, held / n)


def _live_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive in this process (each storage once). Tensors
    without data (the fake ones torch.compile leaves in its caches) are not memory."""
    import gc

    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            try:
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return sum(seen.values())


@pytest.mark.slow  # ~2 min: three training runs, two of them on two ranks
def test_periodic_evals_on_sharded_ranks_match_one_rank_and_change_nothing(tmp_path):
    """ZeRO-3 with experts split over 2 ranks (no rank holds the whole model) scores the tasks
    as one rank does, and evaluating leaves training untouched: the same losses, bit for bit,
    as the same run without evaluations (no RNG, router-bias or load-counter side effects)."""
    tasks = ["train.eval_tasks=[llmtrain_ppl,llmtrain_mc,llmtrain_gen]", "train.eval_tasks_limit=5"]
    sharded = ["parallel.zero_stage=3", "parallel.ep_size=2", "train.save_every=2"]
    one, _ = _eval_run(tmp_path, "one", 1, *tasks)
    two, _ = _eval_run(tmp_path, "two", 2, *tasks, *sharded)
    plain, _ = _eval_run(tmp_path, "plain", 2, *sharded)
    key = "eval/llmtrain_ppl/word_perplexity"
    assert [r["step"] for r in two if key in r] == [2, 4]
    assert "eval/llmtrain_gen/exact_match" in two[-1]  # greedy generation ran on both ranks
    for a, b in zip(one, two):
        for k in (k for k in a if k.startswith("eval/")):
            assert b[k] == pytest.approx(a[k], rel=1e-3), (a["step"], k)
    assert [r["loss"] for r in two] == [r["loss"] for r in plain]
    assert [r["val_loss"] for r in two if "val_loss" in r] == [
        r["val_loss"] for r in plain if "val_loss" in r
    ]
    # `llmtrain eval --sharded` of the step-4 checkpoint under the launcher, at the run's layout
    # (ZeRO-3, experts split): the scores training logged at step 4; rank 0 alone prints them
    seq_len = load_config(tmp_path / "two" / "config.yaml").train.seq_len
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "llmtrain.eval", str(tmp_path / "two"), "--tasks", "llmtrain_ppl",
           "llmtrain_mc", "llmtrain_gen", "--limit", "5", "--max-length", str(seq_len), "--json"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    start = re.search(r"^\{$", p.stdout, re.M)  # the JSON, among the launcher's own lines
    assert start and len(re.findall(r"^\{$", p.stdout, re.M)) == 1, p.stdout[-3000:]  # rank 0
    scores = flat_metrics({"results": json.JSONDecoder().raw_decode(p.stdout[start.start() :])[0]})
    assert scores.keys() == {k for k in two[-1] if k.startswith("eval/")}
    for k, v in scores.items():
        assert v == pytest.approx(two[-1][k], rel=1e-5), k
    # --watch, sharded over the 2 ranks: rank 0 watches and directs, both score; a row for each
    # checkpoint, the engine refilled for the second (ZeRO-3 keeps its small weights gathered
    # between forwards: a refill must not leave them at the first checkpoint's values)
    out = tmp_path / "watch.jsonl"
    i = cmd.index("--json")
    cmd[i:i] = ["--watch", "--poll", "0.2", "--idle-timeout", "120", "--out", str(out)]
    cmd[cmd.index("--master_port") + 1] = str(free_port())
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and {r["dtype"] for r in rows} == {"sharded"}
    logged = {r["step"]: r for r in two if key in r}
    for row in rows:
        for k in scores:
            assert row[k] == pytest.approx(logged[row["step"]][k], rel=1e-5), (row["step"], k)
    assert p.stdout.count('"step": 4') == 1  # shown once, by rank 0


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_training_model_harness_matches_hflm_on_the_export(checkpoint, tmp_path):
    """The harness on the training model (what periodic evaluation runs, nothing exported)
    scores every request as the harness's own HFLM does on the exported model in stock
    transformers: log-likelihoods, greediness, rolling windows, generation, and whole tasks."""
    from lm_eval.models.huggingface import HFLM

    from llmtrain.eval import evaluate_hf_dir
    from llmtrain.eval.live import TrainingModelLM, evaluate_live
    from llmtrain.export import export

    ck, model, tok = checkpoint
    hf = export(ck, tmp_path / "hf", dtype="fp32")
    n = 32  # shorter than the texts: rolling needs several windows, contexts get truncated
    ref = HFLM(pretrained=str(hf), device="cpu", dtype="float32", batch_size=4, max_length=n)
    lm = TrainingModelLM(model.eval(), tok, eos_id(tok), max_length=n, batch_size=3)
    lm.ROWS = 5  # continuations longer than this are scored in several blocks
    lm.PREFILL = 7  # contexts longer than this go through the cache in several forwards
    assert lm.prefix_token_id == ref.prefix_token_id

    docs = [json.loads(line) for line in (TASKS_DIR / "mc.jsonl").read_text().splitlines()]
    gens = [(d["context"], {"until": ["\n"], "max_gen_toks": 12, "do_sample": False})
            for d in docs[:4]]  # fmt: skip
    gens += [(docs[4]["context"] * 3, {"until": "return", "max_new_tokens": 9}),  # truncated
             (docs[5]["context"], {"do_sample": False, "temperature": 0.7,
                                   "max_gen_toks": 5})]  # fmt: skip
    got_text = lm.generate_until(_instances("generate_until", gens))
    assert got_text == ref.generate_until(_instances("generate_until", gens))
    assert any(got_text)

    pairs = [(d["context"], c) for d in docs for c in d["choices"]]
    pairs += [("", "def f(x):\n    return x"), (docs[4]["context"] * 3, " y")]  # empty, truncated
    pairs += [(c, t) for (c, _), t in zip(gens, got_text) if t]  # the model's own greedy text
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    want = ref.loglikelihood(_instances("loglikelihood", pairs))
    assert [g for _, g in got] == [g for _, g in want]
    np.testing.assert_allclose([v for v, _ in got], [v for v, _ in want], rtol=1e-5, atol=1e-4)
    assert any(g for _, g in got) and not all(g for _, g in got)  # both outcomes are exercised

    texts = [
        (json.loads(line)["text"],) for line in (TASKS_DIR / "ppl.jsonl").read_text().splitlines()
    ]
    assert max(len(tok.encode(t).ids) for (t,) in texts) > 2 * n
    np.testing.assert_allclose(
        lm.loglikelihood_rolling(_instances("loglikelihood_rolling", texts)),
        ref.loglikelihood_rolling(_instances("loglikelihood_rolling", texts)),
        rtol=1e-5,
    )

    with pytest.raises(EvalError, match="continuation"):  # HFLM asserts; we say what is wrong
        lm.loglikelihood(_instances("loglikelihood", [("a", docs[4]["context"] * 3)]))
    with pytest.raises(EvalError, match="greedily"):
        lm.generate_until(_instances("generate_until", [("a", {"do_sample": True})]))
    with pytest.raises(EvalError, match="max_gen_toks"):
        lm.generate_until(_instances("generate_until", [("a", {"max_gen_toks": n})]))

    tasks = ["llmtrain_ppl", "llmtrain_mc", "llmtrain_gen"]
    ours = flat_metrics(evaluate_live(lm, tasks, limit=5))
    theirs = flat_metrics(evaluate_hf_dir(hf, tasks, limit=5, max_length=n))
    assert ours.keys() == theirs.keys() and ours
    for k in ours:
        assert ours[k] == pytest.approx(theirs[k], rel=1e-5), k


def _gen_requests() -> list[tuple]:
    """Generation requests of varied context lengths, more of them than two ranks' batches."""
    docs = [json.loads(line) for line in (TASKS_DIR / "mc.jsonl").read_text().splitlines()]
    gens = [(d["context"], {"until": ["\n"], "max_gen_toks": 6}) for d in docs[:7]]
    return gens + [(docs[4]["context"] * 3, {"until": "return", "max_new_tokens": 5})]


def _gen_lm(tok):
    from llmtrain.eval.live import TrainingModelLM

    cfg = load_config(ROOT / "configs" / "debug.yaml", ["model.init_std=0.3", "model.mtp_depth=0"])
    model = build_model(cfg.model, device="cpu", seed=0).eval()  # the checkpoint fixture's
    lm = TrainingModelLM(model, tok, eos_id(tok), max_length=32, batch_size=2)
    lm.PREFILL = 7  # several prefill forwards for the long contexts
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    return lm, forwards


def _gen_rank(rank, world, port, tok_path, out):
    import torch.distributed as dist
    from tokenizers import Tokenizer

    from llmtrain.parallel import comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # mismatched collectives (a broken split) fail in a minute, not gloo's default 30
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    lm, forwards = _gen_lm(Tokenizer.from_file(tok_path))
    texts = lm.generate_until(_instances("generate_until", _gen_requests()))
    every = comm.all_gather_object({"texts": texts, "forwards": forwards[0]})
    if rank == 0:
        out.write_text(json.dumps(every))
    dist.destroy_process_group()


@pytest.mark.slow  # ~30 s: five processes import torch and the harness
def test_generation_is_split_over_ranks_and_equals_one_rank(checkpoint, tmp_path):
    """Periodic evaluation's generation: each rank decodes its share of the requests (fewer
    forwards than one rank doing all), every rank joins the same number of forwards (a sharded
    model's forward is collective), and the texts equal one process's, on every rank."""
    import torch.multiprocessing as mp

    _, _, tok = checkpoint
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    lm, forwards = _gen_lm(tok)
    want = lm.generate_until(_instances("generate_until", _gen_requests()))
    assert any(want) and len(set(want)) > 1
    for world in (2, 3):
        out = tmp_path / f"w{world}.json"
        mp.spawn(run_then_exit, args=(_gen_rank, world, free_port(), tok_path, out), nprocs=world)
        ranks = json.loads(out.read_text())
        assert [r["texts"] for r in ranks] == [want] * world, world
        assert len({r["forwards"] for r in ranks}) == 1, (world, ranks)
        assert ranks[0]["forwards"] < forwards[0], (world, ranks[0]["forwards"], forwards[0])


def test_unknown_periodic_task_fails_before_training(tmp_path, capsys):
    """A task the harness cannot find is a one-line error at start, not at the first evaluation
    hours in, and the run directory is not created."""
    run = tmp_path / "run"
    rc = main(["train", str(ROOT / "configs" / "debug.yaml"), "--run-dir", str(run),
               "train.eval_tasks=[llmtrain_mc,no_such_task]"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip().splitlines() == [
        "llmtrain train: error: unknown task(s) no_such_task; the shipped offline tasks are "
        "llmtrain_ppl, llmtrain_mc and llmtrain_gen; add your own with --include-path DIR"
    ]
    assert not run.exists()


@pytest.mark.parametrize(
    "gen, needle",
    [("do_sample: true\n  temperature: 0.8", "greedily"), ("max_gen_toks: 64", "max_gen_toks")],
)
def test_periodic_generation_task_checked_before_training(tmp_path, gen, needle):
    """A generation task periodic evaluation cannot run (sampling, or more new tokens than
    train.seq_len) is refused when the tasks are checked, before any step."""
    from llmtrain.eval.live import check_tasks

    mine = tmp_path / "tasks"
    mine.mkdir()
    shutil.copy(TASKS_DIR / "mc.jsonl", mine / "mc.jsonl")
    shutil.copy(TASKS_DIR / "utils.py", mine / "utils.py")
    text = (
        (TASKS_DIR / "llmtrain_gen.yaml").read_text().replace("task: llmtrain_gen", "task: my_gen")
    )
    (mine / "my_gen.yaml").write_text(text.replace("max_gen_toks: 16\n  do_sample: false", gen))
    check_tasks(["llmtrain_gen"], 64)  # the shipped task fits
    with pytest.raises(EvalError, match=f"task my_gen: .*{needle}"):
        check_tasks(["my_gen"], 64, [str(mine)])
    # the export path (transformers' own generate) takes it; --sharded decodes as training does
    from llmtrain.eval import check_eval_args

    check_eval_args(["my_gen"], [str(mine)], max_length=64)
    with pytest.raises(EvalError, match=f"task my_gen: .*{needle}"):
        check_eval_args(["my_gen"], [str(mine)], max_length=64, greedy=True)
    if "do_sample" in gen:  # refused under --sharded whatever the context length
        with pytest.raises(EvalError, match="no --sharded"):
            check_eval_args(["my_gen"], [str(mine)], greedy=True)


def test_watch_evaluates_each_checkpoint_as_it_lands_as_training_did(tmp_path, capsys):
    """`llmtrain eval RUN --watch`, started before training, scores each checkpoint as it
    lands, out of the training job, exactly as periodic evaluation scored the same steps inside
    it, and stops at the run's last step; restarted, it skips what it did; a run directory
    that never gets a checkpoint times out; a checkpoint is not a run directory."""
    import threading

    from llmtrain.eval.watch import RESULTS_FILE, watch

    run = tmp_path / "run"
    seq_len = load_config(ROOT / "configs" / "debug.yaml").train.seq_len
    args = ["eval", str(run), "--watch", "--tasks", "llmtrain_ppl", "--limit", "4",
            "--max-length", str(seq_len), "--poll", "0.2", "--idle-timeout", "600"]  # fmt: skip
    result: dict = {}
    watcher = threading.Thread(target=lambda: result.setdefault("rc", main(args)), daemon=True)
    watcher.start()  # before the run directory exists
    recs, _ = _eval_run(tmp_path, "run", 1, "train.eval_tasks=[llmtrain_ppl]",
                        "train.eval_tasks_limit=4", "train.save_every=2",
                        "train.keep_last=5")  # fmt: skip
    watcher.join(timeout=300)
    assert not watcher.is_alive() and result["rc"] == 0  # returned: step 4 is train.max_steps
    shown = capsys.readouterr().out
    rows = [json.loads(line) for line in (run / RESULTS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and "step 2: llmtrain_ppl/" in shown
    periodic = {r["step"]: r for r in recs if "eval/llmtrain_ppl/word_perplexity" in r}
    assert sorted(periodic) == [2, 4]
    for r in rows:
        keys = {k for k in r if k.startswith("eval/")}
        assert keys and keys == {k for k in periodic[r["step"]] if k.startswith("eval/")}
        for k in keys:
            assert r[k] == pytest.approx(periodic[r["step"]][k], rel=1e-5), (r["step"], k)
    assert len({r["eval/llmtrain_ppl/word_perplexity"] for r in rows}) == 2  # the steps differ
    assert any((run / "tensorboard" / "eval_watch").iterdir())
    # restarted: nothing new to do, and it still ends at the run's last step
    assert main(args) == 0
    assert len((run / RESULTS_FILE).read_text().splitlines()) == 2
    never = watch(tmp_path / "never", ["llmtrain_ppl"], poll=0.05, timeout=0.2)
    assert never.rows == [] and not never.finished
    with pytest.raises(EvalError, match="not a run directory"):
        watch(run / "checkpoints" / "step_00000004", ["llmtrain_ppl"], timeout=0)


def _fake_run(tmp_path, steps, **train):
    """A run directory with hand-made complete checkpoints (and step_N.tmp saves in progress)
    whose config says `train` (max_steps, save_every, save_final)."""
    import yaml

    from llmtrain.checkpoint.format import INDEX_FILE

    cfg = yaml.safe_load((ROOT / "configs" / "debug.yaml").read_text())
    cfg["train"].update(train)
    ckdir = tmp_path / "run" / "checkpoints"
    for name in steps:
        d = ckdir / name
        d.mkdir(parents=True)
        for f in (INDEX_FILE, ".metadata"):
            (d / f).write_text("{}")
        (d / "state.json").write_text(json.dumps({"step": int(name[5:13]), "loss": 1.0}))
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run"


def test_watch_against_the_trainers_saves_and_deletes(tmp_path, monkeypatch, caplog):
    """With a stub evaluation: keep_last deleting a checkpoint mid-evaluation skips it; a save
    in progress (step_N.tmp) is never read; a step saved again with other weights is scored
    again; until_step bounds what is scored; a real failure is an error, not a skip; a row cut
    short by a crash does not stop a restart; a second watcher on the same file is refused."""
    import llmtrain.eval.watch as w

    run = _fake_run(tmp_path, ["step_00000002", "step_00000004", "step_00000006",
                               "step_00000008.tmp"], max_steps=6, save_every=2)  # fmt: skip
    ckdir = run / "checkpoints"
    seen = []

    def fake_eval(ck, tasks, **kw):
        name = ck.name[:13]
        seen.append(name)
        # a hard-linked snapshot, not the checkpoint, in this results file's own folder (a
        # second watcher writing another --out keeps, and cleans, its own)
        assert ck.parent.parent.name == ".eval_watch"
        if name == "step_00000002":  # the trainer's prune, mid-evaluation
            shutil.rmtree(ckdir / name)
            raise FileNotFoundError(ck / "model.safetensors")
        return {"results": {"t": {"acc,none": float(name[-1])}}}

    monkeypatch.setattr(w, "run_eval", fake_eval)
    monkeypatch.setattr(w, "check_eval_args", lambda *a, **k: None)
    monkeypatch.setattr(w.time, "sleep", lambda s: None)
    with caplog.at_level("WARNING"):
        res = w.watch(run, ["t"], poll=0, until_step=4)
    assert seen == ["step_00000002", "step_00000004"] and [r["step"] for r in res.rows] == [4]
    assert res.finished and "deleted or saved again" in caplog.text
    # the rest up to the run's last step (max_steps 6), not the .tmp save of step 8
    res = w.watch(run, ["t"], poll=0)
    assert [r["step"] for r in res.rows] == [6] and res.finished
    assert res.rows[0]["eval/t/acc"] == 6.0 and not list((run / ".eval_watch").glob("*/*"))
    assert w._work_dir(run, run / "a.jsonl") != w._work_dir(run, run / "b.jsonl")
    # a resumed run saves step 6 again with other weights: scored again; a cut-short row is
    # skipped on reading
    (ckdir / "step_00000006" / "state.json").write_text(json.dumps({"step": 6, "loss": 0.5}))
    with open(run / w.RESULTS_FILE, "a") as f:
        f.write('{"step": 6, "tas')
    res = w.watch(run, ["t"], poll=0)
    assert [r["step"] for r in res.rows] == [6] and "not JSON" in caplog.text
    assert w.watch(run, ["t"], poll=0).rows == []  # nothing new
    assert len(w.watch(run, ["t"], poll=0, dtype="bfloat16").rows) == 2  # another key: again

    def broken_eval(ck, tasks, **kw):
        raise RuntimeError("a real failure")

    monkeypatch.setattr(w, "run_eval", broken_eval)
    with pytest.raises(RuntimeError, match="a real failure"):
        w.watch(run, ["t"], poll=0, limit=3)

    def pruned_then_broken(ck, tasks, **kw):  # the snapshot is whole: the failure is real
        shutil.rmtree(ckdir / ck.name[:13], ignore_errors=True)
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(w, "run_eval", pruned_then_broken)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="out of memory"):
        w.watch(run, ["t"], poll=0, limit=4)
    assert time.monotonic() - t0 < 5  # at once, not after the deletion wait
    lock = w._lock(run / w.RESULTS_FILE)
    with pytest.raises(EvalError, match="another watcher"):
        w.watch(run, ["t"], poll=0)
    lock.close()


def test_a_restarted_watch_follows_the_runs_present_trajectory(tmp_path, monkeypatch):
    """Rows of an earlier trajectory do not end a restarted watcher: after a rollback (step 6
    not saved again yet) it waits for the new step 6; after a continued run raised max_steps
    (RUN/config.yaml, the latest launch) it waits for the new last step."""
    import yaml

    import llmtrain.eval.watch as w

    run = _fake_run(tmp_path, ["step_00000002", "step_00000004", "step_00000006"], max_steps=6,
                    save_every=2)  # fmt: skip
    ckdir = run / "checkpoints"
    monkeypatch.setattr(w, "run_eval", lambda ck, tasks, **kw: {"results": {"t": {"a": 1.0}}})
    monkeypatch.setattr(w, "check_eval_args", lambda *a, **k: None)
    assert [r["step"] for r in w.watch(run, ["t"], poll=0).rows] == [2, 4, 6]
    # rolled back to step 2 and resumed: step 4 saved again, step 6 not yet
    shutil.rmtree(ckdir / "step_00000006")
    (ckdir / "step_00000004" / "state.json").write_text(json.dumps({"step": 4, "loss": 0.7}))
    res = w.watch(run, ["t"], poll=0.01, timeout=0.3)
    assert [r["step"] for r in res.rows] == [4] and not res.finished
    # continued to max_steps 12: the run's config.yaml says so before its next save lands
    shutil.copytree(ckdir / "step_00000002", ckdir / "step_00000006", dirs_exist_ok=True)
    (ckdir / "step_00000006" / "state.json").write_text(json.dumps({"step": 6, "loss": 0.6}))
    cfg = yaml.safe_load((ckdir / "step_00000006" / "config.yaml").read_text())
    cfg["train"]["max_steps"] = 12
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = w.watch(run, ["t"], poll=0.01, timeout=0.3)
    assert [r["step"] for r in res.rows] == [6] and not res.finished  # 8..12 still to come


def test_watch_rows_name_the_sharded_scorers_overrides(tmp_path, monkeypatch):
    """Scores under other overrides (train.dtype=bf16) are not taken for this watcher's: a
    restart with the same overrides skips what is scored, with others scores again."""
    import llmtrain.eval.watch as w

    run = _fake_run(tmp_path, ["step_00000002", "step_00000004"], max_steps=4, save_every=2)
    monkeypatch.setattr(w, "check_eval_args", lambda *a, **k: None)
    seen = []

    def score(snap):
        seen.append(snap.name)
        return {"results": {"t": {"a": 1.0}}}

    def look(*overrides):
        return [r["step"] for r in w.watch(run, ["t"], poll=0, evaluate=score, dtype="sharded",
                                           overrides=list(overrides)).rows]  # fmt: skip

    assert look("train.dtype=bf16") == [2, 4]
    assert look("train.dtype=bf16") == []
    assert look("train.dtype=fp32") == [2, 4]
    assert look() == [2, 4] and len(seen) == 6
    rows = [json.loads(x) for x in (run / w.RESULTS_FILE).read_text().splitlines()]
    assert [r["overrides"] for r in rows][::2] == [["train.dtype=bf16"], ["train.dtype=fp32"], None]


def test_eval_checks_what_needs_no_weights_before_the_export(checkpoint, tmp_path, monkeypatch):
    """Bad tasks, task files, --limit and a missing tokenizer are told before the model is
    exported (terabytes at 671B), each as one line naming what to fix."""
    import llmtrain.export as export

    ck = checkpoint[0]
    monkeypatch.setattr(export, "export", lambda *a, **k: pytest.fail("exported first"))
    for kw, needle in (({"tasks": ["no_such_task"]}, "unknown task"),
                       ({"tasks": ["llmtrain_mc"], "limit": 0}, "--limit 0"),
                       ({"tasks": ["llmtrain_mc"], "max_length": 1}, "--max-length 1")):  # fmt: skip
        with pytest.raises(EvalError, match=needle):
            run_eval(ck, **kw)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: mine\ndataset_path: [json\n")
    with pytest.raises(EvalError, match="broken.yaml"):
        run_eval(ck, ["mine"], include_path=[str(bad)])
    typo = tmp_path / "typo"
    typo.mkdir()
    text = (TASKS_DIR / "llmtrain_mc.yaml").read_text().replace("task: llmtrain_mc", "task: typo")
    (typo / "typo.yaml").write_text(re.sub(r"doc_to_text: .*", 'doc_to_text: "{{contxt}}"', text))
    with pytest.raises(EvalError, match="typo: Cannot import module 'utils'"):  # no utils.py
        run_eval(ck, ["typo"], include_path=[str(typo)])
    for f in ("utils.py", "mc.jsonl", "ppl.jsonl"):
        shutil.copy(TASKS_DIR / f, typo / f)
    with pytest.raises(EvalError, match="typo: a template does not render"):
        run_eval(ck, ["typo"], include_path=[str(typo)])
    notok = tmp_path / "notok"
    shutil.copytree(ck, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(EvalError, match="no tokenizer.json"):
        run_eval(notok, ["llmtrain_mc"])
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("{}")
    (fresh / "metrics.jsonl").write_text("")
    from llmtrain.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint yet"):
        run_eval(fresh, ["llmtrain_mc"])


def test_watch_of_a_run_directory_it_cannot_write(tmp_path, monkeypatch, caplog):
    """--out elsewhere: no snapshot folder and no TensorBoard events can be made in the run
    directory (files stand where their folders would go), so it reads in place and says so."""
    import llmtrain.eval.watch as w

    run = _fake_run(tmp_path, ["step_00000002"], max_steps=2, save_every=2)
    (run / ".eval_watch").write_text("")
    (run / "tensorboard").write_text("")
    seen = []
    monkeypatch.setattr(w, "run_eval", lambda ck, tasks, **kw: seen.append(ck) or
                        {"results": {"t": {"a": 1.0}}})  # fmt: skip
    monkeypatch.setattr(w, "check_eval_args", lambda *a, **k: None)
    with caplog.at_level("WARNING"):
        res = w.watch(run, ["t"], poll=0, out=tmp_path / "elsewhere" / "rows.jsonl")
    assert res.finished and [r["step"] for r in res.rows] == [2]
    assert seen == [run / "checkpoints" / "step_00000002"]  # in place
    assert "evaluating step_00000002 in place" in caplog.text
    assert "cannot write TensorBoard events" in caplog.text
    assert (tmp_path / "elsewhere" / "rows.jsonl").is_file()


def test_a_broken_task_file_does_not_hide_the_harness_tasks(tmp_path):
    from llmtrain.eval import task_manager

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: mine\ndataset_path: [json\n")
    assert "arc_easy" in task_manager(["arc_easy"], [str(bad)]).all_tasks
    with pytest.raises(EvalError, match="broken.yaml"):
        task_manager(["mine"], [str(bad)])


def test_watch_stops_at_the_last_step_the_run_saves(tmp_path, monkeypatch):
    """save_final: false saves the last multiple of save_every, not max_steps: the watcher stops
    there, and so with an --until-step past it or between saves; one before the first save has
    nothing to do; a run that never gets to its last save times out, unfinished."""
    import llmtrain.eval.watch as w

    run = _fake_run(tmp_path, ["step_00000003"], max_steps=4, save_every=3, save_final=False)
    monkeypatch.setattr(w, "run_eval", lambda ck, tasks, **kw: {"results": {"t": {"a": 1.0}}})
    monkeypatch.setattr(w, "check_eval_args", lambda *a, **k: None)
    ck = run / "checkpoints" / "step_00000003"
    assert w.last_saved_step(ck) == 3
    assert [w.last_saved_step(ck, u) for u in (2, 3, 4, 9)] == [0, 3, 3, 3]
    res = w.watch(run, ["t"], poll=0.01, timeout=5)
    assert res.finished and [r["step"] for r in res.rows] == [3]
    for until in (9, 2):
        res = w.watch(run, ["t"], poll=0.01, timeout=5, until_step=until)
        assert res.finished and res.rows == [], until
    later = _fake_run(tmp_path / "later", ["step_00000003"], max_steps=7, save_every=3)
    res = w.watch(later, ["t"], poll=0.01, timeout=0.1, until_step=5)
    assert res.finished and [r["step"] for r in res.rows] == [3]  # 5 lies between saves
    res = w.watch(later, ["t"], poll=0.01, timeout=0.1)
    assert not res.finished and res.rows == []  # step 7 is not saved yet


def test_flat_metrics_keeps_each_filter_of_a_metric():
    """gsm8k's exact_match under strict-match and flexible-extract are two numbers: named
    METRIC/FILTER (the plain name for filter `none`), not one overwriting the other."""
    res = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1,
                             "exact_match,strict-match": 0.0, "exact_match,flexible-extract": 1.0,
                             "exact_match_stderr,strict-match": 0.0}}}  # fmt: skip
    assert flat_metrics(res) == {"eval/t/acc": 0.5, "eval/t/exact_match/strict-match": 0.0,
                                 "eval/t/exact_match/flexible-extract": 1.0}  # fmt: skip
