"""Export to the Hugging Face DeepseekV3/V2 layout, streamed shard by shard, verified against
stock transformers, and pushed to the Hub.

Input is one of our checkpoints (whatever ZeRO stage and expert-parallel layout wrote it: the
sharded format places every rank's pieces in the full tensors, read here through
llmtrain.checkpoint without a process group), or a run directory (its latest checkpoint). A
Hugging Face directory is imported first (`llmtrain.from_pretrained` + `save_consolidated`)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

import llmtrain.checkpoint.format as ckfmt
from llmtrain.checkpoint import CheckpointError, open_checkpoint
from llmtrain.config import ModelConfig, load_config
from llmtrain.errors import LlmtrainError, ensure_dir
from llmtrain.hf import hf_config_from_model, state_dict_to_hf
from llmtrain.tensor_io import EXPERT_SUFFIXES, ShardWriter, TensorFileError

logger = logging.getLogger(__name__)

FP32_KEYS = ("mlp.gate.weight", "e_score_correction_bias")  # transformers keeps these in fp32


class ExportError(LlmtrainError, RuntimeError):
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
    try:
        return ckfmt.resolve_checkpoint(path)
    except CheckpointError as e:
        raise ExportError(str(e)) from e


class CheckpointSource:
    """Tensors of one of our checkpoints (sharded, or the earlier consolidated format), read one
    at a time through llmtrain.checkpoint; stacked experts a block of experts at a time."""

    ROW_BYTES = 256 * 2**20  # experts are read in blocks of at most this many bytes

    def __init__(self, path: str | Path, row_bytes: int | None = None):
        self.dir = resolve_checkpoint(path)
        self.row_bytes = row_bytes or self.ROW_BYTES
        cfg_file = self.dir / "config.yaml"
        if not cfg_file.is_file():
            raise ExportError(f"checkpoint {self.dir} lacks config.yaml")
        self.config = load_config(cfg_file)
        self.state = json.loads((self.dir / "state.json").read_text())
        try:
            self.reader = open_checkpoint(self.dir)
        except (CheckpointError, TensorFileError) as e:
            raise ExportError(f"checkpoint {self.dir}: {e}") from e
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
        have = set(self.reader.names())
        missing = sorted(set(expected) - have)
        if missing:
            raise ExportError(
                f"checkpoint {self.dir} lacks {len(missing)} tensors, e.g. {missing[:4]}; it is incomplete"
            )
        for k in have & set(expected):
            if self.reader.shape(k) != expected[k]:
                raise ExportError(
                    f"{self.dir}: {k} has shape {list(self.reader.shape(k))}, config says {expected[k]}"
                )

    def tensors(self, split_experts: bool = True) -> Iterator[tuple[str, torch.Tensor, int]]:
        """(name, tensor, expert offset); stacked experts come one expert at a time."""
        try:
            for name in self.reader.names():
                if split_experts and name.endswith(EXPERT_SUFFIXES):
                    for r0, block in self._rows(name):
                        for i in range(block.shape[0]):
                            yield name, block[i : i + 1], r0 + i
                else:
                    yield name, self.reader.read(name), 0
        except (CheckpointError, TensorFileError) as e:
            raise ExportError(f"checkpoint {self.dir}: {e}") from e

    def _rows(self, name: str):
        if hasattr(self.reader, "rows"):
            yield from self.reader.rows(name, self.row_bytes)
        else:
            yield 0, self.reader.read(name)

    def tokenizer_file(self) -> Path | None:
        f = self.dir / "tokenizer.json"
        return f if f.is_file() else None


# ---------------------------------------------------------------- writing


def hf_tensors(
    src, mc: ModelConfig, dtype: torch.dtype, mtp: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our tensors, one at a time, renamed/split to the HF layout and cast.

    DeepSeek-V3 ships the shared embedding and head again in each MTP layer: those copies are
    written as soon as the embedding (and, untied, the head) goes by, so no full-size tensor is
    held back to the end (2 x 3.7 GB in fp32 for DeepSeek-V3)."""
    for name, t, offset in src:
        if name.startswith("mtp.") and not mtp:
            continue
        for hname, ht in state_dict_to_hf({name: t}, mc, expert_offset=offset):
            keep32 = hname.endswith(FP32_KEYS)
            yield hname, ht.to(torch.float32 if keep32 else dtype)
        if not (mtp and mc.mtp_depth):
            continue
        copies = {"model.embed_tokens.weight": ["embed_tokens.weight"], "lm_head.weight":
                  ["shared_head.head.weight"]}.get(name, [])  # fmt: skip
        if name == "model.embed_tokens.weight" and mc.tie_word_embeddings:
            copies.append("shared_head.head.weight")
        for k in range(mc.mtp_depth):
            for what in copies:  # own storage each: safetensors refuses shared tensors
                yield f"model.layers.{mc.num_layers + k}.{what}", t.to(dtype).clone()


