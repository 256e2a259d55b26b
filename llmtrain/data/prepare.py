"""Tokenize once into memory-mapped token shards with an index, cached by content; in parallel,
streaming, resumable, with one writer per shared cache.

Layout of a prepared directory (`<cache>/data/<fingerprint>/`):
  tokenizer.json           the tokenizer used
  index.json               dtype, eos id, vocab size, per split: shards and token counts, the
                           number of bad records skipped (and the first few, with the reason)
  train_00000.bin ...      flat uint16/uint32 token streams: each document followed by EOS
  val_00000.bin ...

How it runs. One process reads the sources in a fixed order and cuts the items into chunks of
~data.chunk_bytes; `data.num_proc` worker processes parse and encode chunks (a bounded number in
flight, so memory stays flat whatever the corpus size); the reader appends each chunk's tokens
in order to the open shard of its split, and starts a new shard once one holds
data.shard_tokens. Shard boundaries therefore fall on chunk boundaries and the output bytes do
not depend on num_proc or on interruptions.

Resumable: the work goes to `<fingerprint>.partial/`, and after every chunk `progress.json`
records how many chunks are done and every shard's length. A rerun truncates the open shards to
those lengths, skips the chunks already done (reading them again, without encoding), and goes
on; the result is byte-identical to an uninterrupted run.

One writer: `<fingerprint>.lock` is created exclusively (O_EXCL) and names its owner (host, pid);
the owner refreshes it every few seconds. Any other process — another rank, another node on a
shared filesystem — waits for `index.json`, logging progress, with no deadline. A lock whose owner
is dead (same host) or that has not been refreshed for LOCK_STALE_S by the waiter's own clock
is taken over (renamed away first, so two waiters cannot both take it), and the new owner
resumes the partial work. Only the owner renames `.partial` to the final name.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from llmtrain.data import corpus
from llmtrain.data.corpus import (
    DataError,
    Item,
    hf_hub_revision,
    hf_parts,
    is_validation,
    iter_documents,
    iter_items,
    parse_item,
    parse_sources,
    source_files,
)
from llmtrain.data.tokenizer import check_fits, eos_id, load_tokenizer, train_bpe, vocab_span

logger = logging.getLogger(__name__)

# 3: documents keyed by their path inside the source (split, mixing); 4: mixture copies a
# source apart, validation documents taken once
FORMAT_VERSION = 4
# hf: rows keyed by their content (2; a running index moved rows between splits when files were
# added): in the key of a preparation with an hf: source only, so local corpora keep their caches
HF_KEYS = 2
LOCK_STALE_S = 300.0  # a lock not refreshed for this long (waiter's clock) has a dead owner
HEARTBEAT_S = 10.0
WAIT_LOG_S = 60.0
# fields that do not change the prepared bytes (so they do not change the cache key)
NOT_IN_KEY = ("cache_dir", "doc_mask", "num_proc", "max_bad_records", "streaming")


def default_cache_root() -> Path:
    return Path(os.environ.get("LLMTRAIN_CACHE", Path.home() / ".cache" / "llmtrain"))


def _fingerprint(data_cfg, vocab_size: int) -> str:
    cfg = {k: v for k, v in asdict(data_cfg).items() if k not in NOT_IN_KEY}
    sources = parse_sources(data_cfg.sources)
    key = {**cfg, "vocab": vocab_size, "v": FORMAT_VERSION}
    if any(src.spec.startswith("hf:") for src in sources):
        key["hf_keys"] = HF_KEYS
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    reached: dict[Path, int] = {}  # each file's real path -> the first source reaching it
    for i, src in enumerate(sources):
        if src.spec.startswith("hf:"):  # a local dataset folder: its files; a Hub name: none
            local = Path(hf_parts(src.spec[3:])[0])
            files = sorted(f for f in local.rglob("*") if f.is_file()) if local.is_dir() else []
        else:
            try:
                files = source_files(src.spec)
            except DataError:
                files = []  # reported when the data is read
        for f in files:
            real = f.resolve()
            if reached.setdefault(real, i) != i:
                raise DataError(
                    f"data.sources[{reached[real]}] and data.sources[{i}] both reach {f}: documents "
                    "are split into train and validation by their names inside their source, so "
                    "a file read by two sources would land in both splits. List disjoint sources; "
                    "to upweight part of a corpus, give it its own source with a weight and keep "
                    "it out of the other (another folder, or a glob)"
                )
            # size, nanosecond mtime and inode: a same-size edit within one second, or a file
            # replaced by a copy that kept its mtime, still changes the key
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
    if data_cfg.tokenizer not in ("", "train"):
        t = Path(data_cfg.tokenizer)
        f = t / "tokenizer.json" if t.is_dir() else t
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def prepared_dir(data_cfg, vocab_size: int, cache_root: Path | None = None) -> Path:
    """Where `data_cfg` is (or will be) prepared."""
    root = Path(data_cfg.cache_dir) if data_cfg.cache_dir else (cache_root or default_cache_root())
    for src in parse_sources(data_cfg.sources):  # the cache's own files would be read as data
        spec = hf_parts(src.spec[3:])[0] if src.spec.startswith("hf:") else src.spec
        if Path(spec).is_dir() and root.resolve().is_relative_to(Path(spec).resolve()):
            raise DataError(f"the data cache {root} lies inside the data source {spec}: its "
                            "shards and tokenizer would be read as data; set data.cache_dir "
                            "(or LLMTRAIN_CACHE) outside the source")  # fmt: skip
    return root / "data" / _fingerprint(data_cfg, vocab_size)


# ---------------------------------------------------------------- the lock


class CacheLock:
    """An exclusive lock file next to the prepared directory, naming its owner."""

    def __init__(self, final: Path):
        self.path = final.with_name(final.name + ".lock")
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: tuple | None = None  # (content, mtime) when last seen changing
        self._seen_at = 0.0

    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(self.me, fh)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="llmtrain-lock")
        self._thread.start()
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self.owner() == self.me:
                self.path.unlink(missing_ok=True)

    def owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def owner_text(self) -> str:
        o = self.owner() or {}
        return f"{o.get('host', '?')} pid {o.get('pid', '?')}"

    def stale(self) -> bool:
        """The owner is gone: a dead pid on this host, or no refresh for LOCK_STALE_S."""
        try:
            st = self.path.stat()
            content = self.path.read_text()
        except OSError:
            return False  # gone: not stale, just free
        try:
            o = json.loads(content)
        except ValueError:
            o = {}
        if o.get("host") == socket.gethostname() and isinstance(o.get("pid"), int):
            try:
                os.kill(o["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        now = time.monotonic()
        if self._seen != (content, st.st_mtime):
            self._seen, self._seen_at = (content, st.st_mtime), now
            return False
        return now - self._seen_at > LOCK_STALE_S

    def break_stale(self) -> None:
        """Move a stale lock aside (atomic: of two waiters only one succeeds), then drop it."""
        aside = self.path.with_name(f"{self.path.name}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        logger.warning("took over the stale data-preparation lock %s", self.path)
        aside.unlink(missing_ok=True)


def _progress_text(final: Path) -> str:
    try:
        p = json.loads((final.with_name(final.name + ".partial") / "progress.json").read_text())
        toks = sum(s["open"] + s.get("closed_tokens", sum(x["tokens"] for x in s.get("shards", [])))
                   for s in p["splits"].values())  # fmt: skip
        return f"{p['chars'] / 1e6:.1f} MB read, {toks / 1e6:.1f}M tokens written so far"
    except (OSError, ValueError, KeyError):
        return "starting"


def _wait(final: Path, lock: CacheLock | None, poll: float = 1.0) -> bool:
    """Wait (no deadline) until `final` is complete: True. With a lock to watch, return False
    as soon as it is free or stale, so the caller can take over."""
    t_log = time.monotonic()
    while not (final / "index.json").is_file():
        if lock is not None:
            if not lock.path.exists():
                return False
            if lock.stale():
                lock.break_stale()
                return False
        if time.monotonic() - t_log > WAIT_LOG_S:
            t_log = time.monotonic()
            who = lock.owner_text() if lock else "local rank 0"
            logger.warning(
                "waiting for %s to prepare %s (%s); to keep this out of a training job, run "
                "`llmtrain data prepare CONFIG` as its own step",
                who,
                final,
                _progress_text(final),
            )
        time.sleep(poll)
    return True


def prepare_data(
    data_cfg, vocab_size: int, cache_root: Path | None = None, local_rank: int = 0
) -> Path:
    """Return the prepared directory for `data_cfg`, building it on first use. Local rank 0 of
    every node may build (one wins the lock); other ranks wait for the result."""
    final = prepared_dir(data_cfg, vocab_size, cache_root)
    if (final / "index.json").is_file():
        return final
    if local_rank != 0:
        _wait(final, None)
        return final
    lock = CacheLock(final)
    while not lock.try_acquire():
        logger.info("%s is being prepared by %s; waiting", final, lock.owner_text())
        if _wait(final, lock):
            return final
    try:
        if (final / "index.json").is_file():  # finished while we waited for the lock
            return final
        part = final.with_name(final.name + ".partial")
        how = "resuming" if (part / "progress.json").is_file() else "preparing"
        logger.info("%s data into %s (once: runs with the same data settings reuse it)", how,
                    final)  # fmt: skip
        try:
            _build(data_cfg, vocab_size, part)
        except DataError:  # bad sources or data: another config must fix it, so nothing resumes
            shutil.rmtree(part, ignore_errors=True)
            raise
        if final.exists():  # left by an owner whose lock was wrongly broken: keep the first
            shutil.rmtree(part)
        else:
            os.rename(part, final)
    finally:
        lock.release()
    logger.info("data ready in %s", final)
    return final


# ---------------------------------------------------------------- reading and encoding


def _chunks(data_cfg, revisions: dict[str, str] | None = None) -> Iterator[list[Item]]:
    """Items cut into chunks of ~chunk_bytes, deterministically. With max_bytes each source
    gives its weight's share of it, and stops at the end of a document (a cut one would have
    no EOS), so a capped mixture is a sample of every source, not the first one's head."""
    chunk: list[Item] = []
    size = 0
    sources = parse_sources(data_cfg.sources)
    weights = sum(s.weight for s in sources)
    for src in sources:
        budget = data_cfg.max_bytes * src.weight / weights if data_cfg.max_bytes else 0
        taken = 0
        for item in iter_items([src], data_cfg.text_field, data_cfg.streaming,
                               data_cfg.val_percent, revisions):  # fmt: skip
            p = item[2]
            n = len(p) if isinstance(p, (str, bytes)) else 0
            chunk.append(item)
            size += n
            taken += n
            if size >= data_cfg.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            if budget and taken >= budget and item[3]:
                break
    if chunk:
        yield chunk


