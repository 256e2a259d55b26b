"""Where documents come from, streamed: local files (.txt, .jsonl, .jsonl.gz, .parquet, .arrow),
directories and globs of them, `hf:` datasets (always streamed), or the embedded corpus (this
Python's own standard-library sources: real text every machine has). No file is read whole.

Reading is split in two so the expensive half runs in worker processes: the reader (one process,
sequential, deterministic) yields *items* — a JSON line still as bytes, a text column value, a
piece of a large text file — and `parse_item` (in the workers) turns an item into text or into a
counted bad record. Each item has a document key; the key decides the validation split (a stable
hash), so the split never depends on file order or on how the work is cut into chunks.

A source may carry a mixture weight (`{path: ..., weight: w}` in `data.sources`): each of its
documents is taken floor(w) times, plus once more when a stable hash of its key falls under
w - floor(w). So 0.25 keeps a quarter of a source, 3 repeats it three times, deterministically.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import math
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import LlmtrainError

logger = logging.getLogger(__name__)

BUILTIN_STDLIB = "builtin:stdlib"
TEXT_PIECE_CHARS = 1 << 20  # large .txt files are read (and encoded) in pieces of ~1 MiB
_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".parquet", ".arrow", ".txt")


class DataError(LlmtrainError, ValueError):
    """Bad data input: the message says which path or field and what to change."""


class SourceUnavailable(LlmtrainError):
    """A source could not be reached for now (the Hub offline or failing): not a DataError, so
    the partial preparation is kept and a rerun resumes it."""


@dataclass(frozen=True)
class Source:
    """One entry of data.sources: a path, directory, glob, hf:NAME[:CONFIG][@SPLIT] or builtin."""

    spec: str
    weight: float = 1.0


# An item: (key, kind, payload, end). kind: "json" (payload: one JSON line, bytes), "text"
# (payload: str), "more" (a further piece of a text file), "bad" (payload: why). `end` is False for all but the last piece of a document
# (a large text file), which then gets no EOS until its end.
Item = tuple[str, str, object, bool]


def parse_sources(raw: list) -> list[Source]:
    """data.sources entries: strings, or mappings {path: ..., weight: ...}."""
    out = []
    for i, s in enumerate(raw):
        if isinstance(s, str):
            out.append(Source(s))
            continue
        if isinstance(s, dict) and set(s) <= {"path", "weight"} and isinstance(s.get("path"), str):
            w = s.get("weight", 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0):
                raise DataError(f"data.sources[{i}].weight={w!r} must be a positive number")
            if not math.isfinite(w):
                raise DataError(f"data.sources[{i}].weight={w!r} must be finite")
            out.append(Source(s["path"], float(w)))
            continue
        raise DataError(
            f"data.sources[{i}]={s!r}: give a path, hf:NAME, or a mapping {{path: ..., weight: ...}}"
        )
    return out


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = [p for p in root.rglob("*.py") if not any(s in p.relative_to(root).parts for s in skip)]
    return sorted(files)


def is_validation(key: str, val_percent: float) -> bool:
    return (zlib.crc32(key.encode()) % 10000) < val_percent * 100


def copies(key: str, weight: float) -> int:
    """How many times a document of a source with this mixture weight is taken (stable)."""
    whole = math.floor(weight)
    frac = weight - whole
    return whole + (frac > 0 and (zlib.crc32(b"mix:" + key.encode()) % 1_000_000) < frac * 1e6)


# what `datasets.Dataset.save_to_disk` writes beside its .arrow files
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")


def source_files(spec: str) -> list[Path]:
    """The files of a local source (a file, a directory, or a glob), sorted; errors name it."""
    if spec == BUILTIN_STDLIB:
        return stdlib_files()
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data source {spec!r}: the pattern matches no files")
        return files
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data path {path} does not exist (data.sources)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))  # .cache/, .git/ ...  # fmt: skip
        # a `datasets` save_to_disk folder: its .arrow files are the data, its JSON the metadata
        arrow_dirs = {p.parent for p in files if p.suffix == ".arrow"}
        files = [p for p in files if not (p.name in DATASETS_METADATA and p.parent in arrow_dirs)]
        if not files:
            raise DataError(f"data directory {path} holds no files")
        return files
    return [path]


def iter_items(
    sources: list[Source],
    text_field: str = "text",
    streaming: bool = True,
    val_percent: float | None = None,
    revisions: dict[str, str] | None = None,
) -> Iterator[Item]:
    """Every item of every source in a fixed order, mixture copies included. A source of weight
    W > 1 is read in ceil(W) passes, copy k of a document in pass k, so copies lie a whole source
    apart: back to back they would share training windows (the model predicts the second copy
    from the first in its context). With `val_percent`, a validation document is taken at most
    once (a weight below 1 still samples it): repeats add no measurement, only such leaks."""

    def taken(key: str, weight: float) -> int:
        n = copies(key, weight)
        return min(n, 1) if val_percent is not None and is_validation(key, val_percent) else n

    for src in sources:
        for k in range(max(1, math.ceil(src.weight))):
            if src.spec.startswith("hf:"):
                rev = (revisions or {}).get(src.spec)
                for item in _iter_hf(src.spec[3:], text_field, streaming, rev):
                    if taken(item[0], src.weight) > k:
                        yield item
                continue
            root = source_root(src.spec)
            for f in source_files(src.spec):
                name = stable_name(f, root)
                if _kind(f) == "text":  # one document per file, streamed in pieces
                    if taken(name, src.weight) > k:
                        yield from _iter_text_file(f, name)
                    continue
                for item in _iter_file(f, text_field, name):
                    if taken(item[0], src.weight) > k:
                        yield item


def source_root(spec: str) -> Path:
    """The directory a source's files are named from: the directory itself, a file's parent,
    a glob's directory before its first wildcard, the standard library's root."""
    if spec == BUILTIN_STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    if any(c in spec for c in "*?["):
        parts = Path(spec).parts
        fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
        return Path(*parts[:fixed]) if fixed else Path(".")
    path = Path(spec)
    return path if path.is_dir() else path.parent


def stable_name(f: Path, root: Path) -> str:
    """A file's name inside its source (POSIX). Document keys, which decide the validation
    split and mixture copies, are made from it, so the same data reached by another path (a
    relative or absolute spelling, a symlink, a copy staged elsewhere) splits the same way."""
    try:
        return f.relative_to(root).as_posix()
    except ValueError:
        return f.name


def _kind(f: Path) -> str:
    name = f.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".json")):  # .json: JSON lines too
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "text"


def _iter_file(f: Path, text_field: str, name: str) -> Iterator[Item]:
    kind = _kind(f)
    if kind == "jsonl":
        yield from _iter_jsonl(f, name)
    elif kind == "parquet":
        yield from _iter_parquet(f, text_field, name)
    else:
        yield from _iter_arrow(f, text_field, name)


def _iter_jsonl(f: Path, name: str) -> Iterator[Item]:
    opener = gzip.open if f.name.lower().endswith(".gz") else open
    i = -1
    try:
        with opener(f, "rb") as fh:
            for i, line in enumerate(fh):  # noqa: B007 (i is reported on a truncated file)
                if line.strip():
                    yield f"{name}:{i}", "json", line, True
    except (OSError, EOFError, zlib.error) as e:  # truncated / corrupt gzip, unreadable file
        yield f"{name}:{i + 1}", "bad", f"{f}: unreadable after line {i + 1} ({e})", True


def _iter_text_file(f: Path, key: str) -> Iterator[Item]:
    """A text file is one document, read in ~1 MiB pieces cut at line ends (never whole).
    Pieces after the first are kind "more", so the worker ends the document with EOS even when
    the last piece is empty."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("strict")
    kind, kept = "text", 0
    try:
        with open(f, "rb") as fh:
            head = fh.read(4096)
            if b"\x00" in head:
                yield key, "bad", f"{f} looks binary (NUL bytes); give text, jsonl or parquet", True
                return
            pending, raw = "", head
            while raw:
                pending += dec.decode(raw)
                # no safe cut yet: read on, up to 4 pieces' worth (then any line end)
                cut = len(pending) >= TEXT_PIECE_CHARS and _cut(
                    pending, len(pending) >= 4 * TEXT_PIECE_CHARS
                )
                if cut:
                    yield key, kind, pending[:cut], False
                    kind, pending, kept = "more", pending[cut:], kept + cut
                raw = fh.read(TEXT_PIECE_CHARS)
            pending += dec.decode(b"", final=True)
            yield key, kind, pending, True
    except (UnicodeDecodeError, OSError) as e:
        why = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"cannot be read ({e})"
        if kind == "more":  # close the document begun in earlier pieces, and say it was kept:
            # streaming never holds the file, so what was read before the fault is trained on
            yield key, "more", "", True
            why += (f" past its first {kept:,} characters: those are kept as a document, the "
                    "rest is skipped")  # fmt: skip
        yield key, "bad", f"{f} {why}", True