# PAD looked up by name in the run's own tokenizer, first match wins (ours first)
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


def special_tokens(tok) -> dict[str, str | None]:
    """eos / bos / pad taken from the tokenizer itself, never invented: a name the vocabulary
    lacks would make transformers add a token with an id past the model's embedding table.
    EOS is the one the data pipeline used. BOS is EOS too: training put no BOS token before
    documents (EOS separates them), so a `<s>` the tokenizer may hold was never seen and
    lm-eval's HFLM, which prefixes every request with the BOS, would score another model
    input than the trainer's evals (GPT-style). PAD may be None."""
    from llmtrain.data.tokenizer import EOS, eos_id

    vocab = tok.get_vocab(with_added_tokens=True)

    def first(names):
        return next((n for n in names if n in vocab), None)

    try:
        eos = tok.id_to_token(eos_id(tok))
    except Exception:  # a tokenizer without an end-of-text token: export it without one
        eos = EOS if EOS in vocab else None
    return {"eos_token": eos, "bos_token": eos, "pad_token": first(PAD_NAMES)}


def write_tokenizer(tok_file: Path | None, out: Path) -> dict:
    if tok_file is None:
        logger.warning("no tokenizer.json in the checkpoint: the export has none")
        return {}
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(tok_file))
    n = raw.get_vocab_size(with_added_tokens=True)
    specials = {k: v for k, v in special_tokens(raw).items() if v is not None}
    probe = "a b"
    if raw.encode(probe).ids != raw.encode(probe, add_special_tokens=False).ids:
        # a post-processor that adds BOS/EOS (Llama-style): training encoded without it, so
        # the export must too, or `tokenizer(text)` feeds the model tokens it never saw
        raw.post_processor = None
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, **specials)
    if len(tok) != n:  # never: every special token above was found in the vocabulary
        raise ExportError(f"the tokenizer grew from {n} to {len(tok)} tokens on export")
    tok.save_pretrained(out)
    cfg_file = out / "tokenizer_config.json"
    if cfg_file.is_file():  # transformers 5 names its own backend class, which 4.x lacks
        tok_cfg = json.loads(cfg_file.read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        # decode as `tokenizers` does (and the evaluation harness scored): transformers before
        # 4.45 defaulted to cleaning spaces (" ." -> "."), changing generated text
        tok_cfg["clean_up_tokenization_spaces"] = False
        cfg_file.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
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
    # experts are read in blocks no larger than an output shard: peak memory follows shard_size
    src = CheckpointSource(checkpoint, min(CheckpointSource.ROW_BYTES, parse_size(shard_size)))
    mc = src.config.model
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ExportError(f"--dtype {dtype}: use bf16 or fp32")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory path for the export")
    ensure_dir(out.parent, "the parent of --out")  # before any work: a parent may be a file
    if out.exists() and any(out.iterdir()):
        src_dir = src.dir.resolve()
        if (out.resolve() in (src_dir, *src_dir.parents) or (out / "checkpoints").exists()
                or (out / "state.json").exists() or (out / ".metadata").exists()):  # fmt: skip
            raise ExportError(f"--out {out} holds a run or checkpoint (the source, or another): "
                              "--overwrite would delete it; give another --out")  # fmt: skip
        if not overwrite:
            raise ExportError(f"{out} exists and is not empty; pass --overwrite or another --out")
        if not (out / "config.json").is_file():
            raise ExportError(f"--out {out} is not an earlier export (no config.json): "
                              "--overwrite replaces exports only; give another --out")  # fmt: skip
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
        import yaml

        from llmtrain.export.card import redacted

        (tmp / "llmtrain_config.yaml").write_text(
            yaml.safe_dump(redacted(src.config.to_dict()), sort_keys=False)
        )
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
    """Write an in-memory model as one of our checkpoints (what the trainer writes, without
    optimizer state): e.g. weights imported with `llmtrain.from_pretrained`."""
    import yaml

    from llmtrain.checkpoint.format import write_full_tensors

    out = Path(out)
    tensors = {k: v for k, v in model.state_dict().items()
               if not k.endswith(("last_counts", "load_since_update", "inv_freq"))}  # fmt: skip
    if cfg.model.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    kinds = {k: "buffer" for k in tensors if k.endswith("e_score_correction_bias")}
    write_full_tensors(
        out,
        {k: (tuple(v.shape), lambda v=v: v.detach().float().cpu()) for k, v in tensors.items()},
        kinds=kinds,
    )
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "state.json").write_text(json.dumps({"step": 0, "tokens_seen": 0, "flops": 0}))
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, out / "tokenizer.json")
    return out
