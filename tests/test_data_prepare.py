"""Data preparation at scale: every source format streamed, bad records skipped and counted,
mixtures, parallel = serial output, resumable after a kill, one writer per shared cache."""

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmtrain.cli import main
from llmtrain.config import DataConfig
from llmtrain.data import corpus
from llmtrain.data.corpus import DataError, iter_documents
from llmtrain.data.loader import PackedDataset, global_sample_indices, permute
from llmtrain.data.prepare import CacheLock, _wait, prepare_data, prepared_dir

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(rng, n=60):
    return " ".join(rng.choice(WORDS, n))


def _cfg(tmp_path, sources, **kw):
    kw.setdefault("val_percent", 20.0)
    kw.setdefault("num_proc", 1)
    return DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), **kw)


def _stream(d: Path, split: str) -> np.ndarray:
    idx = json.loads((d / "index.json").read_text())
    return np.concatenate(
        [np.fromfile(d / s["file"], dtype=idx["dtype"]) for s in idx["splits"][split]["shards"]]
    )


def test_every_format_streams_the_same_documents(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    docs = [_text(rng) for _ in range(12)]
    d = tmp_path / "src"
    (d / "sub").mkdir(parents=True)
    with open(d / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[:3])
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[3:6])
    pq.write_table(pa.table({"text": docs[6:8]}), d / "c.parquet", row_group_size=1)
    tbl = pa.table({"text": docs[8:10]})
    with pa.ipc.new_stream(d / "d.arrow", tbl.schema) as w:  # the format `datasets` writes
        w.write_table(tbl)
    with pa.ipc.new_file(d / "sub" / "e.arrow", tbl.schema) as w:
        w.write_table(tbl)
    monkeypatch.setattr(corpus, "TEXT_PIECE_CHARS", 100)  # a text file read in many pieces
    big = "\n".join(docs[10:12]) + "\n"
    (d / "sub" / "f.txt").write_text(big)
    got = [t for _, t in iter_documents([str(d)])]
    assert got == docs[:10] + docs[8:10] + [big]
    assert [t for _, t in iter_documents([str(d / "*.jsonl*")])] == docs[:6]  # a glob
    # hf: goes through `datasets` streaming; a local dataset directory works offline
    hf_dir = tmp_path / "hfds"
    hf_dir.mkdir()
    (hf_dir / "train.jsonl").write_text((d / "a.jsonl").read_text())
    assert [t for _, t in iter_documents([f"hf:{hf_dir}"])] == docs[:3]
    from llmtrain.data.corpus import iter_items, parse_sources

    # data.streaming=false: `datasets` downloads (here: converts) the dataset first, same rows
    rows = [it[2] for it in iter_items(parse_sources([f"hf:{hf_dir}"]), "text", streaming=False)]
    assert rows == docs[:3]
    with pytest.raises(DataError, match="does not exist"):
        list(iter_documents([str(tmp_path / "missing")]))
    with pytest.raises(DataError, match="matches no files"):
        list(iter_documents([str(tmp_path / "*.nothing")]))
    with pytest.raises(DataError, match="no column 'body'"):
        list(iter_documents([str(d / "c.parquet")], text_field="body"))