def _cut(text: str, anyhow: bool = False) -> int:
    """Where a piece of a large text file may end: after the last lone newline (non-space
    characters on both sides), so no whitespace run is split. GPT-2-style pre-tokenizers keep
    "\\n    " together and split "\\n\\n" or "   \\n" as "\\n", "\\n" inside a text but not at its
    end; Llama 3's keeps "\\n\\n" whole. 0 when there is none, unless `anyhow`: then after the
    last newline, or all (CRLF text, which no cut keeps whole for both kinds)."""
    at = len(text) - 1
    while (at := text.rfind("\n", 0, at)) >= 0:
        if at > 0 and not text[at + 1].isspace() and not text[at - 1].isspace():
            return at + 1
    return (text.rfind("\n") + 1 or len(text)) if anyhow else 0


def check_columns(sources: list[Source], text_field: str) -> None:
    """Every local Parquet/Arrow file has the text column, read from its footer or schema
    (milliseconds a file) before any encoding: found while streaming, the file a TB corpus
    reaches after hours would fail the whole preparation then. Unreadable files are left to
    the reader (counted as bad records)."""
    for src in sources:
        if src.spec.startswith("hf:"):
            continue
        for f in source_files(src.spec):
            kind = _kind(f)
            if kind not in ("parquet", "arrow"):
                continue
            import pyarrow as pa  # only for such files: JSONL and text never load it
            import pyarrow.parquet as pq

            try:
                if kind == "parquet":
                    names = pq.read_schema(f).names
                elif kind == "arrow":
                    with pa.memory_map(str(f)) as m:
                        try:
                            names = pa.ipc.open_file(m).schema.names
                        except pa.ArrowInvalid:
                            m.seek(0)
                            names = pa.ipc.open_stream(m).schema.names
            except (pa.ArrowException, OSError):
                continue
            if text_field not in names:
                raise DataError(f"{f}: no column {text_field!r}; columns are {names} "
                                "(set data.text_field, or leave the file out of data.sources)")  # fmt: skip


