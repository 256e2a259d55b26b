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
import torch

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
    # a `datasets` save_to_disk folder: its .arrow rows, not its metadata JSON as documents;
    # a .json file of JSON lines is JSON lines (as .json.gz is)
    pytest.importorskip("datasets")
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": docs[:4]}).save_to_disk(str(saved))
    assert {p.name for p in saved.iterdir()} >= {"dataset_info.json", "state.json"}
    assert [t for _, t in iter_documents([str(saved)])] == docs[:4]
    (tmp_path / "lines.json").write_text((d / "a.jsonl").read_text())
    assert [t for _, t in iter_documents([str(tmp_path / "lines.json")])] == docs[:3]
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
    assert any(k.startswith("f.jsonl.gz:") for k, _ in docs)  # that part is read, not dropped
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


def test_bad_bytes_deep_in_a_large_text_file_say_what_was_kept(tmp_path, monkeypatch):
    """A text file is streamed in pieces: bytes that are not UTF-8 past the first piece are
    found after those pieces were taken. The report says they were kept, not that the file was
    skipped."""
    monkeypatch.setattr(corpus, "TEXT_PIECE_CHARS", 100)
    f = tmp_path / "big.txt"
    f.write_bytes("".join(f"line {i} of good text\n" for i in range(400)).encode() + b"bad \xff\n")
    bad: list[str] = []
    docs = list(iter_documents([str(f)], bad=bad))
    assert len(bad) == 1 and "not UTF-8 text past its first" in bad[0] and "kept" in bad[0], bad
    assert len(docs) == 1 and docs[0][1].startswith("line 0 of good text")


def test_max_bytes_takes_whole_documents_from_every_source_by_weight(tmp_path, monkeypatch):
    """data.max_bytes caps the corpus: each source gives its weight's share, in whole documents
    (the last one ends with its EOS), not the first source's head cut mid-document."""
    from llmtrain.data import prepare

    rng = np.random.default_rng(7)
    srcs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "x.jsonl", "w") as f:
            f.writelines(
                json.dumps({"text": f"{name} " + _text(rng, 30)}) + "\n" for _ in range(50)
            )
        srcs.append(str(tmp_path / name))
    cfg = _cfg(tmp_path, [srcs[0], {"path": srcs[1], "weight": 3.0}], max_bytes=4000)
    items = [it for chunk in prepare._chunks(cfg) for it in chunk]
    text = [it[2].decode() if isinstance(it[2], bytes) else it[2] for it in items]
    chars = {n: sum(len(t) for t in text if f'"{n} ' in t) for n in "ab"}
    assert 1000 <= chars["a"] < 1000 + 400 and 3000 <= chars["b"] < 3000 + 400, chars
    monkeypatch.setattr(corpus, "TEXT_PIECE_CHARS", 100)  # a text file: stops at its end
    (tmp_path / "t.txt").write_text("".join(f"line {i}\n" for i in range(400)))
    items = [it for chunk in prepare._chunks(_cfg(tmp_path, [str(tmp_path / "t.txt")], max_bytes=300))
             for it in chunk]  # fmt: skip
    assert items[-1][3] and "".join(it[2] for it in items).endswith("line 399\n")


def test_mixture_weights_are_deterministic(tmp_path):
    rng = np.random.default_rng(2)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text("".join(json.dumps({"text": _text(rng, 5)}) + "\n" for _ in range(400)))
    mix = [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 0.25}]
    docs = list(iter_documents(mix))
    n_a = sum(k.startswith("a.jsonl:") for k, _ in docs)  # keys: names in the source
    n_b = sum(k.startswith("b.jsonl:") for k, _ in docs)
    assert n_a == 800 and 70 < n_b < 130
    assert docs == list(iter_documents(mix))  # the same documents every time
    # copies lie a whole source apart, never back to back (they would share training windows)
    keys = [k for k, _ in docs]
    assert keys[:400] == keys[400:800] and all(a != b for a, b in zip(keys, keys[1:]))
    # with the split known, a validation document is taken once
    items = list(corpus.iter_items(corpus.parse_sources(mix[:1]), val_percent=20))
    val = [it[0] for it in items if corpus.is_validation(it[0], 20)]
    assert 40 < len(val) < 120 and len(set(val)) == len(val)
    assert len(items) == 800 - len(val)
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


