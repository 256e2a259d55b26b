"""Checkpoints in the earlier consolidated format: full fp32 weights in `model*.safetensors`,
full Adam moments as `<name>::exp_avg[_sq]` in `optimizer*.safetensors`, `__rng__::torch_cpu`.

They are read one tensor at a time (resume, export, `from_pretrained`) and converted to the
sharded format by `llmtrain checkpoint convert OLD NEW`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from llmtrain.checkpoint.format import MOMENTS, CheckpointError, is_sharded, write_full_tensors
from llmtrain.tensor_io import _ST_DTYPES, TensorFileError, read_header, tensor_files

RNG_KEY = "__rng__::torch_cpu"


class LegacyReader:
    """Tensors of a consolidated checkpoint, each read from its byte range on request."""

    def __init__(self, path: Path):
        self.dir = Path(path)
        try:
            self.files = {"model": tensor_files(self.dir, "model")}
            opt = self.dir / "optimizer.safetensors"
            opt_idx = self.dir / "optimizer.safetensors.index.json"
            self.files["optimizer"] = (
                tensor_files(self.dir, "optimizer") if opt.is_file() or opt_idx.is_file() else {}
            )
            self.headers = {
                f: read_header(self.dir / f)
                for files in self.files.values()
                for f in set(files.values())
            }
        except TensorFileError as e:
            raise CheckpointError(f"checkpoint {self.dir} is unusable: {e}") from e

    def names(self) -> list[str]:
        return list(self.files["model"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.files["model"][name]][name]["shape"])

    def has_moments(self, name: str) -> bool:
        return f"{name}::{MOMENTS[0]}" in self.files["optimizer"]

    def _entry(self, stem: str, key: str) -> tuple[Path, dict]:
        f = self.files[stem].get(key)
        if f is None:
            raise CheckpointError(f"checkpoint {self.dir} lacks {key}")
        return self.dir / f, self.headers[f][key]

    def _read(self, path: Path, key: str, byte: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` from the bytes at `byte` of `key`'s data in `path` (read in place)."""
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            fh.seek(8 + n + byte)
            got = fh.readinto(memoryview(out.view(torch.uint8).numpy())) if out.numel() else 0
        if got != out.numel() * out.element_size():
            raise CheckpointError(f"{path} is truncated (tensor {key})")
        return out

    def _get(self, stem: str, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `key`, or only its rows [r0, r1) along dim 0 (a byte range of the file)."""
        path, info = self._entry(stem, key)
        a, b = info["data_offsets"]
        shape = list(info["shape"])
        if rows is not None:
            row_bytes = (b - a) // shape[0] if shape and shape[0] else 0
            a, b = a + rows[0] * row_bytes, a + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        dtype = _ST_DTYPES[info["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        return self._read(path, key, a, torch.empty((b - a) // size, dtype=dtype)).reshape(shape)

    def elements(self, name: str, moment: str | None, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the flattened tensor (its moment): a byte range of the
        file, so a rank resuming from this format reads its share, not every full tensor."""
        key = name if moment is None else f"{name}::{moment}"
        path, info = self._entry("model" if moment is None else "optimizer", key)
        dtype = _ST_DTYPES[info["dtype"]]
        size = torch.empty((), dtype=dtype).element_size()
        a, b = info["data_offsets"]
        if start < 0 or (start + n) * size > b - a:
            raise CheckpointError(f"{key}: elements [{start}, {start + n}) beyond its "
                                  f"{(b - a) // size}")  # fmt: skip
        return self._read(path, key, a + start * size, torch.empty(n, dtype=dtype))

    def rows(self, name: str, max_bytes: int = 2**30) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, tensor of rows) blocks of at most ~max_bytes along dim 0: a stacked expert
        tensor of a large model is tens of GB, more than one process should hold at once."""
        shape = self.shape(name)
        if not shape:
            yield 0, self.read(name)
            return
        info = self.headers[self.files["model"][name]][name]
        a, b = info["data_offsets"]
        per = max(1, max_bytes // max(1, (b - a) // max(1, shape[0])))
        for r in range(0, shape[0], per):
            yield r, self._get("model", name, (r, min(shape[0], r + per)))

    def read(self, name: str, moment: str | None = None) -> torch.Tensor:
        if moment is None:
            return self._get("model", name)
        return self._get("optimizer", f"{name}::{moment}")

    def rng(self) -> torch.Tensor | None:
        return self._get("optimizer", RNG_KEY) if RNG_KEY in self.files["optimizer"] else None


def convert(old: Path, new: Path) -> Path:
    """Rewrite a consolidated checkpoint in the sharded format, one tensor in memory at a time."""
    old, new = Path(old), Path(new)
    if is_sharded(old):
        raise CheckpointError(f"{old} is already in the sharded format: nothing to convert")
    src = LegacyReader(old)
    if new.exists() and any(new.iterdir()):
        raise CheckpointError(f"{new} exists and is not empty")
    tensors = {n: (src.shape(n), lambda n=n: src.read(n).float()) for n in src.names()}
    moments = {
        n: (lambda m, n=n: src.read(n, m).float()) for n in src.names() if src.has_moments(n)
    }
    kinds = {n: "buffer" for n in src.names() if n.endswith("e_score_correction_bias")}
    write_full_tensors(new, tensors, moments, kinds)
    state = json.loads((old / "state.json").read_text())
    (new / "state.json").write_text(json.dumps(state, indent=1))
    for f in ("config.yaml", "tokenizer.json"):
        if (old / f).is_file():
            shutil.copy(old / f, new / f)
    return new