def test_bad_records_are_skipped_and_counted(tmp_path):
    rng = np.random.default_rng(1)
    d = tmp_path / "src"
    d.mkdir()
    good = [_text(rng) for _ in range(30)]
    lines = [json.dumps({"text": t}) for t in good]
    lines[3] = "{not json"  # bad: not JSON
    lines[7] = json.dumps({"body": "x"})  # bad: no text field
    raw = "\n".join(lines).encode() + b"\n" + b'{"text": "caf\xe9"}\n'  # bad: not UTF-8
    (d / "a.jsonl").write_bytes(raw)
    (d / "b.bin").write_bytes(b"\x00\x01binary" * 10)  # bad: binary
    (d / "c.txt").write_bytes(b"latin-1 \xe9t\xe9\n")  # bad: not UTF-8
    (d / "d.txt").write_text("")  # empty: nothing, not bad
    (d / "e.parquet").write_bytes(b"")  # bad: 0-byte parquet
    full = gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in good))
    (d / "f.jsonl.gz").write_bytes(full[: len(full) // 2])  # bad: truncated
    bad: list[str] = []
    docs = list(iter_documents([str(d)], bad=bad))
    assert len(bad) == 7, bad
    assert any("a.jsonl:4: not valid JSON" in b for b in bad)
    assert any("a.jsonl:8: no field 'text'" in b for b in bad)
    assert any("a.jsonl:31: not UTF-8" in b for b in bad)
    assert any("looks binary" in b for b in bad) and any("c.txt is not UTF-8" in b for b in bad)
    assert any("e.parquet is not a readable parquet" in b for b in bad)
    assert any("f.jsonl.gz: unreadable" in b for b in bad)
    assert 28 <= len(docs) < 60  # the good lines, and the readable part of the gzip
    out = prepare_data(_cfg(tmp_path, [str(d)]), vocab_size=300)
    idx = json.loads((out / "index.json").read_text())
    assert idx["bad_records"] == 7 and len(idx["bad_examples"]) == 5
    assert idx["splits"]["train"]["docs"] + idx["splits"]["val"]["docs"] == len(docs)
    with pytest.raises(DataError, match=r"7 bad records, more than data.max_bad_records=6"):
        prepare_data(_cfg(tmp_path / "x", [str(d)], max_bad_records=6), vocab_size=300)
    # a preparation that fails on its data leaves nothing in the cache (no .partial forever)
    assert not list((tmp_path / "x" / "cache").rglob("*.partial"))
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(_cfg(tmp_path / "y", [str(tmp_path / "missing")]), vocab_size=300)
    assert not list((tmp_path / "y" / "cache").rglob("*.partial"))


def test_mixture_weights_are_deterministic(tmp_path):
    rng = np.random.default_rng(2)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text("".join(json.dumps({"text": _text(rng, 5)}) + "\n" for _ in range(400)))
    mix = [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.25}]
    docs = list(iter_documents(mix))
    n_a = sum(k.startswith(str(a)) for k, _ in docs)
    n_b = sum(k.startswith(str(b)) for k, _ in docs)
    assert n_a == 800 and 70 < n_b < 130
    assert docs == list(iter_documents(mix))  # the same documents every time
    with pytest.raises(DataError, match=r"sources\[0\].weight"):
        list(iter_documents([{"path": str(a), "weight": -1}]))


def _corpus(tmp_path, n_files=6, docs_per=40):
    rng = np.random.default_rng(3)
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(n_files):
        with open(d / f"{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": _text(rng, 40)}) + "\n" for _ in range(docs_per))
    return d


def test_parallel_equals_serial_and_shards_roll(tmp_path):
    d = _corpus(tmp_path)
    kw = dict(chunk_bytes=4000, shard_tokens=3000)
    one = prepare_data(_cfg(tmp_path / "1", [str(d)], **kw), vocab_size=300)
    two = prepare_data(_cfg(tmp_path / "2", [str(d)], num_proc=2, **kw), vocab_size=300)
    idx = json.loads((one / "index.json").read_text())
    assert len(idx["splits"]["train"]["shards"]) > 2
    assert idx == json.loads((two / "index.json").read_text())
    for s in idx["splits"]["train"]["shards"] + idx["splits"]["val"]["shards"]:
        assert (one / s["file"]).read_bytes() == (two / s["file"]).read_bytes()
    ds = PackedDataset(one, "train", 16)  # memory-mapped, read in place
    assert ds.n_tokens == idx["splits"]["train"]["tokens"]
    assert (ds._range(0, ds.n_tokens) == ds.eos_id).sum() == idx["splits"]["train"]["docs"]


