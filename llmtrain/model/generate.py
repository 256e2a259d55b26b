"""Autoregressive generation with the compressed MLA cache: greedy or top-p sampling.

Shape legend: B batch, T tokens fed, S keys (tokens in the cache), L prompt length,
V vocabulary.
"""

from __future__ import annotations

import torch

from llmtrain.model.attention import MLACache, causal_mask

PREFILL = 512  # prompt tokens a forward: the latent-cache path's scores are [B, H, T, S] fp32


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


def _positions(real_BS: torch.Tensor) -> torch.Tensor:
    """RoPE positions that count real tokens only (left pads sit at 0)."""
    return (real_BS.long().cumsum(-1) - 1).clamp(min=0)


def _prompt_mask(real_BS: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """[B, 1, b - a, b]: queries a..b-1 see earlier real keys; a padding query sees itself (a row
    of -inf would give NaN, which reaches real tokens through the values)."""
    mask_BTS = causal_mask(b - a, b, real_BS.device)[None] & real_BS[:, None, :b]
    mask_BTS[:, torch.arange(b - a), torch.arange(a, b)] = True
    return mask_BTS[:, None]


def prefill(model, x_BL: torch.Tensor, real_BL: torch.Tensor | None, cache: MLACache,
            chunk: int | None = None):  # fmt: skip
    """Run left-padded prompts into `cache`, `chunk` tokens a forward (default PREFILL), so the
    scores stay [B, H, chunk, S] and only the last position's logits are made. `real_BL` (None:
    no padding) marks real tokens: pads are masked out of every key, positions count real tokens
    only. Returns the last position's logits [B, V] and the state `decode_step` goes on from."""
    n, longest = x_BL.shape
    if longest == 0:
        raise ValueError("prefill needs at least one prompt token a sequence")
    dev = x_BL.device
    chunk = chunk or PREFILL
    pos_BL = None if real_BL is None else _positions(real_BL)
    for a in range(0, longest, chunk):
        b = min(a + chunk, longest)
        last = (torch.arange(n, device=dev) + 1) * (b - a) - 1 if b == longest else None
        logits_BV = model(x_BL[:, a:b], cache=cache,
                          attention_mask=None if real_BL is None else _prompt_mask(real_BL, a, b),
                          position_ids=None if pos_BL is None else pos_BL[:, a:b],
                          logits_at=last if last is not None else x_BL.new_zeros(0)).logits  # fmt: skip
    return logits_BV, (real_BL, None if pos_BL is None else pos_BL[:, -1:])


def decode_step(model, nxt_B: torch.Tensor, cache: MLACache, state):
    """One token a sequence against the cache: its logits [B, V] and the next state."""
    keys_BS, pos_B1 = state
    n = nxt_B.shape[0]
    if keys_BS is not None:
        keys_BS = torch.cat([keys_BS, keys_BS.new_ones(n, 1)], dim=1)
        pos_B1 = pos_B1 + 1
    logits_BV = model(nxt_B[:, None], cache=cache,
                      attention_mask=None if keys_BS is None else keys_BS[:, None, None, :],
                      position_ids=pos_B1, logits_at=torch.arange(n, device=nxt_B.device)).logits  # fmt: skip
    return logits_BV, (keys_BS, pos_B1)


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
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return [B, L + new] tokens. With `use_cache` the prompt is prefilled (`prefill`) and each
    step feeds one token against the latent cache; without it every step recomputes the whole
    sequence. `attention_mask` [B, L] (1 real, 0 pad; left padding, as transformers' generate
    takes it): each row gets the tokens it would get alone."""
    was_training = model.training
    model.eval()
    b, t = input_ids.shape
    dev = input_ids.device
    real_BL = None if attention_mask is None else attention_mask.to(dev).bool()
    if real_BL is not None and (
        real_BL.shape != input_ids.shape or t == 0 or not bool(real_BL[:, -1].all())
    ):
        raise ValueError(
            f"attention_mask {tuple(real_BL.shape)} must match input_ids {(b, t)} and pad on the "
            "left: every row's last token real (pad_token on the left, as for transformers)"
        )
    cache = MLACache(model.cfg.num_layers) if use_cache else None
    out = input_ids
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    for step in range(max_new_tokens):
        if not use_cache:
            s = out.shape[1]
            real_BS = (
                None if real_BL is None else torch.cat([real_BL, real_BL.new_ones(b, s - t)], dim=1)
            )
            logits = model(out, logits_at=torch.arange(1, b + 1, device=dev) * s - 1,
                           attention_mask=None if real_BS is None else _prompt_mask(real_BS, 0, s),
                           position_ids=None if real_BS is None else _positions(real_BS),
                           ).logits  # fmt: skip
        elif step == 0:
            logits, state = prefill(model, input_ids, real_BL, cache)
        else:
            logits, state = decode_step(model, out[:, -1], cache, state)
        nxt = sample_next(logits, temperature, top_p, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out = torch.cat([out, nxt[:, None]], dim=1)
        if eos_token_id is not None and bool(done.all()):
            break
    model.train(was_training)
    return out