def test_parallel_equals_serial_and_shards_roll(tmp_path, monkeypatch):
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
    stream = ds._range(0, ds.n_tokens)
    assert (stream == ds.eos_id).sum() == idx["splits"]["train"]["docs"]
    # at most OPEN_SHARDS shards stay mapped (a descriptor each: a terabyte corpus has thousands
    # of shards), and reading through the others, in any order, gives the same tokens
    import llmtrain.data.loader as loader

    monkeypatch.setattr(loader, "OPEN_SHARDS", 2)
    few = PackedDataset(one, "train", 16)
    for i in np.random.default_rng(0).permutation(few.n_seq):
        assert np.array_equal(few.sequence(int(i)), stream[i * 16 : i * 16 + 17])
        assert len(few._maps) <= 2


@pytest.mark.parametrize("earlier_release", [False, True], ids=["", "begun-by-an-earlier-release"])
def test_killed_preparation_resumes_to_identical_bytes(tmp_path, earlier_release):
    d = _corpus(tmp_path)
    over = [f"data.sources=[{d}]", "data.chunk_bytes=4000", "data.shard_tokens=1000",
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
    progress = json.loads((part / "progress.json").read_text())
    assert progress["chunks"] == 4
    # closed shards go to an append-only log: the record rewritten after each chunk stays a few
    # numbers (a list of every shard cost 23 ms and 350 kB a chunk at 5,000 shards)
    assert progress["splits"]["train"]["n_shards"] >= 1
    assert all("shards" not in x for x in progress["splits"].values()), progress
    if earlier_release:  # its record listed every closed shard, and it kept no log
        for split, x in progress["splits"].items():
            log = part / f"{split}_shards.jsonl"
            lines = log.read_text().splitlines()[: x.pop("n_shards")] if log.exists() else []
            x["shards"] = [json.loads(line) for line in lines]
            x.pop("closed_tokens")
            log.unlink(missing_ok=True)
        (part / "progress.json").write_text(json.dumps(progress))
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
    keys = [it[0] for it in corpus.iter_items(corpus.parse_sources([f"{d}/0.jsonl"]))]
    n = 40 + sum(1 if corpus.is_validation(k, 20) else 2 for k in keys)  # validation: once
    assert 80 < n < 120 and "train /" in out and f"{n} documents, 0 bad record(s) skip" in out
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


def test_split_does_not_depend_on_how_the_path_is_spelled(tmp_path, monkeypatch):
    """Document keys (validation split, mixture copies) are names inside the source: the same
    folder given relative, absolute or through a symlink splits the same way."""
    rng = np.random.default_rng(1)
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "sub/b.jsonl"):
        with open(src / name, "w") as f:
            f.writelines(json.dumps({"text": _text(rng, 20)}) + "\n" for _ in range(40))
    (tmp_path / "link").symlink_to(src)
    monkeypatch.chdir(tmp_path)

    def val_keys(spec):
        return sorted(k for k, _ in iter_documents([spec]) if corpus.is_validation(k, 20.0))

    ref = val_keys(str(src))
    assert ref and ref == val_keys("corpus") == val_keys(str(tmp_path / "link"))
    glob_keys = val_keys(str(src / "**" / "*.jsonl"))  # a glob: names from its fixed prefix
    assert glob_keys == ref
    assert all(not k.startswith("/") for k in ref)
    # a local dataset folder through `datasets` (hf:PATH) alike
    pytest.importorskip("datasets")
    hf = val_keys("hf:corpus/sub")
    assert hf and hf == val_keys(f"hf:{src / 'sub'}") == val_keys(f"hf:{tmp_path / 'link' / 'sub'}")
    # one file reached by two sources would be split twice (its documents keyed by two names):
    # refused, with the way to upweight part of a corpus
    over = _cfg(tmp_path, [str(src), {"path": str(src / "sub"), "weight": 2.0}])
    with pytest.raises(
        DataError, match=r"sources\[0\] and data.sources\[1\] both reach .*upweight"
    ):
        prepare_data(over, vocab_size=300)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("index.json"))


