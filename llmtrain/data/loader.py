"""Packed fixed-length sequences over the token shards, and the deterministic step sampler.

Shape legend: G global batch (sequences per optimizer step), W data-parallel ranks,
M micro-batch, T sequence length.

Sequence i is stream[i·T : i·T + T + 1] (inputs and next-token labels), documents separated by
EOS. The sampler is stateless: global step s takes samples s·G … s·G+G−1 of an endless stream
of seeded per-epoch permutations, and rank r takes its contiguous G/W of them. So the tokens of
step s are the same at any world size, and resuming at step s needs nothing but s. The
permutations are stateless bijections (`permute`): O(1) memory per rank at any corpus size.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from llmtrain.data.corpus import DataError

# Shards kept memory-mapped at once per dataset: each map holds a file descriptor, and a
# terabyte corpus has thousands of shards (50M tokens each) against a usual limit of 1,024
OPEN_SHARDS = 64


class PackedDataset:
    def __init__(self, root: str | Path, split: str, seq_len: int):
        self.root = Path(root)
        try:
            idx = json.loads((self.root / "index.json").read_text())
            self.eos_id = idx["eos_id"]
            self.vocab_size = idx["vocab_size"]
            dtype = np.dtype(idx["dtype"])
            shards = idx["splits"][split]["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{self.root}/index.json is missing or corrupt ({e!r}); delete "
                            f"{self.root} to prepare the data again") from e  # fmt: skip
        self.dtype = dtype
        self.files = [self._check(s, dtype) for s in shards]
        self.starts = np.cumsum([0] + [int(s["tokens"]) for s in shards])
        self._maps: OrderedDict[int, int] = OrderedDict()  # descriptors of recently read shards
        self.n_tokens = int(self.starts[-1])
        self.seq_len = seq_len
        self.n_seq = (self.n_tokens - 1) // seq_len
        if self.n_seq < 1:
            raise DataError(
                f"the {split} split has {self.n_tokens} tokens, fewer than one sequence of "
                f"{seq_len}; add data or lower train.seq_len"
            )

    def _check(self, shard: dict, dtype: np.dtype) -> Path:
        """A shard's path, after checking its size against the index: a truncated or replaced
        shard would shift every later sample without any error."""
        f = self.root / shard["file"]
        want = int(shard["tokens"]) * dtype.itemsize
        try:
            have = f.stat().st_size
        except OSError as e:
            raise DataError(f"prepared shard {f} is missing ({e.strerror}); delete {self.root} "
                            "to prepare the data again") from e  # fmt: skip
        if have != want:
            raise DataError(f"prepared shard {f} holds {have} bytes where its index says {want} "
                            f"(truncated or overwritten); delete {self.root} to prepare the data again")  # fmt: skip
        return f

    def _fd(self, k: int) -> int:
        """Shard k's file descriptor, opened on first use; at most OPEN_SHARDS stay open."""
        fd = self._maps.get(k)
        if fd is not None:
            self._maps.move_to_end(k)
            return fd
        fd = self._maps[k] = os.open(self.files[k], os.O_RDONLY)
        if len(self._maps) > OPEN_SHARDS:
            os.close(self._maps.popitem(last=False)[1])
        return fd

    def shard(self, k: int) -> np.ndarray:
        """Shard k's tokens, memory-mapped (whole-split statistics; training reads use pread)."""
        if self.starts[k + 1] == self.starts[k]:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.files[k], dtype=self.dtype, mode="r")

    def _range(self, a: int, b: int) -> np.ndarray:
        """Tokens a..b of the split, read with pread: a shard cut short under a running job
        is a DataError naming it (a memory map would kill the rank with SIGBUS)."""
        out = np.empty(b - a, dtype=np.int64)
        k = int(np.searchsorted(self.starts, a, side="right") - 1)
        size = self.dtype.itemsize
        pos = a
        while pos < b:
            lo = pos - self.starts[k]
            hi = min(self.starts[k + 1], b) - self.starts[k]
            if hi > lo:
                want, fd = int(hi - lo) * size, self._fd(k)
                buf = os.pread(fd, want, int(lo) * size)
                if len(buf) != want:
                    raise DataError(
                        f"prepared shard {self.files[k]} holds {os.fstat(fd).st_size} bytes, its "
                        f"index says {int(self.starts[k + 1] - self.starts[k]) * size}: it was "
                        f"truncated or replaced while in use; delete {self.root} to prepare the "
                        "data again, then resume"
                    )
                out[pos - a : pos - a + hi - lo] = np.frombuffer(buf, dtype=self.dtype)
            pos += hi - lo
            k += 1
        return out

    def close(self) -> None:
        while self._maps:
            os.close(self._maps.popitem()[1])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def unigram_entropy(self, max_tokens: int = 50_000_000) -> float:
        """Entropy (nats) of the token frequencies: the loss of the best context-free model.
        Exact up to max_tokens; beyond, estimated on 256 evenly spaced blocks of the stream."""
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        if self.n_tokens <= max_tokens:
            blocks = (self.shard(k) for k in range(len(self.files)))
        else:
            size = max_tokens // 256
            starts = np.linspace(0, self.n_tokens - size, 256).astype(np.int64)
            blocks = [self._range(int(a), int(a) + size) for a in starts]
        for m in blocks:
            counts += np.bincount(m, minlength=self.vocab_size)[: self.vocab_size]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def sequence(self, i: int) -> np.ndarray:
        return self._range(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        arr = np.stack([self.sequence(int(i)) for i in indices])
        t = torch.from_numpy(arr)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing hash of uint64 values (wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(i: np.ndarray, n: int, seed: int, epoch: int, rounds: int = 6) -> np.ndarray:
    """A seeded bijection of [0, n) evaluated at the positions `i`, with O(1) state: a balanced
    Feistel network on the smallest even-bit domain 2^(2h) >= n, cycle-walked back into [0, n).
    Replaces a stored permutation (8 bytes per sequence per rank) at any corpus size."""
    if n <= 1:
        return np.zeros_like(np.asarray(i, dtype=np.int64))
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [
        _mix64(
            np.array(
                [(seed * 0x9E3779B1 + epoch * 0x85EBCA77 + r) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64
            )
        )[0]  # fmt: skip
        for r in range(rounds)
    ]
    x = np.asarray(i, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():  # cycle walking: each walk ends within a few rounds (domain < 4n)
            v = x[todo]
            left, right = v >> np.uint64(half), v & mask
            for k in keys:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            v = (left << np.uint64(half)) | right
            x[todo] = v
            todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64)


def global_sample_indices(
    n_seq: int, step: int, global_batch: int, seed: int, first_sample: int | None = None
) -> np.ndarray:
    """Sequence indices of global step `step`: positions of an endless stream of per-epoch
    permutations, computed without storing any permutation. `first_sample` (default
    step·global_batch) is the stream position the step starts at: a run resumed with another
    global batch continues where the samples consumed so far end."""
    a = step * global_batch if first_sample is None else first_sample
    pos = np.arange(a, a + global_batch, dtype=np.int64)
    out = np.empty_like(pos)
    for e in np.unique(pos // n_seq):
        sel = pos // n_seq == e
        out[sel] = permute(pos[sel] % n_seq, n_seq, seed, int(e))
    return out


def batches_for_step(
    ds: PackedDataset,
    step: int,
    global_batch: int,
    rank: int,
    world: int,
    micro: int,
    seed: int,
    first_sample: int | None = None,
) -> list[np.ndarray]:
    """The micro-batches (sequence indices) rank `rank` processes at global step `step`."""
    idx = global_sample_indices(ds.n_seq, step, global_batch, seed, first_sample)
    per = global_batch // world
    mine = idx[rank * per : (rank + 1) * per]
    return [mine[i : i + micro] for i in range(0, per, micro)]


def document_mask(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, 1, T, T] boolean: causal, and a token sees only its own document (split after EOS)."""
    b, t = input_ids.shape
    doc = torch.cumsum((input_ids == eos_id).long(), dim=1)
    doc = doc - (input_ids == eos_id).long()  # the EOS belongs to the document it ends
    same = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
    return (same & causal).unsqueeze(1)
