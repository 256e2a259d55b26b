"""Byte-level BPE trained with `tokenizers`, or a Hugging Face tokenizer directory loaded as is."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmtrain.data.corpus import DataError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, PAD]


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise DataError(
            f"no tokenizer at {p} (expected a tokenizer.json or a directory holding one)"
        )
    return Tokenizer.from_file(str(f))


def eos_id(tok: Tokenizer) -> int:
    for cand in (EOS, "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"):
        i = tok.token_to_id(cand)
        if i is not None:
            return i
    raise DataError("the tokenizer has no end-of-text token (tried <|endoftext|>, </s>, <eos>)")


def vocab_span(tok: Tokenizer) -> int:
    """Largest token id + 1: what the embedding table must hold and the token dtype must reach
    (a tokenizer's ids need not be contiguous, so its token count can be smaller)."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(ids, default=-1) + 1


def check_fits(tok: Tokenizer, model_vocab: int) -> None:
    n = vocab_span(tok)
    if n > model_vocab:
        raise DataError(
            f"the tokenizer's ids reach {n - 1} (model.vocab_size {model_vocab} holds ids up to "
            f"{model_vocab - 1}); set model.vocab_size >= {n} or use a smaller tokenizer"
        )