def test_hidden_folders_non_text_fields_and_lone_surrogates(tmp_path):
    """`huggingface-cli download --local-dir` leaves .cache/ beside the data: not documents. A
    text field that is a list or number, or JSON text with a lone surrogate, is a bad record
    (counted), not a document made of its repr or a crash of the tokenizer workers."""
    src = tmp_path / "src"
    (src / ".cache" / "hf").mkdir(parents=True)
    (src / ".cache" / "hf" / "a.jsonl.metadata").write_text("etag 123\n")
    rng = np.random.default_rng(4)
    with open(src / "b.jsonl", "w") as f:  # enough for both splits
        f.writelines(json.dumps({"text": _text(rng, 30)}) + "\n" for _ in range(40))
    with open(src / "a.jsonl", "w") as f:
        f.write(json.dumps({"text": "good one"}) + "\n")
        f.write(json.dumps({"text": ["a", "list"]}) + "\n")
        f.write(json.dumps({"text": 12345}) + "\n")
        f.write('{"text": "bad \\ud800 char"}\n')
    assert [p.name for p in corpus.source_files(str(src))] == ["a.jsonl", "b.jsonl"]
    bad: list[str] = []
    docs = [t for _, t in iter_documents([str(src / "a.jsonl")], bad=bad)]
    assert docs == ["good one"]
    assert any("a.jsonl:2: 'text' is not a string (list)" in b for b in bad), bad
    assert any("a.jsonl:3: 'text' is not a string (int)" in b for b in bad), bad
    assert any("a.jsonl:4: text that is not valid Unicode" in b for b in bad), bad
    cfg = _cfg(tmp_path, [str(src)], max_bad_records=3)
    d = prepare_data(cfg, 512)
    assert json.loads((d / "index.json").read_text())["bad_records"] == 3


def test_special_token_text_inside_a_document_is_not_an_eos(tmp_path):
    """A document that writes "<|endoftext|>" keeps it as text: no fake end of document (it
    would split the document under data.doc_mask)."""
    rng = np.random.default_rng(2)
    src = tmp_path / "s.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"text": _text(rng, 30)}) + "\n" for _ in range(30))
        f.write(json.dumps({"text": "before <|endoftext|> after"}) + "\n")
    d = prepare_data(_cfg(tmp_path, [str(src)]), 512)
    eos = json.loads((d / "index.json").read_text())["eos_id"]
    n_eos = sum(int((_stream(d, split) == eos).sum()) for split in ("train", "val"))
    assert n_eos == 31  # one per document


def test_truncated_or_missing_shard_is_refused(tmp_path):
    """A shard shorter than its index says would shift every later sample silently."""
    rng = np.random.default_rng(3)
    src = tmp_path / "s.jsonl"
    with open(src, "w") as f:
        f.writelines(json.dumps({"text": _text(rng, 80)}) + "\n" for _ in range(40))
    d = prepare_data(_cfg(tmp_path, [str(src)]), 512)
    PackedDataset(d, "train", 16)
    shard = d / json.loads((d / "index.json").read_text())["splits"]["train"]["shards"][0]["file"]
    # cut short under a running job (a dataset already open): a DataError naming the shard, not
    # the SIGBUS a memory-mapped read of the lost pages kills the rank with
    code = ("import sys; from llmtrain.data.loader import PackedDataset\n"
            "ds = PackedDataset(sys.argv[1], 'train', 16)\n"
            "open(sys.argv[2], 'r+b').truncate(0)\n"
            "ds._range(0, ds.n_tokens)\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, str(d), str(shard)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 1 and "DataError" in r.stderr and shard.name in r.stderr, (
        r.returncode, r.stderr[-2000:])  # fmt: skip
    shard.write_bytes(b"\0" * 200)
    with pytest.raises(DataError, match=r"holds \d+ bytes where its index says \d+ \(truncated"):
        PackedDataset(d, "train", 16)
    shard.unlink()
    with pytest.raises(DataError, match="is missing"):
        PackedDataset(d, "train", 16)


