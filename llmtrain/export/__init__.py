"""Export to the Hugging Face DeepseekV3/V2 layout, streamed shard by shard, verified against
stock transformers, and pushed to the Hub.

Input is our consolidated checkpoint (whatever ZeRO stage and expert-parallel layout wrote it:
the trainer gathers every partition and every expert at save time), a run directory (its
latest checkpoint), or a Hugging Face directory (re-export)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from llmtrain.config import ModelConfig, load_config
from llmtrain.hf import hf_config_from_model, state_dict_to_hf

logger = logging.getLogger(__name__)

FP32_KEYS = ("mlp.gate.weight", "e_score_correction_bias")  # transformers keeps these in fp32
EXPERT_SUFFIXES = ("mlp.experts.w_gate_up", "mlp.experts.w_down")


class ExportError(RuntimeError):
    pass


def parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", s, flags=re.I)
    if not m:
        raise ExportError(f"size {s!r} is not like 5GB, 500MB or 2GiB")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]  # fmt: skip
    return int(float(m.group(1)) * mult)


# ---------------------------------------------------------------- sources


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir (its latest complete checkpoint)."""
    from llmtrain.train.checkpoint import latest_checkpoint

    p = Path(path)
    if (p / "state.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        ck = latest_checkpoint(p)
        if ck is None:
            raise ExportError(f"run directory {p} has no complete checkpoint yet")
        return ck
    raise ExportError(
        f"{p} is neither a checkpoint (state.json) nor a run directory (checkpoints/)"
    )


class CheckpointSource:
    """Tensors of one of our checkpoints, read one at a time (safetensors, memory-mapped)."""

    def __init__(self, path: str | Path):
        from llmtrain.train.checkpoint import weight_files

        self.dir = resolve_checkpoint(path)
        cfg_file = self.dir / "config.yaml"
        if not cfg_file.is_file():
            raise ExportError(f"checkpoint {self.dir} lacks config.yaml")
        self.config = load_config(cfg_file)
        self.state = json.loads((self.dir / "state.json").read_text())
        self.wmap = weight_files(self.dir)
        self._check_complete(self.config.model)

    def _check_complete(self, mc: ModelConfig) -> None:
        """Every weight the config implies is present with its full shape (all experts)."""
        from llmtrain.model import build_model

        meta = build_model(mc, device="meta")
        expected = {n: tuple(p.shape) for n, p in meta.named_parameters()}
        expected.update(
            {
                n: tuple(b.shape)
                for n, b in meta.named_buffers()
                if n.endswith("e_score_correction_bias")
            }
        )
        missing = sorted(set(expected) - set(self.wmap))
        if missing:
            raise ExportError(
                f"checkpoint {self.dir} lacks {len(missing)} tensors, e.g. {missing[:4]}; it is incomplete"
            )
        from safetensors import safe_open

        for f in sorted(set(self.wmap.values())):
            try:
                with safe_open(str(self.dir / f), "pt") as fh:
                    for k in fh.keys():
                        if k in expected and tuple(fh.get_slice(k).get_shape()) != expected[k]:
                            raise ExportError(
                                f"{f}: {k} has shape {fh.get_slice(k).get_shape()}, config says {expected[k]}"
                            )
            except ExportError:
                raise
            except Exception as e:
                raise ExportError(
                    f"checkpoint shard {self.dir / f} is corrupt or unreadable: {e}"
                ) from e

    def tensors(self, split_experts: bool = True) -> Iterator[tuple[str, torch.Tensor, int]]:
        """(name, tensor, expert offset); stacked experts come one expert at a time."""
        for f in sorted(set(self.wmap.values())):
            yield from read_tensors(self.dir / f, split_experts)

    def tokenizer_file(self) -> Path | None:
        f = self.dir / "tokenizer.json"
        return f if f.is_file() else None


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, byte offsets)."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > 100_000_000:
                raise ValueError(f"bad header length {n}")
            header = json.loads(fh.read(n))
    except Exception as e:
        raise ExportError(f"checkpoint shard {path} is corrupt or unreadable: {e}") from e
    header.pop("__metadata__", None)
    return header


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
                    buf = bytearray(fh.read(step))
                    if len(buf) != step:
                        raise ExportError(f"{path} is truncated (tensor {name})")
                    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
                    yield name, t.reshape([1, *shape[1:]] if rows > 1 else shape), r
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"checkpoint shard {path} could not be read: {e}") from e