def _column_batches(f: Path, text_field: str, batches, name: str) -> Iterator[Item]:
    i = 0
    for b in batches:
        if text_field not in b.schema.names:
            raise DataError(f"{f}: no column {text_field!r}; columns are {b.schema.names} "
                            "(set data.text_field)")  # fmt: skip
        col = b.column(text_field)
        for at in range(0, len(col), 1024):  # an Arrow file may be one huge record batch
            for t in col.slice(at, 1024).to_pylist():
                yield f"{name}:{i}", "text", t, True
                i += 1


def _iter_parquet(f: Path, text_field: str, name: str) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        yield name, "bad", f"{f} is not a readable parquet file ({e})", True
        return
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{f}: no column {text_field!r}; columns are {pf.schema_arrow.names} "
                        "(set data.text_field)")  # fmt: skip
    try:
        yield from _column_batches(f, text_field, pf.iter_batches(1024, columns=[text_field]),
                                   name)  # fmt: skip
    except (pa.ArrowException, OSError) as e:
        yield name, "bad", f"{f}: unreadable part ({e})", True


def _iter_arrow(f: Path, text_field: str, name: str) -> Iterator[Item]:
    """Arrow IPC, file or stream format (what `datasets` writes), memory-mapped."""
    import pyarrow as pa

    try:
        src = pa.memory_map(str(f))
        try:
            r = pa.ipc.open_file(src)
            batches = (r.get_batch(i) for i in range(r.num_record_batches))
        except pa.ArrowInvalid:
            src.seek(0)
            batches = pa.ipc.open_stream(src)
    except (pa.ArrowException, OSError) as e:
        yield name, "bad", f"{f} is not a readable Arrow file ({e})", True
        return
    try:
        yield from _column_batches(f, text_field, batches, name)
    except (pa.ArrowException, OSError) as e:
        yield name, "bad", f"{f}: unreadable part ({e})", True


def hf_parts(spec: str) -> tuple[str, str, str, str]:
    """`NAME[:CONFIG][@SPLIT][#REVISION]` (an `hf:` source without its prefix) ->
    (name, config, split, revision)."""
    spec, _, revision = spec.partition("#")
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    return name, config, split, revision


def hf_hub_revision(spec: str) -> str | None:
    """The commit an `hf:` Hub source reads: its pinned #REVISION resolved, or the head's now;
    None for a local dataset folder or script."""
    name, _, _, revision = hf_parts(spec[3:])
    if Path(name).exists():
        return None
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0"):
        logger.warning("%s: offline, so the commit read is not resolved nor recorded (datasets "
                       "reads its cache)", spec)  # fmt: skip
        return revision or None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return HfApi().dataset_info(name, revision=revision or None).sha
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as e:
        what = "revision" if isinstance(e, RevisionNotFoundError) else "dataset"
        raise DataError(f"data source {spec}: no such {what} on the Hub, or no access to it "
                        f"({type(e).__name__}); check the name and #REVISION; a private or gated "
                        "dataset needs HF_TOKEN (or `hf auth login`) and its terms accepted") from e  # fmt: skip
    except OSError as e:  # offline, connection, 5xx
        raise SourceUnavailable(f"data source {spec}: the Hub cannot be reached ({e}); rerun "
                                "when it can (work done so far is kept)") from e  # fmt: skip


