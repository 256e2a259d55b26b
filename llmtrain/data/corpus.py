"""Where documents come from: local files (txt, jsonl, parquet), a `datasets` dataset, or the
embedded corpus (this Python's own standard-library sources: real text every machine has).

A document is a string; a source yields (doc_key, text) in a deterministic order. The doc key
decides the validation split (a stable hash), so the split never depends on file order.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

from llmtrain.errors import LlmtrainError

BUILTIN_STDLIB = "builtin:stdlib"


class DataError(LlmtrainError, ValueError):
    """Bad data input: the message says which path or field and what to change."""


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = [p for p in root.rglob("*.py") if not any(s in p.relative_to(root).parts for s in skip)]
    return sorted(files)


def is_validation(key: str, val_percent: float) -> bool:
    return (zlib.crc32(key.encode()) % 10000) < val_percent * 100


def _read_text_file(p: Path) -> str:
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {p}: {e}") from e
    if b"\x00" in raw[:4096]:
        raise DataError(f"{p} looks binary (NUL bytes); give text, jsonl or parquet files")
    return raw.decode("utf-8", errors="replace")


def iter_documents(
    sources: list[str], text_field: str = "text", streaming: bool = False
) -> Iterator[tuple[str, str]]:
    """Yield (key, text) for every non-empty document of every source, deterministically."""
    for src in sources:
        if src == BUILTIN_STDLIB:
            root = Path(sysconfig.get_paths()["stdlib"])
            for p in stdlib_files():
                text = _read_text_file(p)
                if text.strip():
                    yield str(p.relative_to(root)), text
            continue
        if src.startswith("hf:"):
            yield from _iter_hf(src[3:], text_field, streaming)
            continue
        path = Path(src)
        if not path.exists():
            raise DataError(f"data path {path} does not exist (data.sources)")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        if not files:
            raise DataError(f"data directory {path} holds no files")
        for f in files:
            yield from _iter_file(f, text_field)


def _iter_file(f: Path, text_field: str) -> Iterator[tuple[str, str]]:
    suffix = f.suffix.lower()
    if suffix == ".jsonl":
        for i, line in enumerate(_read_text_file(f).splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{i + 1}: not valid JSON ({e.msg})") from e
            if text_field not in row:
                raise DataError(f"{f}:{i + 1}: no field {text_field!r} (set data.text_field)")
            if str(row[text_field]).strip():
                yield f"{f}:{i}", str(row[text_field])
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(f)
        except (OSError, ValueError) as e:  # pyarrow: empty, truncated or not parquet at all
            raise DataError(
                f"{f} is not a readable parquet file ({e}); rewrite it or drop it from data.sources"
            ) from e
        if text_field not in table.column_names:
            raise DataError(f"{f}: no column {text_field!r}; columns are {table.column_names}")
        for i, t in enumerate(table.column(text_field).to_pylist()):
            if t and str(t).strip():
                yield f"{f}:{i}", str(t)
    else:
        text = _read_text_file(f)
        if text.strip():
            yield str(f), text


def _iter_hf(spec: str, text_field: str, streaming: bool) -> Iterator[tuple[str, str]]:
    """`hf:NAME[:CONFIG][@SPLIT]`, loaded with `datasets` (streaming supported)."""
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=streaming)
    for i, row in enumerate(ds):
        if text_field not in row:
            raise DataError(f"dataset {name}: no field {text_field!r} (set data.text_field)")
        if row[text_field] and str(row[text_field]).strip():
            yield f"{name}:{i}", str(row[text_field])
