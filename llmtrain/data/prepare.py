"""Tokenize once into sharded binary token files (memory-mapped, with an index), cached by content.

Layout of a prepared directory:
  tokenizer.json           the tokenizer used
  index.json               dtype, eos id, vocab size, per split: shards and token counts
  train_00000.bin ...      flat token streams: each document followed by EOS
  val_00000.bin ...

Only one process per machine prepares (LOCAL_RANK 0); the others wait for the finished
directory, which appears atomically (written under a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from llmtrain.data.corpus import (
    BUILTIN_STDLIB,
    DataError,
    is_validation,
    iter_documents,
    stdlib_files,
)
from llmtrain.data.tokenizer import check_fits, eos_id, load_tokenizer, train_bpe


def default_cache_root() -> Path:
    return Path(os.environ.get("LLMTRAIN_CACHE", Path.home() / ".cache" / "llmtrain"))


def _fingerprint(data_cfg, vocab_size: int) -> str:
    h = hashlib.sha256(
        json.dumps({**asdict(data_cfg), "vocab": vocab_size, "v": 1}, sort_keys=True).encode()
    )
    for src in data_cfg.sources:
        files = []
        if src == BUILTIN_STDLIB:
            files = stdlib_files()
        elif not src.startswith("hf:") and Path(src).exists():
            p = Path(src)
            files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
    if data_cfg.tokenizer not in ("", "train"):
        t = Path(data_cfg.tokenizer)
        f = t / "tokenizer.json" if t.is_dir() else t
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


class _ShardWriter:
    def __init__(self, out: Path, split: str, dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.limit = out, split, dtype, shard_tokens
        self.buf: list[np.ndarray] = []
        self.n_buf = 0
        self.shards: list[dict] = []
        self.docs = 0

    def add(self, ids: list[int]) -> None:
        self.buf.append(np.asarray(ids, dtype=self.dtype))
        self.n_buf += len(ids)
        self.docs += 1
        if self.n_buf >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.n_buf:
            return
        name = f"{self.split}_{len(self.shards):05d}.bin"
        np.concatenate(self.buf).tofile(self.out / name)
        self.shards.append({"file": name, "tokens": self.n_buf})
        self.buf, self.n_buf = [], 0


def prepare_data(
    data_cfg, vocab_size: int, cache_root: Path | None = None, local_rank: int = 0
) -> Path:
    """Return the prepared directory for `data_cfg`, building it on first use."""
    root = Path(data_cfg.cache_dir) if data_cfg.cache_dir else (cache_root or default_cache_root())
    final = root / "data" / _fingerprint(data_cfg, vocab_size)
    if (final / "index.json").is_file():
        return final
    if local_rank != 0:
        deadline = time.time() + 3600
        while not (final / "index.json").is_file():
            if time.time() > deadline:
                raise DataError(f"timed out waiting for local rank 0 to prepare {final}")
            time.sleep(1.0)
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _build(data_cfg, vocab_size, tmp)
        if final.exists():  # another machine's process sharing the disk won the race
            shutil.rmtree(tmp)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _build(data_cfg, vocab_size: int, out: Path) -> None:
    def docs():
        return iter_documents(data_cfg.sources, data_cfg.text_field, data_cfg.streaming)

    if data_cfg.tokenizer in ("", "train"):
        budget = data_cfg.tokenizer_train_bytes

        def sample():
            seen = 0
            for key, text in docs():
                if is_validation(key, data_cfg.val_percent):
                    continue
                yield text
                seen += len(text)
                if seen >= budget:
                    return

        tok = train_bpe(sample(), vocab_size)
    else:
        tok = load_tokenizer(data_cfg.tokenizer)
    check_fits(tok, vocab_size)
    eos = eos_id(tok)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if n_vocab <= 65536 else np.uint32
    tok.save(str(out / "tokenizer.json"))
    writers = {s: _ShardWriter(out, s, dtype, data_cfg.shard_tokens) for s in ("train", "val")}
    n_bytes = 0
    batch: list[tuple[str, str]] = []

    def flush_batch():
        encs = tok.encode_batch([t for _, t in batch], add_special_tokens=False)
        for (key, _), enc in zip(batch, encs):
            split = "val" if is_validation(key, data_cfg.val_percent) else "train"
            writers[split].add(enc.ids + [eos])
        batch.clear()

    bar = tqdm(desc="tokenizing", unit="B", unit_scale=True, disable=None)
    for key, text in docs():
        batch.append((key, text))
        n_bytes += len(text)
        bar.update(len(text))
        if len(batch) >= 256:
            flush_batch()
        if data_cfg.max_bytes and n_bytes >= data_cfg.max_bytes:
            break
    if batch:
        flush_batch()
    bar.close()
    for w in writers.values():
        w.flush()
    if not writers["train"].shards:
        raise DataError(f"no training text found in data.sources={data_cfg.sources}")
    if not writers["val"].shards:
        raise DataError("the validation split is empty: raise data.val_percent or add documents")
    index = {
        "dtype": np.dtype(dtype).name,
        "eos_id": eos,
        "vocab_size": n_vocab,
        "sources": data_cfg.sources,
        "bytes": n_bytes,
        "splits": {s: {"shards": w.shards, "docs": w.docs} for s, w in writers.items()},
    }
    (out / "index.json").write_text(json.dumps(index, indent=1))
