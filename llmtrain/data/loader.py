"""Packed fixed-length sequences over the token shards, and the deterministic step sampler.

Shape legend: G global batch (sequences per optimizer step), W data-parallel ranks,
M micro-batch, T sequence length.

Sequence i is stream[i·T : i·T + T + 1] (inputs and next-token labels), documents separated by
EOS. The sampler is stateless: global step s takes samples s·G … s·G+G−1 of an endless stream
of seeded per-epoch permutations, and rank r takes its contiguous G/W of them. So the tokens of
step s are the same at any world size, and resuming at step s needs nothing but s.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from llmtrain.data.corpus import DataError


class PackedDataset:
    def __init__(self, root: str | Path, split: str, seq_len: int):
        self.root = Path(root)
        idx = json.loads((self.root / "index.json").read_text())
        self.eos_id = idx["eos_id"]
        self.vocab_size = idx["vocab_size"]
        dtype = np.dtype(idx["dtype"])
        shards = idx["splits"][split]["shards"]
        self.maps = [np.memmap(self.root / s["file"], dtype=dtype, mode="r") for s in shards]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        self.n_tokens = int(self.starts[-1])
        self.seq_len = seq_len
        self.n_seq = (self.n_tokens - 1) // seq_len
        if self.n_seq < 1:
            raise DataError(
                f"the {split} split has {self.n_tokens} tokens, fewer than one sequence of "
                f"{seq_len}; add data or lower train.seq_len"
            )

    def _range(self, a: int, b: int) -> np.ndarray:
        out = np.empty(b - a, dtype=np.int64)
        k = int(np.searchsorted(self.starts, a, side="right") - 1)
        pos = a
        while pos < b:
            m = self.maps[k]
            lo = pos - self.starts[k]
            hi = min(len(m), b - self.starts[k])
            out[pos - a : pos - a + hi - lo] = m[lo:hi]
            pos += hi - lo
            k += 1
        return out

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the token frequencies: the loss of the best context-free model."""
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for m in self.maps:
            counts += np.bincount(m, minlength=self.vocab_size)[: self.vocab_size]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def sequence(self, i: int) -> np.ndarray:
        return self._range(i * self.seq_len, i * self.seq_len + self.seq_len + 1)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        arr = np.stack([self.sequence(int(i)) for i in indices])
        t = torch.from_numpy(arr)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


@lru_cache(maxsize=4)
def _epoch_perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def global_sample_indices(n_seq: int, step: int, global_batch: int, seed: int) -> np.ndarray:
    pos = np.arange(step * global_batch, (step + 1) * global_batch)
    out = np.empty_like(pos)
    for e in np.unique(pos // n_seq):
        sel = pos // n_seq == e
        out[sel] = _epoch_perm(n_seq, seed, int(e))[pos[sel] % n_seq]
    return out


def batches_for_step(
    ds: PackedDataset, step: int, global_batch: int, rank: int, world: int, micro: int, seed: int
) -> list[np.ndarray]:
    """The micro-batches (sequence indices) rank `rank` processes at global step `step`."""
    idx = global_sample_indices(ds.n_seq, step, global_batch, seed)
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
