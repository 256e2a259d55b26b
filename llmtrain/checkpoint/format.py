"""The sharded checkpoint format: every tensor a flat 1-D tensor, written by the ranks that own
its pieces, read back at any layout through torch.distributed.checkpoint (DCP).

Why DCP with custom planners (and not DTensor, ShardedTensor or DeepSpeed's universal
checkpoint): ZeRO-1/2 split each parameter at arbitrary offsets of a flat buffer, which neither
DTensor's even `Shard(0)` nor a collective ShardedTensor construction expresses, and the
universal checkpoint finds experts only under AutoEP's fixed names. DCP's public planner classes
take any non-overlapping 1-D chunks (`WriteItem(type=SHARD)`, `ChunkStorageMetadata`), write
one file per rank in parallel, record the chunks in `.metadata`, and on load compute the
overlaps each rank needs, so a rank reads only the stored chunks that meet its own pieces.

A checkpoint directory holds DCP's files (`.metadata`, `__{rank}_0.distcp`) plus
`tensors.json` (each tensor's saved shape and kind), `state.json` (run state), `config.yaml`
and `tokenizer.json`. DCP keys: `model/<name>` (fp32 weights and router-bias buffers),
`optim/<moment>/<name>` (Adam moments), `rng/<rank>` (bytes).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import shutil
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from llmtrain.errors import LlmtrainError

FORMAT = "llmtrain-dcp-1"
MOMENTS = ("exp_avg", "exp_avg_sq")
INDEX_FILE = "tensors.json"


class CheckpointError(LlmtrainError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model; the message says which."""


def model_key(name: str) -> str:
    return f"model/{name}"


def moment_key(moment: str, name: str) -> str:
    return f"optim/{moment}/{name}"


@dataclass
class Piece:
    """Elements [start, start+numel) of the flattened full tensor `key` (of `full_numel`).

    Save: `tensor` (a 1-D view) or `produce` (called when DCP writes it: lazy reads).
    Load: `tensor` is filled in place, or, without it, a buffer is handed to `consume`."""

    key: str
    full_numel: int
    start: int
    numel: int
    tensor: torch.Tensor | None = None
    produce: Callable[[], torch.Tensor] | None = None
    consume: Callable[[torch.Tensor], None] | None = None
    dtype: torch.dtype = torch.float32

    def data(self) -> torch.Tensor:
        t = self.tensor if self.tensor is not None else self.produce()
        return t.detach().reshape(-1)


def _chunk(p: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([p.start]), sizes=torch.Size([p.numel]))