# ---------------------------------------------------------------- writing


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

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max = out, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0
        self.largest = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.buf and self.size + n > self.max:
            self.flush()
        self.buf[name] = t.contiguous()
        self.size += n
        self.total += n

    def flush(self) -> None:
        if not self.buf:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        write_safetensors(self.out / name, self.buf)
        self.files.append((name, list(self.buf)))
        self.largest = max(self.largest, self.size)
        self.buf, self.size = {}, 0

    def finish(self) -> list[str]:
        """Rename to HF's names and write the index when there is more than one shard."""
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.out / self.files[0][0], self.out / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "metadata": {"total_size": self.total},
                    "weight_map": dict(sorted(weight_map.items())),
                },
                indent=2,
            )
        )
        return names


def hf_tensors(
    src, mc: ModelConfig, dtype: torch.dtype, mtp: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors, one at a time, renamed/split to the HF layout and cast."""
    embed = head = None
    for name, t, offset in src:
        if name.startswith("mtp.") and not mtp:
            continue
        if name == "model.embed_tokens.weight" and mc.mtp_depth and mtp:
            embed = t
        if name == "lm_head.weight" and mc.mtp_depth and mtp:
            head = t
        for hname, ht in state_dict_to_hf({name: t}, mc, expert_offset=offset):
            keep32 = hname.endswith(FP32_KEYS)
            yield hname, ht.to(torch.float32 if keep32 else dtype)
    if mtp and mc.mtp_depth:
        head = head if head is not None else embed  # tied
        for k in range(
            mc.mtp_depth
        ):  # DeepSeek-V3 ships the shared embedding and head per MTP layer
            pre = f"model.layers.{mc.num_layers + k}."
            if embed is not None:
                yield (
                    pre + "embed_tokens.weight",
                    embed.to(dtype).clone(),
                )  # own storage: safetensors
            if head is not None:
                yield pre + "shared_head.head.weight", head.to(dtype).clone()


def write_tokenizer(tok_file: Path | None, out: Path) -> dict:
    if tok_file is None:
        logger.warning("no tokenizer.json in the checkpoint: the export has none")
        return {}
    from transformers import PreTrainedTokenizerFast

    from llmtrain.data.tokenizer import EOS, PAD

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_file), eos_token=EOS, bos_token=EOS, pad_token=PAD
    )
    tok.save_pretrained(out)
    return {
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _return_freed_buffers_to_os() -> None:
    """glibc raises its mmap threshold after large frees (up to 32 MB), so later tensor-sized
    buffers come from the heap and freed ones stay resident: RSS creeps up shard after shard.
    A fixed 64 KiB threshold hands every tensor buffer back to the OS when it is freed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def export(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str = "bf16",
    shard_size: str | int = "5GB",
    mtp: bool = True,
    overwrite: bool = False,
    law: str | None = None,
    license: str = "apache-2.0",
) -> Path:
    """Write a transformers-loadable directory; written under a temporary name, then renamed."""
    from llmtrain.export.card import model_card

    _return_freed_buffers_to_os()
    src = CheckpointSource(checkpoint)
    mc = src.config.model
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ExportError(f"--dtype {dtype}: use bf16 or fp32")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty; pass --overwrite or another --out")
    hf_cfg = hf_config_from_model(mc, mtp=mtp)  # raises for configs transformers cannot express
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        w = ShardWriter(tmp, parse_size(shard_size))
        for name, t in hf_tensors(src.tensors(), mc, torch_dtype, mtp):
            w.add(name, t)
        files = w.finish()
        ids = write_tokenizer(src.tokenizer_file(), tmp)
        hf_cfg.update(ids)
        hf_cfg["torch_dtype"] = "bfloat16" if dtype == "bf16" else "float32"
        hf_cfg["dtype"] = hf_cfg["torch_dtype"]
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        gen = {
            "_from_model_config": True,
            "do_sample": False,
            **{k: v for k, v in ids.items() if v is not None},
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        (tmp / "README.md").write_text(model_card(src, hf_cfg, mtp, law, license, files))
        (tmp / "llmtrain_config.yaml").write_text((src.dir / "config.yaml").read_text())
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "exported %s -> %s (%d shard(s), largest %.1f MB)",
        src.dir,
        out,
        len(files),
        w.largest / 1e6,
    )
    return out


def save_consolidated(model, cfg, out: str | Path, tokenizer_file: Path | None = None) -> Path:
    """Write an in-memory model as one of our consolidated checkpoints (what the trainer writes,
    without optimizer state): e.g. weights imported with `llmtrain.from_pretrained`."""
    import yaml

    from llmtrain.train.checkpoint import SHARD_BYTES, write_sharded

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()
               if not k.endswith(("last_counts", "load_since_update", "inv_freq"))}  # fmt: skip
    if cfg.model.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    write_sharded(tensors, out, "model", SHARD_BYTES)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "state.json").write_text(json.dumps({"step": 0, "tokens_seen": 0, "flops": 0}))
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, out / "tokenizer.json")
    return out