def test_killed_preparation_resumes_to_identical_bytes(tmp_path):
    d = _corpus(tmp_path)
    over = [f"data.sources=[{d}]", "data.chunk_bytes=4000", "data.shard_tokens=3000",
            "data.val_percent=20", "data.num_proc=1", "model.vocab_size=300"]  # fmt: skip
    cfg_yaml = ROOT / "configs" / "debug.yaml"
    env = {**os.environ, "LLMTRAIN_FAULT_KILL_AT_CHUNK": "5", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run(
        [sys.executable, "-m", "llmtrain.cli", "data", "prepare", str(cfg_yaml), *over,
         f"data.cache_dir={tmp_path / 'a'}"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    from llmtrain.config import load_config

    cfg_a = load_config(cfg_yaml, [*over, f"data.cache_dir={tmp_path / 'a'}"])
    final = prepared_dir(cfg_a.data, 300)
    part = final.with_name(final.name + ".partial")
    assert json.loads((part / "progress.json").read_text())["chunks"] == 4
    assert final.with_name(final.name + ".lock").exists()  # left by the dead owner
    assert main(["data", "prepare", str(cfg_yaml), *over, f"data.cache_dir={tmp_path / 'a'}"]) == 0
    assert not part.exists() and not final.with_name(final.name + ".lock").exists()
    cfg_b = load_config(cfg_yaml, [*over, f"data.cache_dir={tmp_path / 'b'}"])
    fresh = prepare_data(cfg_b.data, 300)
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in final.iterdir())
    for p in fresh.iterdir():
        assert p.read_bytes() == (final / p.name).read_bytes(), p.name


def test_one_writer_others_wait_without_deadline(tmp_path, monkeypatch):
    final = tmp_path / "data" / "abc"
    lock = CacheLock(final)
    assert lock.try_acquire()
    other = CacheLock(final)
    assert not other.try_acquire() and not other.stale()  # a live owner on this host
    done = threading.Event()

    def finish():
        time.sleep(0.5)
        final.mkdir(parents=True)
        (final / "index.json").write_text("{}")
        done.set()

    threading.Thread(target=finish).start()
    assert _wait(final, other, poll=0.05) and done.is_set()
    lock.release()
    assert not lock.path.exists()
    # a lock whose owner died is taken over; one not refreshed for LOCK_STALE_S too
    lock.path.write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 12345}))
    waiter = CacheLock(tmp_path / "data" / "other")
    waiter.path = lock.path
    assert waiter.stale()
    lock.path.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    import llmtrain.data.prepare as prep

    monkeypatch.setattr(prep, "LOCK_STALE_S", 0.2)
    assert not waiter.stale()  # first sight starts the clock
    time.sleep(0.3)
    assert waiter.stale()
    waiter.break_stale()
    assert not lock.path.exists()


def test_sampler_is_a_stateless_permutation():
    for n in (1, 2, 3, 17, 1000, 4097):
        for e in (0, 1):
            assert sorted(permute(np.arange(n), n, 7, e).tolist()) == list(range(n))
    assert not np.array_equal(
        permute(np.arange(100), 100, 7, 0), permute(np.arange(100), 100, 7, 1)
    )
    n = 10**12  # a trillion sequences: a step still takes microseconds and no memory
    idx = global_sample_indices(n, 123456789, 4096, 3)
    assert len(np.unique(idx)) == 4096 and idx.min() >= 0 and idx.max() < n


def test_cli_prepare_reports_and_bad_inputs_are_one_line(tmp_path, capsys):
    d = _corpus(tmp_path, n_files=2)
    cfg = str(ROOT / "configs" / "debug.yaml")
    common = [f"data.cache_dir={tmp_path / 'c'}", "model.vocab_size=300", "data.val_percent=20"]
    mix = f"data.sources=[{{path: {d}/0.jsonl, weight: 2}}, {d}/1.jsonl]"
    assert main(["data", "prepare", cfg, mix, *common]) == 0
    out = capsys.readouterr().out
    assert "train /" in out and "120 documents, 0 bad record(s) skipped" in out
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "bad.jsonl").write_text("{oops\n" * 3)
    cases = [
        (f"data.sources=[{tmp_path}/missing]", "does not exist"),
        (f"data.sources=[{tmp_path}/bin.txt]", "looks binary"),
        (f"data.sources=[{tmp_path}/bad.jsonl]", "bad.jsonl:3: not valid JSON"),
        (f"data.sources=[{{path: {d}, weight: -2}}]", "weight=-2 must be a positive number"),
    ]
    for src, msg in cases:
        assert main(["data", "prepare", cfg, src, *common, "data.max_bad_records=2"]) == 2, src
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_two_processes_sharing_a_cache_build_once(tmp_path):
    d = _corpus(tmp_path, n_files=4, docs_per=200)
    cmd = [sys.executable, "-m", "llmtrain.cli", "data", "prepare", str(ROOT / "configs" / "debug.yaml"),
           f"data.sources=[{d}]", f"data.cache_dir={tmp_path / 'shared'}", "model.vocab_size=300",
           "data.num_proc=1", "data.chunk_bytes=20000"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("preparing data into" in err for _, err in outs) == 1  # one writer
    assert outs[0][0] == outs[1][0]  # both report the same prepared directory
    assert [p.name for p in (tmp_path / "shared" / "data").iterdir()] == [
        outs[0][0].split(":")[0].rsplit("/", 1)[1]
    ]  # no .partial, no .lock left