class PieceSavePlanner(DefaultSavePlanner):
    """Emits one SHARD write item per piece; identical pieces held by several ranks (replicated
    buffers) are written once, by the lowest rank (DCP's dedup)."""

    def __init__(self, pieces: list[Piece], blobs: dict[str, bytes], on_write=None):
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True
        )
        self.pieces = {(p.key, p.start): p for p in pieces if p.numel > 0}
        self.blobs = blobs
        self.on_write = on_write
        self.n_written = 0

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.pieces.values():
            props = TensorProperties(dtype=p.dtype)
            items.append(
                WriteItem(
                    index=MetadataIndex(p.key, torch.Size([p.start])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=_chunk(p), properties=props, size=torch.Size([p.full_numel])
                    ),
                )
            )
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.blobs]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[write_item.index.fqn])
        p = self.pieces[(write_item.index.fqn, write_item.index.offset[0])]
        t = p.data()
        if t.numel() != p.numel or t.dtype != p.dtype:
            raise CheckpointError(f"{p.key}: piece of {t.numel()} {t.dtype}, planned {p.numel}")
        self.n_written += 1
        if self.on_write is not None:
            self.on_write(self.n_written, len(self.pieces))
        return t


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads, for each local piece, the overlapping parts of the stored chunks (any split)."""

    def __init__(self, pieces: list[Piece], blob_keys: list[str] = ()):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = [p for p in pieces if p.numel > 0]
        self.blob_keys = list(blob_keys)
        self.blobs: dict[str, bytes] = {}
        self._buf: dict[int, torch.Tensor] = {}
        self._left: dict[int, int] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for i, p in enumerate(self.pieces):
            saved = md.get(p.key)
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint lacks {p.key}")
            if saved.size != torch.Size([p.full_numel]):
                raise CheckpointError(
                    f"{p.key}: the checkpoint holds {math.prod(saved.size)} elements, the model "
                    f"{p.full_numel}; it was written for another model config"
                )
            # one local chunk per piece; dest_index.index says which piece
            got = create_read_items_for_chunk_list(p.key, saved, [_chunk(p)])
            got = [dataclasses.replace(r, dest_index=MetadataIndex(p.key, r.dest_index.offset, i))
                   for r in got]  # fmt: skip
            if sum(math.prod(r.lengths) for r in got) != p.numel:
                raise CheckpointError(f"{p.key}: the checkpoint does not cover [{p.start}, "
                                      f"{p.start + p.numel}); it is incomplete")  # fmt: skip
            self._left[i] = len(got)
            items += got
        for k in self.blob_keys:
            if k in md:
                z = torch.Size([0])
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(k),
                                      dest_offsets=z, storage_index=MetadataIndex(k),
                                      storage_offsets=z, lengths=z))  # fmt: skip
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = value.read()

    def _target(self, i: int) -> torch.Tensor:
        p = self.pieces[i]
        if p.tensor is not None:
            return p.tensor.detach().view(-1)
        if i not in self._buf:
            self._buf[i] = torch.empty(p.numel, dtype=p.dtype)
        return self._buf[i]

    def resolve_tensor(self, read_item: ReadItem):
        t = self._target(read_item.dest_index.index)
        return t.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        i = read_item.dest_index.index
        self._left[i] -= 1
        if self._left[i] == 0 and i in self._buf:
            self.pieces[i].consume(self._buf.pop(i))


# ---------------------------------------------------------------- ranged reads


class _Window(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable file of its own."""

    def __init__(self, fh, offset: int, length: int):
        self.fh, self.offset, self.length, self.pos = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.fh.seek(self.offset + self.pos)
        got = self.fh.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def _storage_record(fh, offset: int, length: int, nbytes: int) -> int | None:
    """Where, from `offset`, the raw bytes of the tensor that `torch.save` wrote at
    [offset, offset + length) of `fh` begin; None when the chunk is not that simple layout
    (one uncompressed little-endian storage of `nbytes`), and the whole chunk must be loaded."""
    try:
        zf = zipfile.ZipFile(_Window(fh, offset, length))
        recs = [z for z in zf.infolist() if "/data/" in z.filename and
                not z.filename.endswith("/serialization_id")]  # fmt: skip
        order = [z for z in zf.infolist() if z.filename.endswith("/byteorder")]
        if len(recs) != 1 or recs[0].compress_type != zipfile.ZIP_STORED:
            return None
        if recs[0].file_size != nbytes or sys.byteorder != "little":
            return None
        if order and zf.read(order[0]) != b"little":
            return None
        fh.seek(offset + recs[0].header_offset)
        head = fh.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        return recs[0].header_offset + 30 + name_len + extra_len
    except (zipfile.BadZipFile, OSError, ValueError, struct.error):
        return None


