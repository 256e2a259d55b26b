"""safetensors files read and written one tensor at a time, sharded like Hugging Face checkpoints.

Checkpoints and exports both go through here. Why not only the `safetensors` package: its reader
memory-maps whole files (the touched pages stay resident) and `save_file` serialises a whole file
into one buffer first; the trainer's saves and the export's memory bound need neither.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from llmtrain.errors import LlmtrainError

EXPERT_SUFFIXES = ("mlp.experts.w_gate_up", "mlp.experts.w_down")


class TensorFileError(LlmtrainError, RuntimeError):
    """A weight file is missing, truncated or corrupt; the message names it."""


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def _header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, its metadata entry dropped."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > 100_000_000:
                raise ValueError(f"bad header length {n}")
            header = json.loads(fh.read(n))
    except Exception as e:
        raise TensorFileError(f"{path} is corrupt or unreadable: {e}") from e
    header.pop("__metadata__", None)
    return n, header


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, byte offsets)."""
    return _header(path)[1]


def check_whole(path: Path) -> None:
    """TensorFileError unless the file holds every byte its header names (a copy cut short)."""
    n, header = _header(path)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if path.stat().st_size < 8 + n + end:
        raise TensorFileError(f"{path} is truncated: {path.stat().st_size} bytes of {8 + n + end}")


def read_tensors(
    path: Path, split_experts: bool = False
) -> Iterator[tuple[str, torch.Tensor, int]]:
    """Tensors of one safetensors file, each read into its own buffer and handed over.

    safetensors' own reader memory-maps the file, and the pages it touches stay in the process's
    resident set until the file is closed: a whole input shard per shard. Reading each tensor's
    bytes with plain file reads keeps only the tensor in hand alive (the format is a JSON header
    of dtypes, shapes and byte offsets followed by the raw data)."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                a, b = info["data_offsets"]
                shape = info["shape"]
                dtype = _ST_DTYPES[info["dtype"]]
                # stacked experts [E, ...] are contiguous per expert: read them one expert at a time
                rows = shape[0] if split_experts and name.endswith(EXPERT_SUFFIXES) else 1
                step = (b - a) // rows
                for r in range(rows):
                    fh.seek(8 + n + a + r * step)
                    buf = bytearray(step)  # in place: bytearray(fh.read()) holds two copies
                    if fh.readinto(buf) != step:
                        raise TensorFileError(f"{path} is truncated (tensor {name})")
                    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                    yield name, t.reshape([1, *shape[1:]] if rows > 1 else shape), r
    except TensorFileError:
        raise
    except Exception as e:
        raise TensorFileError(f"{path} could not be read: {e}") from e


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file tensor by tensor from the tensors' own memory.

    `safetensors.torch.save_file` first serialises the whole file into one buffer, doubling the
    memory of a shard; the export's memory bound needs the stream. Same layout: 8-byte header
    length, JSON header (padded with spaces to 8 bytes), then the raw little-endian data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + n],
        }
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as fh:
        fh.write(len(hb).to_bytes(8, "little"))
        fh.write(hb)
        for t in tensors.values():
            if t.numel():
                fh.write(memoryview(t.contiguous().view(torch.uint8).numpy()))


class ShardWriter:
    """Accumulates tensors and writes a safetensors shard whenever the next would overflow."""

    def __init__(self, out: Path, max_bytes: int, stem: str = "model"):
        self.out, self.max, self.stem = out, max_bytes, stem
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0
        self.largest = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.buf and self.size + n > self.max:
            self.flush()
        t = t.contiguous()
        if t.untyped_storage().nbytes() > n:  # a view (one expert of a block): keep only it,
            t = t.clone()  # not the whole block until the shard is written
        self.buf[name] = t
        self.size += n
        self.total += n

    def flush(self) -> None:
        if not self.buf:
            return
        name = f"{self.stem}-part-{len(self.files):05d}.tmp"
        write_safetensors(self.out / name, self.buf)
        self.files.append((name, list(self.buf)))
        self.largest = max(self.largest, self.size)
        self.buf, self.size = {}, 0

    def finish(self) -> list[str]:
        """Rename to HF's names and write the index when there is more than one shard."""
        self.flush()
        n = len(self.files)
        if n == 0:
            write_safetensors(self.out / f"{self.stem}.safetensors", {})
            return [f"{self.stem}.safetensors"]
        if n == 1:
            os.replace(self.out / self.files[0][0], self.out / f"{self.stem}.safetensors")
            return [f"{self.stem}.safetensors"]
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self.files, start=1):
            final = f"{self.stem}-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        (self.out / f"{self.stem}.safetensors.index.json").write_text(
            json.dumps(
                {
                    "metadata": {"total_size": self.total},
                    "weight_map": dict(sorted(weight_map.items())),
                },
                indent=2,
            )
        )
        return names


def write_sharded(
    tensors: dict[str, torch.Tensor], out: Path, stem: str, max_bytes: int
) -> list[str]:
    w = ShardWriter(out, max_bytes, stem)
    for k, v in tensors.items():
        w.add(k, v)
    return w.finish()


def tensor_files(folder: Path, stem: str = "model") -> dict[str, str]:
    """tensor name -> file, for a sharded (index) or single-file set; missing files are errors."""
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
            if not isinstance(wmap, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TensorFileError(
                f"{index} is corrupt or unreadable ({type(e).__name__}: {e})"
            ) from e
        for f in sorted(set(wmap.values())):
            if not (folder / f).is_file():
                raise TensorFileError(f"{folder} is missing the shard {f} named in its index")
        return wmap
    single = folder / f"{stem}.safetensors"
    if not single.is_file():
        raise TensorFileError(f"{folder} has no {stem}.safetensors (nor an index)")
    return {k: single.name for k in read_header(single)}


def load_all(folder: Path, stem: str = "model") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(tensor_files(folder, stem).values())):
        out.update((name, t) for name, t, _ in read_tensors(folder / f))
    return out
