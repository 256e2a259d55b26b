"""The sharded checkpoint format: every tensor a flat 1-D tensor, written by the ranks that own
its pieces, read back at any layout through torch.distributed.checkpoint (DCP).

Why DCP with custom planners (and not DTensor, ShardedTensor or DeepSpeed's universal
checkpoint): ZeRO-1/2 split each parameter at arbitrary offsets of a flat buffer, which neither
DTensor's even `Shard(0)` nor a collective ShardedTensor construction expresses, and the
universal checkpoint finds experts only under AutoEP's fixed names. DCP's public planner classes
take any non-overlapping 1-D chunks (`WriteItem(type=SHARD)`, `ChunkStorageMetadata`), write
one file per rank in parallel, record the chunks in `.metadata`, and on load compute the
overlaps each rank needs, so a rank reads only the stored chunks that meet its own pieces.

Packed (format 2): DCP's `.metadata` lists every stored chunk and is read whole by every rank,
so one chunk per tensor per rank grows as tensors x ranks: ZeRO-3 splits each of DeepSeek-V3's
~3,000 saved tensors over all ranks (at 256 ranks: 713k chunks, a 139 MB file taking 1.4 GB
and 7 s to load on every rank; benchmarks/checkpoint_metadata.py). So each rank's pieces are
written concatenated into a few large "parts" of one DCP tensor per dtype (`pack/float32`),
and `pack_index.npy` (columns key id, start, numel, pack position, part offset, crc32; sorted
by key and start) says where each piece lies. A reader memory-maps the index and binary-searches only
the rows its own pieces meet; `.metadata` holds ranks x parts chunks. Pieces identical on
several ranks (replicated buffers) are written once, by the lowest rank.

A checkpoint directory holds DCP's files (`.metadata`, `__{rank}_0.distcp`), `pack_keys.json`
and `pack_index.npy`, plus `tensors.json` (each tensor's saved shape and kind), `state.json`
(run state), `config.yaml` and `tokenizer.json`. Keys: `model/<name>` (fp32 weights and
router-bias buffers), `optim/<moment>/<name>` (Adam moments), `rng/<rank>` (bytes). Format 1
(no pack files: each key its own DCP tensor) is still read.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import logging
import math
import os
import re
import shutil
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
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

logger = logging.getLogger(__name__)

FORMAT = "llmtrain-dcp-2"
READABLE_FORMATS = ("llmtrain-dcp-1", FORMAT)
MOMENTS = ("exp_avg", "exp_avg_sq")
INDEX_FILE = "tensors.json"
PACK_KEYS = "pack_keys.json"
PACK_INDEX = "pack_index.npy"
PACK_PREFIX = "pack/"
# parts of small pieces start where a piece's offset enters a new bucket of this many elements
# (256 MB of fp32), so a part's copy at write time stays under twice that; a piece this large,
# or one produced lazily, is a part of its own (written without a copy)
PART_ELEMS = 2**26


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
    """Packs each rank's pieces into parts of one DCP tensor per dtype (see the module doc).

    Local plans carry only a compact summary (key names and an int64 row per piece); the
    coordinator drops pieces identical to a lower rank's, checks the rest do not overlap, lays
    out every rank's parts, writes `pack_index.npy` and `pack_keys.json`, and hands each rank
    its parts. `out` is the checkpoint directory (where the coordinator writes the index);
    `pack=False` writes format 1 (one DCP tensor per key), kept to test reading old checkpoints."""

    def __init__(self, pieces: list[Piece], blobs: dict[str, bytes], on_write=None,
                 out: Path | None = None, pack: bool = True, part_elems: int | None = None):  # fmt: skip
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True
        )
        self._by_index = {(p.key, p.start): p for p in pieces if p.numel > 0}
        self.pieces = list(self._by_index.values())
        self.blobs = blobs
        self.on_write = on_write
        self.out, self.pack = out, pack
        self.part_elems = PART_ELEMS if part_elems is None else part_elems
        self.n_written = 0
        self._parts: dict[tuple[str, int], list[int]] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.blobs]
        if not self.pack:
            items += [_write_item(p.key, p.start, p.numel, p.full_numel, p.dtype)
                      for p in self.pieces]  # fmt: skip
            self.plan = SavePlan(items)
            return self.plan
        keys: dict[str, tuple[int, str]] = {}
        for p in self.pieces:
            info = (p.full_numel, _dtype_name(p.dtype))
            if keys.setdefault(p.key, info) != info:
                raise CheckpointError(f"{p.key}: pieces of different sizes or dtypes {info}, "
                                      f"{keys[p.key]}")  # fmt: skip
        names = list(keys)
        kid = {k: i for i, k in enumerate(names)}
        rows = np.array(
            [(kid[p.key], p.start, p.numel, int(p.produce is not None),
              crc32(p.tensor) if p.tensor is not None else -1) for p in self.pieces],
            dtype=np.int64,
        ).reshape(-1, 5)  # fmt: skip
        # compressed: every rank names the same ~3,000 keys, the coordinator gathers them all
        packed_keys = zlib.compress(json.dumps([(k, *keys[k]) for k in names]).encode())
        summary = {"keys": packed_keys, "rows": rows}
        self.plan = SavePlan(items, planner_data=summary)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        if self.pack:
            parts, table, keys, totals = _pack_layout(
                [pl.planner_data for pl in all_plans], self.part_elems
            )
            all_plans = [
                dataclasses.replace(
                    pl,
                    items=list(pl.items) + [
                        _write_item(PACK_PREFIX + dt, off, n, totals[dt], _DTYPES[dt])
                        for dt, off, n, _ in parts[r]
                    ],
                    planner_data=parts[r],
                )
                for r, pl in enumerate(all_plans)
            ]  # fmt: skip
            if self.out is not None:
                _write_pack_index(Path(self.out), table, keys, self.part_elems)
        return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self.pack:
            self._parts = {(dt, off): idx for dt, off, _, idx in new_plan.planner_data}
        return super().finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[write_item.index.fqn])
        fqn, off = write_item.index.fqn, write_item.index.offset[0]
        if not self.pack:
            t = self._piece_data(self._by_index[(fqn, off)])
        else:
            idx = self._parts[(fqn[len(PACK_PREFIX) :], off)]
            if len(idx) == 1:  # a part of its own: the piece itself, no copy
                t = self._piece_data(self.pieces[idx[0]])
            else:  # small pieces: one bounded copy
                n = sum(self.pieces[i].numel for i in idx)
                t = torch.empty(n, dtype=self.pieces[idx[0]].dtype)
                at = 0
                for i in idx:
                    d = self._piece_data(self.pieces[i])
                    t[at : at + d.numel()].copy_(d)
                    at += d.numel()
        self.n_written += 1
        if self.on_write is not None:
            self.on_write(self.n_written, len(self._parts) if self.pack else len(self.pieces))
        return t

    @staticmethod
    def _piece_data(p: Piece) -> torch.Tensor:
        t = p.data()
        if t.numel() != p.numel or t.dtype != p.dtype:
            raise CheckpointError(f"{p.key}: piece of {t.numel()} {t.dtype}, planned {p.numel}")
        return t


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) != dtype:
        raise CheckpointError(f"cannot checkpoint a {dtype} piece (supported: {list(_DTYPES)})")
    return name


def _write_item(key: str, start: int, numel: int, full: int, dtype: torch.dtype) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([numel]))
    return WriteItem(
        index=MetadataIndex(key, torch.Size([start])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size([full])
        ),
    )


def _pack_layout(summaries: list[dict], part_elems: int):
    """The coordinator's plan: for each rank, its parts [(dtype, pack offset, numel, [piece
    indices in the rank's order])]; the index table [6, rows] (key id, start, numel, pack
    position, part offset, crc32 of the piece's bytes or -1) sorted by key and start; the keys
    [(name, full numel, dtype)]; and each dtype's pack length. Vectorised: ~3M pieces at 1,024 ranks. Summary rows: (key,
    start, numel, produced lazily, crc32 or -1)."""
    keys: dict[str, tuple[int, str]] = {}
    lists = {blob: json.loads(zlib.decompress(blob)) for blob in {s["keys"] for s in summaries}}
    for decoded in lists.values():  # ZeRO ranks send the same list: each distinct one once
        for name, full, dt in decoded:
            if keys.setdefault(name, (full, dt)) != (full, dt):
                raise CheckpointError(f"{name}: ranks disagree on its size or dtype "
                                      f"({keys[name]} vs {(full, dt)})")  # fmt: skip
    names = sorted(keys)
    gid = {k: i for i, k in enumerate(names)}
    to_global = {b: np.array([gid[k[0]] for k in d], dtype=np.int64) for b, d in lists.items()}
    del lists
    fulls = np.array([keys[k][0] for k in names], dtype=np.int64)
    dts = [keys[k][1] for k in names]
    cols = []  # key id, start, numel, rank, local index, produced lazily, crc32
    for r, s in enumerate(summaries):
        rows = s["rows"]
        to_g = to_global[s["keys"]]
        n = len(rows)
        cols.append(np.stack([to_g[rows[:, 0]] if n else rows[:, 0], rows[:, 1], rows[:, 2],
                              np.full(n, r), np.arange(n), rows[:, 3], rows[:, 4]], 1))  # fmt: skip
    a = np.concatenate(cols) if cols else np.zeros((0, 7), dtype=np.int64)
    a = a[np.lexsort((a[:, 3], a[:, 1], a[:, 0]))]  # by key, start, rank
    same = np.zeros(len(a), dtype=bool)
    same[1:] = (a[1:, 0] == a[:-1, 0]) & (a[1:, 1] == a[:-1, 1]) & (a[1:, 2] == a[:-1, 2])
    a = a[~same]  # a replicated piece: the lowest rank writes it
    over = np.nonzero((a[1:, 0] == a[:-1, 0]) & (a[1:, 1] < a[:-1, 1] + a[:-1, 2]))[0]
    if len(over):
        k, i = names[a[over[0], 0]], over[0]
        raise CheckpointError(f"{k}: ranks {a[i, 3]} and {a[i + 1, 3]} hold overlapping, "
                              f"different pieces [{a[i, 1]}, +{a[i, 2]}) and "
                              f"[{a[i + 1, 1]}, +{a[i + 1, 2]})")  # fmt: skip
    if len(a) and ((a[:, 1] < 0) | (a[:, 1] + a[:, 2] > fulls[a[:, 0]])).any():
        raise CheckpointError("a piece lies outside its tensor")
    # each rank's kept pieces in its own order, per dtype, cut into parts
    a = a[np.lexsort((a[:, 4], a[:, 3]))]
    pos = np.zeros(len(a), dtype=np.int64)
    part_of = np.zeros(len(a), dtype=np.int64)
    totals: dict[str, int] = {}
    parts: list[list] = [[] for _ in summaries]
    dt_of = np.array(dts, dtype=object)
    bounds = np.searchsorted(a[:, 3], np.arange(len(summaries) + 1))
    for r in range(len(summaries)):
        lo, hi = bounds[r], bounds[r + 1]
        for dt in sorted(set(dt_of[a[lo:hi, 0]])) if hi > lo else ():
            sel = lo + np.nonzero(dt_of[a[lo:hi, 0]] == dt)[0]
            n = a[sel, 2]
            own = (a[sel, 5] == 1) | (n >= part_elems)
            local = np.concatenate([[0], np.cumsum(n)[:-1]])
            brk = np.zeros(len(sel), dtype=bool)
            brk[1:] = own[1:] | own[:-1] | (local[1:] // part_elems != local[:-1] // part_elems)
            base = totals.get(dt, 0)
            pos[sel] = base + local
            starts = np.nonzero(np.concatenate([[True], brk[1:]]))[0]
            ends = np.append(starts[1:], len(sel))
            for s0, e0 in zip(starts, ends):
                off = int(base + local[s0])
                part_of[sel[s0:e0]] = off
                parts[r].append((dt, off, int(n[s0:e0].sum()), a[sel[s0:e0], 4].tolist()))
            totals[dt] = base + int(n.sum())
    order = np.lexsort((a[:, 1], a[:, 0]))
    table = np.stack([a[order, 0], a[order, 1], a[order, 2], pos[order], part_of[order],
                      a[order, 6]])  # fmt: skip
    return parts, table, [(k, int(fulls[i]), dts[i]) for i, k in enumerate(names)], totals


def _write_pack_index(path: Path, table: np.ndarray, keys: list, part_elems: int) -> None:
    with open(path / PACK_INDEX, "wb") as fh:
        np.save(fh, np.ascontiguousarray(table, dtype=np.int64))
        fh.flush()
        os.fsync(fh.fileno())
    write_file(path / PACK_KEYS, json.dumps({"format": FORMAT, "part_elems": part_elems,
                                             "keys": keys}))  # fmt: skip


class PackIndex:
    """A packed checkpoint's index, memory-mapped: a lookup touches a few pages, not the file."""

    def __init__(self, path: Path):
        try:
            meta = json.loads((path / PACK_KEYS).read_text())
            self.table = np.load(path / PACK_INDEX, mmap_mode="r")
            self.keys = {k: (i, int(full), dt) for i, (k, full, dt) in enumerate(meta["keys"])}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: {PACK_KEYS} or {PACK_INDEX} is missing or corrupt "
                                  f"({e}); resume from an earlier checkpoint") from e  # fmt: skip
        if self.table.ndim != 2 or self.table.shape[0] != 6:
            raise CheckpointError(f"{path / PACK_INDEX}: unexpected shape {self.table.shape}")

    @classmethod
    def open(cls, path: Path, metadata) -> PackIndex | None:
        """The index of a packed checkpoint (its `.metadata` holds `pack/*`), else None."""
        if not any(k.startswith(PACK_PREFIX) for k in metadata.state_dict_metadata):
            return None
        return cls(path)

    def full(self, key: str) -> int | None:
        got = self.keys.get(key)
        return None if got is None else got[1]

    def read_items(self, p: Piece, i: int) -> tuple[list[ReadItem], dict[int, int]]:
        """Reads of the stored rows that meet piece `p` (the i-th of the planner), and the crc32
        of each read that takes a whole stored piece, by its offset in `p`."""
        kid, _, dt = self.keys[p.key]
        ids = self.table[0]
        lo, hi = int(np.searchsorted(ids, kid, "left")), int(np.searchsorted(ids, kid, "right"))
        starts = self.table[1, lo:hi]
        end = p.start + p.numel
        j0 = lo + max(0, int(np.searchsorted(starts, p.start, "right")) - 1)
        j1 = lo + int(np.searchsorted(starts, end, "left"))
        rows = np.asarray(self.table[1:6, j0:j1])
        items, crcs = [], {}
        for s, n, pos, off, crc in rows.T.tolist():
            a, b = max(s, p.start), min(s + n, end)
            if (a, b) == (s, s + n) and crc >= 0:
                crcs[a - p.start] = crc
            if b > a:
                items.append(ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(p.key, torch.Size([p.start]), i),
                    dest_offsets=torch.Size([a - p.start]),
                    storage_index=MetadataIndex(PACK_PREFIX + dt, torch.Size([off])),
                    storage_offsets=torch.Size([pos + (a - s) - off]),
                    lengths=torch.Size([b - a]),
                ))  # fmt: skip
        return items, crcs