def test_vocab_check_uses_the_largest_id(tmp_path):
    """A tokenizer with few tokens but a large id (sparse ids) must not pass as small."""
    from tokenizers import Tokenizer, models

    from llmtrain.data.tokenizer import check_fits, vocab_span

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<|endoftext|>": 5000}, unk_token="a"))
    assert tok.get_vocab_size(with_added_tokens=True) == 3 and vocab_span(tok) == 5001
    with pytest.raises(DataError, match="ids reach 5000"):
        check_fits(tok, 1024)
    check_fits(tok, 5001)


def test_validation_sample_spans_the_split(monkeypatch):
    """The val loss reads a fixed permutation of the whole split, not its first sequences (its
    first files): distinct, spread, the same for every call."""
    import types

    from llmtrain.parallel import comm
    from llmtrain.train.loop import evaluate

    monkeypatch.setattr(comm, "all_reduce", lambda t, **kw: t)  # one rank, no process group

    class Seqs:
        n_seq = 1000
        seen: list[int] = []

        def batch(self, idx):
            self.seen.extend(idx)
            x = torch.zeros((len(idx), 4), dtype=torch.long)
            return x, x

    class Out:
        lm_loss = torch.tensor(1.0)  # what the model returns: a 0-d tensor

    def engine(*a, **kw):
        return Out()

    engine.train = lambda mode=True: None
    layout = types.SimpleNamespace(global_batch=8, micro_batch=4)
    ds = Seqs()
    evaluate(engine, ds, layout, 0, 1, "cpu", 16, 0, False)
    first = list(ds.seen)
    assert len(first) == 16 and len(set(first)) == 16 and max(first) > 500
    ds.seen.clear()
    evaluate(engine, ds, layout, 0, 1, "cpu", 16, 0, False)
    assert ds.seen == first


def test_large_text_files_tokenize_as_the_whole_file(monkeypatch):
    """A large .txt is encoded in ~1 MiB pieces; a piece ends after a lone newline (text on
    both sides), so no whitespace run is split and the pieces' tokens are the whole file's."""
    from llmtrain.data.tokenizer import train_bpe

    monkeypatch.setattr(corpus, "TEXT_PIECE_CHARS", 200)
    rng = np.random.default_rng(5)
    # half the lines indented (as code is): a cut after "\n" must not split "\n    "; some
    # end in spaces or a blank line, whose runs ("   \n", "\n\n") a piece's end would keep whole
    lines = [" " * int(rng.integers(0, 9)) * (i % 2) + _text(rng, 5) + "  " * (i % 3 == 0)
             + "\n" * (i % 5 == 0) for i in range(300)]  # fmt: skip
    text = "\n".join(lines) + "\n"
    # a BPE that knows those runs whole (documents ending in them): a wrong cut shows
    tok = train_bpe(iter([text] + ["w  \n", "w\n\n"] * 200), 400)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "big.txt"
        f.write_text(text)
        pieces = [payload for _, _, payload, _ in corpus._iter_text_file(f, "big.txt")]
    assert len(pieces) > 10 and "".join(pieces) == text
    ids = [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids]
    assert ids == tok.encode(text, add_special_tokens=False).ids
    assert corpus._cut("a\n  b\nc\n   ") == 6 and corpus._cut("  \n   ") == 0
    assert corpus._cut("a\nb  \nc\n\nd\r\ne") == 2 and corpus._cut("\nb") == 0
    assert corpus._cut("  \n   ", anyhow=True) == 3
    # one huge JSONL/Parquet document is encoded in such pieces too, with the same tokens
    from llmtrain.data import prepare
    from llmtrain.data.tokenizer import eos_id

    assert len(prepare.split_long(text)) > 10 and "".join(prepare.split_long(text)) == text
    with tempfile.TemporaryDirectory() as d:
        tok.save(str(Path(d) / "tok.json"))
        prepare._init_worker(str(Path(d) / "tok.json"), "text", 0.0, "uint32")
    out = prepare._encode_chunk([("doc:0", "text", text, True)])
    assert out["train"].tolist() == ids + [eos_id(tok)]
    # no newline to cut after: pieces of at most 4 × TEXT_PIECE_CHARS all the same (memory first)
    assert [len(p) for p in prepare.split_long("x" * 1000)] == [800, 200]