_W: dict = {}


def _init_worker(tok_file: str, text_field: str, val_percent: float, dtype: str) -> None:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    tok = Tokenizer.from_file(tok_file)
    # "<|endoftext|>" written inside a document is text, not an end of document (no fake EOS)
    tok.encode_special_tokens = True
    _W.update(tok=tok, eos=eos_id(tok), tf=text_field, val=val_percent, dtype=np.dtype(dtype))


def split_long(text: str) -> list[str]:
    """A document's text in ~TEXT_PIECE_CHARS pieces cut as large text files are (after a
    newline followed by text: with a byte-level BPE the pieces' tokens are the whole text's),
    so a huge JSONL or Parquet document is not encoded at once."""
    n, out, start = corpus.TEXT_PIECE_CHARS, [], 0
    while len(text) - start > 4 * n:
        cut = corpus._cut(text[start : start + n]) or corpus._cut(text[start : start + 4 * n], True)
        out.append(text[start : start + cut])
        start += cut
    out.append(text[start:])
    return out


def _encode_chunk(items: list[Item]) -> dict:
    """Parse and encode one chunk: the token stream of each split, docs, bad records."""
    tok, eos, dtype = _W["tok"], _W["eos"], _W["dtype"]
    texts, meta, bad, chars = [], [], [], 0
    for item in items:
        text, why = parse_item(item, _W["tf"])
        if why is not None:
            bad.append(why)
            continue
        if text is None:
            continue
        chars += len(text)
        texts.append(text)
        meta.append((is_validation(item[0], _W["val"]), item[3]))
    long = {i for i, t in enumerate(texts) if len(t) > 4 * corpus.TEXT_PIECE_CHARS}
    short = [t for i, t in enumerate(texts) if i not in long]
    encs = iter(tok.encode_batch(short, add_special_tokens=False) if short else [])
    parts: dict[bool, list] = {False: [], True: []}
    docs = {False: 0, True: 0}
    eos_arr = np.array([eos], dtype=dtype)
    for i, (val, end) in enumerate(meta):
        if i in long:  # one piece at a time: an Encoding costs ~100 bytes a character
            ids = np.concatenate([np.asarray(tok.encode(p, add_special_tokens=False).ids, dtype)
                                  for p in split_long(texts[i])])  # fmt: skip
        else:
            ids = np.asarray(next(encs).ids, dtype=dtype)
        parts[val].append(ids)
        if end:
            parts[val].append(eos_arr)
            docs[val] += 1
    out = {"bad": bad, "chars": chars}
    for val, split in ((False, "train"), (True, "val")):
        out[split] = np.concatenate(parts[val]) if parts[val] else np.empty(0, dtype)
        out[split + "_docs"] = docs[val]
    return out


