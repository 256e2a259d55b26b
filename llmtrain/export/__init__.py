"""Export to the Hugging Face DeepseekV3/V2 layout, streamed shard by shard, verified against
stock transformers, and pushed to the Hub.

Input is our consolidated checkpoint (whatever ZeRO stage and expert-parallel layout wrote it:
the trainer gathers every partition and every expert at save time), a run directory (its
latest checkpoint), or a Hugging Face directory (re-export)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from llmtrain.config import ModelConfig, load_config
from llmtrain.hf import hf_config_from_model, state_dict_to_hf
from llmtrain.tensor_io import ShardWriter, TensorFileError, read_header, read_tensors, tensor_files

logger = logging.getLogger(__name__)

FP32_KEYS = ("mlp.gate.weight", "e_score_correction_bias")  # transformers keeps these in fp32


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
        self.dir = resolve_checkpoint(path)
        cfg_file = self.dir / "config.yaml"
        if not cfg_file.is_file():
            raise ExportError(f"checkpoint {self.dir} lacks config.yaml")
        self.config = load_config(cfg_file)
        self.state = json.loads((self.dir / "state.json").read_text())
        try:
            self.wmap = tensor_files(self.dir)
        except TensorFileError as e:
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
        missing = sorted(set(expected) - set(self.wmap))
        if missing:
            raise ExportError(
                f"checkpoint {self.dir} lacks {len(missing)} tensors, e.g. {missing[:4]}; it is incomplete"
            )
        for f in sorted(set(self.wmap.values())):
            path = self.dir / f
            try:
                header = read_header(path)
            except TensorFileError as e:
                raise ExportError(f"checkpoint shard {e}") from e
            end = max((v["data_offsets"][1] for v in header.values()), default=0)
            if path.stat().st_size < end:
                raise ExportError(f"checkpoint shard {path} is truncated")
            for k, info in header.items():
                if k in expected and tuple(info["shape"]) != expected[k]:
                    raise ExportError(
                        f"{f}: {k} has shape {info['shape']}, config says {expected[k]}"
                    )

    def tensors(self, split_experts: bool = True) -> Iterator[tuple[str, torch.Tensor, int]]:
        """(name, tensor, expert offset); stacked experts come one expert at a time."""
        for f in sorted(set(self.wmap.values())):
            try:
                yield from read_tensors(self.dir / f, split_experts)
            except TensorFileError as e:
                raise ExportError(f"checkpoint shard {e}") from e

    def tokenizer_file(self) -> Path | None:
        f = self.dir / "tokenizer.json"
        return f if f.is_file() else None


# ---------------------------------------------------------------- writing


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


# special tokens looked up by name in the run's own tokenizer, first match wins (ours first)
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<｜begin▁of▁sentence｜>", "[CLS]")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


def special_tokens(tok) -> dict[str, str | None]:
    """eos / bos / pad taken from the tokenizer itself, never invented: a name the vocabulary
    lacks would make transformers add a token with an id past the model's embedding table.
    EOS is the one the data pipeline used; BOS falls back to it (GPT-style); PAD may be None."""
    from llmtrain.data.tokenizer import EOS, eos_id

    vocab = tok.get_vocab(with_added_tokens=True)

    def first(names):
        return next((n for n in names if n in vocab), None)

    try:
        eos = tok.id_to_token(eos_id(tok))
    except Exception:  # a tokenizer without an end-of-text token: export it without one
        eos = EOS if EOS in vocab else None
    return {"eos_token": eos, "bos_token": first(BOS_NAMES) or eos, "pad_token": first(PAD_NAMES)}


def write_tokenizer(tok_file: Path | None, out: Path) -> dict:
    if tok_file is None:
        logger.warning("no tokenizer.json in the checkpoint: the export has none")
        return {}
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(tok_file))
    n = raw.get_vocab_size(with_added_tokens=True)
    specials = {k: v for k, v in special_tokens(raw).items() if v is not None}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), **specials)
    if len(tok) != n:  # never: every special token above was found in the vocabulary
        raise ExportError(f"the tokenizer grew from {n} to {len(tok)} tokens on export")
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

    from llmtrain.tensor_io import write_sharded
    from llmtrain.train.checkpoint import SHARD_BYTES

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