def test_tokenizer_sample_takes_every_source_by_weight(tmp_path):
    """The BPE is trained on each source's share of data.tokenizer_train_bytes, not on the
    first bytes in source order (which would leave a later source out)."""
    from tokenizers import Tokenizer

    rng = np.random.default_rng(6)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": _text(rng, 50)}) + "\n" for _ in range(300)))
    b.write_text("".join(json.dumps({"text": _text(rng, 50).upper()}) + "\n" for _ in range(300)))
    cfg = _cfg(tmp_path, [str(a), str(b)], tokenizer_train_bytes=40_000)
    tok = Tokenizer.from_file(str(prepare_data(cfg, 512) / "tokenizer.json"))
    assert len(tok.encode("ALPHA BETA GAMMA").ids) <= 6
    assert len(tok.encode("alpha beta gamma").ids) <= 6


# ---------------------------------------------------------------- hf: sources on a Hub


def _hub_rows(tag: str, n: int, start: int = 0) -> bytes:
    return "".join(json.dumps({"text": f"{tag} doc {i} " + "word " * 300}) + "\n"
                   for i in range(start, start + n)).encode()  # fmt: skip


@pytest.fixture
def ds_hub(tmp_path):
    from llmtrain.data.tokenizer import train_bpe

    from .fake_ds_hub import FakeDatasetHub

    hub = FakeDatasetHub()
    tok = tmp_path / "tok.json"
    train_bpe([f"document {i} " * 50 for i in range(200)], 512).save(str(tok))

    def prepare(source: str, cache: str = "cache", **env_extra):
        cfg = tmp_path / "cfg.yaml"
        data = {"sources": [source], "tokenizer": str(tok), "val_percent": 5.0,
                "chunk_bytes": 50_000, "num_proc": 1, "cache_dir": str(tmp_path / cache)}  # fmt: skip
        cfg.write_text(json.dumps({"model": {"vocab_size": 512}, "data": data}))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url,
               "HF_HOME": str(tmp_path / "hfhome"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5", **env_extra}  # fmt: skip
        env.pop("HF_TOKEN", None)
        p = subprocess.run([sys.executable, "-m", "llmtrain.cli", "data", "prepare", str(cfg)],
                           env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        final = [d for d in (tmp_path / cache / "data").glob("*") if d.is_dir()]
        return p, final

    yield hub, prepare
    hub.server.shutdown()


def _tokens(d: Path) -> bytes:
    return b"".join((d / f).read_bytes() for f in sorted(x.name for x in d.glob("*.bin")))


def test_hf_hub_source_reads_one_commit_pinned_or_recorded_across_a_resume(ds_hub):
    """An unpinned hf: source reads the commit it had when the preparation began, a resume after
    the Hub moved on included (it mixed two revisions' documents), and index.json records it;
    #REVISION pins one; an outage during a resume keeps the work done (it deleted it)."""
    hub, prepare = ds_hub
    files = lambda tag: {f"data/train-0000{k}.jsonl": _hub_rows(tag, 400, 400 * k) for k in (0, 1)}  # noqa: E731
    rev_a = hub.commit("org/corpus", files("A"))
    p, _ = prepare("hf:org/corpus", cache="a")  # the whole of A, for comparison
    assert p.returncode == 0, p.stderr[-2000:]
    p, _ = prepare("hf:org/corpus", LLMTRAIN_FAULT_KILL_AT_CHUNK="3")
    assert p.returncode == -9, p.stderr[-2000:]
    hub.commit("org/corpus", files("C"))
    p, _ = prepare("hf:org/corpus", HF_HUB_OFFLINE="1")  # the Hub out of reach: work kept
    assert p.returncode == 2 and "work done so far is kept" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    p, final = prepare("hf:org/corpus")  # resumed at the Hub's C: still A
    assert p.returncode == 0, p.stderr[-2000:]
    a = [d for d in (final[0].parents[2] / "a" / "data").glob("*") if d.is_dir()][0]
    assert _tokens(final[0]) == _tokens(a)
    index = json.loads((final[0] / "index.json").read_text())
    assert index["hf_revisions"] == {"hf:org/corpus": rev_a}
    p, pinned = prepare(f"hf:org/corpus#{rev_a}", cache="pinned")  # A, while the Hub is at C
    assert p.returncode == 0 and _tokens(pinned[0]) == _tokens(a), p.stderr[-2000:]
    p, _ = prepare("hf:org/corpus#" + "f" * 40, cache="nosuch")
    assert p.returncode == 2 and "no such revision" in p.stderr, p.stderr[-2000:]


def test_hf_rows_keep_their_split_when_files_are_added(tmp_path, monkeypatch):
    """hf: rows are keyed by content: a file added in front of a dataset's files (a new shard
    sorting first) moves no row between train and validation (a running index shifted every
    later row's key, and so its split)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hfcache"))
    d = tmp_path / "ds"
    d.mkdir()
    rng = np.random.default_rng(5)
    with open(d / "b.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"{i} {_text(rng, 20)}"}) + "\n" for i in range(300))

    def keys():
        return {text: key for key, _, text, _ in corpus._iter_hf(str(d), "text")}

    before = keys()
    with open(d / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"new {i} {_text(rng, 20)}"}) + "\n" for i in range(50))
    after = keys()
    assert len(after) == 350 and all(after[t] == k for t, k in before.items())


def test_a_missing_parquet_column_is_found_before_any_encoding(tmp_path, monkeypatch):
    """Schemas are read first (milliseconds a file): at TB scale the reader reaches a file
    without the text column hours in, and the preparation failed there."""
    from llmtrain.data import prepare

    rng = np.random.default_rng(6)
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.table({"text": [_text(rng) for _ in range(50)]}), d / "a.parquet")
    pq.write_table(pa.table({"body": [_text(rng) for _ in range(5)]}), d / "b.parquet")

    def no_tokenizer_yet(*a, **k):
        raise AssertionError("the tokenizer was trained before the sources were checked")

    monkeypatch.setattr(prepare, "_tokenizer", no_tokenizer_yet)
    with pytest.raises(DataError, match=r"b.parquet: no column 'text'; columns are \['body'\]"):
        prepare_data(_cfg(tmp_path, [str(d)]), 512)


def test_a_cache_inside_a_source_is_refused(tmp_path):
    """Its tokenizer and shards would be read as data (bad records), and its key never settles."""
    src = _corpus(tmp_path)
    cfg = DataConfig(sources=[str(src)], cache_dir=str(src / "cache"))
    with pytest.raises(DataError, match="lies inside the data source"):
        prepared_dir(cfg, 512)