class _SplitWriter:
    """Appends a split's tokens to its open shard; closes it at shard_tokens (chunk-aligned).
    Closed shards go to an append-only log (`<split>_shards.jsonl`), so the progress record
    written after every chunk stays a few numbers whatever the shard count (a TB corpus makes
    ~5,000 shards: rewriting their list after each 1 MiB chunk cost 23 ms and 350 kB)."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, limit: int, state: dict | None):
        self.out, self.split, self.dtype, self.limit = out, split, dtype, limit
        state = state or {"n_shards": 0, "docs": 0, "open": 0}
        self.log = out / f"{split}_shards.jsonl"
        lines = self.log.read_bytes().splitlines(keepends=True) if self.log.is_file() else []
        if "shards" in state:  # a preparation an earlier release began: its list, into the log
            lines = [(json.dumps(x) + "\n").encode() for x in state["shards"]]
            state = {**state, "n_shards": len(lines)}
        kept = lines[: state["n_shards"]]  # lines past the last progress record are dropped
        self.log.write_bytes(b"".join(kept))
        self.shards = [json.loads(x) for x in kept]
        self.closed_tokens = sum(int(x["tokens"]) for x in self.shards)
        self.docs, self.open = state["docs"], state["open"]
        self.fh = None
        if self.open:  # resume: drop whatever was written after the last progress record
            with open(self.out / self._name(), "r+b") as fh:
                fh.truncate(self.open * self.dtype.itemsize)

    def _name(self) -> str:
        return f"{self.split}_{len(self.shards):05d}.bin"

    def files(self) -> set[str]:
        return ({s["file"] for s in self.shards} | {self.log.name}
                | ({self._name()} if self.open else set()))  # fmt: skip

    def append(self, arr: np.ndarray, docs: int) -> None:
        self.docs += docs
        if arr.size:
            if self.fh is None:
                self.fh = open(self.out / self._name(), "ab")
            arr.tofile(self.fh)
            self.open += arr.size
        if self.open >= self.limit:
            self.close_shard()

    def close_shard(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.open:
            rec = {"file": self._name(), "tokens": self.open}
            with open(self.log, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            self.shards.append(rec)
            self.closed_tokens += self.open
            self.open = 0

    def flush(self) -> None:
        if self.fh is not None:
            self.fh.flush()

    def state(self) -> dict:
        return {"n_shards": len(self.shards), "docs": self.docs, "open": self.open,
                "closed_tokens": self.closed_tokens}  # fmt: skip


def _num_proc(data_cfg) -> int:
    n = data_cfg.num_proc or len(os.sched_getaffinity(0))
    return max(1, n)


def _tokenizer(data_cfg, vocab_size: int, out: Path):
    """The saved tokenizer of a partial run, the user's, or a BPE trained on the train split."""
    from tokenizers import Tokenizer

    saved = out / "tokenizer.json"
    if saved.is_file():
        return Tokenizer.from_file(str(saved))
    if data_cfg.tokenizer in ("", "train"):
        budget = data_cfg.tokenizer_train_bytes

        def sample():
            """Each source's share of the budget by its mixture weight (not the first bytes in
            source order), read piece by piece (no file whole), the validation split left out."""
            srcs = parse_sources(data_cfg.sources)
            total = sum(src.weight for src in srcs) or 1.0
            for src in srcs:
                share, seen = budget * src.weight / total, 0
                for key, text in iter_documents([src.spec], data_cfg.text_field, bad=[],
                                                join=False):  # fmt: skip
                    if is_validation(key, data_cfg.val_percent):
                        continue
                    yield text
                    seen += len(text)
                    if seen >= share:
                        break

        tok = train_bpe(sample(), vocab_size)
    else:
        tok = load_tokenizer(data_cfg.tokenizer)
    check_fits(tok, vocab_size)
    tmp = out / "tokenizer.json.tmp"
    tok.save(str(tmp))
    os.replace(tmp, saved)
    return tok


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _build(data_cfg, vocab_size: int, out: Path) -> None:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    corpus.check_columns(parse_sources(data_cfg.sources), data_cfg.text_field)
    tok = _tokenizer(data_cfg, vocab_size, out)
    check_fits(tok, vocab_size)
    eos = eos_id(tok)
    n_vocab = vocab_span(tok)
    dtype = np.dtype(np.uint16 if n_vocab <= 65536 else np.uint32)
    progress_file = out / "progress.json"
    prog = json.loads(progress_file.read_text()) if progress_file.is_file() else {}
    writers = {
        s: _SplitWriter(out, s, dtype, data_cfg.shard_tokens, prog.get("splits", {}).get(s))
        for s in ("train", "val")
    }
    keep = {"tokenizer.json", "progress.json"} | set().union(*(w.files() for w in writers.values()))
    for f in out.iterdir():  # shards begun after the last progress record
        if f.name not in keep:
            f.unlink()
    done, chars = prog.get("chunks", 0), prog.get("chars", 0)
    # every hf: Hub source reads one commit from start to resume: the one recorded when this
    # preparation began (a Hub that moved on meanwhile is not mixed in), noted in index.json
    revisions = dict(prog.get("hf_revisions", {}))
    for src in parse_sources(data_cfg.sources):
        if src.spec.startswith("hf:") and src.spec not in revisions:
            sha = hf_hub_revision(src.spec)
            if sha:
                revisions[src.spec] = sha
    bad_n, bad_first = prog.get("bad", 0), list(prog.get("bad_examples", []))
    args = (str(out / "tokenizer.json"), data_cfg.text_field, data_cfg.val_percent, dtype.name)
    nproc = _num_proc(data_cfg)
    fault_chunk = int(os.environ.get("LLMTRAIN_FAULT_KILL_AT_CHUNK", "0"))
    bar = tqdm(desc="tokenizing", unit="B", unit_scale=True, disable=None, initial=chars)

    def consume(res: dict, k: int) -> None:
        nonlocal chars, bad_n
        for s in ("train", "val"):
            writers[s].append(res[s], res[s + "_docs"])
            writers[s].flush()
        if k == fault_chunk:  # tests: die between writing tokens and recording them
            os.kill(os.getpid(), signal.SIGKILL)
        chars += res["chars"]
        bar.update(res["chars"])
        if res["bad"]:
            for why in res["bad"][: max(0, 5 - len(bad_first))]:
                logger.warning("skipped a bad record: %s", why)
            bad_first.extend(res["bad"][: max(0, 5 - len(bad_first))])
            bad_n += len(res["bad"])
            if bad_n > data_cfg.max_bad_records:
                raise DataError(
                    f"{bad_n} bad records, more than data.max_bad_records="
                    f"{data_cfg.max_bad_records}; the first: {bad_first[0]}; the last: "
                    f"{res['bad'][-1]}. Fix the data or raise data.max_bad_records"
                )
        _write_json(progress_file, {"chunks": k, "chars": chars, "bad": bad_n,
                                    "hf_revisions": revisions,
                                    "bad_examples": bad_first,
                                    "splits": {s: w.state() for s, w in writers.items()}})  # fmt: skip

    chunks = _chunks(data_cfg, revisions)
    for _ in range(done):  # already encoded and written: read past them
        if next(chunks, None) is None:
            break
    k = done
    if nproc == 1:
        _init_worker(*args)
        for chunk in chunks:
            k += 1
            consume(_encode_chunk(chunk), k)
    else:
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (torch, rayon)
        with ctx.Pool(nproc, initializer=_init_worker, initargs=args) as pool:
            inflight: collections.deque = collections.deque()
            for chunk in chunks:
                inflight.append(pool.apply_async(_encode_chunk, (chunk,)))
                if len(inflight) >= 2 * nproc:  # bounded: memory stays flat
                    k += 1
                    consume(inflight.popleft().get(), k)
            while inflight:
                k += 1
                consume(inflight.popleft().get(), k)
    bar.close()
    for w in writers.values():
        w.close_shard()
    if not writers["train"].shards:
        why = f"; {bad_n} bad record(s) skipped, the first: {bad_first[0]}" if bad_n else ""
        raise DataError(f"no training text found in data.sources={data_cfg.sources}{why}")
    if not writers["val"].shards:
        n = writers["train"].docs
        raise DataError(
            f"the validation split is empty: each document goes wholly to one split, and all "
            f"{n} went to training; raise data.val_percent or add documents"
            + (
                " (a text file is one document: cut a large one into several files)"
                if n < 50
                else ""
            )
        )
    if bad_n:
        logger.warning("skipped %d bad record(s) (data.max_bad_records=%d); first: %s", bad_n,
                       data_cfg.max_bad_records, bad_first[0])  # fmt: skip
    index = {
        "format": FORMAT_VERSION,
        "dtype": dtype.name,
        "eos_id": eos,
        "vocab_size": n_vocab,
        "sources": data_cfg.sources,
        "hf_revisions": revisions,
        "bytes": chars,
        "chunks": k,
        "bad_records": bad_n,
        "bad_examples": bad_first,
        "splits": {
            s: {
                "shards": w.shards,
                "docs": w.docs,
                "tokens": int(sum(x["tokens"] for x in w.shards)),
            }
            for s, w in writers.items()
        },
    }
    _write_json(out / "index.json", index)
    progress_file.unlink()
    for w in writers.values():
        w.log.unlink()


def describe(final: Path) -> str:
    """One line about a prepared directory, for `llmtrain data prepare`."""
    idx = json.loads((final / "index.json").read_text())
    sp = idx["splits"]
    return (
        f"{final}: {sp['train']['tokens']:,} train / {sp['val']['tokens']:,} val tokens "
        f"({idx['dtype']}, {len(sp['train']['shards'])} + {len(sp['val']['shards'])} shards), "
        f"{sp['train']['docs'] + sp['val']['docs']:,} documents, "
        f"{idx['bad_records']} bad record(s) skipped"
    )