def _saved_numel(metadata, pack: PackIndex | None, key: str) -> int | None:
    """How many elements the checkpoint holds of `key` (None: it lacks it), either format."""
    if pack is not None:
        return pack.full(key)
    saved = metadata.state_dict_metadata.get(key)
    return math.prod(saved.size) if isinstance(saved, TensorStorageMetadata) else None


def crc32(t: torch.Tensor) -> int:
    """zlib's crc32 of a tensor's bytes (~7 GB/s here), read to the host in bounded blocks."""
    flat = t.detach().reshape(-1)
    step = max(1, 2**26 // flat.element_size())
    crc = 0
    for a in range(0, flat.numel(), step):
        block = flat[a : a + step].contiguous().cpu()
        crc = zlib.crc32(memoryview(block.view(torch.uint8).numpy()), crc)
    return crc


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads, for each local piece, the overlapping parts of the stored chunks (any split)."""

    def __init__(
        self, pieces: list[Piece], blob_keys: list[str] = (), pack: PackIndex | None = None
    ):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = [p for p in pieces if p.numel > 0]
        self.pack = pack
        # (piece, offset in it) -> (crc32, stored dtype) of a read that takes a whole stored piece
        self._crc: dict[tuple[int, int], tuple[int, torch.dtype]] = {}
        self._reads: list[ReadItem] = []
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
            full = _saved_numel(self.metadata, self.pack, p.key)
            if full is None:
                raise CheckpointError(f"the checkpoint lacks {p.key}")
            if full != p.full_numel:
                raise CheckpointError(
                    f"{p.key}: the checkpoint holds {full} elements, the model "
                    f"{p.full_numel}; it was written for another model config"
                )
            if self.pack is not None:
                got, crcs = self.pack.read_items(p, i)
                stored = _DTYPES[self.pack.keys[p.key][2]]
                self._crc.update({(i, at): (c, stored) for at, c in crcs.items()})
            else:  # format 1: one local chunk per piece; dest_index.index says which piece
                got = create_read_items_for_chunk_list(p.key, md[p.key], [_chunk(p)])
                got = [dataclasses.replace(r, dest_index=MetadataIndex(p.key, r.dest_index.offset,
                                                                       i)) for r in got]  # fmt: skip
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
        # the tensor reads stay here: DCP gathers every rank's plan on the coordinator, and at
        # 1,000 ranks one ReadItem per piece is gigabytes there; the blobs go through DCP
        self._reads = [r for r in items if r.type != LoadItemType.BYTE_IO]
        return LoadPlan([r for r in items if r.type == LoadItemType.BYTE_IO])

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return LoadPlan(list(new_plan.items) + self._reads)

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

    def expected_crc(self, read_item: ReadItem) -> tuple[int, torch.dtype] | None:
        """The crc32 (and stored dtype) of a read that takes a whole stored piece; each read's
        once, so a check made by the ranged reader is not repeated by `commit_tensor`."""
        return self._crc.pop((read_item.dest_index.index, read_item.dest_offsets[0]), None)

    def check_crc(self, read_item: ReadItem, want: int, got: int) -> None:
        if want != got:
            p = self.pieces[read_item.dest_index.index]
            raise CheckpointError(
                f"{p.key}: elements [{p.start + read_item.dest_offsets[0]}, "
                f"+{read_item.lengths[0]}) fail their crc32 check: the checkpoint's files are "
                "damaged; resume from an earlier checkpoint (RUN/checkpoints/step_*)"
            )

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        want = self.expected_crc(read_item)  # torch's reader; the ranged one checked already
        if want is not None and tensor.dtype == want[1]:  # a converted copy has other bytes
            self.check_crc(read_item, want[0], crc32(tensor))
        i = read_item.dest_index.index
        self._left[i] -= 1
        if self._left[i] == 0 and i in self._buf:
            self.pieces[i].consume(self._buf.pop(i))


# ---------------------------------------------------------------- ranged reads

READ_BLOCK = 2**26  # bytes: the host buffer a read into a device tensor goes through


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

    def read_metadata(self, *args, **kwargs):
        """Once per reader: `load_pieces` reads it before DCP (for its errors and the pack
        index), and DCP's load would unpickle it again."""
        if kwargs.get("rank") is not None:  # DCP's rank-local metadata: another file
            return super().read_metadata(*args, **kwargs)
        if getattr(self, "_metadata", None) is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

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
        want = planner.expected_crc(req)
        fh.seek(info.offset + at + req.storage_offsets[0] * size)
        # straight into the target only on the host: a GPU target (the fp32 master weights and
        # moments of a CUDA run) is read through one bounded (pinned) host buffer
        direct = target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
        step = max(1, n) if direct else max(1, min(n, READ_BLOCK // size))
        buf = target if direct else torch.empty(step, dtype=dtype, pin_memory=target.is_cuda)
        crc = 0
        for a in range(0, n, step):
            k = min(step, n - a)
            dst = buf if direct else buf[:k]
            view = memoryview(dst.view(torch.uint8).numpy())
            got = 0
            while got < k * size:
                r = fh.readinto(view[got:])
                if not r:
                    raise CheckpointError(f"{self.path}/{info.relative_path} is truncated at "
                                          f"{req.storage_index.fqn}")  # fmt: skip
                got += r
            if want is not None:  # on the host bytes read, before any copy to a device
                crc = zlib.crc32(view, crc)
            if not direct:
                target[a : a + k].copy_(dst)
        if want is not None:
            planner.check_crc(req, want[0], crc)
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
    pack: bool = True,
) -> None:
    """Every rank writes its pieces into its own file under `path`; rank 0 writes `.metadata`
    and the pack index. Files are fsynced (DCP's `sync_files`). `on_write(i, n)` runs before
    the i-th of n parts. `group`: the process group DCP coordinates over (default: the default
    group). `pack=False`: format 1, for tests of reading old checkpoints."""
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    planner = PieceSavePlanner(pieces, blobs or {}, on_write, out=path, pack=pack)
    _unwrapped(dcp.save, path, {}, storage_writer=writer, planner=planner, no_dist=no_dist,
               process_group=group, saving=True)  # fmt: skip


def load_pieces(
    path: Path, pieces: list[Piece], blob_keys: list[str] = (), no_dist: bool = False
) -> dict[str, bytes]:
    """Fill each piece from the stored chunks it overlaps; returns the requested blobs present."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} has no .metadata: not a complete sharded checkpoint")
    reader = RangedReader(str(path))
    try:  # before DCP: it would log a torch traceback per rank for an unreadable file
        md = reader.read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path}/.metadata is missing or corrupt ({type(e).__name__}); "
                              "resume from an earlier checkpoint (RUN/checkpoints/step_*)") from e  # fmt: skip
    planner = PieceLoadPlanner(pieces, blob_keys, PackIndex.open(path, md))
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
        if saving:
            raise CheckpointError(f"checkpoint {path}: {errs[0]!r}") from None
        raise CheckpointError(f"checkpoint {path} could not be read ({errs[0]!r}): a file of it "
                              f"is damaged or unreadable; {RECOVER}") from None  # fmt: skip


# ---------------------------------------------------------------- index, run state, files


def write_index(path: Path, tensors: dict[str, dict[str, Any]]) -> None:
    """`tensors`: name -> {"shape": [...], "kind": "param" | "buffer", "moments": bool}."""
    write_file(path / INDEX_FILE, json.dumps({"format": FORMAT, "tensors": tensors}, indent=1))


def check_format(ck: Path, index: dict) -> None:
    """Refuse a tensors.json this release cannot read (a newer release's, or damaged)."""
    got = index.get("format") if isinstance(index, dict) else None
    if got not in READABLE_FORMATS:
        raise CheckpointError(
            f"{ck / INDEX_FILE}: checkpoint format {got!r} is not one this llmtrain reads "
            f"({', '.join(READABLE_FORMATS)}): written by a newer llmtrain (upgrade to read it), "
            f"or the file is damaged ({RECOVER})"
        )


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


_STEP_DIR = re.compile(r"step_(\d{8,})")
RECOVER = "resume from an earlier checkpoint (resume=RUN/checkpoints/step_N)"


def checkpoint_step(d: Path) -> int | None:
    """N of a checkpoint directory named step_N (8+ digits), None for any other name (a save in
    progress `step_N.tmp`, a user's `step_best`)."""
    m = _STEP_DIR.fullmatch(Path(d).name)
    return int(m.group(1)) if m else None


def is_complete(d: Path) -> bool:
    return (Path(d) / "state.json").is_file() and (is_sharded(d) or is_legacy(d))


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete RUN/checkpoints/step_N, in step order. A save in progress
    (step_N.tmp: renamed when complete) and other names are not listed."""
    out = []
    ckdir = Path(run_dir) / "checkpoints"
    for d in ckdir.glob("step_*") if ckdir.is_dir() else ():
        n = checkpoint_step(d)
        if n is not None and d.is_dir() and is_complete(d):
            out.append((n, d))
    return sorted(out)


def read_json(path: Path) -> Any:
    """A checkpoint's small JSON file; a missing or damaged one is one line naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} is missing or damaged ({type(e).__name__}: {e}); "
                              f"{RECOVER}") from None  # fmt: skip


def _mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except OSError:
        return 0


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint to resume RUN from: the one `RUN/checkpoints/latest` names (None before
    the first save). A complete step_N newer than it, or with no `latest` at all, is a save
    killed between its rename and `latest`'s update: that checkpoint is complete, so it is
    taken (with a warning) rather than losing a save interval or starting over. A `latest`
    written after that save (its state.json) was pointed back by hand, a rollback: it is
    followed (the resume then moves the later checkpoints aside). After a resume from another
    run's checkpoint, `latest` holds that checkpoint's absolute path until this run's first save,
    so a run stopped before it continues from there, not from step 0."""
    ckdir = Path(run_dir) / "checkpoints"
    ptr = ckdir / "latest"
    done = complete_checkpoints(run_dir)
    named = None
    if ptr.is_file():
        try:
            name = ptr.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            name, why = None, f"is unreadable ({type(e).__name__})"
        else:
            why = f"names {name}, which is incomplete or missing" if name else "is empty"
        if not name or ("/" in name and not os.path.isabs(name)) or not is_complete(ckdir / name):
            newest = f" (the newest complete: resume={done[-1][1]})" if done else ""
            raise CheckpointError(f"{ptr} {why}; {RECOVER}{newest}")
        named = ckdir / name
    if done and (named is None or (checkpoint_step(named) or -1) < done[-1][0]):
        if named is not None and _mtime(done[-1][1] / "state.json") < _mtime(ptr):
            logger.info("%s names %s, set after %s was saved: resuming from %s", ptr,
                        named.name, done[-1][1].name, named.name)  # fmt: skip
            return named
        logger.warning(
            "%s %s, but %s is complete and newer (a save stopped before it updated `latest`): "
            "resuming from it", ptr, f"names {named.name}" if named else "is missing",
            done[-1][1].name,
        )  # fmt: skip
        return done[-1][1]
    return named


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its latest complete checkpoint)."""
    p = Path(path)
    if p.name.endswith(".tmp"):  # a save killed midway (state.json may already be there)
        raise CheckpointError(f"{p} is an incomplete save (the trainer never completed it); give "
                              "a complete checkpoint (RUN/checkpoints/step_*) or the run directory")  # fmt: skip
    if (p / "state.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        ck = latest_checkpoint(p)
        if ck is None:
            raise CheckpointError(f"run directory {p} has no complete checkpoint yet")
        return ck
    if (p / "config.yaml").is_file() and (p / "metrics.jsonl").is_file():  # before its 1st save
        raise CheckpointError(f"run directory {p} has no checkpoint yet (the first is saved at "
                              "step train.save_every); `llmtrain eval --watch` waits for it")  # fmt: skip
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
        check_format(self.dir, index)
        self.index: dict[str, dict] = index["tensors"]
        self._reader = RangedReader(str(self.dir))
        try:
            self._md = self._reader.read_metadata()
        except Exception as e:
            raise CheckpointError(f"{self.dir}/.metadata is missing or corrupt: {e}") from e
        self._reader.set_up_storage_reader(self._md, True)
        self._pack = PackIndex.open(self.dir, self._md)

    def names(self) -> list[str]:
        return list(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name]["shape"])

    def has(self, key: str) -> bool:
        if self._pack is not None:
            return key in self._pack.keys
        return key in self._md.state_dict_metadata

    def _read(self, key: str, start: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        planner = PieceLoadPlanner([Piece(key, self._full(key), start, numel, tensor=out)],
                                   pack=self._pack)  # fmt: skip
        planner.set_up_planner({}, self._md, True)
        plan = planner.finish_plan(planner.create_local_plan())
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
        full = _saved_numel(self._md, self._pack, key)
        if full is None:
            raise CheckpointError(f"checkpoint {self.dir} lacks {key}")
        return full

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