def hf_key(label: str, text) -> str:
    """A Hub row's document key: its content, not its position, so rows keep their split when
    files are added or reordered (a running index shifts every later row) and exact duplicates
    share one split."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else repr(text).encode()
    return f"{label}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def _iter_hf(
    spec: str, text_field: str, streaming: bool = True, revision: str | None = None
) -> Iterator[Item]:
    """`hf:NAME[:CONFIG][@SPLIT][#REVISION]` — a Hub dataset, or a local dataset directory or
    script — streamed through `datasets` (nothing is downloaded whole or converted first), or
    with `streaming=False` (data.streaming) downloaded and cached by `datasets` first.
    `revision` (a commit recorded when the preparation began) overrides the spec's."""
    import datasets

    name, config, split, pinned = hf_parts(spec)
    revision = revision or pinned or None
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train",
                                   streaming=streaming, revision=revision)  # fmt: skip
    except (FileNotFoundError, ValueError) as e:  # no such dataset/config/split, no access
        raise DataError(f"data source hf:{spec}: cannot open with datasets ({e})") from e
    except Exception as e:  # offline, connection, 5xx: transient, keep the work done
        raise SourceUnavailable(f"data source hf:{spec}: cannot reach it now ({e}); rerun to "
                                "resume (work done so far is kept)") from e  # fmt: skip
    # the split hashes the key: a local folder is named by itself, not by how its path is spelled
    label = Path(name).resolve().name if Path(name).is_dir() else name
    i = -1
    try:
        for i, row in enumerate(ds):  # noqa: B007 (i is reported on a failure)
            if text_field not in row:
                raise DataError(f"dataset {name}: no field {text_field!r}; fields are "
                                f"{sorted(row)} (set data.text_field)")  # fmt: skip
            yield hf_key(label, row[text_field]), "text", row[text_field], True
    except (DataError, GeneratorExit):
        raise
    except Exception as e:
        raise SourceUnavailable(f"data source hf:{spec}: reading failed after {i + 1:,} rows "
                                f"({e}); rerun to resume (work done so far is kept)") from e  # fmt: skip


def parse_item(item: Item, text_field: str) -> tuple[str | None, str | None]:
    """(text, None), (None, None) for an empty document, or (None, why) for a bad record."""
    key, kind, payload, _ = item
    if kind == "bad":
        return None, str(payload)
    if kind == "json":
        where = _where(key, kind)  # keys count lines from 0, messages from 1
        try:
            row = json.loads(payload)
        except UnicodeDecodeError:
            return None, f"{where}: not UTF-8"
        except json.JSONDecodeError as e:
            return None, f"{where}: not valid JSON ({e.msg})"
        if not isinstance(row, dict):
            return None, f"{where}: a JSON {type(row).__name__}, not an object with {text_field!r}"
        if text_field not in row:
            return None, (f"{where}: no field {text_field!r}; fields are {sorted(row)[:20]} "
                          "(set data.text_field)")  # fmt: skip
        payload = row[text_field]
    if payload is None:
        return None, None
    if not isinstance(payload, str):  # a list, number or object is not a document's text
        return (
            None,
            f"{_where(key, kind)}: {text_field!r} is not a string ({type(payload).__name__})",
        )
    try:
        payload.isascii() or payload.encode("utf-8")  # (isascii is O(1): most text skips this)
    except UnicodeEncodeError:  # JSON may escape a lone surrogate ("\ud800"): not text
        return None, f"{_where(key, kind)}: text that is not valid Unicode (a lone surrogate)"
    text = payload
    return (text, None) if (text.strip() or not item[3] or kind == "more") else (None, None)


def _where(key: str, kind: str) -> str:
    if kind == "json":
        path, _, i = key.rpartition(":")
        return f"{path}:{int(i) + 1}"
    return key


def iter_documents(
    sources: list, text_field: str = "text", bad: list[str] | None = None, join: bool = True
) -> Iterator[tuple[str, str]]:
    """(key, text) of every non-empty document, in one process (tokenizer training, tests).
    Bad records are skipped and appended to `bad` (raised as DataError when `bad` is None);
    pieces of a large text file are joined, or with `join=False` yielded one by one (~1 MiB
    each: memory stays flat whatever the file's size)."""
    srcs = [s if isinstance(s, Source) else Source(s) for s in parse_sources(list(sources))]
    parts: list[str] = []
    for item in iter_items(srcs, text_field):
        text, why = parse_item(item, text_field)
        if why is not None:
            if bad is None:
                raise DataError(why)
            bad.append(why)
            parts.clear()
            continue
        if text is not None and not join:
            if text.strip():
                yield item[0], text
            continue
        if text is not None:
            parts.append(text)
        if item[3] and parts:
            doc = "".join(parts)
            parts.clear()
            if doc.strip():
                yield item[0], doc