class RangedReader(dcp.FileSystemReader):
    """DCP's file reader, but a 1-D read takes only the bytes it needs from the stored chunk.

    torch's reader `torch.load`s the whole stored chunk for any overlap and then narrows it, so
    a rank resuming at another layout (more ranks, ZeRO-1/2 -> 3, another ep_size) or exporting
    a row block would read whole chunks: up to the full checkpoint per rank. Our chunks are
    flat (`Piece`), and DCP writes each one as `torch.save` of a storage of exactly its elements
    (views are cloned), stored uncompressed: the elements [a, a + n) are bytes
    [data + a·s, data + (a + n)·s) of the file. Anything else (transforms, BYTE_IO, an unexpected
    layout) goes through torch's reader."""

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._dtypes = {k: m.properties.dtype for k, m in metadata.state_dict_metadata.items()
                        if isinstance(m, TensorStorageMetadata)}  # fmt: skip
        self._chunk_numel = {
            MetadataIndex(k, c.offsets): math.prod(c.sizes)
            for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
            for c in m.chunks
        }
        self._data_at: dict[MetadataIndex, int | None] = {}

    def read_data(self, plan: LoadPlan, planner):
        rest, per_file = [], {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if (req.type == LoadItemType.BYTE_IO or len(req.storage_offsets) != 1
                    or info.transform_descriptors or req.storage_index.fqn not in self._dtypes):  # fmt: skip
                rest.append(req)
            else:
                per_file.setdefault(info.relative_path, []).append(req)
        for rel, reqs in per_file.items():
            with open(Path(self.path) / rel, "rb", buffering=0) as fh:
                for req in sorted(reqs, key=lambda r: (self.storage_data[r.storage_index].offset,
                                                       r.storage_offsets[0])):  # fmt: skip
                    if not self._read_range(fh, req, planner):
                        rest.append(req)
        if rest:
            return super().read_data(LoadPlan(rest), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_range(self, fh, req: ReadItem, planner) -> bool:
        info = self.storage_data[req.storage_index]
        dtype = self._dtypes[req.storage_index.fqn]
        size = torch.empty((), dtype=dtype).element_size()
        key = MetadataIndex(req.storage_index.fqn, req.storage_index.offset)
        if key not in self._data_at:
            numel = self._chunk_numel.get(key)
            self._data_at[key] = (
                None
                if numel is None
                else _storage_record(fh, info.offset, info.length, numel * size)
            )
        at = self._data_at[key]
        if at is None:
            return False
        target = planner.resolve_tensor(req).detach()
        n = req.lengths[0]
        if target.numel() != n:
            raise CheckpointError(f"{req.storage_index.fqn}: read of {n} into {target.numel()}")
        buf = (
            target
            if (target.dtype == dtype and target.is_contiguous())
            else torch.empty(n, dtype=dtype)
        )
        fh.seek(info.offset + at + req.storage_offsets[0] * size)
        view = memoryview(buf.view(torch.uint8).numpy()) if n else memoryview(b"")
        got = 0
        while got < n * size:
            k = fh.readinto(view[got:])
            if not k:
                raise CheckpointError(f"{self.path}/{info.relative_path} is truncated at "
                                      f"{req.storage_index.fqn}")  # fmt: skip
            got += k
        if buf is not target:
            target.copy_(buf)
        planner.commit_tensor(req, target)
        return True


# ---------------------------------------------------------------- collective save / load


def save_pieces(
    path: Path,
    pieces: list[Piece],
    blobs: dict[str, bytes] | None = None,
    on_write: Callable[[int, int], None] | None = None,
    no_dist: bool = False,
    group=None,
) -> None:
    """Every rank writes its pieces into its own file under `path`; rank 0 writes `.metadata`.
    Files are fsynced (DCP's `sync_files`). `on_write(i, n)` runs before the i-th piece. `group`:
    the process group DCP coordinates over (default: the default group)."""
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    planner = PieceSavePlanner(pieces, blobs or {}, on_write)
    _unwrapped(dcp.save, path, {}, storage_writer=writer, planner=planner, no_dist=no_dist,
               process_group=group, saving=True)  # fmt: skip


def load_pieces(
    path: Path, pieces: list[Piece], blob_keys: list[str] = (), no_dist: bool = False
) -> dict[str, bytes]:
    """Fill each piece from the stored chunks it overlaps; returns the requested blobs present."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} has no .metadata: not a complete sharded checkpoint")
    planner = PieceLoadPlanner(pieces, blob_keys)
    reader = RangedReader(str(path))
    try:  # before DCP: it would log a torch traceback per rank for an unreadable file
        reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}/.metadata is missing or corrupt ({type(e).__name__}); "
                              "resume from an earlier checkpoint (RUN/checkpoints/step_*)") from e  # fmt: skip
    _unwrapped(dcp.load, path, {}, storage_reader=reader, planner=planner, no_dist=no_dist)
    return planner.blobs


# a failed write leaving less than this free is taken for a full disk (see `_unwrapped`)
NEARLY_FULL = 64 * 2**20


def _unwrapped(fn, path: Path, *args, saving: bool = False, **kwargs):
    """DCP reports any rank's failure as a CheckpointException (a BaseException): raise ours,
    with the first rank's message, on every rank.

    A full disk reaches DCP's writer inside `torch.save`, whose zip writer reports the short
    write as a RuntimeError ("unexpected pos ..."), not ENOSPC: a save that fails so with the
    disk (nearly) full is raised as the OSError it is, so the caller cleans up and says so."""
    try:
        with warnings.catch_warnings():  # "no process group: single process" is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            return fn(*args, **kwargs)
    except CheckpointException as e:
        errs = [exc for exc, _ in e.failures.values()]
        if saving and not any(isinstance(x, OSError) for x in errs):
            where = Path(path)
            while not where.exists() and where != where.parent:
                where = where.parent
            try:
                free = shutil.disk_usage(where).free
            except OSError:
                free = None
            if free is not None and free < NEARLY_FULL:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free; "
                              f"the write failed: {errs[0]})", str(path)) from None  # fmt: skip
        oserr = next((x for x in errs if isinstance(x, OSError)), None)
        if oserr is not None:  # a full disk, a quota, a vanished mount: the caller says what to do
            raise OSError(oserr.errno, oserr.strerror or str(oserr), oserr.filename) from None
        ours = next((x for x in errs if isinstance(x, CheckpointError)), None)
        if ours is not None:
            raise CheckpointError(str(ours)) from None
        raise CheckpointError(f"checkpoint {path}: {errs[0]!r}") from None


# ---------------------------------------------------------------- index, run state, files


def write_index(path: Path, tensors: dict[str, dict[str, Any]]) -> None:
    """`tensors`: name -> {"shape": [...], "kind": "param" | "buffer", "moments": bool}."""
    write_file(path / INDEX_FILE, json.dumps({"format": FORMAT, "tensors": tensors}, indent=1))


def write_file(path: Path, text: str | bytes) -> None:
    """Write and fsync a small file."""
    data = text.encode() if isinstance(text, str) else text
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_sharded(path: Path) -> bool:
    return (path / INDEX_FILE).is_file() and (path / ".metadata").is_file()


def is_legacy(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (
        path / "model.safetensors.index.json"
    ).is_file()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `RUN/checkpoints/latest` names (None before the first save)."""
    ptr = Path(run_dir) / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    d = ptr.parent / ptr.read_text().strip()
    if not (d / "state.json").is_file() or not (is_sharded(d) or is_legacy(d)):
        raise CheckpointError(f"{ptr} names {d.name}, which is incomplete or missing")
    return d


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest complete checkpoint)."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        ck = latest_checkpoint(p)
        if ck is None:
            raise CheckpointError(f"run directory {p} has no complete checkpoint yet")
        return ck
    raise CheckpointError(
        f"{p} is neither a checkpoint (state.json) nor a run directory (checkpoints/)"
    )


# ---------------------------------------------------------------- offline reading


class ShardedReader:
    """Reads a sharded checkpoint without a process group, one full tensor (or rows) at a time."""

    def __init__(self, path: Path):
        self.dir = Path(path)
        try:
            index = json.loads((self.dir / INDEX_FILE).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.dir / INDEX_FILE} is missing or corrupt: {e}") from e
        if index.get("format") != FORMAT:
            raise CheckpointError(f"{self.dir}: unknown checkpoint format {index.get('format')!r}")
        self.index: dict[str, dict] = index["tensors"]
        self._reader = RangedReader(str(self.dir))
        try:
            self._md = self._reader.read_metadata()
        except Exception as e:
            raise CheckpointError(f"{self.dir}/.metadata is missing or corrupt: {e}") from e
        self._reader.set_up_storage_reader(self._md, True)

    def names(self) -> list[str]:
        return list(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name]["shape"])

    def has(self, key: str) -> bool:
        return key in self._md.state_dict_metadata

    def _read(self, key: str, start: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        planner = PieceLoadPlanner([Piece(key, self._full(key), start, numel, tensor=out)])
        planner.set_up_planner({}, self._md, True)
        plan = planner.create_local_plan()
        try:
            self._reader.read_data(plan, planner).wait()
        except CheckpointError:
            raise
        except Exception as e:
            files = sorted({self._md.storage_data[r.storage_index].relative_path
                            for r in plan.items})  # fmt: skip
            raise CheckpointError(f"{self.dir}: reading {key} from {files} failed: {e}") from e
        return out

    def _full(self, key: str) -> int:
        md = self._md.state_dict_metadata.get(key)
        if md is None:
            raise CheckpointError(f"checkpoint {self.dir} lacks {key}")
        return math.prod(md.size)

    def read(self, name: str, moment: str | None = None) -> torch.Tensor:
        key = model_key(name) if moment is None else moment_key(moment, name)
        return self._read(key, 0, self._full(key)).view(self.shape(name))

    def rows(self, name: str, max_bytes: int = 2**30) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, tensor of rows) blocks of at most ~max_bytes along dim 0."""
        shape = self.shape(name)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        n = max(1, max_bytes // max(1, 4 * row))
        for r in range(0, shape[0] if shape else 1, n):
            k = min(n, shape[0] - r)
            yield r, self._read(model_key(name), r * row, k * row).view(k, *shape[1:])


def write_full_tensors(
    path: Path,
    tensors: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]],
    moments: dict[str, Callable[[str], torch.Tensor]] | None = None,
    kinds: dict[str, str] | None = None,
) -> None:
    """One process writes full tensors, each read lazily when DCP writes it (conversion,
    `save_consolidated`). `tensors`: name -> (shape, producer)."""
    path.mkdir(parents=True, exist_ok=True)
    pieces, index = [], {}
    for name, (shape, produce) in tensors.items():
        n = math.prod(shape)
        pieces.append(Piece(model_key(name), n, 0, n, produce=produce))
        has_m = moments is not None and name in moments
        index[name] = {"shape": list(shape), "kind": (kinds or {}).get(name, "param"),
                       "moments": has_m}  # fmt: skip
        if has_m:
            for m in MOMENTS:
                pieces.append(Piece(moment_key(m, name), n, 0, n,
                                    produce=lambda name=name, m=m: moments[name](m)))  # fmt: skip
    save_pieces(path, pieces, no_dist=True)
    write_index(path, index)
