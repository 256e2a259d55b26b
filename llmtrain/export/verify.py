"""Load an export with stock transformers and compare it with our model: logits and greedy text."""

from __future__ import annotations

from pathlib import Path

import torch

BOUND = 1e-4  # max-abs over logits, both sides in fp32 on the same (possibly bf16-rounded) weights


@torch.no_grad()
def verify(
    export_dir: str | Path,
    checkpoint: str | Path,
    prompts: int = 2,
    seq: int = 24,
    new_tokens: int = 12,
) -> dict:
    from transformers import AutoModelForCausalLM

    import llmtrain
    from llmtrain.model import generate

    export_dir = Path(export_dir)
    from llmtrain.hf import quiet_transformers_load

    with quiet_transformers_load():
        hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    ours = llmtrain.from_pretrained(checkpoint)
    dtype = _saved_dtype(export_dir)
    if dtype == "bfloat16":  # compare on the weights the export holds: bf16, routers kept fp32
        from llmtrain.export import FP32_KEYS

        for n, p in ours.named_parameters():
            if not n.endswith(FP32_KEYS):
                p.data = p.data.to(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.cfg.vocab_size, (prompts, seq), generator=g)
    diff = (hf(ids).logits.float() - ours(ids).logits.float()).abs().max().item()
    # an explicit all-ones mask: without one transformers infers it from pad_token_id and masks
    # every prompt token equal to it (token 0 of the random prompt), which our model does not
    prompt = ids[:1, :8]
    ref_tokens = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             do_sample=False, min_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=0)  # fmt: skip
    our_tokens = generate(ours, prompt, new_tokens)
    same = bool(torch.equal(ref_tokens, our_tokens))
    return {
        "max_abs_logit_diff": diff,
        "bound": BOUND,
        "saved_dtype": dtype,
        "generate_equal": same,
        "ok": diff <= BOUND and same,
    }


def _saved_dtype(d: Path) -> str:
    import json

    return json.loads((d / "config.json").read_text()).get("torch_dtype", "float32")
