"""Autoregressive generation with the compressed MLA cache: greedy or top-p sampling.

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from llmtrain.model.attention import MLACache


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Greedy when temperature == 0, else nucleus sampling over the smallest set with mass >= top_p."""
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    probs = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        p_sorted, idx = probs.sort(dim=-1, descending=True)
        drop = p_sorted.cumsum(-1) - p_sorted > top_p  # keep the token that crosses top_p
        p_sorted = p_sorted.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(
        -1
    )


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return [B, T + new] tokens. With `use_cache` the prefix runs once and each step feeds
    one token against the latent cache; without it every step recomputes the whole prefix."""
    was_training = model.training
    model.eval()
    cache = MLACache(model.cfg.num_layers) if use_cache else None
    out = input_ids
    feed = input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(feed if use_cache else out, cache=cache).logits[:, -1]
        nxt = sample_next(logits, temperature, top_p, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out = torch.cat([out, nxt[:, None]], dim=1)
        feed = nxt[:, None]
        if eos_token_id is not None and bool(done.all()):
            break
    model.train(was_training)
    return out
